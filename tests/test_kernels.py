"""The torch reference paged attention and KV write against a float64 dense oracle, plus backend selection."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import CACHE_DTYPES, assert_close, dense_attention, make_batch, tolerance, with_cache_dtype

from specserve.kernels import reference, select_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (query_lens, context_lens): contexts end mid-block and on block edges; 16 and 17 straddle the
# reference's short/long split; a context of 0 is a fresh prompt (the pure-causal path).
LAYOUTS = [
    ([1, 1, 1], [15, 16, 50]),
    ([2, 5, 1], [0, 33, 7]),
    ([17], [31]),
    ([17, 5], [0, 0]),
    ([1, 2, 5, 17], [45, 9, 26, 3]),
    ([16, 17, 1], [4, 0, 64]),
    ([70, 1, 100], [40, 200, 0]),  # prefill-sized chunks: several query tiles in the C++ kernel
]

GRID = list(itertools.product(range(len(LAYOUTS)), [1, 3, 4, 8], [64, 128], [16, 32], DTYPES))


@pytest.mark.parametrize(("layout", "group", "head_dim", "block_size", "dtype"), GRID)
def test_reference_matches_dense(layout: int, group: int, head_dim: int, block_size: int, dtype) -> None:
    query_lens, context_lens = LAYOUTS[layout]
    batch = make_batch(
        query_lens,
        context_lens,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=GRID.index((layout, group, head_dim, block_size, dtype)),
    )
    out = torch.full_like(batch.q, float("nan"))
    result = reference.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        out=out,
    )
    assert result is out
    assert_close(out, dense_attention(batch), tolerance(dtype))


def test_reference_plan_is_reusable_across_layers() -> None:
    """The engine builds one plan per step and runs every layer's queries and cache through it."""
    query_lens = [1, 2, 17]
    layer0 = make_batch(
        query_lens,
        [20, 5, 9],
        num_kv_heads=1,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=5,
    )
    gen = torch.Generator().manual_seed(6)
    # Another layer: same layout, different queries and cache contents (the NaN poison stays NaN).
    layer1 = dataclasses.replace(
        layer0,
        q=torch.randn(layer0.q.shape, generator=gen),
        k_cache=layer0.k_cache * -0.5,
        v_cache=layer0.v_cache * 3.0,
        keys=[k * -0.5 for k in layer0.keys],
        values=[v * 3.0 for v in layer0.values],
    )
    plan = reference.build_plan(
        layer0.block_tables.tolist(), layer0.seq_lens.tolist(), query_lens, layer0.k_cache.shape[1]
    )
    for batch in (layer0, layer1):
        out = reference.paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            plan=plan,
        )
        assert_close(out, dense_attention(batch), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_write_kv_scatters_and_skips_negative_slots(dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, heads, dim = 6, 16, 2, 64
    k_cache = torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11].to(torch.int32)
    slots[[2, 7]] = -1  # padding tokens
    key = torch.randn(11, heads, dim, generator=gen)  # float32 into a possibly narrower cache
    value = torch.randn(11, heads, dim, generator=gen)
    reference.write_kv(key, value, k_cache, v_cache, slots)

    flat_k = k_cache.view(-1, heads, dim)
    flat_v = v_cache.view(-1, heads, dim)
    kept = slots >= 0
    assert torch.equal(flat_k[slots[kept].long()], key[kept].to(dtype))
    assert torch.equal(flat_v[slots[kept].long()], value[kept].to(dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[kept].long()] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_select_backend() -> None:
    from specserve.kernels.cpu import build

    # auto on CPU: the C++ short-query kernel when it builds here, else the torch reference
    cpu = select_backend("cpu")
    assert cpu.name == ("cpu" if build.load() is not None else "torch")
    assert cpu.paged_attention is reference.paged_attention
    torch_cpu = select_backend("cpu", "torch")
    assert torch_cpu.name == "torch" and torch_cpu.build_plan is reference.build_plan
    assert select_backend("cuda", "torch").name == "torch"
    for device, prefer in (("cuda", "auto"), ("cuda", "triton")):
        backend = select_backend(device, prefer)
        assert backend.name == "triton" and backend.build_plan is None
    with pytest.raises(ValueError, match="auto, cpu, torch or triton"):
        select_backend("cpu", "cuda")


def test_select_backend_refuses_compiled_triton_on_cpu() -> None:
    from specserve.kernels import triton_attention

    if triton_attention.interpreted():
        pytest.skip("another test imported the kernels under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("cpu", "triton")


def test_split_k_only_when_the_grid_is_too_small_for_the_gpu() -> None:
    from specserve.kernels.triton_attention import MAX_SPLITS, MIN_TOKENS_PER_SPLIT, choose_splits

    sms = 108
    assert choose_splits(64 * 8, sms, 2048) == 1  # batch 64 x 8 KV heads already fills the GPU
    assert choose_splits(4, sms, 2048) == 2048 // MIN_TOKENS_PER_SPLIT  # capped by work per split
    assert choose_splits(1, sms, 1 << 20) == MAX_SPLITS
    assert choose_splits(1, sms, 100) == 1  # too short to be worth a merge
    for programs in range(1, 2 * sms):
        splits = choose_splits(programs, sms, 32768)
        assert splits & (splits - 1) == 0 and programs * splits >= min(2 * sms, programs * MAX_SPLITS)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_dense(layout: int, dtype) -> None:
    """The C++ short-query kernel (backend "cpu"), with the reference's SDPA path for long queries."""
    from specserve.kernels import select_backend

    backend = select_backend("cpu", "cpu")
    query_lens, context_lens = LAYOUTS[layout]
    for group, head_dim, block_size in [(1, 64, 16), (3, 128, 32), (8, 64, 32)]:
        batch = make_batch(
            query_lens,
            context_lens,
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=layout * 10 + group,
        )
        plan = backend.build_plan(
            batch.block_tables.tolist(), batch.seq_lens.tolist(), query_lens, block_size
        )
        out = torch.full_like(batch.q, float("nan"))
        backend.paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            plan=plan,
            out=out,
        )
        assert_close(out, dense_attention(batch), tolerance(dtype))


def _variant(monkeypatch, isa: str):
    """The CPU kernels with the library of one build variant loaded in place of the native one."""
    from specserve.kernels import cpu

    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    if isa not in cpu.build.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    lib = cpu.build.build_variant(isa)
    monkeypatch.setattr(cpu.build, "_lib", lib)
    monkeypatch.setattr(cpu.build, "_paths", int(lib.specserve_paths()))
    return cpu


# Layouts for the ISA variants: decode over many lengths, verify-sized queries, and prefill chunks of
# several query tiles over long contexts (query tiles of 16 tokens, key tiles of 8, blocks of 8 to 64).
VARIANT_LAYOUTS = [
    *LAYOUTS,
    ([1] * 9, [0, 7, 8, 15, 16, 63, 64, 255, 1000]),
    ([5, 3, 5], [700, 3, 40]),
    ([256], [512]),
    ([33, 1, 48], [0, 511, 7]),
    # one sequence: too few (sequence, head) tasks for two threads, so float32 splits its keys into parts
    ([1], [1000]),
    ([4], [300]),
]
# (group, head_dim, block_size): SmolLM2's 3, Llama's 4 and 8, MHA, Gemma 3's 256-wide heads; 80 and block 12
# take the generic loops
VARIANT_SHAPES = [
    (1, 64, 8),
    (3, 64, 16),
    (4, 128, 32),
    (8, 64, 64),
    (3, 128, 16),
    (4, 256, 16),
    (2, 80, 16),
    (3, 64, 12),
]


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHE_DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), VARIANT_SHAPES)
def test_cpu_kernel_variants_match_dense(
    monkeypatch, isa, dtype, cache_dtype, group, head_dim, block_size
) -> None:
    """Every build variant this CPU runs, through the engine's path (the plan routes prefill chunks to the
    kernel where supports_long says so), against float64 dense attention over the caches' values."""
    cpu = _variant(monkeypatch, isa)
    backend = select_backend("cpu", "cpu")
    paths = cpu.build.fast_paths()
    if isa == "portable":
        assert paths == []
    import platform

    if (
        isa != "portable"
        and platform.machine() in ("x86_64", "AMD64")
        and "avx2" in cpu.build.available_isas()
    ):
        assert "float32" in paths
    long_here = cpu.attention.supports_long(dtype, head_dim, block_size)
    assert long_here == (
        str(dtype).removeprefix("torch.") in paths
        and head_dim in (64, 128, 256)
        and block_size % (8 if dtype == torch.float32 else 16) == 0
    )
    for n, (query_lens, context_lens) in enumerate(VARIANT_LAYOUTS):
        batch = make_batch(
            query_lens,
            context_lens,
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=100 * n + group,
        )
        batch = with_cache_dtype(batch, cache_dtype)
        tables, lens = batch.block_tables.tolist(), batch.seq_lens.tolist()
        plan = backend.build_plan(tables, lens, query_lens, block_size)
        out = torch.full_like(batch.q, float("nan"))
        backend.paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            plan=plan,
            out=out,
        )
        assert_close(out, dense_attention(batch), tolerance(dtype))
        if long_here:  # every query, prefill chunks too, from the kernel alone
            out2 = torch.full_like(batch.q, float("nan"))
            nat = plan.native
            cpu.attention.paged_attention_short(
                batch.q, batch.k_cache, batch.v_cache, nat.block_tables, nat.seq_lens,
                nat.query_start_loc, nat.all_ids, batch.scale, out2,
            )  # fmt: skip
            assert torch.equal(out2, out)


