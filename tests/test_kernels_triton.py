"""The Triton kernels, run on CPU by Triton's interpreter, against the torch reference and float64 attention.

Triton picks compile-or-interpret when a function is decorated, its own library (tl.max, tl.cdiv, ...)
included, once per process: whichever test imports Triton first fixes it for the whole pytest run. So the
kernels run in a child process started with TRITON_INTERPRET=1 (this file run as a script), which writes
their outputs to a file; the tests here rebuild the same seeded inputs and check those outputs. The pytest
process itself never changes mode, so other tests, and compiled Triton on a CUDA machine, are unaffected.

The interpreter is slow, so the cases are few and small, chosen to cover head sizes 64/128, block sizes
16/32, float32/bfloat16/float16, query lengths 1/2/5/17, GQA ratios 1/3/4/8, both tile heights
(decode/verify and prefill) and the split-K path, without the full cartesian product.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from kernel_cases import PagedBatch, assert_close, dense_attention, make_batch, tolerance
from test_kernels_window import dense_window_attention, poison_outside_window
from tree_cases import LAYOUTS as TREE_LAYOUTS
from tree_cases import dense_tree_attention, parents_of
from tree_cases import query_lens as tree_query_lens

from specserve.kernels import reference

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    query_lens: list[int]
    context_lens: list[int]
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_splits: int = 1
    strided_q: bool = False  # q as a view into a fused QKV projection
    pad_rows: int = 0  # q rows past the last sequence (CUDA-graph padding): must stay untouched
    seed: int = 0
    window: int | None = None  # sliding window; blocks wholly before it are NaN-poisoned
    softcap: float | None = None
    trees: tuple[str | None, ...] | None = None  # tree_cases.TREES names per sequence (None: no tree)


CASES = {
    "decode-gqa4-d128-b16-f32": Case([1, 1, 1], [15, 16, 50], 2, 4, 128, 16, torch.float32, seed=1),
    "verify-gqa8-d64-b32-bf16": Case([5, 2, 5], [21, 40, 3], 1, 8, 64, 32, torch.bfloat16, seed=2),
    "verify-gqa3-d64-b16-f16": Case(
        [2, 1, 2], [7, 30, 16], 2, 3, 64, 16, torch.float16, strided_q=True, seed=3
    ),
    "chunk-gqa1-d64-b16-f16": Case([17], [31], 2, 1, 64, 16, torch.float16, seed=4),
    "prompts-gqa3-d128-b32-f32": Case([17, 5], [0, 0], 2, 3, 128, 32, torch.float32, pad_rows=2, seed=5),
    "mixed-gqa3-d64-b16-bf16": Case([1, 2, 5, 17], [45, 9, 26, 3], 2, 3, 64, 16, torch.bfloat16, seed=6),
    "mixed-gqa1-d128-b32-f32": Case([2, 1, 5], [14, 63, 32], 2, 1, 128, 32, torch.float32, seed=7),
    "splitk-decode-gqa4-d64-b16-f32": Case(
        [1, 1], [100, 37], 2, 4, 64, 16, torch.float32, num_splits=3, pad_rows=1, seed=8
    ),
    "splitk-mixed-gqa8-d128-b32-bf16": Case(
        [2, 17], [60, 20], 1, 8, 128, 32, torch.bfloat16, num_splits=4, seed=9
    ),
}


def _sweep() -> dict[str, Case]:
    """Every dtype x head size x block size once; layouts (period 4), GQA ratios and split factors
    (period 3) rotate so that each layout meets each split factor."""
    layouts = [
        ([1, 1, 1, 1], [3, 32, 47, 0]),
        ([2, 5], [18, 50]),
        ([17, 1], [9, 77]),
        ([5, 17, 2], [0, 14, 31]),
    ]
    grid = itertools.product([torch.float32, torch.bfloat16, torch.float16], [64, 128], [16, 32])
    cases = {}
    for i, (dtype, dim, block_size) in enumerate(grid):
        query_lens, context_lens = layouts[i % 4]
        group, splits = [1, 3, 4, 8][i // 3 % 4], [2, 1, 5][i % 3]
        name = f"sweep{i}-gqa{group}-d{dim}-b{block_size}-{str(dtype)[6:]}-s{splits}"
        kv_heads = max(1, 8 // group)
        cases[name] = Case(
            query_lens, context_lens, kv_heads, group, dim, block_size, dtype, splits, seed=100 + i
        )
    return cases


CASES.update(_sweep())
# Sliding windows and soft-capping (Gemma 3, Mistral, Gemma 2): decodes far past the window, verify queries
# straddling its edge, a prefill chunk longer than it, and split-K over a window.
WINDOW_CASES = {
    "window8-verify-gqa2-d64-b16-f32": Case([4, 5, 3], [36, 37, 100], 2, 2, 64, 16, torch.float32, window=8),
    "window16-chunk-cap-gqa4-d64-b16-bf16": Case(
        [17, 40], [50, 0], 1, 4, 64, 16, torch.bfloat16, window=16, softcap=20.0, seed=11
    ),
    "window8-decode-cap-gqa1-d128-b32-f32": Case(
        [1, 1, 1, 1], [5, 40, 41, 200], 2, 1, 128, 32, torch.float32, window=8, softcap=5.0, seed=12
    ),
    "window37-splitk-gqa4-d64-b16-f16": Case(
        [1, 2], [200, 41], 2, 4, 64, 16, torch.float16, num_splits=3, window=37, seed=13
    ),
}
CASES.update(WINDOW_CASES)


def _tree_case(layout: int, *shape, **extra) -> Case:
    names, context_lens = TREE_LAYOUTS[layout]
    return Case(tree_query_lens(names), context_lens, *shape, trees=tuple(names), seed=20 + layout, **extra)


# Draft trees (tests/tree_cases.py) beside decodes, prefill chunks and a chain: both tile heights, split-K,
# a window inside the trees' depth, soft-capping.
TREE_CASES = {
    "tree-binary3-star-uneven-gqa4-d64-b16-f32": _tree_case(0, 2, 4, 64, 16, torch.float32),
    "tree-chain-uneven-window-cap-gqa3-d128-b32-bf16": _tree_case(
        1, 2, 3, 128, 32, torch.bfloat16, window=6, softcap=20.0
    ),
    "tree-wide40-gqa1-d64-b16-f16": _tree_case(2, 2, 1, 64, 16, torch.float16),
    "tree-full64-splitk-window-gqa8-d64-b16-f32": _tree_case(
        3, 1, 8, 64, 16, torch.float32, num_splits=3, window=9
    ),
}
CASES.update(TREE_CASES)

# (key/value dtype, cache dtype, block size, slot_mapping dtype)
WRITE_KV_CASES = {
    "f32-b16-i32": (torch.float32, torch.float32, 16, torch.int32),
    "bf16-b32-i64": (torch.bfloat16, torch.bfloat16, 32, torch.int64),
    "f32-into-f16-b16-i64": (torch.float32, torch.float16, 16, torch.int64),
}
WRITE_THEN_ATTEND_CASES = ["verify-gqa8-d64-b32-bf16", "mixed-gqa1-d128-b32-f32"]


def _batch(case: Case) -> PagedBatch:
    return make_batch(
        case.query_lens,
        case.context_lens,
        num_kv_heads=case.num_kv_heads,
        group=case.group,
        head_dim=case.head_dim,
        block_size=case.block_size,
        dtype=case.dtype,
        seed=case.seed,
    )


def _query(batch: PagedBatch, case: Case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    q = batch.q
    if case.pad_rows:
        q = torch.cat([q, torch.randn(case.pad_rows, *q.shape[1:], generator=gen).to(q.dtype)])
    if case.strided_q:
        kv = 2 * case.num_kv_heads
        q = torch.cat([q, torch.randn(q.shape[0], kv, q.shape[2], generator=gen).to(q.dtype)], dim=1)[:, :-kv]
        assert not q.is_contiguous()
    return q


def _write_kv_inputs(src_dtype: torch.dtype, block_size: int, slot_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim, tokens = 5, 2, 64, 13
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(slot_dtype)
    slots[[0, 9]] = -1  # padding tokens are skipped
    # key and value as views into one fused projection output, as the model produces them.
    qkv = torch.randn(tokens, 3 * heads, dim, generator=gen).to(src_dtype)
    return qkv[:, heads : 2 * heads], qkv[:, 2 * heads :], slots, (num_blocks, block_size, heads, dim)


def _new_token_writes(case: Case, batch: PagedBatch):
    """The new tokens' K/V and slots, and the cache as it stands before they are written (NaN there)."""
    keys, values, slots = [], [], []
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    for s, (ctx, q_len) in enumerate(zip(case.context_lens, case.query_lens)):
        pos = torch.arange(ctx, ctx + q_len)
        slot = batch.block_tables[s].long()[pos // case.block_size] * case.block_size + pos % case.block_size
        k_cache.view(-1, case.num_kv_heads, case.head_dim)[slot] = float("nan")
        v_cache.view(-1, case.num_kv_heads, case.head_dim)[slot] = float("nan")
        keys.append(batch.keys[s][ctx:])
        values.append(batch.values[s][ctx:])
        slots.append(slot)
    return torch.cat(keys), torch.cat(values), torch.cat(slots), k_cache, v_cache  # int64, as the engine


# ---- the child process: runs the kernels under the interpreter ----


def _run_attention(kernels: ModuleType, case: Case) -> torch.Tensor:
    batch = _batch(case)
    if case.window:
        assert poison_outside_window(batch, case.query_lens, case.window) > 0
    q = _query(batch, case)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # poisoned: unwritten elements stay NaN
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    trees = parents_of(list(case.trees)) if case.trees else None
    result = kernels.paged_attention(
        q,
        *args,
        batch.scale,
        out=out,
        num_splits=case.num_splits,
        window=case.window,
        softcap=case.softcap,
        trees=trees,
    )
    assert result is out
    return out


def _run_write_kv(
    kernels: ModuleType, src_dtype, cache_dtype, block_size: int, slot_dtype
) -> tuple[torch.Tensor, ...]:
    key, value, slots, shape = _write_kv_inputs(src_dtype, block_size, slot_dtype)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    kernels.write_kv(key, value, k_cache, v_cache, slots)
    return k_cache, v_cache


def _run_write_then_attend(kernels: ModuleType, case: Case) -> tuple[torch.Tensor, ...]:
    batch = _batch(case)
    key, value, slots, k_cache, v_cache = _new_token_writes(case, batch)
    kernels.write_kv(key, value, k_cache, v_cache, slots)
    out = kernels.paged_attention(
        batch.q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale
    )
    return k_cache, v_cache, out


def _guarded(run: Callable[[], object]) -> object:
    """A failing case reports its traceback to its own test instead of failing the whole child."""
    try:
        return run()
    except Exception:
        return traceback.format_exc()


def _child_main(out_path: str) -> None:
    from specserve.kernels import triton_attention as kernels

    assert kernels.interpreted(), "the child must run with TRITON_INTERPRET=1"
    results = {}
    for name, case in CASES.items():
        results[f"attention/{name}"] = _guarded(lambda case=case: _run_attention(kernels, case))
    for name, params in WRITE_KV_CASES.items():
        results[f"write_kv/{name}"] = _guarded(lambda params=params: _run_write_kv(kernels, *params))
    for name in WRITE_THEN_ATTEND_CASES:
        results[f"write_then_attend/{name}"] = _guarded(
            lambda name=name: _run_write_then_attend(kernels, CASES[name])
        )
    torch.save(results, out_path)


# ---- the tests ----


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out_path = tmp_path_factory.mktemp("triton_interpreted") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, str(out_path)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stderr[-6000:]}"
    return torch.load(out_path)


