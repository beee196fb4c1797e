"""The weight-only products alone: SmolLM2-135M's four layer matrices for all 30 layers, at a few step sizes.

Each layer has its own random weights (int8 codes and their bf16 scales, or the dense bf16 matrix in
oneDNN's prepacked layout, as the model holds them), and a pass runs every layer's four products, so
weights come from memory as in a step rather than from cache. Times are the mean of --passes passes after
one warm-up, on torch's threads (one per core by default).

- dense: the bf16 matmul the unquantized model runs (torch.ops.mkldnn._linear_pointwise, prepacked);
- torch int8: torch._weight_int8pack_mm, the packed-int kernel torchao and gpt-fast call;
- ours int8: kernels/cpu_paged_attention.cpp's AVX512-BF16 product (int8_matmul_bf16), where built.

    python bench/quant_kernels.py [--rows 1,8,16,64] [--passes 5] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_line  # noqa: E402

# (out, in) of SmolLM2-135M's fused qkv, o, fused gate_up and down
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)

    import torch

    from specserve.kernels import cpu_paged_attention as cpa

    if args.threads:
        torch.set_num_threads(args.threads)
    ours = cpa.load() is not None and cpa.quant_bf16_fast()
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        mats = []
        for n, k in SHAPES:
            codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            scales = (torch.rand(n) * 0.01).to(torch.bfloat16)
            dense = torch.ops.mkldnn._reorder_linear_weight(codes.to(torch.bfloat16) * scales[:, None])
            tiles = cpa.int8_tiles(codes) if ours else None
            mats.append((k, dense, codes, scales, tiles, scales.float()))
        layers.append(mats)

    def products(kind: str, xs: dict[int, torch.Tensor]) -> None:
        for mats in layers:
            for k, dense, codes, scales, tiles, scales_f32 in mats:
                if kind == "dense":
                    torch.ops.mkldnn._linear_pointwise(xs[k], dense, None, "none", [], "")
                elif kind == "torch int8":
                    torch._weight_int8pack_mm(xs[k], codes, scales)
                else:
                    cpa.int8_matmul_bf16(xs[k], tiles, scales_f32)

    kinds = ["dense", "torch int8"] + (["ours int8"] if ours else [])
    print(f"CPU: {cpu_line()} | {torch.get_num_threads()} threads | {LAYERS} layers x {len(SHAPES)} matrices")
    print(f"{'rows':>5}" + "".join(f"{k + ' ms':>16}" for k in kinds) + f"{'dense / ours':>14}")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        ms = {}
        for kind in kinds:
            products(kind, xs)
            t0 = time.perf_counter()
            for _ in range(args.passes):
                products(kind, xs)
            ms[kind] = (time.perf_counter() - t0) / args.passes * 1e3
        ratio = f"{ms['dense'] / ms['ours int8']:>13.2f}x" if ours else ""
        print(f"{rows:>5}" + "".join(f"{ms[k]:>16.2f}" for k in kinds) + ratio, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
