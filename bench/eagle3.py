"""EAGLE-3 on open chat with nothing to copy: speculation off vs n-gram vs an EAGLE-3 head, one process.

Traffic: questions, advice, stories and emails (the prompt list below, written for this benchmark: none is
cut from CPython's stdlib nor from the head trainer's prompts), chat-templated by the model's own template,
EOS respected; half greedy, half sampled (temperature 0.7, top_p 0.95, a seed each).

1. One request at a time, `speculation: "auto"`, in the order off, n-gram, eagle3, eagle3, n-gram, off (the
   machine is noisy; ratios come from the adjacent pairs): output tok/s ratios eagle3 / off and
   eagle3 / n-gram, separately for greedy and sampled requests, and the head's acceptance per draft
   position (how often draft j was accepted given it was proposed) and mean acceptance length (tokens per
   verify step, the bonus token included).
2. 8 and 32 requests in flight, closed loop, `auto` with eagle3 against off.
   With `--tree SPEC` (speculative_token_tree: "{'depth': 3, 'branching': 2}" or vLLM's paths) a fourth
   engine drafts trees with the same head and k node budget, run between the chain runs: tree / chain and
   tree / off ratios.
3. `--capture-overhead`: what capturing the head's three layers costs a target step that drafts nothing
   (ModelRunner.run against run_capturing on the same decode steps of 1 and 8 sequences, ABBA).
4. `--vllm` (after 1 and 2) or `--vllm-only`: the peer. vLLM's CPU build (its venv: --vllm-python,
   $SPECSERVE_VLLM_PYTHON or /work/vllm-venv) serves the one-at-a-time traffic of 1 (the same prompt token
   ids, sampling settings and seeds, EOS respected) on the demo model exported to --target-dir, with its
   EAGLE-3 (`{"method": "eagle3", "model": --head}`: the same head, read in the speculators format), its
   n-gram (set as ours) and speculation off, k = --k, each in its own process: tok/s per engine, greedy and
   sampled, vLLM's acceptance per draft position and mean acceptance length, ratios between its own runs
   and, with --vllm, ours over its (our eagle3 over its eagle3, or over its n-gram where its build cannot
   run eagle3: then that is said with the error's line, and off and n-gram stand). Intel OpenMP from its
   venv is preloaded, as vLLM's CPU guide asks for speculative decoding (--vllm-gnu-omp: not).

Greedy outputs must be identical across the three engines (verification is lossless); the script says so.
The head is read from --head (default: /work/cache/eagle3/smollm2-135m-instruct/); where none is there it
is trained first with tools/train_eagle.py.

    python bench/eagle3.py [--head DIR] [--requests 16] [--concurrency 8,32] [--loaded-requests 16,48]
                           [--k 4] [--max-tokens 128] [--dtype bfloat16] [--capture-overhead]
                           [--tree "{'depth': 3, 'branching': 2}"] [--vllm | --vllm-only] [--vllm-gnu-omp]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from chat_traffic import ChatRequest, Run, run_closed_loop  # noqa: E402
from common import DEFAULT_OUT, REPO, cpu_line  # noqa: E402

DEFAULT_HEAD = Path("/work/cache/eagle3/smollm2-135m-instruct")
SYSTEM = "You are a helpful assistant."
PROMPTS = (
    "What causes the seasons on Earth? Explain it to a curious twelve-year-old.",
    "I keep waking up at 3 a.m. and cannot fall asleep again. What could I try?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write an email to my landlord asking to fix the heating, which has been broken for a week.",
    "How do vaccines train the immune system?",
    "Give me some advice for my first week at a new job as a nurse.",
    "Tell a bedtime story about a fox who is afraid of the dark.",
    "Draft a polite email declining a wedding invitation because I will be abroad.",
    "Why is the sky blue during the day and red at sunset?",
    "How can I save money on groceries without eating worse?",
    "Write a story about two old friends meeting again at a train station after twenty years.",
    "Write an email to my team announcing that our Friday meeting moves to Thursday afternoon.",
    "What is the difference between weather and climate?",
    "My teenage son spends all evening on his phone. How should I talk to him about it?",
    "Write a short fable about a tortoise who wants to fly.",
    "Write a thank-you email to a teacher who helped my daughter love reading.",
    "How do bees make honey?",
    "What should I pack for a three-day hiking trip in the mountains in autumn?",
    "Tell a story about a robot who learns to bake bread.",
    "Write an email asking my manager for two days off next month for a family event.",
    "Why do we dream?",
    "How do I start running if I have never exercised before?",
    "Write a story set in a small village where it has not rained for a year.",
    "Write an email to a customer apologising for a late delivery and offering a discount.",
)


def build_traffic(n: int, max_tokens: int) -> list[ChatRequest]:
    """n chat turns over PROMPTS; every other one sampled."""
    out = []
    for i in range(n):
        user = PROMPTS[i % len(PROMPTS)]
        sampled = i % 2 == 1
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        out.append(ChatRequest("open", messages, max_tokens, 0.7 if sampled else 0.0, 2000 + i))
    return out


def ensure_head(head: Path, model: str | None) -> Path:
    if (head / "config.json").is_file():
        return head
    trainer = REPO / "tools" / "train_eagle.py"
    if not trainer.is_file():
        raise SystemExit(f"no head at {head} and no {trainer} to train one")
    cmd = [sys.executable, str(trainer), "--out", str(head)]
    if model:
        cmd += ["--target", model]
    print("training a head:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return head


class PositionCounts:
    """Per draft position j: how often it was proposed and accepted (the verifier's answers, counted)."""

    def __init__(self) -> None:
        self.proposed: Counter[int] = Counter()
        self.accepted: Counter[int] = Counter()
        self.steps = 0
        self.tokens = 0

    def hook(self, spec) -> None:
        verify = spec.verify

        def counting(*args, **kwargs):
            out = verify(*args, **kwargs)
            for acc in out:
                if acc.num_draft_tokens:
                    self.steps += 1
                    self.tokens += acc.num_accepted_drafts + 1
                    for j in range(acc.num_draft_tokens):
                        self.proposed[j + 1] += 1
                        self.accepted[j + 1] += j < acc.num_accepted_drafts
            return out

        spec.verify = counting

    def summary(self) -> dict:
        return {
            "acceptance_per_position": {
                j: round(self.accepted[j] / self.proposed[j], 3) for j in sorted(self.proposed)
            },
            "mean_acceptance_length": round(self.tokens / self.steps, 3) if self.steps else None,
        }


def split(run: Run, traffic: list[ChatRequest], greedy: bool) -> float:
    """tok/s of a one-at-a-time run's greedy (or sampled) requests: their output tokens over their
    latencies (requests ran one after another, in order, so latencies[i] is request i's)."""
    idx = [i for i, r in enumerate(traffic[: run.requests]) if (r.temperature == 0.0) == greedy]
    tokens = run.greedy_tokens if greedy else run.output_tokens - run.greedy_tokens
    return tokens / sum(run.latencies[i] for i in idx)


def capture_overhead(model: str | None, dtype: str, steps: int) -> None:
    """Decode steps of 1 and 8 sequences with a 256-token context, with and without capture, ABBA."""
    from specserve import LLM
    from specserve.engine.model_runner import ForwardEntry, ModelRunner
    from specserve.spec.eagle3.head import default_layer_ids

    llm = LLM(model, dtype=dtype, num_kv_blocks=160)
    target = llm.engine.model
    runner = ModelRunner(target, 160, 16)
    layers = default_layer_ids(target.cfg.num_layers)
    for batch in (1, 8):
        entries = [ForwardEntry([7], 256, list(range(17 * i, 17 * i + 17)), 1, True) for i in range(batch)]
        plain = [ForwardEntry(e.token_ids, e.start_pos, e.block_table, 1) for e in entries]
        times = {"plain": 0.0, "capture": 0.0}
        for name in ("plain", "capture", "capture", "plain") * 2:
            t0 = time.perf_counter()
            for _ in range(steps):
                if name == "plain":
                    runner.run(plain)
                else:
                    runner.run_capturing(entries, layers)
            times[name] += time.perf_counter() - t0
        ratio = times["capture"] / times["plain"]
        print(f"batch {batch}: capture / plain step time {ratio:.3f} ({steps * 4} steps each)", flush=True)


def run_vllm_leg(
    args: argparse.Namespace, head: Path, traffic: list[ChatRequest], prompts: list[list[int]]
) -> dict:
    """Part 4: vLLM's eagle3 (first: where its build refuses it, that shows before the other runs), n-gram
    and off over `traffic`, a request at a time; its engines' runs and the ratios between them."""
    requests = [
        common.Request("", r.max_tokens, p, r.temperature, r.top_p, r.seed) for r, p in zip(traffic, prompts)
    ]
    specs = {"eagle3": {"method": "eagle3", "model": str(head)}, "ngram": common.VLLM_NGRAM, "off": None}
    runs = common.vllm_systems(
        args.vllm_python,
        common.ensure_target_dir(args.target_dir),
        common.Workload("open chat", requests),
        args.out_dir,
        "eagle3",
        specs,
        args.k,
        one_at_a_time=True,
        dtype=args.dtype,
        return_outputs=True,
        # stat logging on for every engine alike: vLLM counts drafts and acceptance only with it
        ttft=True,
        iomp=not args.vllm_gnu_omp,
    )
    ran = {name: r for name, r in runs.items() if "tok_s" in r}
    tok_s: dict[str, dict[str, float]] = {}
    for name, r in ran.items():
        tok_s[name] = {"all": r["tok_s"]}
        for kind, greedy in (("greedy", True), ("sampled", False)):
            idx = [i for i, q in enumerate(traffic) if (q.temperature == 0.0) == greedy]
            tokens = sum(len(r["outputs"][i]["token_ids"]) for i in idx)
            seconds = sum(r["batch_seconds"][i] for i in idx)
            if seconds:
                tok_s[name][kind] = tokens / seconds
    ratios = {
        f"{a}/{b}": {kind: round(v / tok_s[b][kind], 3) for kind, v in tok_s[a].items() if kind in tok_s[b]}
        for a, b in (("eagle3", "off"), ("eagle3", "ngram"), ("ngram", "off"))
        if a in tok_s and b in tok_s
    }
    greedy_idx = [i for i, q in enumerate(traffic) if q.temperature == 0.0]
    greedy = {name: [r["outputs"][i]["token_ids"] for i in greedy_idx] for name, r in ran.items()}
    same = len({json.dumps(v) for v in greedy.values()}) <= 1
    if "failed" in runs["eagle3"]:
        print(f"vLLM-CPU did not run eagle3 with {head}: {runs['eagle3']['failed']}", flush=True)
    for pair, row in ratios.items():
        print(f"vllm {pair} tok/s: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    print(f"vllm greedy outputs identical across {sorted(ran)}: {same}", flush=True)
    for r in runs.values():
        r.pop("outputs", None)
    return {
        "iomp": not args.vllm_gnu_omp,
        "engines": runs,
        "tok_s": {n: {k: round(v, 2) for k, v in t.items()} for n, t in tok_s.items()},
        "ratios": ratios,
        "greedy_outputs_identical": same,
    }


def ours_over_vllm(ours: dict, vllm: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Our one-at-a-time tok/s (the mean of an engine's two runs) over vLLM's on the same requests, greedy
    and sampled: our eagle3 against its eagle3, or against its n-gram where its build did not run eagle3,
    and each n-gram and off against the other's."""
    peer = "eagle3" if "eagle3" in vllm else "ngram"
    out: dict[str, dict[str, float]] = {}
    for mine, theirs in (("eagle3", peer), ("ngram", "ngram"), ("off", "off")):
        row = {
            kind: round(statistics.fmean(ours[kind]["tok_s"][mine]) / vllm[theirs][kind], 3)
            for kind in ("greedy", "sampled")
            if theirs in vllm and kind in vllm[theirs]
        }
        if row:
            out[f"ours {mine} / vllm {theirs}"] = row
            print(f"ours {mine} / vllm {theirs} tok/s: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", type=Path, default=DEFAULT_HEAD)
    p.add_argument("--model", help="default: the demo model (SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=16, help="requests of the one-at-a-time runs")
    p.add_argument("--concurrency", default="8,32", help="in-flight levels of the loaded runs ('' for none)")
    p.add_argument("--loaded-requests", default="16,48", help="requests per loaded run, one per level")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="each engine's KV pool")
    p.add_argument("--capture-overhead", action="store_true", help="only part 3 (no head needed)")
    p.add_argument("--tree", help="also eagle3 drafting trees of this speculative_token_tree")
    p.add_argument("--steps", type=int, default=50, help="steps per timed block of --capture-overhead")
    p.add_argument("--vllm", action="store_true", help="also part 4: vLLM's CPU build, eagle3 / ngram / off")
    p.add_argument("--vllm-only", action="store_true", help="part 4 alone (implies --vllm)")
    p.add_argument("--vllm-python", help="vLLM's interpreter (default: $SPECSERVE_VLLM_PYTHON or the venv)")
    p.add_argument("--target-dir", type=Path, default=DEFAULT_OUT / "target-hf", help="vLLM's model dir")
    p.add_argument(
        "--vllm-gnu-omp", action="store_true", help="run vLLM on torch's GNU OpenMP, not its venv's Intel one"
    )
    args = p.parse_args(argv)
    args.vllm = args.vllm or args.vllm_only
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.loaded_requests = [int(x) for x in args.loaded_requests.split(",") if x]
    if len(args.loaded_requests) != len(args.concurrency):
        p.error("--loaded-requests needs one count per --concurrency level")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specserve import LLM

    if args.capture_overhead:
        print(f"CPU: {cpu_line()} | {args.dtype} | load {os.getloadavg()[0]:.1f}", flush=True)
        capture_overhead(args.model, args.dtype, args.steps)
        return 0
    head = ensure_head(args.head, args.model)
    if args.vllm_only:
        return vllm_only(args, head)
    # three engines in one process: each KV pool sized here, not a tenth of the machine's memory
    common = {
        "dtype": args.dtype,
        "max_num_seqs": max([1, *args.concurrency]),
        "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
    }
    engines = {
        "off": LLM(args.model, **common),
        "ngram": LLM(
            args.model, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **common
        ),
        "eagle3": LLM(
            args.model,
            speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k},
            **common,
        ),
    }
    if args.tree:
        engines["tree"] = LLM(
            args.model,
            speculative_config={
                "method": "eagle3",
                "model": str(head),
                "num_speculative_tokens": args.k,
                "speculative_token_tree": args.tree,
            },
            **common,
        )
    positions = PositionCounts()
    positions.hook(engines["eagle3"].engine.spec)
    traffic = build_traffic(max([args.requests, *args.loaded_requests]), args.max_tokens)
    prompts = [engines["off"].engine.encode_chat(r.messages) for r in traffic]
    for llm in engines.values():
        run_closed_loop(llm, prompts[:2], traffic[:2], 1, "warm")
    positions.__init__()
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_line()} | {args.dtype} | k={args.k} auto | head {head} | load {load0:.1f}", flush=True)
    n = args.requests
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    order = ("off", "ngram", "eagle3", "tree", "tree", "eagle3", "ngram", "off")
    for name in (o for o in order if o in engines):
        r = run_closed_loop(engines[name], prompts[:n], traffic[:n], 1, name)
        runs[name].append(r)
        print(f"  C=1 {name}: {r.tok_s:.1f} tok/s ({r.seconds:.1f} s)", flush=True)
    same = all(a.greedy_outputs == b.greedy_outputs for rs in runs.values() for a in rs for b in runs["off"])
    result: dict = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "k": args.k,
        "head": str(head),
        "tree": args.tree,
        "one_at_a_time": {},
    }
    for kind, greedy in (("greedy", True), ("sampled", False)):
        tok = {name: [split(r, traffic, greedy) for r in rs] for name, rs in runs.items()}
        row = {
            "eagle3_over_off": [round(tok["eagle3"][j] / tok["off"][1 - j], 3) for j in (0, 1)],
            "eagle3_over_ngram": [round(tok["eagle3"][j] / tok["ngram"][j], 3) for j in (0, 1)],
            "tok_s": {name: [round(x, 2) for x in v] for name, v in tok.items()},
        }
        if "tree" in tok:
            row["tree_over_eagle3"] = [round(tok["tree"][j] / tok["eagle3"][1 - j], 3) for j in (0, 1)]
            row["tree_over_off"] = [round(tok["tree"][j] / tok["off"][1 - j], 3) for j in (0, 1)]
        result["one_at_a_time"][kind] = row
        print(f"C=1 {kind}: eagle3/off {row['eagle3_over_off']}, eagle3/ngram {row['eagle3_over_ngram']}")
        if "tree" in tok:
            print(f"C=1 {kind}: tree/eagle3 {row['tree_over_eagle3']}, tree/off {row['tree_over_off']}")
    result["one_at_a_time"]["eagle3_positions"] = positions.summary()
    result["greedy_outputs_identical"] = same
    print(f"eagle3 per position: {positions.summary()} | greedy identical: {same}", flush=True)
    result["loaded"] = []
    for conc, m in zip(args.concurrency, args.loaded_requests):
        pair = {}
        for name in ("off", "eagle3", "eagle3", "off"):
            r = run_closed_loop(engines[name], prompts[:m], traffic[:m], conc, name)
            pair.setdefault(name, []).append(r.tok_s)
        ratios = [round(pair["eagle3"][j] / pair["off"][1 - j], 3) for j in (0, 1)]
        result["loaded"].append({"concurrency": conc, "requests": m, "eagle3_over_off": ratios})
        print(f"C={conc}: eagle3/off tok/s {ratios}", flush=True)
    if args.vllm:
        engines.clear()  # vLLM's processes get the memory our engines held
        gc.collect()
        result["vllm"] = run_vllm_leg(args, head, traffic[:n], prompts[:n])
        result["ours_over_vllm"] = ours_over_vllm(result["one_at_a_time"], result["vllm"]["tok_s"])
    save(args, result, load0)
    return 0


def vllm_only(args: argparse.Namespace, head: Path) -> int:
    from specserve import LLM

    traffic = build_traffic(args.requests, args.max_tokens)
    tokenizer = LLM(args.model, dtype=args.dtype, max_num_seqs=1).engine  # the same prompt ids as ours
    prompts = [tokenizer.encode_chat(r.messages) for r in traffic]
    del tokenizer
    gc.collect()
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_line()} | {args.dtype} | k={args.k} | head {head} | load {load0:.1f}", flush=True)
    result = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "k": args.k,
        "head": str(head),
        "requests": args.requests,
    }
    result["max_tokens"] = args.max_tokens
    result["vllm"] = run_vllm_leg(args, head, traffic, prompts)
    save(args, result, load0)
    return 0


def save(args: argparse.Namespace, result: dict, load0: float) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"eagle3_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}; wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