def test_kernel_isa_env_selects_the_build(monkeypatch, tmp_path) -> None:
    from specserve.kernels import cpu

    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu.build, "_lib", None)
    monkeypatch.setattr(cpu.build, "_failed", False)
    monkeypatch.setattr(cpu.build, "_paths", 0)
    monkeypatch.setenv(cpu.build.ISA_ENV, "portable")
    assert cpu.build.load() is not None and cpu.build.fast_paths() == []
    assert [p.name.split("-")[1] for p in (tmp_path / "kernels").glob("*.so")] == ["portable"]
    monkeypatch.setattr(cpu.build, "_lib", None)
    monkeypatch.setenv(cpu.build.ISA_ENV, "avx512-please")
    assert cpu.build.load() is None  # an unknown variant warns and falls back, as a missing compiler does


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHE_DTYPES)
@pytest.mark.parametrize("dim", [64, 20])
@pytest.mark.parametrize("tokens", [37, 300])
def test_fused_rope_write_kv_is_the_torch_path_bit_for_bit(
    monkeypatch, isa, dtype, cache_dtype, dim, tokens
) -> None:
    """The C++ rope + KV write against LlamaModel's torch ops: rotation, then write_kv (which rounds into a
    bfloat16 cache under float32 as torch's .to does). Dim 20 takes the float32 vector loop's scalar tail;
    300 tokens, the threaded loop."""
    cpu = _variant(monkeypatch, isa)
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, block_size, num_blocks = 9, 3, 16, 24
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    freqs = torch.arange(200, dtype=torch.float32)[:, None] * torch.rand(dim // 2, generator=gen)[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    positions = torch.randint(0, 200, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[4, 30]] = -1  # not cached

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = dim // 2
        return x * cos[positions] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[positions]

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_k = rotate(q.view(tokens, heads, dim)), rotate(k.view(tokens, kv_heads, dim))
    want_kc = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=cache_dtype)
    want_vc = torch.zeros_like(want_kc)
    reference.write_kv(want_k, v.view(tokens, kv_heads, dim), want_kc, want_vc, slots)

    k_cache, v_cache = torch.zeros_like(want_kc), torch.zeros_like(want_vc)
    fused = qkv.clone()
    cpu.elementwise.rope_write_kv(fused, positions, cos, sin, heads, kv_heads, k_cache, v_cache, slots)
    assert torch.equal(fused[:, : heads * dim].view(tokens, heads, dim), want_q)
    assert torch.equal(fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim), want_k)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.elementwise.rope_write_kv(
            qkv.half(), positions, cos, sin, heads, kv_heads, k_cache, v_cache, slots
        )


