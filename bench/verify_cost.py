"""What a verify step costs against a decode step: one sequence's forward of 1 + k tokens, by k.

Speculation pays only while a step of 1 + k tokens costs little more than a step of one: with acceptance a,
k drafts make (1 - a^(k+1)) / (1 - a) tokens a step, so a verify that costs 3 decode steps caps any
proposer at a third of that. Times ModelRunner.run (the engine's forward and logits) for one sequence at a
context of --context tokens, at each --rows, the median of --repeats; rounds alternate between the engine
as built and (--int4-rows-beside-copy N) one whose int4 few-row product runs steps of up to N rows beside
its dense copy, or (--head-rows-beside-copy N) one whose Q8_0 head's does, so both see the same load.

    python bench/verify_cost.py [--dtype bfloat16] [--rows 1,2,3,5,9,17,33] [--int4-rows-beside-copy 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_line  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="auto")
    p.add_argument("--model", help="default: the demo model")
    p.add_argument("--rows", default="1,2,3,5,9,17,33")
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--int4-rows-beside-copy", type=int, help="also time an engine with this few-row limit")
    p.add_argument("--head-rows-beside-copy", type=int, help="... or this Q8_0 head's limit")
    args = p.parse_args(argv)

    from specserve import LLM
    from specserve.engine.model_runner import ForwardEntry
    from specserve.models import linear

    def runner():
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=1)
        return llm.engine.runner

    engines = {"as built": runner()}
    if args.int4_rows_beside_copy is not None:
        linear.OwnInt4RowsBf16.BESIDE_COPY_MAX_ROWS = args.int4_rows_beside_copy
        linear.OwnInt4RowsBf16.AMX_BESIDE_COPY_MAX_ROWS = args.int4_rows_beside_copy
        linear.OwnInt4TileRowsBf16.BESIDE_COPY_MAX_ROWS = args.int4_rows_beside_copy
        engines[f"int4 rows <= {args.int4_rows_beside_copy}"] = runner()
    if args.head_rows_beside_copy is not None:
        linear.OwnInt8GroupedTileRowsBf16.BESIDE_COPY_MAX_ROWS = args.head_rows_beside_copy
        linear.OwnInt8GroupedRowsAmx.BESIDE_COPY_MAX_ROWS = args.head_rows_beside_copy
        engines[f"Q8_0 head rows <= {args.head_rows_beside_copy}"] = runner()
    rows = [int(r) for r in args.rows.split(",")]
    blocks = list(range((args.context + max(rows)) // 8 + 2))
    for r in engines.values():
        r.run([ForwardEntry(list(range(100, 100 + args.context)), 0, blocks, 1)])
    times: dict[tuple[str, int], list[float]] = {}
    for i in range(args.repeats):
        order = list(engines.items())
        for name, r in order if i % 2 else order[::-1]:
            for n in rows:
                entry = ForwardEntry([5] * n, args.context, blocks, n)
                t0 = time.perf_counter()
                r.run([entry])
                times.setdefault((name, n), []).append(time.perf_counter() - t0)
    print(f"CPU: {cpu_line()} | {args.dtype} | quantization {args.quantization} | context {args.context}")
    for name in engines:
        one = statistics.median(times[(name, rows[0])])
        print(
            f"{name}: "
            + " | ".join(
                f"{n} rows {1000 * statistics.median(times[(name, n)]):.1f} ms "
                f"({statistics.median(times[(name, n)]) / one:.2f}x)"
                for n in rows
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
