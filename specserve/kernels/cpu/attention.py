"""Paged attention on CPU in C++ (csrc/attention*.cpp): decode, speculative verify and, where the CPU has a
fast path for the dtype, prefill chunks; and the CPU attention backend's plan, which routes each sequence to
the kernel or to the torch reference's gather + SDPA.

The torch reference must gather every sequence's K/V into a padded tensor before SDPA can read it: per layer
that copies the whole KV of the batch and reads it twice more. This kernel walks the block tables and reads
each cached K and V row once, in float32 accumulation. The caches are in q's dtype, or bfloat16 under float32
queries (the engine's kv_cache_dtype), widened as they are read. For a dtype it does not handle (float16) or a
block too large, the plan falls back to gather + SDPA for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels import reference
from specserve.kernels import tree as tree_mask
from specserve.kernels.cpu import build


def supports(dtype: torch.dtype, block_size: int, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel takes queries of `dtype` over caches of `cache_dtype` (None: the same)."""
    return (dtype, cache_dtype or dtype) in build.KV_DTYPES and block_size <= 256


def supports_long(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether prefill chunks run here too: the float32 AVX2 + FMA path and the bfloat16 AVX512-BF16 one.
    On a 2-core AVX2 EPYC (SmolLM2 shapes, 4 chunks of 256 over 512 cached tokens, one thread) the float32
    kernel took 22.0-22.3 ms a layer against gather + SDPA's 22.5-23.6 (bench/kernels.py --threads 1):
    level, and one code path for every query length; the bf16 one is 3-5x faster than gather + SDPA. Head
    sizes 64, 128 and 256 (Gemma 3's): before 256 was one, Gemma 3 270M's prefill chunks went to gather +
    SDPA and its decode to the generic loops, and the first 32 W1 requests (capped at 128 tokens, 64 in
    flight, bf16, 2-core Zen 4) took 141 ms a step against 127 after."""
    if head_dim not in (64, 128, 256) or block_size > 256:
        return False
    if dtype == torch.float32:
        return bool(build._paths & build.PATH_F32) and block_size % 8 == 0
    return dtype == torch.bfloat16 and bool(build._paths & build.PATH_BF16) and block_size % 16 == 0


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if q.stride(2) != 1 or out.stride(2) != 1 or out.dtype != q.dtype:
        raise ValueError("q and out need head_dim innermost and one dtype")
    if v_cache.dtype != k_cache.dtype or (q.dtype, k_cache.dtype) not in build.KV_DTYPES:
        raise ValueError(f"no kernel for {q.dtype} queries over {k_cache.dtype} / {v_cache.dtype} caches")


def paged_attention_short(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    invariant: bool = False,
) -> None:
    """Attention for the sequences in seq_ids (int64), written into out; build.load() must have succeeded.
    Queries longer than a few tokens only where supports_long() says so. window: each query sees its own
    position and the window - 1 before it (blocks wholly before are not read); softcap: scores become
    softcap * tanh(score / softcap) before the softmax; invariant: each row's arithmetic the same whatever
    else the call holds (rows of its sequence, other sequences), at some cost in float32 (Args::invariant).

    q and out are [tokens, heads, head_dim] with head_dim innermost; the caches contiguous; block_tables,
    seq_lens and query_start_loc int32 and contiguous. q and out of one dtype, the caches of it too or
    bfloat16 under float32 (build.KV_DTYPES).
    """
    _check_layout(q, k_cache, v_cache, out)
    for t, dt in (
        (block_tables, torch.int32),
        (seq_lens, torch.int32),
        (query_start_loc, torch.int32),
        (seq_ids, torch.int64),
    ):
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"index tensors must be contiguous {dt}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = build._lib.specserve_paged_attention_short(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        seq_ids.data_ptr(),
        seq_ids.numel(),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        build.KV_DTYPES[q.dtype, k_cache.dtype],
        torch.get_num_threads(),
        window or 0,
        softcap or 0.0,
        int(invariant),
    )
    build.check(rc, "paged_attention_short")


def paged_attention_tree(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    rows: tree_mask.TreeRows,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attention for the sequences holding draft trees (rows.seq_ids), by their ancestor masks
    (kernels/tree.py), written into out; the same layout rules as paged_attention_short."""
    _check_layout(q, k_cache, v_cache, out)
    seq_ids = torch.tensor(rows.seq_ids, dtype=torch.int64)
    mask, depth = rows.mask.contiguous(), rows.depth.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = build._lib.specserve_paged_attention_tree(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        seq_ids.data_ptr(),
        seq_ids.numel(),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        build.KV_DTYPES[q.dtype, k_cache.dtype],
        torch.get_num_threads(),
        window or 0,
        softcap or 0.0,
        mask.data_ptr(),
        depth.data_ptr(),
    )
    build.check(rc, "paged_attention_tree")


@dataclass
class NativeShort:
    """Sequences for the C++ kernel, which reads the block tables itself: the short-query ones, and with
    them the long ones where the kernel handles those too (supports_long). The CPU backend's plans carry it
    (build_plan), and reference.paged_attention hands it the batch first (attend)."""

    seq_ids: torch.Tensor  # int64 [n], short queries
    all_ids: torch.Tensor  # int64, long queries first (their tasks are the largest), then short
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    invariant: bool = False  # batch-invariant arithmetic (paged_attention_short)
    trees: list[list[int] | None] | None = None  # per sequence, its draft tree's parents (kernels/tree.py)
    tree_rows: tree_mask.TreeRows | None = None  # their rows, for paged_attention_tree

    def kernel_takes_all(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether the C++ kernel runs every sequence (all_ids): no prefill chunks, or a fast path that takes
        them; else it runs seq_ids and the chunks go to gather + SDPA."""
        return self.all_ids.numel() == self.seq_ids.numel() or supports_long(dtype, head_dim, block_size)

    def attend(
        self,
        plan: reference.AttentionPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        window: int | None,
        softcap: float | None,
    ) -> reference.AttentionPlan:
        """Runs the sequences the kernel takes into out and returns the gather + SDPA plan for the rest:
        the prefill chunks the kernel leaves, or, for a dtype or block size it does not handle (float16,
        huge blocks), the whole batch."""
        block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
        if not supports(q.dtype, block_size, k_cache.dtype):
            qsl = self.query_start_loc.tolist()
            tables = [
                row[: -(-n // block_size)]
                for row, n in zip(self.block_tables.tolist(), self.seq_lens.tolist())
            ]
            query_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
            return reference.build_plan(
                tables, self.seq_lens.tolist(), query_lens, block_size, window=window, trees=self.trees
            )
        if self.tree_rows is not None:
            paged_attention_tree(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                self.tree_rows,
                scale,
                out,
                window=window,
                softcap=softcap,
            )
        ids = self.all_ids
        long_seqs: list[reference.LongSeq] = []
        if not self.kernel_takes_all(q.dtype, head_dim, block_size):
            ids, long_seqs = self.seq_ids, plan.long_seqs()
        if ids.numel():
            paged_attention_short(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                ids,
                scale,
                out,
                window=window,
                softcap=softcap,
                invariant=self.invariant,
            )
        return reference.AttentionPlan([], long_seqs, window=window)


def build_plan(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    window: int | None = None,
    invariant: bool = False,
    trees: list[list[int] | None] | None = None,
) -> reference.AttentionPlan:
    """The CPU backend's plan: short queries (and long ones, where it handles them) go to the C++ kernel,
    the rest to gather + SDPA, whose index tensors are built only on first need (float32, or a CPU without
    the bf16 kernel): where the kernel takes the prefill chunks, their masks would be built for nothing.
    window: a sliding window's plan (each layer type with its own window reads its own plan). trees: per
    sequence, its draft tree's parents or None; those sequences go to paged_attention_tree (a chain stays
    on the causal kernel: kernels/tree.py drops it)."""
    starts = reference.query_starts(query_lens)
    width = max(len(t) for t in block_tables)
    trees = tree_mask.normalize(trees)
    rows = None if trees is None else tree_mask.tree_rows(trees, query_lens)
    in_tree = set(rows.seq_ids) if rows is not None else set()
    short_ids = [s for s, ql in enumerate(query_lens) if ql <= reference.SHORT_QUERY_MAX and s not in in_tree]
    long_ids = [s for s, ql in enumerate(query_lens) if ql > reference.SHORT_QUERY_MAX and s not in in_tree]
    native = NativeShort(
        torch.tensor(short_ids, dtype=torch.long),
        torch.tensor(long_ids + short_ids, dtype=torch.long),
        torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        invariant,
        trees,
        rows,
    )
    long_inputs = (block_tables, seq_lens, query_lens, starts, block_size, window, None, frozenset(in_tree))
    return reference.AttentionPlan([], None, native, long_inputs, window)