def _bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two tensors are, element by element (same sign assumed near zero)."""
    bits = lambda t: t.to(torch.bfloat16).view(torch.int16).to(torch.int32)  # noqa: E731
    return (bits(got) - bits(want)).abs()


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_fused_add_rms_norm_is_the_residual_add_then_torch_rms_norm(monkeypatch, isa, dtype, rows) -> None:
    """The residual stream it leaves in h is exactly h + add; its norm is F.rms_norm's up to the order of
    the squares' sum (300 rows: the threaded loop; add a strided view, as a slice of a wider output is)."""
    cpu = _variant(monkeypatch, isa)
    gen = torch.Generator().manual_seed(5)
    d = 576
    h = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
    wide = torch.randn(rows, d + 64, generator=gen).to(dtype)
    add, weight = wide[:, 32 : 32 + d], torch.randn(d, generator=gen).to(dtype)
    want_h = h + add
    want = F.rms_norm(want_h, (d,), weight, 1e-6)
    got_h = h.clone()
    got = cpu.elementwise.add_rms_norm(got_h, add, weight, 1e-6)
    assert torch.equal(got_h, want_h)
    plain = cpu.elementwise.add_rms_norm(want_h.clone(), None, weight, 1e-6)
    for out in (got, plain):
        if dtype == torch.bfloat16:
            ulps = _bf16_ulps(out, want)
            assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 0.01
        else:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="weight"):
        cpu.elementwise.add_rms_norm(
            h.clone(), add, weight.float() if dtype == torch.bfloat16 else weight.double(), 1e-6
        )


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_rms_norm_heads_is_torch_rms_norm_of_each_head_in_place(monkeypatch, isa, dtype, rows) -> None:
    """q and k norms on their slices of a fused qkv row (4 q heads, 1 k head, then v, Gemma 3 270M's): each
    head normalised as F.rms_norm normalises it, in place; the rest of the row untouched."""
    cpu = _variant(monkeypatch, isa)
    gen = torch.Generator().manual_seed(8)
    hd = 256
    qkv = (torch.randn(rows, 6 * hd, generator=gen) * 3).to(dtype)
    q_w, k_w = (torch.randn(hd, generator=gen).to(dtype) for _ in range(2))
    qk = qkv[:, : 5 * hd].view(rows, 5, hd)
    want_q = F.rms_norm(qk[:, :4], (hd,), q_w, 1e-6)
    want_k = F.rms_norm(qk[:, 4:], (hd,), k_w, 1e-6)
    v = qkv[:, 5 * hd :].clone()
    cpu.elementwise.rms_norm_heads(qk[:, :4], q_w, 1e-6)
    cpu.elementwise.rms_norm_heads(qk[:, 4:], k_w, 1e-6)
    assert torch.equal(qkv[:, 5 * hd :], v)
    for got, want in ((qk[:, :4], want_q), (qk[:, 4:], want_k)):
        if dtype == torch.bfloat16:
            ulps = _bf16_ulps(got, want)
            assert int(ulps.max()) <= 1 and float((ulps > 0).float().mean()) < 0.01
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.elementwise.rms_norm_heads(qkv.view(rows, 6, hd).transpose(0, 1), q_w, 1e-6)


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_fused_silu_mul_is_silu_of_gate_times_up(monkeypatch, isa, dtype, rows) -> None:
    """silu(gate) * up for a fused gate_up row (gate first) with torch's two roundings in bfloat16: rarely
    a step from torch's silu, so at most two from its product; float32 to a few ulps."""
    cpu = _variant(monkeypatch, isa)
    gen = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
    gate_up[0, :2] = torch.tensor([-200.0, 200.0]).to(dtype)  # past exp's range: 0 and x, no NaN
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up + 0.0  # + 0.0: silu(-200) is -0.0 in torch and 0.0 here
    got = cpu.elementwise.silu_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype and not got.isnan().any()
    got = got + 0.0
    if dtype == torch.bfloat16:
        ulps = _bf16_ulps(got, want)
        assert int(ulps.max()) <= 2 and float((ulps > 0).float().mean()) < 0.01
        silu = cpu.elementwise.silu_mul(torch.cat([gate, torch.ones_like(up)], dim=-1)) + 0.0
        assert int(_bf16_ulps(silu, F.silu(gate) + 0.0).max()) <= 1
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        cpu.elementwise.silu_mul(gate_up.half())


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_fused_gelu_tanh_mul_is_gelu_of_gate_times_up(monkeypatch, isa, dtype, rows) -> None:
    """Gemma's GeGLU: F.gelu(gate, approximate="tanh") * up with torch's two roundings in bfloat16 (as
    silu_mul), float32 to a few ulps of float64's. Below 1e-4 it is compared by its difference: there
    torch's float32 1 + tanh cancels (to 0 once tanh rounds to -1, gates under about -5), and ours,
    x sigmoid(2u), keeps the tiny true value. Gates far out on both sides give gelu's 0 and x, no NaN."""
    cpu = _variant(monkeypatch, isa)
    gen = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(rows, 2 * 2048, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -30.0, 30.0, 200.0]).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu.elementwise.gelu_tanh_mul(gate_up)
    assert got.shape == (rows, 2048) and got.dtype == dtype and not got.isnan().any()
    if dtype == torch.bfloat16:
        gelu = cpu.elementwise.gelu_tanh_mul(torch.cat([gate, torch.ones_like(up)], dim=-1))
        for ours, torchs, steps in (
            (got, F.gelu(gate, approximate="tanh") * up, 2),
            (gelu, F.gelu(gate, approximate="tanh"), 1),
        ):
            near = torchs.float().abs() < 1e-4
            ulps = _bf16_ulps(ours, torchs)[~near]
            assert int(ulps.max()) <= steps and float((ulps > 0).float().mean()) < 0.01
            assert float((ours.float() - torchs.float()).abs()[near].max()) < 1e-4
    else:
        exact = F.gelu(gate.double(), approximate="tanh") * up.double()
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        cpu.elementwise.gelu_tanh_mul(gate_up.half())


def test_triton_backend_without_triton_names_the_extra(monkeypatch) -> None:
    import builtins
    import sys

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    import specserve.kernels

    # forget an earlier import, both as a module and as the package's attribute
    monkeypatch.delitem(sys.modules, "specserve.kernels.triton_attention", raising=False)
    monkeypatch.delattr(specserve.kernels, "triton_attention", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_triton)
    with pytest.raises(ValueError, match=r"specserve\[gpu\]"):
        select_backend("cuda", "auto")