def _result(results: dict[str, object], key: str):
    value = results[key]
    if isinstance(value, str):
        pytest.fail(f"kernel raised in the interpreter child:\n{value}")
    return value


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_reference_and_dense(interpreted: dict[str, object], name: str) -> None:
    case = CASES[name]
    out = _result(interpreted, f"attention/{name}")
    batch = _batch(case)
    num_tokens = batch.q.shape[0]
    assert out.shape == _query(batch, case).shape
    assert torch.isnan(out[num_tokens:]).all(), "padding rows past the last sequence were written"
    out = out[:num_tokens]
    tol = tolerance(case.dtype)
    if case.trees:
        assert_close(
            out, dense_tree_attention(batch, parents_of(list(case.trees)), case.window, case.softcap), tol
        )
        return
    if case.window or case.softcap:
        assert_close(out, dense_window_attention(batch, case.window, case.softcap), tol)
        return

    expected = reference.paged_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
    )
    assert_close(out, dense_attention(batch), tol)
    assert_close(out, expected, tol)


@pytest.mark.parametrize("name", list(WRITE_KV_CASES))
def test_write_kv_matches_reference(interpreted: dict[str, object], name: str) -> None:
    src_dtype, cache_dtype, block_size, slot_dtype = WRITE_KV_CASES[name]
    k_cache, v_cache = _result(interpreted, f"write_kv/{name}")
    key, value, slots, shape = _write_kv_inputs(src_dtype, block_size, slot_dtype)
    k_expected = torch.full(shape, float("nan"), dtype=cache_dtype)
    v_expected = torch.full(shape, float("nan"), dtype=cache_dtype)
    reference.write_kv(key, value, k_expected, v_expected, slots)
    assert bool((slots >= 0).any()) and torch.isfinite(k_cache).any()
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", WRITE_THEN_ATTEND_CASES)
def test_write_then_attend(interpreted: dict[str, object], name: str) -> None:
    """An engine step: the new tokens' K/V go into their slots (the cache holds only the context), then
    attention reads them back through the block tables."""
    case = CASES[name]
    k_cache, v_cache, out = _result(interpreted, f"write_then_attend/{name}")
    batch = _batch(case)
    torch.testing.assert_close(k_cache, batch.k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, batch.v_cache, rtol=0, atol=0, equal_nan=True)
    assert_close(out, dense_attention(batch), tolerance(case.dtype))


if __name__ == "__main__":
    _child_main(sys.argv[1])
