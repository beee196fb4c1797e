"""A float32 model's decode step over a float32 KV cache against a bfloat16 one (kv_cache_dtype), by context.

One sequence at a time at each --contexts length (a synthetic prompt of that many tokens), for each of the
two engines in turn (ABBA, --rounds pairs): the prompt is prefilled, then --steps decode steps are timed.
Attention reads every cached K and V row at every step, so the bfloat16 cache's gain grows with the
context; the products' share of a step does not change.

    python bench/kv_cache_dtype.py                                  # w4a8, contexts 300 to 4,000
    python bench/kv_cache_dtype.py --quantization none --contexts 1000,4000 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_line  # noqa: E402


def step_ms(llm, request_id: str, context: int, steps: int) -> float:
    """Mean milliseconds of `steps` decode steps of one sequence with `context` tokens before them."""
    from specserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, speculation="off")
    engine.add_request(request_id, [100 + (i * 7) % 5000 for i in range(context)], params)
    while engine.scheduler.waiting or any(not s.in_decode for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    took = (time.perf_counter() - t0) / steps * 1e3
    while engine.scheduler.running:
        engine.step()
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="w4a8")
    p.add_argument("--contexts", default="300,1000,2000,4000")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=2, help="ABBA pairs at each context")
    args = p.parse_args(argv)

    from specserve import LLM

    kinds = ("auto", "bfloat16")
    engines = {
        kv: LLM(
            dtype="float32",
            max_num_seqs=1,
            quantization=args.quantization,
            kv_cache_dtype=kv,
            enable_prefix_caching=False,
        )
        for kv in kinds
    }
    print(f"{cpu_line()}; float32 model, {args.quantization}; load {os.getloadavg()[0]:.1f}")
    print("| context | float32 cache | bfloat16 cache | ratio |")
    print("|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        runs: dict[str, list[float]] = {kv: [] for kv in kinds}
        for r in range(2 * args.rounds):
            for kv in kinds if r % 2 == 0 else reversed(kinds):
                runs[kv].append(step_ms(engines[kv], f"c{context}-{r}-{kv}", context, args.steps))
        f32, bf16 = (statistics.fmean(runs[kv]) for kv in kinds)
        print(f"| {context} | {f32:.2f} ms | {bf16:.2f} ms | {f32 / bf16:.2f}x |", flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
