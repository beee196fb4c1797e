"""The weight-only quantized and dense matrix products in C++ (csrc/matmul*.cpp): x [rows, k] times w^T for
w held as int8 codes with scales, int4 codes with scales and offsets, or dense float32 / bfloat16 panels,
each in the layout its kernel reads (the *_tiles, *_panels and pack_int4 helpers here make them).

float32 activations: AVX2 + FMA kernels (build.quant_fast()), generic loops elsewhere; bfloat16 activations:
AVX512-BF16 kernels only (build.quant_bf16_fast()), which other builds refuse (code 2). A Product binds one
matrix's weights once, so a call checks only its activations. models/quant.py holds the matrices.
"""

from __future__ import annotations

import torch

from specserve.kernels.cpu import build

# The bfloat16 products read their codes in tiles of this many outputs (int8_tiles, int4_tiles)
INT8_TILE = 16

# The weight-only quantized products (models/quant.py holds the matrices; these only read them). int4 codes
# come packed by pack_int4: 16 bytes per group of INT4_GROUP inputs, byte i holding code i in its low nibble
# and code i + 16 in its high one, so one 16-byte load unpacks into the group's 32 codes in input order.
INT4_GROUP = 32


class Product:
    """A weight-only product of the library (specserve_<name>) bound to its weights: their checks and
    pointers are taken once, when bound, so a call checks only its activations. A batch-1 decode step of
    SmolLM2 makes 121 of these calls; bound, a tiny one takes ~4.5 us against ~6.7 when the weights were
    checked at every call (avx2 build, Zen 4). Called as (x, its row stride, rows, *weights, out, its row
    stride, threads); rc != 0 means the library refused its arguments."""

    __slots__ = ("name", "n", "k", "x_dtype", "out_dtype", "_fn", "_args", "_weights")

    def __init__(
        self, name: str, x_dtype: torch.dtype, out_dtype: torch.dtype, n: int, k: int, *weights: torch.Tensor
    ) -> None:
        self.name, self.n, self.k, self.x_dtype, self.out_dtype = name, n, k, x_dtype, out_dtype
        self._fn = getattr(build._lib, f"specserve_{name}")
        self._weights = weights  # the pointers below stay valid while these live
        self._args = (*(w.data_ptr() for w in weights), n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.x_dtype or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != self.k:
            raise ValueError(
                f"{self.name} takes {self.x_dtype} activations [rows, {self.k}] with k innermost, "
                f"not {x.dtype} {list(x.shape)}"
            )
        rows = x.shape[0]
        out = torch.empty(rows, self.n, dtype=self.out_dtype)
        if rows == 0:
            return out
        threads = torch.get_num_threads()
        rc = self._fn(x.data_ptr(), x.stride(0), rows, *self._args, out.data_ptr(), self.n, threads)
        if rc != 0:
            raise ValueError(f"{self.name} refused its arguments (code {rc})")
        return out


def int8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] -> [n // 16, k // 2, 16, 2], the layout int8_matmul_bf16 reads: for each tile of 16
    outputs and each pair of inputs, the 16 outputs' two codes side by side (one vdpbf16ps operand)."""
    n, k = codes.shape
    if codes.dtype != torch.int8 or n % INT8_TILE != 0 or k % 2 != 0:
        raise ValueError(f"int8_tiles takes int8 codes [n, k] with n a multiple of {INT8_TILE} and k even")
    return codes.view(n // INT8_TILE, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bind_int8_bf16(tiles: torch.Tensor, scales: torch.Tensor) -> Product:
    """x [rows, k] bfloat16 times w^T -> [rows, n] bfloat16, w[j] = codes[j] * scales[j] (float32 [n]), the
    codes in int8_tiles' layout; products exact, sums in float32, rounded once. Needs
    build.quant_bf16_fast()."""
    if tiles.dtype != torch.int8 or tiles.dim() != 4 or not tiles.is_contiguous():
        raise ValueError("int8_matmul_bf16 takes the codes as int8_tiles gives them")
    n, k = tiles.shape[0] * INT8_TILE, tiles.shape[1] * 2
    if scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous():
        raise ValueError(f"int8_matmul_bf16: float32 scales [{n}]")
    return Product("int8_matmul_bf16", torch.bfloat16, torch.bfloat16, n, k, tiles, scales)


def int8_matmul_bf16(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return bind_int8_bf16(tiles, scales)(x)


def bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """A dense bfloat16 matrix [n, k] -> the panels panel_matmul reads: [n // 32][k // 2][2][16][2] (the
    int8_tiles layout, two tiles side by side per input pair), a last panel of one tile for an odd n // 16."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % INT8_TILE != 0 or k % 2 != 0:
        raise ValueError(f"bf16_panels takes bfloat16 [n, k] with n a multiple of {INT8_TILE} and k even")
    tiles = weight.view(n // INT8_TILE, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3)  # [tiles, pairs, 16, 2]
    full = n // (2 * INT8_TILE) * 2
    panels = tiles[:full].reshape(full // 2, 2, k // 2, INT8_TILE, 2).transpose(1, 2).reshape(-1)
    return torch.cat([panels, tiles[full:].reshape(-1)]).view(n, k)


def f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """A dense float32 matrix [n, k] -> the panels panel_matmul reads: [n // 16][k][16] (for each input, 16
    outputs' weights side by side), a last panel of 8 outputs when n // 8 is odd."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % 8 != 0:
        raise ValueError("f32_panels takes float32 [n, k] with n a multiple of 8")
    full = n // 16 * 16
    panels = weight[:full].reshape(full // 16, 16, k).transpose(1, 2).reshape(-1)
    return torch.cat([panels, weight[full:].t().reshape(-1)]).view(n, k)


# the dense panel products by the panels' dtype (f32_panels: AVX2 + FMA builds; bf16_panels: AVX512-BF16)
_PANEL_PRODUCTS = {torch.float32: "f32_matmul", torch.bfloat16: "bf16_matmul"}


def bind_panels(panels: torch.Tensor) -> Product:
    """x [rows, k] times w^T -> [rows, n] in the panels' dtype, w held as f32_panels or bf16_panels gives it:
    float32 sums in input order, bf16 ones in float32 rounded once. float32 needs build.quant_fast(), bf16
    build.quant_bf16_fast(); other builds refuse the call (code 2)."""
    if panels.dtype not in _PANEL_PRODUCTS or panels.dim() != 2 or not panels.is_contiguous():
        raise ValueError("panel_matmul takes the weight as f32_panels or bf16_panels gives it")
    n, k = panels.shape
    return Product(_PANEL_PRODUCTS[panels.dtype], panels.dtype, panels.dtype, n, k, panels)


def panel_matmul(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    return bind_panels(panels)(x)


def int4_tiles(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 codes [n, k] (0..15) with float32 scales and zeros [n, k // 32] -> the layout int4_matmul_bf16
    reads: codes [n // 16, k // 2, 16] bytes (output j's two codes of an input pair in one byte, the first in
    the low nibble), scales and zeros [n // 16, k // 32, 16]."""
    n, k = codes.shape
    if n % INT8_TILE != 0 or k % INT4_GROUP != 0 or scales.shape != (n, k // INT4_GROUP):
        raise ValueError(f"int4_tiles takes codes [n, k] with n a multiple of {INT8_TILE}, k of {INT4_GROUP}")
    pairs = codes.to(torch.uint8).view(n // INT8_TILE, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3)
    tiles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // INT8_TILE, INT8_TILE, -1).permute(0, 2, 1).contiguous()

    return tiles, by_tile(scales), by_tile(zeros)


def bind_int4_bf16(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Product:
    """x [rows, k] bfloat16 times w^T -> [rows, n] bfloat16, w = (code - 8) * scale + zero per group of 32
    inputs, rounded to bf16 as the dense bf16 form (quant.dequantize) holds it, in int4_tiles' layout; sums in
    float32. Written for steps of many rows (few are bind_int4_rows_bf16's). Needs build.quant_bf16_fast()."""
    if tiles.dtype != torch.uint8 or tiles.dim() != 3 or not tiles.is_contiguous():
        raise ValueError("int4_matmul_bf16 takes the codes as int4_tiles gives them")
    n, k = tiles.shape[0] * INT8_TILE, tiles.shape[1] * 2
    shape = (tiles.shape[0], k // INT4_GROUP, INT8_TILE)
    for t in (scales, zeros):
        if t.dtype != torch.float32 or t.shape != shape or not t.is_contiguous():
            raise ValueError(f"int4_matmul_bf16: float32 scales and zeros {list(shape)} (int4_tiles)")
    return Product("int4_matmul_bf16", torch.bfloat16, torch.bfloat16, n, k, tiles, scales, zeros)


def int4_matmul_bf16(
    x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    return bind_int4_bf16(tiles, scales, zeros)(x)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[n, k] codes in 0..15 (uint8) -> [n, k // 2] uint8 in the kernels' nibble layout."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // INT4_GROUP, 2, INT4_GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [n, k // 2] -> [n, k] codes (uint8)."""
    n = packed.shape[0]
    groups = packed.reshape(n, -1, INT4_GROUP // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=-1).reshape(n, -1)


def _check_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("quantized weights, scales and offsets must be contiguous")


def bind_int8(codes: torch.Tensor, scales: torch.Tensor) -> Product:
    """x [rows, k] float32 times w^T -> [rows, n] float32, w = codes [n, k] int8 times scales, float32 [n]
    (one per output row) or [n, k // 32] (one per group of 32 inputs). build.load() must have succeeded;
    vectorised where build.quant_fast(): for 1..8 rows, and for more with a scale per output and n a
    multiple of 8 (a panel of 16 outputs widened at a time for the dense float32 panel product's register
    blocks)."""
    _check_contiguous(codes, scales)
    n, k = codes.shape
    grouped = scales.dim() == 2
    if (
        codes.dtype != torch.int8
        or scales.dtype != torch.float32
        or scales.numel() != (n * (k // INT4_GROUP) if grouped else n)
        or (grouped and k % INT4_GROUP != 0)
    ):
        raise ValueError("int8_matmul takes int8 codes [n, k] and float32 scales [n] or [n, k // 32]")
    name = "int8_grouped_matmul" if grouped else "int8_matmul"
    return Product(name, torch.float32, torch.float32, n, k, codes, scales)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return bind_int8(codes, scales)(x)


def _check_int4(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> tuple[int, int]:
    _check_contiguous(packed, scales, offsets)
    n, k = packed.shape[0], packed.shape[1] * 2
    if (
        packed.dtype != torch.uint8
        or k % INT4_GROUP != 0
        or scales.dtype != torch.float32
        or offsets.dtype != torch.float32
        or scales.numel() != n * (k // INT4_GROUP)
        or offsets.numel() != scales.numel()
    ):
        raise ValueError("int4 takes packed uint8 [n, k // 2] and float32 scales and offsets [n, k // 32]")
    return n, k


def bind_int4(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Product:
    """x [rows, k] float32 times w^T, w[j, i] = code * scales[j, g] + offsets[j, g] for i in group g (codes
    from pack_int4) -> [rows, n] float32. build.load() must have succeeded; vectorised where
    build.quant_fast(): for 1..8 rows, and for more where n is a multiple of 8 (widened panels, as
    int8_matmul)."""
    n, k = _check_int4(packed, scales, offsets)
    return Product("int4_matmul", torch.float32, torch.float32, n, k, packed, scales, offsets)


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    return bind_int4(packed, scales, offsets)(x)


# The most rows int4_rows_bf16 takes (csrc/matmul.cpp's kInt4RowsMax: the AMX tiles' passes of 32 rows pay
# up to two of them, linear.OwnInt4RowsBf16.AMX_BESIDE_COPY_MAX_ROWS); the rows of q4_bf16_row
# (AVX512-BF16), which sums each of its 1..8 rows as a one-row call does; and the most rows a call runs on it
# where AMX tiles run the rest (csrc's kInt4AmxFromRows - 1): the tiles' sums come in another order, of the
# weights rounded to bf16, so only calls of up to that many rows sum each row as a one-row call.
INT4_ROWS_BF16_MAX = 64
INT4_ROWS_BF16_AVX512 = 8
INT4_ROWS_BF16_BELOW_AMX = 1


def bind_int4_rows_bf16(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Product:
    """bind_int4's matrix times x [rows, k] bfloat16 (1..INT4_ROWS_BF16_MAX rows) -> [rows, n] bfloat16: codes
    exact in bf16 products on vdpbf16ps (2 or more rows on AMX's tdpbf16ps where build.int4_rows_amx(), each
    weight rounded to bf16 as a bf16 model holds it), sums in float32, rounded once. Needs
    build.quant_bf16_fast()."""
    n, k = _check_int4(packed, scales, offsets)
    return Product("int4_rows_bf16", torch.bfloat16, torch.bfloat16, n, k, packed, scales, offsets)


# The most rows int4_tile_rows_bf16 and int8_grouped_tile_rows_bf16 take (csrc/matmul.cpp's kTileRowsMax)
TILE_ROWS_BF16_MAX = 32


def bind_int4_tile_rows_bf16(tiles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Product:
    """x [rows, k] bfloat16 (1..TILE_ROWS_BF16_MAX rows) times w^T -> [rows, n] bfloat16, w = code *
    scale + offset per group of 32 inputs, the codes in int4_tiles' layout and the offsets in its scales' (its
    zeros' place): codes exact in bf16 products on vdpbf16ps, the 16 lanes 16 outputs, sums in float32,
    rounded once; each row summed alike whatever the rows beside it. Needs build.quant_bf16_fast()."""
    if tiles.dtype != torch.uint8 or tiles.dim() != 3 or not tiles.is_contiguous():
        raise ValueError("int4_tile_rows_bf16 takes the codes as int4_tiles gives them")
    n, k = tiles.shape[0] * INT8_TILE, tiles.shape[1] * 2
    shape = (tiles.shape[0], k // INT4_GROUP, INT8_TILE)
    for t in (scales, offsets):
        if t.dtype != torch.float32 or t.shape != shape or not t.is_contiguous():
            raise ValueError(f"int4_tile_rows_bf16: float32 scales and offsets {list(shape)} (int4_tiles)")
    return Product("int4_tile_rows_bf16", torch.bfloat16, torch.bfloat16, n, k, tiles, scales, offsets)


def int8_grouped_tiles(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix (int8 codes [n, k], float32 scales [n, k // 32], n a multiple of 16) -> the layout
    int8_grouped_tile_rows_bf16 reads: the codes as int8_tiles gives them, the scales [n // 16, k // 32,
    16]."""
    n, k = codes.shape
    if scales.shape != (n, k // INT4_GROUP) or k % INT4_GROUP:
        raise ValueError(f"int8_grouped_tiles takes codes [n, k] and scales [n, k // {INT4_GROUP}]")
    tiles = int8_tiles(codes)
    return tiles, scales.float().view(n // INT8_TILE, INT8_TILE, -1).permute(0, 2, 1).contiguous()


def bind_int8_grouped_tile_rows_bf16(tiles: torch.Tensor, scales: torch.Tensor) -> Product:
    """A Q8_0 matrix in int8_grouped_tiles' layout times x [rows, k] bfloat16 (1..TILE_ROWS_BF16_MAX
    rows) -> [rows, n] float32: codes exact in bf16 products on vdpbf16ps, the 16 lanes 16 outputs, sums and
    scales in float32; each row summed alike whatever the rows beside it. Needs build.quant_bf16_fast()."""
    if tiles.dtype != torch.int8 or tiles.dim() != 4 or not tiles.is_contiguous():
        raise ValueError("int8_grouped_tile_rows_bf16 takes the codes as int8_grouped_tiles gives them")
    n, k = tiles.shape[0] * INT8_TILE, tiles.shape[1] * 2
    shape = (tiles.shape[0], k // INT4_GROUP, INT8_TILE)
    if scales.dtype != torch.float32 or scales.shape != shape or not scales.is_contiguous():
        raise ValueError(f"int8_grouped_tile_rows_bf16: float32 scales {list(shape)} (int8_grouped_tiles)")
    return Product("int8_grouped_tile_rows_bf16", torch.bfloat16, torch.float32, n, k, tiles, scales)


# The most rows int8_grouped_rows_bf16 takes (csrc/matmul.cpp's kInt8GroupedRowsMax), and the most a call
# runs as the float32 product does (kInt8GroupedAmxFromRows - 1): the row summed as a one-row call sums it.
# Past them the AMX tiles, whose sums of the weights rounded to bf16 come in another order.
INT8_GROUPED_ROWS_BF16_MAX = 32
INT8_GROUPED_ROWS_BF16_BELOW_AMX = 1


def bind_int8_grouped_rows_bf16(codes: torch.Tensor, scales: torch.Tensor) -> Product:
    """A Q8_0 matrix (int8 codes [n, k], float32 scales [n, k // 32], n a multiple of 16) times x [rows, k]
    bfloat16 (1..INT8_GROUPED_ROWS_BF16_MAX rows) -> [rows, n] float32: up to INT8_GROUPED_ROWS_BF16_BELOW_AMX
    rows as bind_int8 on the rows widened to float32, more on AMX tiles with each weight rounded to bf16 (the
    dense bf16 copy's values), sums in float32. Needs build.int8_grouped_rows_amx(); other builds refuse the
    call (code 2)."""
    for name, t, dtype in (("codes", codes, torch.int8), ("scales", scales, torch.float32)):
        if t.dtype != dtype or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"int8_grouped_rows_bf16: {name} must be contiguous {dtype} [n, ...]")
    n, k = codes.shape
    if n % INT8_TILE or n == 0:
        raise ValueError(f"int8_grouped_rows_bf16: codes' outputs ({n}) must be a multiple of {INT8_TILE}")
    if k % INT4_GROUP or k == 0:
        raise ValueError(f"int8_grouped_rows_bf16: codes' inputs ({k}) must be a multiple of {INT4_GROUP}")
    if scales.shape != (n, k // INT4_GROUP):
        want = [n, k // INT4_GROUP]
        raise ValueError(f"int8_grouped_rows_bf16: scales must be {want}, not {list(scales.shape)}")
    return Product("int8_grouped_rows_bf16", torch.bfloat16, torch.float32, n, k, codes, scales)


def int8_widen(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [n, k] int8 * scales [n] -> [n, k] float32, on every thread."""
    if codes.dtype != torch.int8 or scales.dtype != torch.float32 or scales.numel() != codes.shape[0]:
        raise ValueError("int8_widen takes int8 codes [n, k] and float32 scales [n]")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("int8_widen takes contiguous codes and scales")
    out = torch.empty(codes.shape, dtype=torch.float32)
    n, k = codes.shape
    build._lib.specserve_int8_widen(
        codes.data_ptr(), scales.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()
    )
    return out


def int4_widen(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """pack_int4 codes with their scales and offsets -> [n, k] float32, on every thread."""
    if not (packed.is_contiguous() and scales.is_contiguous() and offsets.is_contiguous()):
        raise ValueError("int4_widen takes contiguous codes, scales and offsets")
    n, k = _check_int4(packed, scales, offsets)
    out = torch.empty(n, k, dtype=torch.float32)
    build._lib.specserve_int4_widen(
        packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), n, k, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


# w8a8 / w4a8 (csrc/matmul_q8.cpp): activations quantized per Q8_BLOCK inputs right before the product,
# integer sums, scales in float32 (kernels/reference_a8.py is the same arithmetic in torch). Weights in tiles
# of Q8_TILE outputs, 4 inputs side by side per output (one 32-bit lane of vpdpbusd).
Q8_BLOCK = 32
Q8_TILE = 16


def w8a8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] in -127..127 -> [n // 16, k // 4, 16, 4] uint8 of code + 128, the layout
    w8a8_matmul reads."""
    n, k = codes.shape
    if codes.dtype != torch.int8 or n % Q8_TILE or k % Q8_BLOCK:
        raise ValueError(f"w8a8_tiles takes int8 codes [n, k], n a multiple of {Q8_TILE}, k of {Q8_BLOCK}")
    if int(codes.min()) < -127:
        raise ValueError("w8a8 codes must lie in -127..127 (AVX2's sign trick negates them)")
    shifted = (codes.to(torch.int16) + 128).to(torch.uint8)
    return shifted.view(n // Q8_TILE, Q8_TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def w4a8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [n, k] in 0..15 -> [n // 16, k // 8, 16, 4] uint8: for each 8 inputs, an output's byte i
    holds input i in its low nibble and input i + 4 in its high one (the layout w4a8_matmul reads)."""
    n, k = codes.shape
    if n % Q8_TILE or k % Q8_BLOCK:
        raise ValueError(f"w4a8_tiles takes codes [n, k], n a multiple of {Q8_TILE}, k of {Q8_BLOCK}")
    c = codes.to(torch.uint8).view(n // Q8_TILE, Q8_TILE, k // 8, 2, 4)
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()


def by_tile(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-block values [n, k // 32] -> [n // 16, k // 32, 16] in dtype (a tile's 16 outputs side by side)."""
    n = t.shape[0]
    return t.to(dtype).view(n // Q8_TILE, Q8_TILE, -1).permute(0, 2, 1).contiguous()


def fits_half(t: torch.Tensor) -> bool:
    """Whether every value of t is a float16 value (w4a8's scales and offsets can then be kept as float16
    bits, bind_w4a8, and read as the same values)."""
    return bool(torch.equal(t.to(torch.float16).float(), t.float()))


_A8_NAMES = {torch.float32: "", torch.bfloat16: "_bf16"}


def bind_w8a8(tiles: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Product:
    """x [rows, k] (float32 or bfloat16) times w^T -> [rows, n] in x's dtype, w = codes * scales (float32
    [n]), the codes as w8a8_tiles gives them, x quantized per 32 inputs first (any build; SIMD where
    build.int_dot_fast())."""
    if tiles.dtype != torch.uint8 or tiles.dim() != 4 or not tiles.is_contiguous() or dtype not in _A8_NAMES:
        raise ValueError("w8a8_matmul takes the codes as w8a8_tiles gives them, float32 or bfloat16 x")
    n, k = tiles.shape[0] * Q8_TILE, tiles.shape[1] * 4
    if scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous():
        raise ValueError(f"w8a8_matmul: float32 scales [{n}]")
    return Product(f"w8a8_matmul{_A8_NAMES[dtype]}", dtype, dtype, n, k, tiles, scales)


def bind_w4a8(
    tiles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype
) -> Product:
    """x [rows, k] times w^T, w = code * scale + offset per group of 32 inputs (scales and offsets as by_tile
    gives them, both float32 or both float16: the same arithmetic in float32 either way), codes as
    w4a8_tiles, x quantized per 32 inputs first; out in x's dtype."""
    if tiles.dtype != torch.uint8 or tiles.dim() != 4 or not tiles.is_contiguous() or dtype not in _A8_NAMES:
        raise ValueError("w4a8_matmul takes the codes as w4a8_tiles gives them, float32 or bfloat16 x")
    n, k = tiles.shape[0] * Q8_TILE, tiles.shape[1] * 8
    shape = (n // Q8_TILE, k // Q8_BLOCK, Q8_TILE)
    for t in (scales, offsets):
        if t.dtype != scales.dtype or t.dtype not in (torch.float32, torch.float16):
            raise ValueError("w4a8_matmul: scales and offsets both float32 or both float16")
        if t.shape != shape or not t.is_contiguous():
            raise ValueError(f"w4a8_matmul: scales and offsets {list(shape)} (by_tile)")
    name = "w4a8_matmul" if scales.dtype == torch.float32 else "w4a8h_matmul"
    return Product(f"{name}{_A8_NAMES[dtype]}", dtype, dtype, n, k, tiles, scales, offsets)


def bind_w8a8_grouped(tiles: torch.Tensor, scales: torch.Tensor) -> Product:
    """x [rows, k] float32 times w^T -> [rows, n] float32, w = code * scale per group of 32 inputs (a Q8_0
    matrix: llama.cpp's Q8_0 x Q8_0 product), codes as w8a8_tiles gives them, scales as by_tile gives them
    (float32, or float16 where each is a float16 value: the same arithmetic), x quantized per 32 inputs."""
    if tiles.dtype != torch.uint8 or tiles.dim() != 4 or not tiles.is_contiguous():
        raise ValueError("w8a8g_matmul takes the codes as w8a8_tiles gives them")
    n, k = tiles.shape[0] * Q8_TILE, tiles.shape[1] * 4
    shape = (n // Q8_TILE, k // Q8_BLOCK, Q8_TILE)
    kinds = (torch.float32, torch.float16)
    if scales.dtype not in kinds or scales.shape != shape or not scales.is_contiguous():
        raise ValueError(f"w8a8g_matmul: float32 or float16 scales {list(shape)} (by_tile)")
    name = "w8a8g_matmul" if scales.dtype == torch.float32 else "w8a8gh_matmul"
    return Product(name, torch.float32, torch.float32, n, k, tiles, scales)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The library's quantization of activations [rows, k] (float32 or bfloat16): int8 codes [rows, k],
    float32 scales and int32 code sums [rows, k // 32] (what the w*a8 products do first)."""
    rows, k = x.shape
    if x.dtype not in build.DTYPES or x.stride(1) != 1 or k % Q8_BLOCK or rows < 1:
        raise ValueError("quantize_q8 takes float32 or bfloat16 [rows, k], k a multiple of 32, k innermost")
    codes = torch.empty(rows, k, dtype=torch.int8)
    scales = torch.empty(rows, k // Q8_BLOCK)
    sums = torch.empty(rows, k // Q8_BLOCK, dtype=torch.int32)
    rc = build._lib.specserve_quantize_q8(
        x.data_ptr(), x.stride(0), rows, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr(),
        build.DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    build.check(rc, "quantize_q8")
    return codes, scales, sums
