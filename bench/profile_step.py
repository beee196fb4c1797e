"""Where one decode step's time goes: torch profiler ops and Python functions, at a given batch size.

Admits --batch requests of the workload, steps the engine until every one of them is decoding (prefill
done), then profiles --steps decode steps twice: with torch.profiler (top ops by self CPU time) and with
cProfile (top Python functions by own time). Not a test; a look for whoever optimises the step.

    python bench/profile_step.py [--batch 64] [--steps 10] [--dtype bfloat16] [--quantization int8]
        [--workload W.jsonl] [--chain-ab]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import breakdown, format_breakdown, load_workload, step_delta, tokenize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workload", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--attention-backend", default="auto", help="auto, torch or cpu (the C++ kernel)")
    p.add_argument("--quantization", default="auto", help="none, auto, int8 or int4 (the service's flag)")
    p.add_argument(
        "--chain-ab",
        action="store_true",
        help="also time --steps steps with the layers chained in one library call and as the Python loop, "
        "alternating (ABBA twice), and print both",
    )
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from specserve import LLM, SamplingParams

    workload = load_workload(args.workload, args.batch)
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=args.batch,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
    )
    tokenize(workload, llm.tokenizer)
    engine = llm.engine
    # Long outputs, so nobody finishes while we look.
    params = SamplingParams(
        max_tokens=(12 if args.chain_ab else 4) * args.steps + 64,
        temperature=0.0,
        ignore_eos=True,
        speculation="off",
    )
    for i, r in enumerate(workload.requests[: args.batch]):
        engine.add_request(f"p{i}", r.prompt_token_ids, params)
    while engine.scheduler.waiting or any(not s.in_decode for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm the decode path
        engine.step()

    before = engine.step_times.as_dict()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    print(
        f"batch {len(engine.scheduler.running)}, {args.dtype}, {args.quantization}, "
        f"attention {engine.model.backend.name}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"decode step: {wall * 1e3:.1f} ms wall")
    print(format_breakdown("plain", breakdown(step_delta(before, engine.step_times.as_dict()))))

    if args.chain_ab:
        chain_ab(engine, args.steps)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(f"\ntorch profiler, {args.steps} decode steps, top ops by self CPU time:")
    print(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50)
    )

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        engine.step()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
    print(f"cProfile, {args.steps} decode steps, top functions by own time:")
    print(buf.getvalue())
    return 0


def chain_ab(engine, steps: int) -> None:
    """Decode steps with the model's layer chains (models/llama.py: LlamaModel.chain_runs) and without them,
    in ABBA order twice; contexts grow as it runs, so each side gets early and late steps alike."""
    model = engine.model
    runs = model.chain_runs
    if not runs:
        print("\nchain A/B: this model runs no layer chain (see models/chain_plan.py: layer_chains)")
        return
    times: dict[str, list[float]] = {"chained": [], "Python loop": []}
    try:
        for order in (["chained", "Python loop"], ["Python loop", "chained"]) * 2:
            for name in order:
                model.chain_runs = runs if name == "chained" else []
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[name].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        model.chain_runs = runs
    print("\nchain A/B, ms a decode step (ABBA twice):")
    for name, ts in times.items():
        print(f"  {name:12s} {sum(ts) / len(ts):7.2f}   ({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    sys.exit(main())
