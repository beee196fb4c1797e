"""The w8a8 / w4a8 arithmetic in torch: what csrc/matmul_q8.cpp computes, bit for bit (the tests hold every
build variant to it), and what runs those modes where the library's integer products are not built.

Activations are quantized per row in blocks of 32 inputs, as llama.cpp's Q8_0: d = amax * float32(1/127),
codes round(x * (1 / d)) half to even (0 where d is 0), clamped to +-127. Each block's dot product with the
weight codes is an exact integer. Scales are applied in float32, each product rounded on its own, blocks
summed in input order:
- w8a8 (int8 codes, a scale per output): acc += d_b * dot_b; out = acc * scale
- w4a8 (codes 0..15, scale and offset per output and block of 32, w = code * scale + offset):
  acc += d_b * (scale_b * dot_b + offset_b * sum_b), sum_b the block's activation codes summed
- w8a8 grouped (int8 codes, a scale per output and block of 32: a Q8_0 matrix, llama.cpp's Q8_0 x Q8_0):
  acc += d_b * (scale_b * dot_b)
"""

from __future__ import annotations

import torch

BLOCK = 32
# rows at a time: the per-block dot products [rows, n, k / 32] in float64 stay small
_ROWS = 256


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, k] -> int8 codes [rows, k], float32 scales and int32 code sums [rows, k // 32]."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    inv127 = torch.tensor(1.0, dtype=torch.float32) / 127.0
    d = blocks.abs().amax(dim=-1) * inv127
    inv = torch.where(d > 0, torch.ones_like(d).div(d), torch.zeros_like(d))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127)
    sums = codes.sum(dim=-1).to(torch.int32)  # exact: integers far below 2^24
    return codes.to(torch.int8).reshape(rows, k), d, sums


def _block_dots(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """Integer dot products per block: [nb, rows, n] float32 (exact: |dot| <= 32 * 127 * 127 < 2^24)."""
    rows, k = codes.shape
    n = weight_codes.shape[0]
    x = codes.double().reshape(rows, k // BLOCK, BLOCK).transpose(0, 1)  # [nb, rows, 32]
    w = weight_codes.double().reshape(n, k // BLOCK, BLOCK).permute(1, 2, 0)  # [nb, 32, n]
    return torch.bmm(x, w).float()


def _by_rows(x: torch.Tensor, n: int, one: object) -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for r0 in range(0, x.shape[0], _ROWS):
        out[r0 : r0 + _ROWS] = one(x[r0 : r0 + _ROWS]).to(x.dtype)  # type: ignore[operator]
    return out


def w8a8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] times w^T, w = codes [n, k] int8 * scales [n] float32 -> [rows, n] in x's dtype."""

    def one(rows: torch.Tensor) -> torch.Tensor:
        xq, d, _ = quantize_activations(rows)
        dots = _block_dots(xq, codes)
        acc = torch.zeros(rows.shape[0], codes.shape[0])
        for b in range(dots.shape[0]):
            acc = acc + d[:, b, None] * dots[b]
        return acc * scales.float()

    return _by_rows(x, codes.shape[0], one)


def w4a8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """x [rows, k] times w^T, w = codes [n, k] (0..15) * scales + offsets per block of 32 inputs
    ([n, k // 32] float32) -> [rows, n] in x's dtype."""

    def one(rows: torch.Tensor) -> torch.Tensor:
        xq, d, sums = quantize_activations(rows)
        dots = _block_dots(xq, codes)
        acc = torch.zeros(rows.shape[0], codes.shape[0])
        s, o, fs = scales.float(), offsets.float(), sums.float()
        for b in range(dots.shape[0]):
            t = s[None, :, b] * dots[b] + o[None, :, b] * fs[:, b, None]
            acc = acc + d[:, b, None] * t
        return acc

    return _by_rows(x, codes.shape[0], one)


def w8a8_grouped_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] times w^T, w = codes [n, k] int8 * scales per block of 32 inputs ([n, k // 32])
    -> [rows, n] in x's dtype."""

    def one(rows: torch.Tensor) -> torch.Tensor:
        xq, d, _ = quantize_activations(rows)
        dots = _block_dots(xq, codes)
        acc = torch.zeros(rows.shape[0], codes.shape[0])
        s = scales.float()
        for b in range(dots.shape[0]):
            acc = acc + d[:, b, None] * (s[None, :, b] * dots[b])
        return acc

    return _by_rows(x, codes.shape[0], one)
