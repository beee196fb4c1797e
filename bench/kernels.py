"""Benchmark the paged-attention kernels (not a test): Triton on a CUDA GPU, the C++ kernel on CPU.

CUDA: for decode (1 new token), speculative verify (k+1) and a prefill chunk over a paged cache with shuffled
blocks, times specserve's Triton kernel with triton.testing.do_bench next to torch SDPA on K/V already
gathered into dense tensors (the best a gather-based path can do) and gather + SDPA, and prints the memory
bandwidth achieved against the device's peak. Decode attention is bandwidth-bound: the target is >= 70% of
peak at batch 64, context 2,048.

CPU (--device cpu, the default without CUDA; SmolLM2-135M's shapes, float32): the same cases per layer call
through the engine's path (backend "cpu": the C++ kernel where it takes the queries, gather + SDPA where it
does not), through each build variant of the kernel this CPU runs (native, avx2, portable), and through the
torch backend's gather + SDPA; then rotary embedding + KV write, fused against the torch ops. Best of
repeated calls (the machines are shared: the least disturbed call is the kernel's own cost). Runs against
an older checkout too (PYTHONPATH=...), printing what it lacks as n/a.

    python bench/kernels.py [--batch 64] [--context 2048] [--dtype bf16] [--peak-gbps 2039]
    python bench/kernels.py --device cpu [--batch 64] [--context 512] [--chunk 256] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import sys
import time
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


def best_seconds(fn, min_seconds: float = 1.0, min_calls: int = 5) -> float:
    """The fastest call. On one thread, by the thread's CPU time: on a shared, oversubscribed machine no
    call escapes preemption, and wall time then measures the neighbours more than the kernel."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()  # warm-up: first-touch pages, thread pool
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def cpu_main(args: argparse.Namespace) -> int:
    import platform

    from specserve.kernels import cpu, select_backend

    torch.manual_seed(0)
    if cpu.build.load() is None:
        print("bench/kernels.py: the C++ kernel does not build here (no compiler?); nothing to time.")
        return 1
    flags = set(cpu.build._cpu_signature().split())
    isa_flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    variants = cpu.build.available_isas() if hasattr(cpu.build, "build_variant") else []
    fast = cpu.build.fast_paths() if hasattr(cpu.build, "fast_paths") else "n/a (older checkout)"
    print(
        f"{platform.processor() or platform.machine()} [{isa_flags}], torch threads {torch.get_num_threads()}"
        f" ({'thread CPU time' if torch.get_num_threads() == 1 else 'wall time'})"
        f" | batch {args.batch}, context {args.context}, heads {args.q_heads}/{args.kv_heads}, head_dim "
        f"{args.head_dim}, block {args.block_size}, {args.dtype} | kernel fast paths: {fast}"
    )
    cpu_backend = select_backend("cpu", "cpu")
    header = f"{'case (one layer)':<22}{'engine us':>11}{'GB/s':>7}"
    header += "".join(f"{v + ' us':>13}" for v in variants) + f"{'gather+sdpa us':>16}"
    print(header)
    cases = [
        ("decode", 1, args.batch),
        (f"verify q={args.verify_len}", args.verify_len, args.batch),
        (f"prefill q={args.chunk}", args.chunk, args.prefill_batch),
    ]
    for name, query_len, batch in cases:
        if query_len <= args.context:
            line = _cpu_attention_case(args, name, query_len, batch, cpu_backend, variants)
            if line is None:
                return 1
            print(line)

    print(f"{'rope + write_kv':<22}{'fused us':>11}{'torch ops us':>14}")
    for tokens in (args.batch, args.chunk * args.prefill_batch):  # a decode step's, a prefill's tokens
        print(_cpu_rope_case(args, tokens))
    return 0


