"""Torch reference paged attention and KV-cache write: the CPU path, and the oracle for the Triton kernels.

Layout (vLLM's): all new query tokens of all sequences are packed along dim 0.
- q:               [num_tokens, num_q_heads, head_dim]
- k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
- block_tables:    [num_seqs, max_blocks_per_seq] int32 (entries past a sequence's blocks are ignored)
- seq_lens:        [num_seqs] int32, tokens in the cache for each sequence *including* the new ones
- query_start_loc: [num_seqs + 1] int32, cumulative query lengths (sequence s owns q[qsl[s]:qsl[s+1]])
Query token i of sequence s sits at position seq_len - q_len + i and attends to positions <= its own
(causal within the new tokens, full attention to the earlier context). The new tokens' K/V must already be
written into the cache (write_kv) before the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Sequences with at most this many new tokens (decode, speculative verify) are batched together, padded;
# longer ones (prefill chunks) run one at a time so a long chunk does not pad every decode to its length.
SHORT_QUERY_MAX = 16


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into the cache; negative slots are skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


@dataclass
class ShortGroup:
    """Sequences with short queries, batched: queries padded to max_q, keys padded to max_kv."""

    q_index: torch.Tensor  # [n, max_q] rows of q to gather (padding repeats a valid row)
    q_valid: torch.Tensor  # [n, max_q] bool
    kv_slots: torch.Tensor  # [n, max_kv] flat cache slots (padding repeats a slot of the row, masked out)
    mask: torch.Tensor  # [n, 1, max_q, max_kv] bool, True = may attend
    out_index: torch.Tensor  # [num_valid] rows of the output the valid queries land in


@dataclass
class LongSeq:
    q_start: int
    q_len: int
    kv_slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # None: pure causal over a fresh prompt (q_len == seq_len)


@dataclass
class AttentionPlan:
    """Index tensors derived from the batch layout; built once per step, reused by every layer."""

    short: ShortGroup | None
    long: list[LongSeq]


def _slots(table: list[int], length: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(table[: (length + block_size - 1) // block_size], dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:length]


def build_plan(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
) -> AttentionPlan:
    short_ids = [s for s, ql in enumerate(query_lens) if ql <= SHORT_QUERY_MAX]
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)

    long: list[LongSeq] = []
    for s, ql in enumerate(query_lens):
        if ql <= SHORT_QUERY_MAX:
            continue
        sl = seq_lens[s]
        slots = _slots(block_tables[s], sl, block_size)
        mask = None
        if sl != ql:
            q_pos = torch.arange(sl - ql, sl)[:, None]
            mask = torch.arange(sl)[None, :] <= q_pos
        long.append(LongSeq(starts[s], ql, slots, mask))

    short = None
    if short_ids:
        n = len(short_ids)
        max_q = max(query_lens[s] for s in short_ids)
        max_kv = max(seq_lens[s] for s in short_ids)
        q_index = torch.zeros(n, max_q, dtype=torch.long)
        q_valid = torch.zeros(n, max_q, dtype=torch.bool)
        kv_slots = torch.zeros(n, max_kv, dtype=torch.long)
        q_pos = torch.zeros(n, max_q, dtype=torch.long)
        kv_len = torch.zeros(n, 1, dtype=torch.long)
        for row, s in enumerate(short_ids):
            ql, sl = query_lens[s], seq_lens[s]
            q_index[row, :ql] = torch.arange(starts[s], starts[s] + ql)
            q_index[row, ql:] = starts[s]
            q_valid[row, :ql] = True
            kv_slots[row, :sl] = _slots(block_tables[s], sl, block_size)
            # Pad with one of the sequence's own slots: masked scores still multiply V, and a block this
            # sequence does not own may hold uninitialised NaN/inf (0 * NaN = NaN).
            kv_slots[row, sl:] = kv_slots[row, 0] if sl > 0 else 0
            q_pos[row, :ql] = torch.arange(sl - ql, sl)
            q_pos[row, ql:] = sl - 1
            kv_len[row] = sl
        kv_pos = torch.arange(max_kv)[None, None, :]
        mask = (kv_pos <= q_pos[:, :, None]) & (kv_pos < kv_len[:, :, None])
        short = ShortGroup(q_index, q_valid, kv_slots, mask[:, None], q_index[q_valid])
    return AttentionPlan(short, long)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, causal: bool
) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D]; GQA by repeating KV heads."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries against the paged cache. Returns [num_tokens, num_q_heads, head_dim]."""
    if plan is None:
        qsl = query_start_loc.tolist()
        plan = build_plan(
            block_tables.tolist(),
            seq_lens.tolist(),
            [b - a for a, b in zip(qsl[:-1], qsl[1:])],
            k_cache.shape[1],
        )
    if out is None:
        out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)

    if plan.short is not None:
        g = plan.short
        qs = q[g.q_index]  # [n, max_q, Hq, D]
        ks = k_flat[g.kv_slots].to(q.dtype)
        vs = v_flat[g.kv_slots].to(q.dtype)
        res = _sdpa(qs, ks, vs, g.mask, scale, causal=False)
        out[g.out_index] = res[g.q_valid]
    for seq in plan.long:
        qs = q[seq.q_start : seq.q_start + seq.q_len][None]
        ks = k_flat[seq.kv_slots][None].to(q.dtype)
        vs = v_flat[seq.kv_slots][None].to(q.dtype)
        res = _sdpa(qs, ks, vs, seq.mask, scale, causal=seq.mask is None)
        out[seq.q_start : seq.q_start + seq.q_len] = res[0]
    return out
