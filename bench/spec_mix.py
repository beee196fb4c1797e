"""Does `auto` choose well? Every proposer alone and `auto` over all of them, on a mix of traffic, by load.

A worker may hold several proposers (`--speculative-method suffix,ngram[,eagle3]`); a request's speculation
`auto` lets the policy pick the method and k per request per step from measured acceptance and step cost
(spec/policy.py). This bench serves one mix of three kinds of chat request, in turn:

- open chat with nothing to copy (bench/chat_traffic.py's questions about stdlib modules);
- agentic turns, code edits and records to JSON (bench/suffix_traffic.py's traffic);
- templated requests whose answer's shape is not in the prompt (bench/suffix_fleet.py's templates);

on engines with speculation off, each method alone, and all methods together, closed loop at each
--concurrency level. Every request is greedy, so every engine must give the same tokens (verification is
lossless; fp32 keeps them identical, bf16 may round a verify step and a decode step differently). Each run
starts a fresh engine (a suffix tree then holds only what that run served); the engines run in order and then
in reverse, and a ratio is taken per pass (the machine is noisy). Goals: `auto` >= the best single method at
each level within noise, and >= 1.0x off everywhere.

    python bench/spec_mix.py [--concurrency 1,8,32] [--requests 12,32,64] [--k 4] [--max-tokens 128]
        [--dtype bfloat16] [--head DIR (adds eagle3)] [--model M]
    # what auto's guard (spec/policy.py SpeculationGuard) adds, against auto without it and off
    python bench/spec_mix.py --concurrency 8,32 --requests 64,128 --engines off,auto,auto-unguarded
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_traffic import ChatRequest, Run, run_closed_loop  # noqa: E402
from chat_traffic import build_traffic as chat_traffic  # noqa: E402
from common import DEFAULT_OUT, concurrency_levels, cpu_line  # noqa: E402
from suffix_fleet import TEMPLATES  # noqa: E402
from suffix_traffic import build_traffic as agent_traffic  # noqa: E402

KINDS = ("open", "agentic", "templated")


def build_mix(n: int, max_tokens: int, seed: int = 0) -> list[ChatRequest]:
    """n greedy chat requests, the three kinds in turn, each kind's requests in its own bench's order."""
    opens = [r for r in chat_traffic(4 * n, max_tokens, seed) if r.kind == "open"]
    agents = agent_traffic(n, max_tokens, 0.0, seed)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        j = i // len(KINDS)
        if kind == "open":
            messages = opens[j % len(opens)].messages
        elif kind == "agentic":
            messages = agents[j % len(agents)].messages
        else:
            messages = [{"role": "user", "content": TEMPLATES[j % len(TEMPLATES)](rng)}]
        out.append(ChatRequest(kind, messages, max_tokens, 0.0, 1000 + i))
    return out


def spec_configs(args: argparse.Namespace) -> dict[str, dict | None]:
    methods = ["suffix", "ngram"] + (["eagle3"] if args.head else [])
    configs: dict[str, dict | None] = {"off": None}
    for m in methods:
        configs[m] = {"method": m, "num_speculative_tokens": args.k}
    configs["auto"] = {"method": ",".join(methods), "num_speculative_tokens": args.k}
    configs["auto-unguarded"] = dict(configs["auto"])  # only where --engines names it
    for c in configs.values():
        if c is not None and "eagle3" in c["method"]:
            c["model"] = str(args.head)
    return configs


def one_run(args, name: str, config: dict | None, prompts, traffic, conc: int) -> Run:
    from specserve import LLM

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=conc, speculative_config=config)
    if name == "auto-unguarded":
        # `auto` as its policy prices drafts, without the guard that times whole steps of each choice
        # (spec/policy.py SpeculationGuard): what the guard adds
        llm.engine.spec.guard.speculates = lambda decoding: True
    if args.zero_k and llm.engine.spec is not None:
        # every request proposes nothing: what the proposers' own work each step costs, drafts aside
        llm.engine.spec.policy.choose_ks = lambda acceptances, other_tokens: [0] * len(acceptances)
    run_closed_loop(llm, warm_prompts(llm), warm_traffic(), 2, "warm")  # first-call costs, other traffic
    gc.collect()
    steps = llm.engine.stats().steps
    run = run_closed_loop(llm, prompts, traffic, conc, name)
    # target forwards the run took: with the drafts verified, what its time follows from, less noisy than
    # the time itself on a shared machine
    run.steps = llm.engine.stats().steps - steps  # type: ignore[attr-defined]
    del llm
    gc.collect()
    return run


def warm_traffic() -> list[ChatRequest]:
    return [
        ChatRequest("warm", [{"role": "user", "content": t}], 16, 0.0, 1)
        for t in ("Say hello.", "Count to five.")
    ]


def warm_prompts(llm) -> list[list[int]]:
    return [llm.engine.encode_chat(r.messages) for r in warm_traffic()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,8,32", help="requests in flight, one set of runs each")
    p.add_argument("--requests", default="12,32,64", help="requests per run, one per concurrency level")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every method")
    p.add_argument("--max-tokens", type=int, default=128, help="per request; EOS may end it sooner")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--head", type=Path, help="an EAGLE-3 head (speculators format): adds eagle3")
    p.add_argument("--zero-k", action="store_true", help="k = 0 for every request: overhead only")
    p.add_argument(
        "--engines",
        help="a subset of off,suffix,ngram,auto[,eagle3][,auto-unguarded] (auto without its guard), in order",
    )
    p.add_argument("--model", help="default: the demo model")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    concurrency_levels(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specserve import LLM

    configs = spec_configs(args)
    if args.engines:
        configs = {name: configs[name] for name in args.engines.split(",")}
    else:
        del configs["auto-unguarded"]
    traffic = build_mix(max(args.requests), args.max_tokens)
    tokenizer_llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1)
    prompts = [tokenizer_llm.engine.encode_chat(r.messages) for r in traffic]
    del tokenizer_llm
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_line()} | {args.dtype} | k={args.k} | engines {list(configs)} | load {load0:.1f}")
    rows = []
    for conc, n in zip(args.concurrency, args.requests):
        order = list(configs)
        runs: dict[str, list[Run]] = {name: [] for name in order}
        for name in order + order[::-1]:
            r = one_run(args, name, configs[name], prompts[:n], traffic[:n], conc)
            runs[name].append(r)
            acc = r.summary()["acceptance"]
            print(
                f"  C={conc} {name}: {r.tok_s:.1f} tok/s ({r.seconds:.1f} s, acceptance {acc},"
                f" {r.steps} steps verifying {r.proposed} drafts, load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
        # the ratios a subset of --engines allows (--engines off,auto --zero-k has no single method)
        singles = [m for m in order if m not in ("off", "auto", "auto-unguarded")]
        passes = []
        for j in (0, 1):
            tok_s = {name: runs[name][j].tok_s for name in order}
            one: dict = {
                "tok_s": {k: round(v, 2) for k, v in tok_s.items()},
                "steps": {name: runs[name][j].steps for name in order},
                "drafts_verified": {name: runs[name][j].proposed for name in order},
            }
            if "auto" in tok_s and singles:
                best = max(singles, key=lambda m: tok_s[m])
                one["best_single"] = best
                one["auto_vs_best"] = round(tok_s["auto"] / tok_s[best], 3)
            if "auto" in tok_s and "off" in tok_s:
                one["auto_vs_off"] = round(tok_s["auto"] / tok_s["off"], 3)
            passes.append(one)
        reference = runs[order[0]][0].greedy_outputs
        same = {name: all(r.greedy_outputs == reference for r in runs[name]) for name in order}
        rows.append({"concurrency": conc, "requests": n, "passes": passes, "greedy_identical": same})
        parts = []
        if "auto_vs_best" in passes[0]:
            parts.append(
                "auto / best single "
                + ", ".join(f"{p['auto_vs_best']:.2f} ({p['best_single']})" for p in passes)
            )
        if "auto_vs_off" in passes[0]:
            parts.append("auto / off " + ", ".join(f"{p['auto_vs_off']:.2f}" for p in passes))
        parts.append(f"greedy identical: {same}")
        print(f"C={conc}: " + " | ".join(parts), flush=True)
    load1 = os.getloadavg()[0]
    print(f"load {load0:.1f} -> {load1:.1f}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"spec-mix-{time.strftime('%Y%m%d-%H%M%S')}.json"
    payload = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "engines": {k: v for k, v in configs.items()},
        "load": [load0, load1],
        "rows": rows,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