def _cpu_attention_case(args, name: str, query_len: int, batch: int, cpu_backend, variants) -> str | None:
    from specserve.kernels import cpu, reference

    s = make_setup(argparse.Namespace(**{**vars(args), "batch": batch}), query_len, torch.device("cpu"))
    tables, lens = s.block_tables.tolist(), s.seq_lens.tolist()
    out = torch.empty_like(s.q)

    def call(plan) -> torch.Tensor:
        return reference.paged_attention(
            s.q, s.k_cache, s.v_cache, s.block_tables, s.seq_lens, s.query_start_loc, s.scale,
            plan=plan, out=out,
        )  # fmt: skip

    cpu_plan = cpu_backend.build_plan(tables, lens, [query_len] * batch, args.block_size)
    torch_plan = reference.build_plan(tables, lens, [query_len] * batch, args.block_size)
    expected = call(torch_plan).clone()
    err = (call(cpu_plan) - expected).abs().max().item()
    if err > 1e-2 * expected.abs().max().item():
        print(f"{name}: the engine's path differs from gather + SDPA by {err:.3g}", file=sys.stderr)
        return None
    t_engine = best_seconds(lambda: call(cpu_plan))
    per_variant = []
    native_lib, native_paths = cpu.build._lib, getattr(cpu.build, "_paths", 0)
    for isa in variants:
        lib = cpu.build.build_variant(isa)
        cpu.build._lib, cpu.build._paths = lib, int(lib.specserve_paths())
        try:
            per_variant.append(best_seconds(lambda: call(cpu_plan)))
        finally:
            cpu.build._lib, cpu.build._paths = native_lib, native_paths
    t_torch = best_seconds(lambda: call(torch_plan))
    line = f"{name:<22}{t_engine * 1e6:>11.1f}{attention_bytes(s) / t_engine / 1e9:>7.1f}"
    return line + "".join(f"{t * 1e6:>13.1f}" for t in per_variant) + f"{t_torch * 1e6:>16.1f}"


def _cpu_rope_case(args, tokens: int) -> str:
    from specserve.kernels import cpu, reference

    dtype = DTYPES[args.dtype]
    dim, heads, kv_heads = args.head_dim, args.q_heads, args.kv_heads
    num_blocks = -(-tokens // args.block_size) + 8
    k_cache = torch.zeros(num_blocks, args.block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.randint(0, 4096, (tokens,))
    slots = torch.randperm(num_blocks * args.block_size)[:tokens]
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * torch.rand(dim // 2)[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def torch_ops() -> None:  # what LlamaModel.forward runs unfused
        c, sn = cos[positions], sin[positions]
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        half = dim // 2
        for x in (q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)):
            y = x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sn
        reference.write_kv(y, v.view(tokens, kv_heads, dim), k_cache, v_cache, slots)

    def fused() -> None:
        cpu.elementwise.rope_write_kv(qkv, positions, cos, sin, heads, kv_heads, k_cache, v_cache, slots)

    try:
        fused()
        t_fused = f"{best_seconds(fused) * 1e6:>11.1f}"
    except ValueError:  # an older checkout: bfloat16 only
        t_fused = f"{'n/a':>11}"
    return f"{f'{tokens} tokens':<22}{t_fused}{best_seconds(torch_ops) * 1e6:>14.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--context", type=int, help="tokens per sequence, new ones included (2048 on CUDA, 512 on CPU)"
    )
    parser.add_argument("--q-heads", type=int, help="32 on CUDA, 9 on CPU (SmolLM2-135M)")
    parser.add_argument("--kv-heads", type=int, help="8 on CUDA, 3 on CPU")
    parser.add_argument("--head-dim", type=int, help="128 on CUDA, 64 on CPU")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="bf16 on CUDA, fp32 on CPU")
    parser.add_argument(
        "--verify-len", type=int, default=5, help="k+1 query tokens per sequence when verifying"
    )
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk length")
    parser.add_argument("--prefill-batch", type=int, default=4, help="CPU: prefill chunks in the call")
    parser.add_argument("--peak-gbps", type=float, help="override the device's peak memory bandwidth (GB/s)")
    parser.add_argument(
        "--threads", type=int, help="CPU: torch (and kernel) threads; 1 is steadiest on a busy shared machine"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    defaults = {"context": (512, 2048), "q_heads": (9, 32), "kv_heads": (3, 8), "head_dim": (64, 128)}
    defaults["dtype"] = ("fp32", "bf16")
    for key, (cpu_value, cuda_value) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, cpu_value if on_cpu else cuda_value)
    if on_cpu:
        return cpu_main(args)

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
