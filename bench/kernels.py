"""Benchmark the Triton paged-attention kernels on a CUDA GPU (not a test).

For decode (1 new token), speculative verify (k+1) and a prefill chunk over a paged cache with shuffled
blocks, times specserve's Triton kernel with triton.testing.do_bench next to torch SDPA on K/V already
gathered into dense tensors (the best a gather-based path can do) and gather + SDPA, and prints the memory
bandwidth achieved against the device's peak. Decode attention is bandwidth-bound: the target is >= 70% of
peak at batch 64, context 2,048. On a machine without CUDA it says so and exits cleanly.

    python bench/kernels.py [--batch 64] [--context 2048] [--dtype bf16] [--peak-gbps 2039]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DECODE_TARGET = 0.70


@dataclass
class Setup:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_len: int
    context: int  # tokens per sequence, new ones included
    scale: float


def make_setup(args: argparse.Namespace, query_len: int, device: torch.device) -> Setup:
    dtype = DTYPES[args.dtype]
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    # A long-running server's cache is fragmented: hand the blocks out in random order.
    block_tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(
        args.batch, blocks_per_seq
    )
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(
        0, (args.batch + 1) * query_len, query_len, dtype=torch.int32, device=device
    )
    q = torch.randn(args.batch * query_len, args.q_heads, args.head_dim, dtype=dtype, device=device)
    scale = args.head_dim**-0.5
    return Setup(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, query_len, args.context, scale)


def gather(s: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense, contiguous K/V [batch, kv_heads, context, head_dim] read through the block tables."""
    blocks = s.block_tables.long()
    k = s.k_cache[blocks].flatten(1, 2)[:, : s.context].transpose(1, 2).contiguous()
    v = s.v_cache[blocks].flatten(1, 2)[:, : s.context].transpose(1, 2).contiguous()
    return k, v


def sdpa(s: Setup, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch = k.shape[0]
    q = s.q.view(batch, s.query_len, -1, s.q.shape[-1]).transpose(1, 2)
    mask = None
    if s.query_len > 1:  # causal among the new tokens, which sit at the end of each sequence
        q_pos = torch.arange(s.context - s.query_len, s.context, device=q.device)[:, None]
        mask = torch.arange(s.context, device=q.device)[None, :] <= q_pos
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(s.q.shape)


def attention_bytes(s: Setup) -> int:
    """Bytes a perfect kernel moves: every cached K/V read once, q read and out written once."""
    kv = (
        2
        * s.seq_lens.numel()
        * s.context
        * s.k_cache.shape[2]
        * s.k_cache.shape[3]
        * s.k_cache.element_size()
    )
    return kv + 2 * s.q.numel() * s.q.element_size() + s.block_tables.numel() * 4


def attention_flops(s: Setup) -> int:
    visible = sum(s.context - s.query_len + i + 1 for i in range(s.query_len))  # per sequence and head
    return 4 * s.seq_lens.numel() * visible * s.q.shape[1] * s.q.shape[2]


def peak_bandwidth(device: torch.device) -> float:
    """Bytes/s from the memory clock and bus width (double data rate), as NVIDIA quotes it."""
    props = torch.cuda.get_device_properties(device)
    return 2 * props.memory_bus_width / 8 * props.memory_clock_rate * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence, new ones included")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--verify-len", type=int, default=5, help="k+1 query tokens per sequence when verifying"
    )
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk length")
    parser.add_argument("--peak-gbps", type=float, help="override the device's peak memory bandwidth (GB/s)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device here; the Triton kernels need an NVIDIA GPU. Nothing timed.")
        return 0

    import triton.testing

    from specserve.kernels import triton_attention

    device = torch.device("cuda")
    peak = args.peak_gbps * 1e9 if args.peak_gbps else peak_bandwidth(device)
    print(
        f"{torch.cuda.get_device_name(device)}: peak memory bandwidth {peak / 1e9:.0f} GB/s | "
        f"batch {args.batch}, context {args.context}, heads {args.q_heads}/{args.kv_heads}, "
        f"head_dim {args.head_dim}, block {args.block_size}, {args.dtype}"
    )
    print(f"{'case':<16}{'triton us':>11}{'GB/s':>8}{'% peak':>8}{'TFLOP/s':>9}", end="")
    print(f"{'sdpa us':>10}{'gather+sdpa us':>16}")

    decode_fraction = 0.0
    cases = [
        ("decode", 1),
        (f"verify q={args.verify_len}", args.verify_len),
        (f"prefill q={args.chunk}", args.chunk),
    ]
    for name, query_len in cases:
        if query_len > args.context:
            continue
        s = make_setup(args, query_len, device)
        out = torch.empty_like(s.q)

        def run_triton(s: Setup = s, out: torch.Tensor = out) -> torch.Tensor:
            return triton_attention.paged_attention(
                s.q,
                s.k_cache,
                s.v_cache,
                s.block_tables,
                s.seq_lens,
                s.query_start_loc,
                s.scale,
                out=out,
                max_query_len=s.query_len,
                max_seq_len=s.context,
            )

        k, v = gather(s)
        expected = sdpa(s, k, v)
        err = (run_triton().float() - expected.float()).abs().max().item()
        if err > 2e-2 * expected.float().abs().max().item():
            print(
                f"{name}: Triton output differs from SDPA by {err:.3g}; not timing a wrong kernel",
                file=sys.stderr,
            )
            return 1

        t_triton = triton.testing.do_bench(run_triton) * 1e-3
        t_sdpa = triton.testing.do_bench(lambda s=s, k=k, v=v: sdpa(s, k, v)) * 1e-3
        t_gather = triton.testing.do_bench(lambda s=s: sdpa(s, *gather(s))) * 1e-3
        bandwidth = attention_bytes(s) / t_triton
        if query_len == 1:
            decode_fraction = bandwidth / peak
        print(
            f"{name:<16}{t_triton * 1e6:>11.1f}{bandwidth / 1e9:>8.0f}{100 * bandwidth / peak:>7.1f}%"
            f"{attention_flops(s) / t_triton / 1e12:>9.1f}{t_sdpa * 1e6:>10.1f}{t_gather * 1e6:>16.1f}"
        )

    tokens = torch.randperm(args.batch * args.context, device=device)[: args.batch].to(torch.int32)
    s = make_setup(args, 1, device)
    kv_new = torch.randn(args.batch, args.kv_heads, args.head_dim, dtype=s.k_cache.dtype, device=device)
    t_write = (
        triton.testing.do_bench(
            lambda: triton_attention.write_kv(kv_new, kv_new, s.k_cache, s.v_cache, tokens)
        )
        * 1e-3
    )
    write_bytes = 4 * kv_new.numel() * kv_new.element_size()  # K and V, each read once and written once
    print(f"{'write_kv':<16}{t_write * 1e6:>11.1f}{write_bytes / t_write / 1e9:>8.0f}")

    verdict = "meets" if decode_fraction >= DECODE_TARGET else "is below"
    print(f"decode reaches {decode_fraction:.0%} of peak bandwidth: {verdict} the {DECODE_TARGET:.0%} target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
