"""Structured output's token bitmask in C++ (csrc/bitmask.cpp): forbidden tokens' logits to -inf, in place,
on one thread (a parallel region stalls on a loaded machine; see the C++)."""

from __future__ import annotations

import torch

from specserve.kernels.cpu import build


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Forbidden tokens' logits to -inf, in place, on `rows` (int64) of float32 logits [R, V]: token t of row
    r is allowed where bit t % 32 of bitmask[r, t // 32] (int32, xgrammar's packing) is set. build.load()
    must have succeeded."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("apply_bitmask takes float32 logits [rows, vocab] with vocab innermost")
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[0] < logits.shape[0]:
        raise ValueError("apply_bitmask takes a contiguous int32 bitmask with a row per logits row")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError("the bitmask is narrower than the vocabulary")
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        raise ValueError("apply_bitmask takes contiguous int64 row indices")
    rc = build._lib.specserve_apply_bitmask(
        logits.data_ptr(), logits.stride(0), logits.shape[1], bitmask.data_ptr(), bitmask.shape[1],
        rows.data_ptr(), rows.numel(), logits.shape[0],
    )  # fmt: skip
    if rc != 0:
        raise ValueError("apply_bitmask: a row index out of range")
