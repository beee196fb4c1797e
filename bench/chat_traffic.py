"""Should `specserve serve` start with n-gram speculation + `auto` on? Chat traffic, speculation off vs on.

The product question: a worker started with `--speculative-method ngram` (requests default to
`speculation: "auto"`) must never be slower than one started without speculation, on the traffic a chat
service sees, at any load. This bench builds that traffic and runs it on both engines in one process,
in the order off, on, on, off (the machine is noisy; ratios are taken from adjacent runs).

Traffic (deterministic, from CPython's stdlib, chat-templated by the model's own template, EOS respected):
- open questions about stdlib modules (little to copy: n-gram rarely proposes, auto should back off);
- summarise a docstring; list the names a piece of code defines (some copying);
- edit a function and give it back whole (much copying: where prompt lookup pays).
Half the requests are greedy, half sampled (temperature 0.7, top_p 0.95, a seed each). Greedy requests
produce the same tokens on both engines (verification is lossless), so their tok/s compare like for like.

Load is closed-loop: C requests in flight, a new one enters as one finishes (C = 1, 8, 32 by default).
Reported per C and engine: output tok/s, mean and p90 request latency, acceptance; on/off ratios.

    python bench/chat_traffic.py [--concurrency 1,8,32] [--requests 8,24,48] [--k 4] [--dtype float32]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, concurrency_levels, cpu_line  # noqa: E402

MODULES = (
    "json", "textwrap", "argparse", "collections", "functools", "itertools", "pathlib", "shutil",
    "string", "statistics", "heapq", "bisect", "fractions", "difflib", "csv", "calendar",
)  # fmt: skip
QUESTIONS = (
    "What is the Python module `{m}` for? Answer in a few sentences.",
    "Give three practical tips for using Python's `{m}` module well.",
    "When should I avoid the `{m}` module, and what should I use instead?",
)
SYSTEM = "You are a helpful assistant."


@dataclass
class ChatRequest:
    kind: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    seed: int

    @property
    def top_p(self) -> float:
        """Sampled requests draw from the top 95 %; greedy ones need no cut."""
        return 0.95 if self.temperature else 1.0


def _functions(rng: random.Random) -> list[str]:
    import difflib
    import json as json_mod
    import textwrap

    funcs = []
    for mod in (textwrap, difflib, json_mod.encoder, json_mod.decoder):
        for _, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ == mod.__name__:
                src = inspect.getsource(fn)
                if 200 < len(src) < 1500:
                    funcs.append(src)
    rng.shuffle(funcs)
    return funcs


def build_traffic(n: int, max_tokens: int = 256, seed: int = 0) -> list[ChatRequest]:
    """n chat turns, the kinds in turn: open, summarise, list names, edit (a quarter each)."""
    import importlib

    rng = random.Random(seed)
    funcs = _functions(rng)
    out: list[ChatRequest] = []
    for i in range(n):
        mod = MODULES[i % len(MODULES)]
        kind = ("open", "summarise", "names", "edit")[i % 4]
        if kind == "open":
            user = rng.choice(QUESTIONS).format(m=mod)
        elif kind == "summarise":
            doc = (importlib.import_module(mod).__doc__ or "").strip()[:1200]
            user = f"Summarise this documentation in two sentences:\n\n{doc}"
        elif kind == "names":
            code = funcs[i % len(funcs)]
            user = f"List every name this code defines, one per line:\n\n```python\n{code}```"
        else:
            user = (
                "Add type hints to this function and give back the whole function:\n\n"
                f"```python\n{funcs[i % len(funcs)]}```"
            )
        sampled = (i // 4) % 2 == 1
        out.append(
            ChatRequest(
                kind,
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                max_tokens=max_tokens,
                temperature=0.7 if sampled else 0.0,
                seed=1000 + i,
            )
        )
    return out


@dataclass
class Run:
    engine: str  # "off" or "ngram k=K auto"
    concurrency: int
    requests: int
    seconds: float
    output_tokens: int
    greedy_tokens: int
    latencies: list[float]
    proposed: int
    accepted: int
    greedy_outputs: dict[int, list[int]]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "engine": self.engine,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "seconds": round(self.seconds, 2),
            "output_tokens": self.output_tokens,
            "tok_s": round(self.tok_s, 2),
            "latency_mean_s": round(statistics.fmean(lat), 3),
            "latency_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 3),
            "acceptance": round(self.accepted / self.proposed, 3) if self.proposed else None,
            "proposed": self.proposed,
        }


def run_closed_loop(llm, prompts: list[list[int]], traffic: list[ChatRequest], concurrency: int, name: str):
    """Keep `concurrency` requests in flight; one enters as one finishes."""
    from specserve import SamplingParams

    engine = llm.engine
    pending = deque(range(len(prompts)))
    started: dict[str, tuple[int, float]] = {}
    seqs = {}
    latencies: list[float] = []
    produced = greedy = proposed = accepted = 0
    greedy_outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(started) < concurrency:
            i = pending.popleft()
            r = traffic[i]
            rid = f"{name}-{concurrency}-{i}-{time.monotonic_ns()}"
            params = SamplingParams(
                max_tokens=r.max_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                seed=r.seed,
            )
            engine.add_request(rid, prompts[i], params, stream=False)
            seqs[rid] = engine._requests[rid]
            started[rid] = (i, time.perf_counter())
        for delta in engine.step():
            if not delta.finished:
                continue
            i, t_start = started.pop(delta.request_id)
            seq = seqs.pop(delta.request_id)
            latencies.append(time.perf_counter() - t_start)
            produced += seq.num_output_tokens
            proposed += seq.draft_proposed
            accepted += seq.draft_accepted
            if traffic[i].temperature == 0.0:
                greedy += seq.num_output_tokens
                greedy_outputs[i] = list(seq.output_token_ids)
    seconds = time.perf_counter() - t0
    n = len(prompts)
    return Run(name, concurrency, n, seconds, produced, greedy, latencies, proposed, accepted, greedy_outputs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,8,32", help="requests in flight, one run each")
    p.add_argument("--requests", default="8,24,48", help="requests per run, one per concurrency level")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (serve's default is 4)")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256, help="per request; EOS may end it sooner")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--model", help="default: the demo model")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    concurrency_levels(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specserve import LLM

    common = {"dtype": args.dtype, "max_num_seqs": max(args.concurrency)}
    engines = {
        "off": LLM(args.model, **common),
        "on": LLM(
            args.model,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": args.k,
                "prompt_lookup_max": args.prompt_lookup_max,
            },
            **common,
        ),
    }
    traffic = build_traffic(max(args.requests), args.max_tokens)
    prompts = [engines["off"].engine.encode_chat(r.messages) for r in traffic]
    for llm in engines.values():  # warm both (first-call allocations, thread pools)
        run_closed_loop(llm, prompts[:2], traffic[:2], 2, "warm")
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_line()} | {args.dtype} | ngram k={args.k} auto | load {load0:.1f}", flush=True)
    rows = []
    for conc, n in zip(args.concurrency, args.requests):
        runs: dict[str, list[Run]] = {"off": [], "on": []}
        for name in ("off", "on", "on", "off"):
            r = run_closed_loop(engines[name], prompts[:n], traffic[:n], conc, name)
            runs[name].append(r)
            load = os.getloadavg()[0]
            print(f"  C={conc} {name}: {r.tok_s:.1f} tok/s ({r.seconds:.1f} s, load {load:.1f})", flush=True)
        # lossless: greedy requests produce the same tokens whether speculation runs or not
        same = all(a.greedy_outputs == b.greedy_outputs for a in runs["off"] for b in runs["on"])
        # pair the adjacent runs: (off1, on1) and (on2, off2)
        ratios = [runs["on"][0].tok_s / runs["off"][0].tok_s, runs["on"][1].tok_s / runs["off"][1].tok_s]
        lat = [
            statistics.fmean(runs["on"][j].latencies) / statistics.fmean(runs["off"][j].latencies)
            for j in (0, 1)
        ]
        row = {
            "concurrency": conc,
            "requests": n,
            "tok_s_ratio_on_off": [round(x, 3) for x in ratios],
            "mean_latency_ratio_on_off": [round(x, 3) for x in lat],
            "greedy_outputs_identical": same,
            "runs": [r.summary() for name in ("off", "on") for r in runs[name]],
        }
        rows.append(row)
        acc = runs["on"][0].summary()["acceptance"]
        print(
            f"C={conc}: on/off tok/s {ratios[0]:.2f}, {ratios[1]:.2f}"
            f" | mean latency {lat[0]:.2f}, {lat[1]:.2f} | acceptance {acc} | greedy identical: {same}",
            flush=True,
        )
    load1 = os.getloadavg()[0]
    print(f"load {load0:.1f} -> {load1:.1f} (2 cores; ratios from adjacent runs are what count)")
    by_kind: dict[str, int] = {}
    for r in traffic:
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"chat-traffic-{time.strftime('%Y%m%d-%H%M%S')}.json"
    payload = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "k": args.k,
        "traffic": by_kind,
        "load": [load0, load1],
        "rows": rows,
        "max_tokens": args.max_tokens,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
