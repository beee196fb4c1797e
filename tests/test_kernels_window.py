"""Sliding-window attention and score soft-capping (Gemma 3, Mistral, Gemma 2) in every CPU backend: the torch
reference's gather + SDPA plans and each build variant of the C++ kernel, against float64 dense attention
with the window mask. Blocks wholly outside every query's window are poisoned with NaN, so a kernel that
reads them fails."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import PagedBatch, assert_close, make_batch, tolerance

from specserve.kernels import reference, select_backend

# (query_lens, context_lens): decodes far past the window and just inside it, verify queries straddling
# the window edge, prefill chunks longer than the window, a fresh prompt longer than the window
LAYOUTS = [
    ([1, 1, 1, 1], [5, 40, 41, 200]),
    ([4, 5, 3], [36, 37, 100]),
    ([17, 40], [30, 0]),
    ([70, 1, 33], [90, 300, 7]),
]
WINDOWS = [8, 37]


def dense_window_attention(batch: PagedBatch, window: int | None, softcap: float | None) -> torch.Tensor:
    outs = []
    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[starts[s] : starts[s + 1]].double()
        q_len, seq_len = q.shape[0], k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        kv_pos = torch.arange(seq_len)[None, :]
        visible = kv_pos <= q_pos
        if window:
            visible &= kv_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def poison_outside_window(batch: PagedBatch, query_lens: list[int], window: int) -> int:
    """NaN into every block no query of its sequence can see; returns how many blocks were poisoned."""
    bs = batch.k_cache.shape[1]
    poisoned = 0
    for s, (ql, sl) in enumerate(zip(query_lens, batch.seq_lens.tolist())):
        first_visible = max(0, sl - ql + 1 - window)
        for b in range(first_visible // bs):
            block = int(batch.block_tables[s, b])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")
            poisoned += 1
    return poisoned


def run(backend, batch: PagedBatch, query_lens, window, softcap) -> torch.Tensor:
    plan = None
    if backend.build_plan is not None:
        tables = batch.block_tables.tolist()
        plan = backend.build_plan(
            tables, batch.seq_lens.tolist(), query_lens, batch.k_cache.shape[1], window=window
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
        window=window,
        softcap=softcap,
    )
    return out


def check(backend, dtype, group, head_dim, block_size, window, softcap, seed) -> None:
    poisoned = 0
    for n, (query_lens, context_lens) in enumerate(LAYOUTS):
        batch = make_batch(
            query_lens,
            context_lens,
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=seed + n,
        )
        if window:
            poisoned += poison_outside_window(batch, query_lens, window)
        got = run(backend, batch, query_lens, window, softcap)
        assert_close(got, dense_window_attention(batch, window, softcap), tolerance(dtype))
    assert poisoned > 0 or not window


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(1, 64, 8), (3, 64, 16), (4, 128, 32)])
def test_reference_window_matches_dense(window, dtype, group, head_dim, block_size) -> None:
    backend = select_backend("cpu", "torch")
    check(backend, dtype, group, head_dim, block_size, window, None, seed=window + group)


def test_reference_softcap_with_and_without_window() -> None:
    backend = select_backend("cpu", "torch")
    for window in (None, 8):
        check(backend, torch.float32, 2, 64, 16, window, 0.5, seed=3)


def _variant(monkeypatch, isa: str):
    from specserve.kernels import cpu

    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    if isa not in cpu.build.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    lib = cpu.build.build_variant(isa)
    monkeypatch.setattr(cpu.build, "_lib", lib)
    monkeypatch.setattr(cpu.build, "_paths", int(lib.specserve_paths()))
    return cpu


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"), [(1, 64, 8), (3, 128, 16), (4, 256, 16), (2, 80, 16)]
)
def test_cpu_kernel_window_and_softcap_match_dense(
    monkeypatch, isa, dtype, group, head_dim, block_size
) -> None:
    """Each build variant (fast float32 / bfloat16 paths where compiled, the generic loops otherwise and for
    head_dim 80), through the engine's plan; prefill chunks go to the kernel where supports_long says so."""
    _variant(monkeypatch, isa)
    backend = select_backend("cpu", "cpu")
    for window, softcap in ((8, None), (37, None), (None, 0.7), (8, 0.7)):
        check(backend, dtype, group, head_dim, block_size, window, softcap, seed=group * 7 + (window or 1))


def test_plan_for_another_window_is_refused() -> None:
    batch = make_batch(
        [1], [20], num_kv_heads=1, group=1, head_dim=64, block_size=8, dtype=torch.float32, seed=0
    )
    plan = reference.build_plan(batch.block_tables.tolist(), batch.seq_lens.tolist(), [1], 8, window=8)
    with pytest.raises(ValueError, match="window"):
        reference.paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
            batch.query_start_loc, batch.scale, plan=plan, window=None,
        )  # fmt: skip
