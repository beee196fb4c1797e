"""Torch reference paged attention and KV-cache write: gather + SDPA, the oracle for the C++ and Triton
kernels, and the torch backend (a CPU without a compiler, float16).

Layout (vLLM's): all new query tokens of all sequences are packed along dim 0.
- q:               [num_tokens, num_q_heads, head_dim]
- k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
- block_tables:    [num_seqs, max_blocks_per_seq] int32 (entries past a sequence's blocks are ignored)
- seq_lens:        [num_seqs] int32, tokens in the cache for each sequence *including* the new ones
- query_start_loc: [num_seqs + 1] int32, cumulative query lengths (sequence s owns q[qsl[s]:qsl[s+1]])
Query token i of sequence s sits at position seq_len - q_len + i and attends to positions <= its own
(causal within the new tokens, full attention to the earlier context); with a sliding `window` W only to the
W positions ending at its own (HF's kv > q - W), and blocks wholly before every query's window are not read.
`softcap` caps scores as cap * tanh(score / cap) before the softmax (Gemma 2 style). The new tokens' K/V
must already be written into the cache (write_kv) before the call. A sequence whose new tokens form a draft
tree (kernels/tree.py) attends by its tree's ancestor masks instead of causally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from specserve.kernels import tree as tree_mask

# Sequences with at most this many new tokens (decode, speculative verify) are batched together, padded;
# longer ones (prefill chunks) run one at a time so a long chunk does not pad every decode to its length.
SHORT_QUERY_MAX = 16
# A batched group is split where padding every member to the longest context would waste more than this
# share of the gathered K/V (decodes of very different lengths), at most MAX_GROUPS ways.
MAX_PADDING_WASTE = 0.3
MAX_GROUPS = 4


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
    """Sequences with short queries, batched: queries padded to max_q, contexts padded to whole blocks."""

    q_index: torch.Tensor  # [n, max_q] rows of q to gather (padding repeats a valid row)
    q_valid: torch.Tensor  # [n, max_q] bool
    blocks: torch.Tensor  # [n * max_blocks] block ids to gather (padding repeats one of the row's blocks)
    num_blocks: int  # max_blocks
    mask: torch.Tensor  # [n, 1, max_q, max_blocks * block_size] bool, True = may attend
    # Gathered rows past each sequence's length, zeroed before use: masked scores still multiply V, and
    # a block tail nobody wrote may hold anything (0 * NaN = NaN).
    pad_index: torch.Tensor
    out_index: torch.Tensor  # [num_valid] rows of the output the valid queries land in


@dataclass
class LongSeq:
    q_start: int
    q_len: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] (from first_pos's block with a window)
    mask: torch.Tensor | None  # None: pure causal over a fresh prompt (q_len == seq_len)
    first_pos: int = 0  # position of blocks[0]'s first token (a window skips the blocks before it)


class NativeAttention(Protocol):
    """A backend's kernel carried by its plans (kernels/cpu/attention.py: NativeShort): paged_attention
    hands it the batch first; it runs the sequences it takes into out and returns the gather + SDPA plan
    for the rest."""

    def attend(
        self,
        plan: AttentionPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        window: int | None,
        softcap: float | None,
    ) -> AttentionPlan: ...


@dataclass
class AttentionPlan:
    """Index tensors derived from the batch layout; built once per step, reused by every layer."""

    groups: list[ShortGroup]
    # Prefill chunks for gather + SDPA; None until first needed (long_seqs) where a native plan may take them
    long: list[LongSeq] | None
    native: NativeAttention | None = None
    long_inputs: tuple | None = field(default=None, repr=False)
    window: int | None = None

    def long_seqs(self) -> list[LongSeq]:
        if self.long is None:
            self.long = _long_seqs(*self.long_inputs)
        return self.long


def _split_by_length(ids: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Sort by context length and cut where padding to the group's longest would waste too much."""
    ids = sorted(ids, key=lambda s: seq_lens[s])
    groups: list[list[int]] = []
    while ids:
        if len(groups) == MAX_GROUPS - 1:
            groups.append(ids)
            break
        size = len(ids)
        # the longest prefix whose padding to its own maximum stays within budget
        while size > 1:
            longest = seq_lens[ids[size - 1]]
            used = sum(seq_lens[s] for s in ids[:size])
            if used >= (1 - MAX_PADDING_WASTE) * longest * size:
                break
            size -= 1
        groups.append(ids[:size])
        ids = ids[size:]
    return groups


