"""The decoder layer's elementwise steps in C++ (csrc/elementwise.cpp, csrc/rope_kv.cpp), one pass each with
torch's roundings: residual add + RMSNorm, the per-head q / k RMSNorm, silu(gate) * up and Gemma's
gelu_tanh(gate) * up, and the rotary embedding fused with the new tokens' KV-cache write. float32 and
bfloat16, in every build variant; build.load() must have succeeded.
"""

from __future__ import annotations

import torch

from specserve.kernels.cpu import build

# The dtypes rope_write_kv takes (each in every build variant).
ROPE_DTYPES = (torch.float32, torch.bfloat16)


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotary embedding of qkv's q and k heads in place, then the new K and V into the cache (float32 or
    bfloat16, the caches of the same dtype or bfloat16 under float32, rounded to nearest even as they are
    written; tokens with a negative slot are not cached).

    qkv [tokens, (num_heads + 2 * num_kv_heads) * head_dim] rows (q, k, v heads); cos/sin [max_pos, ...,
    head_dim] contiguous; positions and slot_mapping int64. Bit for bit what LlamaModel's torch path does.
    """
    head_dim = k_cache.shape[-1]
    if (
        qkv.dtype not in ROPE_DTYPES
        or qkv.stride(1) != 1
        or cos.dtype != qkv.dtype
        or sin.dtype != qkv.dtype
        or v_cache.dtype != k_cache.dtype
        or (qkv.dtype, k_cache.dtype) not in build.KV_DTYPES
    ):
        raise ValueError(
            "rope_write_kv takes float32 or bfloat16 qkv rows and rotary tables alike, over caches of that "
            "dtype or bfloat16"
        )
    if not (
        cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    ):
        raise ValueError("rotary tables and KV caches must be contiguous")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    rc = build._lib.specserve_rope_write_kv(
        qkv.data_ptr(),
        qkv.stride(0),
        qkv.shape[0],
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        build.KV_DTYPES[qkv.dtype, k_cache.dtype],
        torch.get_num_threads(),
    )
    build.check(rc, "rope_write_kv")


def _rows(t: torch.Tensor, d: int, what: str) -> None:
    if t.dim() != 2 or t.shape[1] < d or t.stride(1) != 1 or t.dtype not in build.DTYPES:
        raise ValueError(f"{what} must be float32 or bfloat16 rows of at least {d} contiguous elements")


def add_rms_norm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(h, weight) of rows [n, d], one pass; with `add`, h += add in place first (the residual
    stream, rounded to its dtype as `h + add` is) and the norm is of the sum."""
    n, d = h.shape
    for t, what in ((h, "h"), *(((add, "add"),) if add is not None else ())):
        _rows(t, d, what)
    if weight.shape != (d,) or not weight.is_contiguous() or weight.dtype != h.dtype:
        raise ValueError("weight must be a contiguous vector of h's width and dtype")
    if add is not None and (add.shape[0] != n or add.dtype != h.dtype):
        raise ValueError("add must have h's rows and dtype")
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    rc = build._lib.specserve_add_rms_norm(
        h.data_ptr(),
        None if add is None else add.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        n,
        d,
        h.stride(0),
        0 if add is None else add.stride(0),
        out.stride(0),
        eps,
        build.DTYPES[h.dtype],
        torch.get_num_threads(),
    )
    build.check(rc, "add_rms_norm")
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """F.rms_norm over the last dimension of x [n, heads, d] in place, each head alone (q and k norms):
    heads contiguous within a token, tokens at any row stride (a slice of the fused qkv output)."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.dtype not in build.DTYPES:
        raise ValueError("x must be float32 or bfloat16 [n, heads, d] with each token's heads contiguous")
    n, heads, d = x.shape
    if weight.shape != (d,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError("weight must be a contiguous vector of x's head width and dtype")
    rc = build._lib.specserve_rms_norm_heads(
        x.data_ptr(),
        weight.data_ptr(),
        n,
        heads,
        d,
        x.stride(0),
        eps,
        build.DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    build.check(rc, "rms_norm_heads")


def _act_mul(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    n, d2 = gate_up.shape
    _rows(gate_up, d2, "gate_up")
    d = d2 // 2
    out = torch.empty(n, d, dtype=gate_up.dtype)
    fn = getattr(build._lib, f"specserve_{name}")
    rc = fn(
        gate_up.data_ptr(),
        out.data_ptr(),
        n,
        d,
        gate_up.stride(0),
        d,
        build.DTYPES[gate_up.dtype],
        torch.get_num_threads(),
    )
    build.check(rc, name)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [n, 2d] holding gate then up (a fused gate_up projection), one pass."""
    return _act_mul("silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU) for rows [n, 2d] holding gate then up, one
    pass."""
    return _act_mul("gelu_tanh_mul", gate_up)
