"""A Q8_0 LM head alone (SmolLM2's 49,152 x 576, a float16 scale per 32 inputs) at the few rows of decode and
verify steps, each way the form table can run it, alternated in one process, best of --rounds (the head from
memory: --copies copies in turn). Not a test.

A bf16 model's (the default):
- f32 rows: our float32 product on the rows widened to float32 (models/linear.py's OwnInt8F32OnBf16);
- dense bf16: the dense bf16 copy on oneDNN's prepacked linear (the copy beside the blocks, DenseCopy);
- amx rows: our Q8_0 rows product for bf16 rows (OwnInt8GroupedRowsAmx: AMX tiles from 3 rows);
- --other-csrc DIR: amx rows again from another source tree (a csrc/ with one change), to A/B a kernel edit.
A float32 w8a8 / w4a8 model's (--a8):
- f32 rows: the weight-only modes' head (OwnInt8F32 on float32 activations);
- a8 rows: the w*a8 modes' (quant.a8_head: the activations quantized per 32 inputs, Q8_0 x Q8_0).

    python bench/head_rows.py [--rows 1,3,5,9,17] [--rounds 10] [--other-csrc /tmp/csrc]
    python bench/head_rows.py --a8 --rows 1,2,5,9
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import cpu_line

from specserve.kernels import cpu

OUT, IN = 49152, 576  # SmolLM2-135M's tied head


def _widened(product: cpu.matmul.Product) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: product(x.float())


def _prepacked(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,3,5,9,17", help="rows of the steps, comma-separated")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--copies", type=int, default=4, help="heads read in turn, so each comes from memory")
    p.add_argument("--out", type=int, default=OUT, help="the head's outputs (smaller: a smoke run)")
    p.add_argument("--other-csrc", type=Path, help="another csrc/ whose amx rows product runs beside ours")
    p.add_argument("--a8", action="store_true", help="a float32 w*a8 model's head forms")
    args = p.parse_args(argv)
    if args.a8:
        return _a8(args)
    if cpu.build.load() is None or not cpu.build.int8_grouped_rows_amx():
        print("the library runs no AMX tiles here (build.int8_grouped_rows_amx)", file=sys.stderr)
        return 1
    other = cpu.build.build_variant("native", args.other_csrc) if args.other_csrc else None
    torch.manual_seed(0)
    heads = []
    for _ in range(args.copies):
        codes = torch.randint(-127, 128, (args.out, IN), dtype=torch.int8)
        scales = (torch.rand(args.out, IN // 32) * 0.02).contiguous()
        dense = (codes.float() * scales.repeat_interleave(32, dim=1)).to(torch.bfloat16)
        heads.append((codes, scales, torch.ops.mkldnn._reorder_linear_weight(dense)))
    forms: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "f32 rows": [_widened(cpu.matmul.bind_int8(c, s)) for c, s, _ in heads],
        "dense bf16": [_prepacked(w) for _, _, w in heads],
        "amx rows": [cpu.matmul.bind_int8_grouped_rows_bf16(c, s) for c, s, _ in heads],
    }
    if other is not None:
        saved = cpu.build._lib
        cpu.build._lib = other  # a Product binds the library's function when made
        forms["other amx rows"] = [cpu.matmul.bind_int8_grouped_rows_bf16(c, s) for c, s, _ in heads]
        cpu.build._lib = saved
    _time(forms, args, torch.bfloat16)
    return 0


def _a8(args: argparse.Namespace) -> int:
    if cpu.build.load() is None or not cpu.build.int_dot_fast():
        print("the library runs no integer SIMD products here (build.int_dot_fast)", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    heads = []
    for _ in range(args.copies):
        codes = torch.randint(-127, 128, (args.out, IN), dtype=torch.int8)
        scales = (torch.rand(args.out, IN // 32) * 0.02).half().float()  # a GGUF's float16 scales
        heads.append((codes, scales))
    tiles = cpu.matmul.w8a8_tiles
    forms = {
        "f32 rows": [cpu.matmul.bind_int8(c, s) for c, s in heads],
        "a8 rows": [
            cpu.matmul.bind_w8a8_grouped(tiles(c), cpu.matmul.by_tile(s, torch.float16)) for c, s in heads
        ],
    }
    _time(forms, args, torch.float32)
    return 0


Forms = dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]


def _time(forms: Forms, args: argparse.Namespace, dtype: torch.dtype) -> None:
    print(f"{cpu_line()}, {torch.get_num_threads()} threads, head {args.out} x {IN}, best of {args.rounds}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, IN).to(dtype)
        best = dict.fromkeys(forms, float("inf"))
        order = list(forms)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                for f in forms[name]:
                    t = time.perf_counter()
                    f(x)
                    best[name] = min(best[name], time.perf_counter() - t)
        print(f"rows {rows:2d}: " + "  ".join(f"{n} {b * 1e3:6.2f} ms" for n, b in best.items()))


if __name__ == "__main__":
    sys.exit(main())