def _first_block(seq_len: int, q_len: int, block_size: int, window: int | None) -> int:
    """The first block any of the sequence's queries sees: with a window, the one holding the earliest
    query's first visible position; blocks before it are never gathered."""
    if window is None:
        return 0
    return max(0, seq_len - q_len + 1 - window) // block_size


def _short_group(
    ids: list[int],
    block_tables,
    seq_lens,
    query_lens,
    starts,
    block_size: int,
    window: int | None = None,
    trees: tree_mask.TreeRows | None = None,
) -> ShortGroup:
    n = len(ids)
    max_q = max(query_lens[s] for s in ids)
    first = {s: _first_block(seq_lens[s], query_lens[s], block_size, window) for s in ids}
    max_blocks = max(-(-seq_lens[s] // block_size) - first[s] for s in ids)
    q_index = torch.zeros(n, max_q, dtype=torch.long)
    q_valid = torch.zeros(n, max_q, dtype=torch.bool)
    q_pos = torch.zeros(n, max_q, dtype=torch.long)
    blocks = []
    lens = []
    offsets = []
    for row, s in enumerate(ids):
        ql, sl = query_lens[s], seq_lens[s]
        q_index[row, :ql] = torch.arange(starts[s], starts[s] + ql)
        q_index[row, ql:] = starts[s]
        q_valid[row, :ql] = True
        q_pos[row, :ql] = torch.arange(sl - ql, sl)
        q_pos[row, ql:] = sl - 1
        own = block_tables[s][first[s] : -(-sl // block_size)]
        blocks.extend(own + [own[0]] * (max_blocks - len(own)))
        lens.append(sl)
        offsets.append(first[s] * block_size)
    # absolute position of each gathered row
    kv_pos = torch.arange(max_blocks * block_size)[None, None, :] + torch.tensor(offsets)[:, None, None]
    kv_len = torch.tensor(lens)[:, None, None]
    mask = (kv_pos <= q_pos[:, :, None]) & (kv_pos < kv_len)
    if window is not None:
        mask &= kv_pos > q_pos[:, :, None] - window
    if trees is not None:
        for row, s in enumerate(ids):
            if s in trees.seq_ids:
                ql, sl, rows = query_lens[s], seq_lens[s], slice(starts[s], starts[s] + query_lens[s])
                vis = tree_mask.visible(trees.mask[rows], trees.depth[rows], sl - ql, kv_pos[row, 0], window)
                mask[row, :ql] = vis & (kv_pos[row, 0] < sl)
    pad_index = torch.nonzero((kv_pos >= kv_len).flatten()).flatten()
    blocks_t = torch.tensor(blocks, dtype=torch.long)
    return ShortGroup(q_index, q_valid, blocks_t, max_blocks, mask[:, None], pad_index, q_index[q_valid])


def query_starts(query_lens: list[int]) -> list[int]:
    """Each sequence's first row in the packed queries, and the total: query_start_loc as a list."""
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)
    return starts


def build_plan(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    window: int | None = None,
    trees: list[list[int] | None] | None = None,
) -> AttentionPlan:
    """window: a sliding window's plan (each layer type with its own window reads its own plan).
    trees: per sequence, its draft tree's parent array or None (kernels/tree.py)."""
    starts = query_starts(query_lens)
    rows = None if trees is None else tree_mask.tree_rows(trees, query_lens)
    short_ids = [s for s, ql in enumerate(query_lens) if ql <= SHORT_QUERY_MAX]
    long_inputs = (block_tables, seq_lens, query_lens, starts, block_size, window, rows)
    groups = [
        _short_group(ids, block_tables, seq_lens, query_lens, starts, block_size, window, rows)
        for ids in _split_by_length(short_ids, seq_lens)
    ]
    return AttentionPlan(groups, _long_seqs(*long_inputs), window=window)


def _long_seqs(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    starts: list[int],
    block_size: int,
    window: int | None = None,
    trees: tree_mask.TreeRows | None = None,
    skip: frozenset[int] = frozenset(),
) -> list[LongSeq]:
    """skip: sequences a backend's kernel runs itself."""
    long = []
    for s, ql in enumerate(query_lens):
        if ql <= SHORT_QUERY_MAX or s in skip:
            continue
        sl = seq_lens[s]
        first = _first_block(sl, ql, block_size, window)
        blocks = torch.tensor(block_tables[s][first : -(-sl // block_size)], dtype=torch.long)
        mask = None
        if sl != ql or window is not None:
            q_pos = torch.arange(sl - ql, sl)[:, None]
            kv_pos = torch.arange(first * block_size, sl)[None, :]
            mask = kv_pos <= q_pos
            if window is not None:
                mask &= kv_pos > q_pos - window
        if trees is not None and s in trees.seq_ids:
            rows = slice(starts[s], starts[s] + ql)
            kv_pos = torch.arange(first * block_size, sl)
            mask = tree_mask.visible(trees.mask[rows], trees.depth[rows], sl - ql, kv_pos, window)
        long.append(LongSeq(starts[s], ql, sl, blocks, mask, first * block_size))
    return long


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask,
    scale: float,
    causal: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D]; SDPA shares each KV head across its group."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if softcap:
        # SDPA cannot cap scores: the same arithmetic spelled out (as HF's eager attention does it)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return (probs @ v).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
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
    window: int | None = None,
    softcap: float | None = None,
    trees: list[list[int] | None] | None = None,
) -> torch.Tensor:
    """Attention of packed queries against the paged cache. Returns [num_tokens, num_q_heads, head_dim].
    A plan must have been built for the same window (build_plan(..., window=window)) and trees; trees is
    read only where no plan is given."""
    if plan is None:
        qsl = query_start_loc.tolist()
        plan = build_plan(
            block_tables.tolist(),
            seq_lens.tolist(),
            [b - a for a, b in zip(qsl[:-1], qsl[1:])],
            k_cache.shape[1],
            window=window,
            trees=trees,
        )
    if plan.window != window:
        raise ValueError(f"attention plan built for window {plan.window}, called with {window}")
    if out is None:
        out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]

    def gather(cache: torch.Tensor, blocks: torch.Tensor, rows: int, pad=None) -> torch.Tensor:
        # whole blocks are contiguous in the cache: one index_select copies block_size tokens at a time
        # as [blocks, block_size * heads * dim]: a row copy per block (far faster than a 4-D index_select)
        kv = cache.view(cache.shape[0], -1).index_select(0, blocks).to(q.dtype)
        if pad is not None and pad.numel():
            kv.view(-1, num_kv_heads, head_dim).index_fill_(0, pad, 0)
        return kv.view(rows, -1, num_kv_heads, head_dim)

    if plan.native is not None:  # a backend's kernel takes what it runs; the rest is planned for SDPA
        plan = plan.native.attend(plan, q, k_cache, v_cache, scale, out, window, softcap)
    long_seqs = plan.long_seqs()
    for g in plan.groups:
        n = g.q_index.shape[0]
        ks, vs = gather(k_cache, g.blocks, n, g.pad_index), gather(v_cache, g.blocks, n, g.pad_index)
        res = _sdpa(q[g.q_index], ks, vs, g.mask, scale, False, softcap)
        out[g.out_index] = res[g.q_valid]
    for seq in long_seqs:
        qs = q[seq.q_start : seq.q_start + seq.q_len][None]
        ks = gather(k_cache, seq.blocks, 1)[:, : seq.seq_len - seq.first_pos]
        vs = gather(v_cache, seq.blocks, 1)[:, : seq.seq_len - seq.first_pos]
        res = _sdpa(qs, ks, vs, seq.mask, scale, seq.mask is None, softcap)
        out[seq.q_start : seq.q_start + seq.q_len] = res[0]
    return out
