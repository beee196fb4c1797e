"""The C++ CPU kernels of this checkout against another revision's, over a whole model's layers.

bench/kernels.py times one layer's call, best of many: its K and V stay in cache between calls. In a step
every layer reads its own cache and weights from memory, so this times SmolLM2's 30 layers in turn, each
with caches or weights of its own (float32, the AVX2 class's dtype; attention in bf16 too), the two builds
alternated in one process (ABBA), and prints each one's median and whether their outputs agree bit for bit.
Not a test.

- attention: paged attention, --batch sequences of --context tokens, --query new tokens each (--dtype);
- f32: the dense float32 panel product (the four layer matrices) at --rows rows;
- int4: the float32 int4 product (few-row kernels, or widened panels from 16 rows) at --rows rows;
- int8: the float32 int8 product, a scale per output (as int4);
- int8-bf16: the AVX512-BF16 int8 product (bf16 rows, codes in 16-output tiles, a scale per output);
- head: the int8 LM head a Q8_0 GGUF keeps (SmolLM2's 49,152 x 576, a scale per 32 inputs), four copies
  in turn so that each comes from memory, at --rows rows;
- head-a8: the same head as a w*a8 model runs it, on int8 activations (Q8_0 x Q8_0, float16 scales);
- w4a8 / w8a8: the integer products (activations quantized per 32 inputs; int4 codes with float16 scales
  and offsets per group of 32, as a Q4_1 GGUF's layers keep them, or int8 a scale per output), float32 in
  and out, at --rows rows.

    python bench/kernel_ab.py --base HEAD~1 [--case attention] [--batch 64] [--context 400] [--query 1]
    python bench/kernel_ab.py --base HEAD~1 --case f32 --rows 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import REPO, cpu_line

from specserve.kernels import cpu

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [out, in]
# Where the whole library's source was before it was split by op (csrc/)
OLD_SOURCE = "specserve/kernels/cpu_paged_attention.cpp"


def attention(args: argparse.Namespace) -> tuple[Callable[[], torch.Tensor], str]:
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    shape = (num_blocks, args.block_size, KV_HEADS, HEAD_DIM)
    dtype = getattr(torch, args.dtype)
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    ids = torch.arange(num_blocks) if args.order == "sequential" else torch.randperm(num_blocks)
    tables = ids.to(torch.int32).view(args.batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    starts = torch.arange(0, (args.batch + 1) * args.query, args.query, dtype=torch.int32)
    q = torch.randn(args.batch * args.query, Q_HEADS, HEAD_DIM).to(dtype)
    seq_ids = torch.arange(args.batch, dtype=torch.int64)

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        for k_cache, v_cache in caches:
            cpu.attention.paged_attention_short(
                q, k_cache, v_cache, tables, seq_lens, starts, seq_ids, HEAD_DIM**-0.5, out
            )
        return out

    what = (
        f"attention, {LAYERS} layers: batch {args.batch}, context {args.context}, query {args.query}, "
        f"block {args.block_size}, {args.order} blocks, {args.dtype}"
    )
    return run, what


def products(args: argparse.Namespace) -> tuple[Callable[[], torch.Tensor], str]:
    from specserve.models import quant

    layers = []
    shapes = ((49152, 576),) * 4 if args.case.startswith("head") else SHAPES * LAYERS
    for n, k in shapes:
        w = torch.randn(n, k)
        if args.case == "f32":
            layers.append((k, cpu.matmul.f32_panels(w)))
        elif args.case == "int4":
            q4 = quant.quantize_int4(w)
            packed = cpu.matmul.pack_int4(q4.codes)
            layers.append((k, (packed, q4.scales.contiguous(), (q4.zeros - 8.0 * q4.scales).contiguous())))
        elif args.case == "int8-bf16":
            q8 = quant.quantize_int8(w)
            layers.append((k, (cpu.matmul.int8_tiles(q8.codes), q8.scales.contiguous())))
        elif args.case == "w4a8":
            q4 = quant.quantize_int4(w)
            scales = cpu.matmul.by_tile(q4.scales).half()
            offsets = cpu.matmul.by_tile(q4.zeros - 8.0 * q4.scales).half()
            layers.append((k, (cpu.matmul.w4a8_tiles(q4.codes), scales, offsets)))
        elif args.case == "w8a8":
            q8 = quant.A8Weight.of(quant.quantize_int8(w)).w
            layers.append((k, (cpu.matmul.w8a8_tiles(q8.codes), q8.scales.contiguous())))
        elif args.case == "head-a8":
            q8 = quant.quantize_int8_grouped(w)
            layers.append((k, (cpu.matmul.w8a8_tiles(q8.codes), cpu.matmul.by_tile(q8.scales).half())))
        else:
            q8 = quant.quantize_int8(w)
            codes, scales = (q8.codes, q8.scales) if args.case == "int8" else _q8_0(w)
            layers.append((k, (codes.contiguous(), scales.contiguous())))
    dtype = torch.bfloat16 if args.case == "int8-bf16" else torch.float32
    xs = {k: torch.randn(args.rows, k).to(dtype) for _, k in shapes}
    product = {"f32": cpu.matmul.panel_matmul, "int4": cpu.matmul.int4_matmul}.get(
        args.case, cpu.matmul.int8_matmul
    )

    # int8-bf16's and the a8 products bound once per build, as the model binds them
    bind = {
        "int8-bf16": cpu.matmul.bind_int8_bf16,
        "w4a8": lambda *w: cpu.matmul.bind_w4a8(*w, torch.float32),
        "w8a8": lambda *w: cpu.matmul.bind_w8a8(*w, torch.float32),
        "head-a8": cpu.matmul.bind_w8a8_grouped,
    }.get(args.case)
    bound: dict[object, list] = {}

    def run() -> torch.Tensor:
        # each product's bits summed by column: any changed output changes them, and they are small to keep
        sums = []
        if bind is not None and cpu.build._lib not in bound:
            bound[cpu.build._lib] = [bind(*w) for _, w in layers]
        for i, (k, w) in enumerate(layers):
            if bind is not None:
                y = bound[cpu.build._lib][i](xs[k])
            else:
                y = product(xs[k], w) if args.case == "f32" else product(xs[k], *w)
            bits = y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32)
            sums.append(bits.sum(dim=0, dtype=torch.int64))
        return torch.cat(sums)

    head = args.case.startswith("head")
    what = "the int8 head, 4 copies" if head else f"the four layer matrices, {LAYERS} layers"
    return run, f"{args.case} products of {what}, {args.rows} rows, {str(dtype).removeprefix('torch.')}"


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and a float32 scale per 32 inputs (GGUF's Q8_0: scale = max |w| / 127)."""
    groups = w.view(w.shape[0], -1, 32)
    scales = groups.abs().amax(-1).clamp_min(1e-12) / 127.0
    codes = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.view_as(w), scales


