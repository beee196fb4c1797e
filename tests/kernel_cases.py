"""Random paged-attention batches and a float64 dense oracle, shared by the reference and Triton kernel tests.

The cache is built by direct indexing from dense per-sequence K/V (independent of any write_kv under test),
through block tables whose blocks are shuffled and non-contiguous. Every slot no sequence owns is poisoned
with NaN (the tail of each last block, spare blocks), so a kernel that reads past a sequence shows it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

SPARE_BLOCKS = 3  # unowned blocks in every cache, block 0 among them


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with -1
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], as stored in the cache
    values: list[torch.Tensor]


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    poison_cache: bool = True,
) -> PagedBatch:
    """context_lens are the tokens already cached before the new ones; seq_len = context + query."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + SPARE_BLOCKS
    # Block 0 stays unowned (and poisoned): kernels must not use slot 0 as harmless padding.
    order = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    table_width = max(blocks_needed) + 1
    block_tables = torch.full((len(seq_lens), table_width), -1, dtype=torch.int32)

    fill = float("nan") if poison_cache else 0.0
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    keys, values = [], []
    next_block = 0
    for s, n in enumerate(seq_lens):
        blocks = order[next_block : next_block + blocks_needed[s]]
        next_block += blocks_needed[s]
        block_tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        block_ids = torch.tensor(blocks, dtype=torch.long)[pos // block_size]
        k_cache[block_ids, pos % block_size] = k
        v_cache[block_ids, pos % block_size] = v
        keys.append(k)
        values.append(v)

    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    # Not 1/sqrt(d), so a kernel ignoring the given scale fails.
    scale = 1.3 / head_dim**0.5
    return PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        scale=scale,
        keys=keys,
        values=values,
    )


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Plain float64 causal attention per sequence from the dense K/V: the oracle."""
    outs = []
    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[starts[s] : starts[s + 1]].double()
        q_len, seq_len = q.shape[0], k.shape[0]
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= q_pos
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Every element within rel of the expected, relative to the largest expected magnitude.

    Attention outputs cross zero, so a purely element-wise relative bound is meaningless near zero;
    the scale of the whole output is the natural yardstick.
    """
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    err = (actual.double() - expected.double()).abs().max().item()
    size = expected.double().abs().max().item()
    assert err <= rel * size, f"max abs error {err:.3g} exceeds {rel:g} x max |expected| {size:.3g}"


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def with_cache_dtype(batch: PagedBatch, cache_dtype: torch.dtype) -> PagedBatch:
    """The batch with its caches held in cache_dtype, the oracle's K and V rounded as they now are."""
    if cache_dtype == batch.k_cache.dtype:
        return batch
    return dataclasses.replace(
        batch,
        k_cache=batch.k_cache.to(cache_dtype),
        v_cache=batch.v_cache.to(cache_dtype),
        keys=[k.to(cache_dtype).to(k.dtype) for k in batch.keys],
        values=[v.to(cache_dtype).to(v.dtype) for v in batch.values],
    )


# (queries and outputs, caches): each dtype over its own caches, and float32 over bfloat16 (kv_cache_dtype)
CACHE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]
