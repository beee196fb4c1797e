"""The weight-only products alone: SmolLM2-135M's four layer matrices for all 30 layers, at a few step sizes.

Each layer has its own random weights, held as the model holds them: int8 codes with their bf16 scales,
int4 codes with a scale and zero per group of 32, the dense bf16 matrix in oneDNN's prepacked layout. A pass
runs every layer's four products, so weights come from memory as in a step rather than from cache. Times are
the median of --passes passes (each running every kind once, in turn) after one warm-up, on torch's threads
(one per core by default).

- dense: the bf16 matmul the unquantized model runs (torch.ops.mkldnn._linear_pointwise, prepacked);
- torch int8 / int4: torch._weight_int8pack_mm and _weight_int4pack_mm_for_cpu (groups of 32), the
  packed-int kernels torchao and gpt-fast call;
- fp32 MKL / ours (--float32): F.linear on the dense float32 matrix, and our AVX2 + FMA panel product;
  fp32 int8 / int4: our float32 products on the quantized matrices (int8_matmul, int4_matmul), and int8
  widened 256 outputs at a time for MKL (what steps of more than 8 rows ran before the widening panels);
- ours bf16 / int8 / int4: kernels/cpu/csrc/matmul_bf16_avx512.cpp's products (panel_matmul on the dense
  matrix's panels, int8_matmul_bf16, int4_matmul_bf16), where built;
- ours int4 rows: our AVX512-BF16 few-row int4 product on the float32 kernels' nibbles (int4_rows_bf16,
  1..8 rows: each code as the exact bf16 1 + code / 16 on vdpbf16ps), what bf16 `auto` runs batch-1 steps on.
- w8a8 / w4a8 (--a8; fp32 and bf16 in and out): kernels/cpu/csrc/matmul_q8.cpp's integer products on the same
  int8 / int4 codes, activations quantized per 32 inputs inside each call (w8a8_matmul, w4a8_matmul).

    python bench/quant_kernels.py [--rows 1,8,16,64] [--passes 5] [--threads N] [--float32] [--a8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_line  # noqa: E402

# (out, in) of SmolLM2-135M's fused qkv, o, fused gate_up and down
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def _width(kind: str) -> int:
    return max(14, len(kind) + 5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--threads", type=int)
    p.add_argument("--float32", action="store_true", help="also time float32 dense: MKL's sgemm against ours")
    p.add_argument("--a8", action="store_true", help="also time the w8a8 / w4a8 integer products")
    args = p.parse_args(argv)

    import torch

    from specserve.kernels import cpu
    from specserve.models import quant
    from specserve.models.llama import prepacked_linear_available

    if args.threads:
        torch.set_num_threads(args.threads)
    ours = cpu.build.load() is not None and cpu.build.quant_bf16_fast()
    torch.manual_seed(0)
    bf16_dense = prepacked_linear_available(torch.device("cpu"), torch.bfloat16)
    layers = []
    for _ in range(LAYERS):
        mats = []
        for n, k in SHAPES:
            q8 = quant.quantize_int8(torch.randn(n, k))
            scales = q8.scales.to(torch.bfloat16)
            q4 = quant.quantize_int4(torch.randn(n, k))
            mat = {}
            # oneDNN prepacks bf16 only where it has bf16 kernels: an AVX2-only CPU has no bf16 dense
            # baseline (its native dtype is float32: --float32)
            if bf16_dense:
                mat["dense"] = torch.ops.mkldnn._reorder_linear_weight(
                    quant.dequantize(q8).to(torch.bfloat16)
                )
            mat["torch int8"] = (q8.codes, scales)
            mat["torch int4"] = (
                torch._convert_weight_to_int4pack_for_cpu(q4.codes.to(torch.int32), 2),
                torch.stack([q4.scales.t(), q4.zeros.t()], dim=-1).to(torch.bfloat16),
            )
            if args.float32:
                mat["fp32 MKL"] = quant.dequantize(q8)
                if cpu.build.load() is not None and cpu.build.quant_fast():
                    mat["fp32 ours"] = cpu.matmul.f32_panels(mat["fp32 MKL"])
                    mat["fp32 int8"] = (q8.codes, q8.scales)
                    mat["fp32 int4"] = (
                        cpu.matmul.pack_int4(q4.codes),
                        q4.scales.contiguous(),
                        (q4.zeros - 8.0 * q4.scales).contiguous(),
                    )
                    mat["fp32 int8 wide"] = (q8.codes, q8.scales)
            if ours:
                mat["ours bf16"] = cpu.matmul.bf16_panels(quant.dequantize(q8).to(torch.bfloat16))
                mat["ours int8"] = (cpu.matmul.int8_tiles(q8.codes), scales.float())
                mat["ours int4"] = cpu.matmul.int4_tiles(q4.codes, q4.scales, q4.zeros)
                mat["ours int4 rows"] = cpu.matmul.bind_int4_rows_bf16(
                    cpu.matmul.pack_int4(q4.codes),
                    q4.scales.contiguous(),
                    (q4.zeros - 8.0 * q4.scales).contiguous(),
                )
            if args.a8 and cpu.build.load() is not None:
                w8, w4 = quant.A8Weight.of(q8).w, q4
                t8, t4 = cpu.matmul.w8a8_tiles(w8.codes), cpu.matmul.w4a8_tiles(w4.codes)
                s4 = cpu.matmul.by_tile(w4.scales)
                o4 = cpu.matmul.by_tile(w4.zeros - 8.0 * w4.scales)
                for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                    mat[f"{name} w8a8"] = cpu.matmul.bind_w8a8(t8, w8.scales.contiguous(), dtype)
                    mat[f"{name} w4a8"] = cpu.matmul.bind_w4a8(t4, s4, o4, dtype)
            mats.append((k, mat))
        layers.append(mats)

    def products(kind: str, inputs: dict[torch.dtype, dict[int, torch.Tensor]]) -> None:
        xs = inputs[torch.float32 if kind.startswith("fp32") else torch.bfloat16]
        for mats in layers:
            for k, mat in mats:
                w = mat[kind]
                if kind == "dense":
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                elif kind == "torch int8":
                    torch._weight_int8pack_mm(xs[k], *w)
                elif kind == "torch int4":
                    torch._weight_int4pack_mm_for_cpu(xs[k], w[0], quant.GROUP, w[1])
                elif kind == "fp32 MKL":
                    torch.nn.functional.linear(xs[k], w)
                elif kind in ("ours bf16", "fp32 ours"):
                    cpu.matmul.panel_matmul(xs[k], w)
                elif kind == "fp32 int8":
                    cpu.matmul.int8_matmul(xs[k], *w)
                elif kind == "fp32 int4":
                    cpu.matmul.int4_matmul(xs[k], *w)
                elif kind == "fp32 int8 wide":  # what int8 ran for many rows before: widened for MKL
                    codes, scales = w
                    quant._widened_blocks(
                        xs[k],
                        len(codes),
                        lambda j, m, c=codes, s=scales: cpu.matmul.int8_widen(c[j : j + m], s[j : j + m]),
                    )
                elif kind == "ours int4 rows" or kind.endswith("a8"):
                    w(xs[k])
                elif kind == "ours int8":
                    cpu.matmul.int8_matmul_bf16(xs[k], *w)
                else:
                    cpu.matmul.int4_matmul_bf16(xs[k], *w)

    ours_kinds = ["ours bf16", "ours int8", "ours int4", "ours int4 rows"]
    kinds = (["dense"] if bf16_dense else []) + ["torch int8", "torch int4"] + (ours_kinds if ours else [])
    fp32 = ("fp32 MKL", "fp32 ours", "fp32 int8", "fp32 int4", "fp32 int8 wide")
    a8 = ("fp32 w8a8", "fp32 w4a8", "bf16 w8a8", "bf16 w4a8")
    kinds += [kind for kind in fp32 + a8 if kind in layers[0][0][1]]
    print(f"CPU: {cpu_line()} | {torch.get_num_threads()} threads | {LAYERS} layers x {len(SHAPES)} matrices")
    print(f"{'rows':>5}" + "".join(f"{k + ' ms':>{_width(k)}}" for k in kinds))
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        inputs = {torch.bfloat16: xs, torch.float32: {k: x.float() for k, x in xs.items()}}
        # passes interleave the kinds, and each kind's figure is its median pass: on a shared 2-core machine
        # a kind timed in one stretch took whatever load that stretch had (the same kind varied 20 % between
        # runs of the script, while the interleaved medians' ratios held)
        # our int4 rows product takes 1..INT4_ROWS_BF16_MAX rows only: a blank column past them
        here = [k for k in kinds if k != "ours int4 rows" or rows <= cpu.matmul.INT4_ROWS_BF16_MAX]
        times: dict[str, list[float]] = {kind: [] for kind in here}
        for kind in here:
            products(kind, inputs)
        for _ in range(args.passes):
            for kind in here:
                t0 = time.perf_counter()
                products(kind, inputs)
                times[kind].append((time.perf_counter() - t0) * 1e3)
        ms = {kind: statistics.median(t) for kind, t in times.items()}
        cells = (f"{ms[k]:>{_width(k)}.2f}" if k in ms else " " * _width(k) for k in kinds)
        print(f"{rows:>5}" + "".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