def _base_sources(rev: str, into: Path) -> Path:
    """The revision's kernel sources written into `into`, laid out as build_variant reads them: its csrc/
    files, or, from before the library was split by op, its one source file as the unity translation unit."""
    csrc = cpu.build.CSRC.resolve().relative_to(REPO)

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True
        ).stdout

    names = git("ls-tree", "--name-only", f"{rev}:{csrc}").split() if _has(rev, csrc) else []
    if names:
        for name in names:
            (into / name).write_text(git("show", f"{rev}:{csrc}/{name}"))
    else:
        (into / cpu.build.UNITY).write_text(git("show", f"{rev}:{OLD_SOURCE}"))
    return into


def _has(rev: str, path: Path) -> bool:
    probe = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{rev}:{path}"], capture_output=True)
    return probe.returncode == 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision whose kernel source to compare against")
    p.add_argument(
        "--case",
        choices=("attention", "f32", "int4", "int8", "int8-bf16", "head", "head-a8", "w4a8", "w8a8"),
        default="attention",
    )
    p.add_argument("--rows", type=int, default=2048, help="activation rows of the products")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--query", type=int, default=1, help="new tokens a sequence (1: decode, k + 1: verify)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--order",
        choices=("sequential", "shuffled"),
        default="sequential",
        help="block ids of a sequence: consecutive (a prompt's blocks, as the pool hands them out) or random",
    )
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the attention case's caches"
    )
    args = p.parse_args(argv)

    if cpu.build.load() is None:
        print("the C++ kernel cannot be built here")
        return 1
    isa = os.environ.get(cpu.build.ISA_ENV) or "native"  # the variant the engine loads
    with tempfile.TemporaryDirectory() as tmp:
        builds = {args.base: cpu.build.build_variant(isa, _base_sources(args.base, Path(tmp)))}
    builds["this checkout"] = cpu.build.build_variant(isa)

    torch.manual_seed(0)
    if args.case == "attention":
        run, what = attention(args)
    else:
        run, what = products(args)

    times: dict[str, list[float]] = {name: [] for name in builds}
    outs: dict[str, torch.Tensor] = {}
    names = list(builds)
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            cpu.build._lib = builds[name]  # the module's loaded library, swapped for this pass
            t0 = time.perf_counter()
            out = run()
            times[name].append((time.perf_counter() - t0) * 1e3)
            outs[name] = out
    cpu.build._lib = builds["this checkout"]

    print(cpu_line())
    print(f"{what}, {isa} build, {torch.get_num_threads()} threads")
    for name in names:
        median, best = statistics.median(times[name]), min(times[name])
        print(f"  {name:>14}: median {median:7.2f} ms, best {best:7.2f} ms")
    same = torch.equal(outs[names[0]], outs[names[1]])
    print(f"  outputs {'identical' if same else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
