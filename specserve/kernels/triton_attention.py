"""Triton paged attention and KV-cache write: the CUDA path, same signatures as kernels.reference.

One attention kernel serves decode (1 new token), speculative verify (k+1) and chunked prefill (a chunk):
a program owns BLOCK_Q consecutive new tokens of one sequence times the GROUP query heads that share one KV
head, so each K/V tile read from the paged cache feeds BLOCK_M = BLOCK_Q * GROUP query rows. Programs are
numbered without a host sync: sequence s owns program ids [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1)
(a superset of the q-blocks it needs), found back by binary search over query_start_loc.
When there are too few programs to fill the GPU (small decode batches over long contexts), the KV range is
split over NUM_SPLITS programs whose partial softmax states are merged by a second kernel (split-K).
Softmax runs in base 2 with the scale folded into log2(e), as flash attention does.
A sliding window (Gemma 3's local layers, Mistral) starts each program's KV loop at the first tile its
earliest query can see, so tiles wholly before the window are never read; soft-capping (Gemma 2) caps scores
as cap * tanh(score / cap) before the softmax. Both are compile-time switches: off, they cost nothing.
A draft tree (kernels/tree.py) is a third: each row's ancestor mask over its sequence's new rows and its
depth, the rope position a window is measured from; a sequence without a tree has all bits and depth = its
row, so the same arithmetic is causal for it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from specserve.kernels import tree as tree_mask

LOG2E = math.log2(math.e)
# Each split should stream at least this many KV positions, or the merge costs more than it wins.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
# Stated explicitly: Triton 3.9 warns that its default (fused multiply-add allowed) changes in 3.10.
FP_FUSION = True
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence s with qsl[s] // BLOCK_Q + s <= pid (those keys strictly increase with s)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        key = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if key <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_DIM] fp32, split-K only
    part_max_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32 (log2 domain)
    part_sum_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tree_mask_ptr,  # [num_tokens] int64 ancestor bits, tree steps only
    tree_depth_ptr,  # [num_tokens] int32
    scale,
    window,
    softcap,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    # BLOCK_M need not be a multiple of GROUP: rows past BLOCK_Q * GROUP belong to no token.
    row_ok = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = context_len + tok
    q_at = q_pos  # the position a window is measured from: a tree row's is context + its depth
    if HAS_TREE:
        row_bits = tl.load(tree_mask_ptr + q_row, mask=row_ok, other=-1)
        q_at = context_len + tl.load(tree_depth_ptr + q_row, mask=row_ok, other=0)

    # The last query row of this block sees positions < kv_end; nothing past it is read.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    # ... and with a window, the first query row sees nothing before kv_start (a tree row's depth may be
    # as low as 0).
    kv_start = 0
    if HAS_WINDOW:
        if HAS_TREE:
            kv_start = tl.maximum(context_len + 1 - window, 0)
        else:
            kv_start = tl.maximum(context_len + q_block * BLOCK_Q + 1 - window, 0)
    first_tile = kv_start // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        kv_pos = t * TILE_N + offs_n
        kv_ok = (kv_pos < kv_end) & (kv_pos >= kv_start)  # a tile may begin before the window: not read
        block = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        in_block = kv_pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr
            + block[None, :] * stride_kb
            + in_block[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=d_ok[:, None] & kv_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + in_block[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # cap * tanh(s / cap)
        s = s * 1.4426950408889634  # log2(e): the softmax runs in base 2
        # Causal mask; it also hides positions >= kv_end since every valid q_pos < kv_end.
        visible = kv_pos[None, :] <= q_pos[:, None]
        if HAS_TREE:
            # new row j is seen where the row's ancestor bit j is set (rows past 64 belong to no tree)
            j = kv_pos - context_len
            in_new = j >= 0
            jc = tl.minimum(tl.maximum(j, 0), 63).to(tl.int64)
            bit = ((row_bits[:, None] >> jc[None, :]) & 1) != 0
            visible = visible & ((~in_new | (j >= 64))[None, :] | bit)
            if HAS_WINDOW:
                key_depth = tl.load(tree_depth_ptr + q_start + jc, mask=in_new & kv_ok, other=0)
                key_at = tl.where(in_new, context_len + key_depth, kv_pos)
                visible = visible & (key_at[None, :] > q_at[:, None] - window)
        elif HAS_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the input dtype as tensor cores need; the second cast is a no-op on GPU.
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # Every split stores, empty ones too (m = -inf, l = 0), so the merge needs no bookkeeping.
        part = (q_row * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_loc_ptr,
    num_seqs,
    stride_ot,
    stride_oh,
    stride_od,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Rows of q past the last sequence (padding) have no partials; leave their output alone.
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    part = (token.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_all = tl.max(m, 0)
    w = tl.exp2(m - m_all)  # 0 for empty splits (m = -inf) and the padding past NUM_SPLITS
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + h * stride_kch + d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + h * stride_vch + d * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter instead of being compiled.

    Fixed when the module is imported: triton.jit reads TRITON_INTERPRET at decoration time.
    """
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [num_tokens, num_kv_heads, head_dim] into the cache; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        enable_fp_fusion=FP_FUSION,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_splits(programs: int, num_sms: int, max_context: int) -> int:
    """Split-K factor: enough programs for two per SM, each split streaming >= MIN_TOKENS_PER_SPLIT."""
    target = 2 * num_sms
    if programs >= target:
        return 1
    # Powers of two only: every distinct split count is a separately compiled kernel.
    splits = min(triton.next_power_of_2(triton.cdiv(target, programs)), MAX_SPLITS)
    while splits > 1 and splits * MIN_TOKENS_PER_SPLIT > max_context:
        splits //= 2
    return splits


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: object | None = None,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    trees: list[list[int] | None] | tree_mask.TreeRows | None = None,
) -> torch.Tensor:
    """Attention of packed queries against the paged cache. Returns [num_tokens, num_q_heads, head_dim].

    plan is accepted for signature parity with the reference and ignored. max_query_len / max_seq_len are
    hints for the launch shape only (results do not depend on them; without them, bounds come from tensor
    shapes, never from a host sync); num_splits forces the split-K factor (1 disables it). window: each
    query sees the `window` positions ending at its own; softcap: scores capped as cap * tanh(s / cap).
    trees: per sequence its draft tree's parents or None, or their rows already laid out
    (tree.tree_rows, on q's device: no host sync); chains run the causal kernel.
    """
    del plan
    if trees is not None and not isinstance(trees, tree_mask.TreeRows):
        qsl = query_start_loc.tolist()
        trees = tree_mask.tree_rows(trees, [b - a for a, b in zip(qsl[:-1], qsl[1:])])
        trees = None if trees is None else trees.to(q.device)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group evenly over {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads

    if max_query_len is None:
        max_query_len = num_tokens - num_seqs + 1
    # Decode and verify rows fit one 16-row tile; prefill chunks get taller tiles for tensor-core reuse.
    block_m = max(16 if max_query_len * group <= 16 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    num_programs = num_tokens // block_q + num_seqs

    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = 1
        if q.device.type == "cuda":
            num_sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
            num_splits = choose_splits(num_programs * num_kv_heads, num_sms, max_seq_len)

    if num_splits > 1:
        part_acc = torch.empty(
            num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched: the kernel stores to out directly

    # The interpreter cannot compute on bfloat16 (numpy has none), so it upcasts dot operands to float32
    # after the same rounding the GPU path does; results match the tensor-core computation.
    dot_dtype = tl.float32 if interpreted() and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype]
    _paged_attention_kernel[(num_programs, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_lens if trees is None else trees.mask,  # never read without a tree
        seq_lens if trees is None else trees.depth,
        scale,
        window or 0,
        softcap or 0.0,
        num_seqs,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=max(32, block_size),
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype,
        # float32 must not silently drop to TF32 on Ampere+.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=bool(window),
        HAS_SOFTCAP=bool(softcap),
        HAS_TREE=trees is not None,
        enable_fp_fusion=FP_FUSION,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            query_start_loc,
            num_seqs,
            *out.stride(),
            NUM_Q_HEADS=num_q_heads,
            HEAD_DIM=head_dim,
            HEAD_PAD=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            enable_fp_fusion=FP_FUSION,
        )
    return out
