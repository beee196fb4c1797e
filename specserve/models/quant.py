"""Weight-only quantized linears: our kernels (kernels/cpu/matmul.py: AVX2 + FMA for float32
activations, AVX512-BF16 for bfloat16) and torch's packed-int kernels for bfloat16 (what torchao's CPU
layouts and gpt-fast call).

Two stored forms, both plain data until the model packs them for its device:
- `Int8Weight`: symmetric int8 per output channel; run by ours in float32 (AVX2 + FMA) and in bf16
  (AVX512-BF16, any step size), elsewhere in bf16 by `torch._weight_int8pack_mm`.
- `Int4Weight`: 4-bit codes with a scale and zero per group of 32 along the input, in tinygemm's convention
  w = (q - 8) * scale + zero; run by ours in float32, and in bf16 by ours (AVX512-BF16) for few rows and
  many, elsewhere in bf16 by `torch._weight_int4pack_mm_for_cpu`. GGUF's Q4_0, Q4_1 and Q4_K are this
  exactly (groups of 32 with a scale and a minimum), so they load without re-quantizing
  (models/loader/gguf.py).

The decoder layers' matrices are quantized. The embedding is a lookup that needs the dense table; the LM head
(tied to it in most small models) keeps that dense form for steps of many rows, and where our float32 kernels
run, a quantized model reads its few-row logits from an int8 copy in groups of 32 (head_form: at batch 1 the
dense head would otherwise cost as much as all the quantized layers together); in bf16 that copy is a GGUF's
own Q8_0 blocks, which the loader keeps (HEAD_Q8_0).

w8a8 / w4a8 (vLLM's names) keep the same weights (`A8Weight` wraps them) and quantize the activations too,
per 32 inputs right before each product, so the products are integer SIMD (kernels/cpu/csrc/matmul_q8.cpp,
kernels/reference_a8.py): their arithmetic differs from the weight-only modes' by design, and is the same
at every step size and on every machine. Their LM head, where it is Q8_0 blocks (a GGUF's), is such a
product too (a8_head), at every step size.

Which of these runs a matrix at a step of N rows is models/linear.py's table; the packed forms here build the
chosen forms' data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import cpu, reference_a8
from specserve.models import linear

MODES = ("none", "auto", "int8", "int4", "w8a8", "w4a8")
# the modes that quantize activations too (A8Weight)
A8_MODES = ("w8a8", "w4a8")
# GGUF's 4-bit block; a group must divide the input width (SmolLM2's 576 is not a multiple of 128)
GROUP = cpu.matmul.INT4_GROUP
# The CPU int4 packing interleaves output rows in tiles of 16.
INT4_ROW_TILE = 16

Linear = Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Int8Weight:
    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32, or [out, in // GROUP] for the LM head's groups (quantize_head)


@dataclass(frozen=True)
class Int4Weight:
    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in // GROUP] float32
    zeros: torch.Tensor  # [out, in // GROUP] float32: the value of code 8


@dataclass(frozen=True)
class A8Weight:
    """A matrix of a w8a8 / w4a8 model: int8 codes in -127..127 with a scale per output (AVX2's sign trick
    negates them), or int4 in groups of 32, or (the LM head: a8_head) int8 with a scale per group of 32, a
    Q8_0 matrix kept as its blocks; its products quantize their activations first (a8)."""

    w: Int8Weight | Int4Weight

    @classmethod
    def of(cls, w: Int8Weight | Int4Weight) -> A8Weight:
        if isinstance(w, Int8Weight) and w.scales.dim() == 2:  # a scale per group: re-quantized per output
            w = quantize_int8(dequantize(w))
        if isinstance(w, Int8Weight):
            w = Int8Weight(w.codes.clamp(-127, 127), w.scales)
        return cls(w)


QuantizedWeight = Int8Weight | Int4Weight | A8Weight


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, not {mode!r}")


def kernels_fast(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a vectorised weight-only kernel runs this compute dtype here, so that `auto` keeps a
    checkpoint's quantization: float32 on AVX2 + FMA (our kernels, kernels/cpu/matmul.py), bfloat16
    on AVX-512 (torch's packed-int kernels).

    torch's have no vectorised float32 path: SmolLM2's layer matmuls at batch 1 ran 5-10x slower in int8 and
    int4 than the dense float32 F.linear (2-core AVX2 EPYC, bench/quant_kernels.py); ours ran them 2-3x
    faster than dense (bench/quant.py --batch1 on that EPYC: int8 1.86x, int4 2.28x end to end)."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return cpu.build.load() is not None and cpu.build.quant_fast()
    avx512 = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")
    return dtype == torch.bfloat16 and avx512


def effective_mode(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` keeps a checkpoint's quantization where the kernels pay for it, and dequantizes elsewhere;
    an explicit int8/int4/w8a8/w4a8 is taken as asked."""
    check_mode(mode)
    if mode == "auto" and not kernels_fast(device, dtype):
        return "none"
    return mode


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    w = w.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return Int8Weight(codes, scales)


def quantize_int8_grouped(w: torch.Tensor) -> Int8Weight:
    """Symmetric int8 with a scale per group of 32 inputs (amax / 127), as GGUF's Q8_0 blocks: a Q8_0 matrix
    dequantized comes back bit for bit (each block's largest code is +-127, and 127 times its float16 scale
    is exact in float32, so amax / 127 is that scale and every value divides back to its code)."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GROUP)
    # 4,096 rows at a time: whole, a 49,152-row head's float temporaries were the load's peak (bench/load.py)
    for r0 in range(0, n, 4096):
        groups = w[r0 : r0 + 4096].float().reshape(-1, k // GROUP, GROUP)
        s = groups.abs().amax(dim=-1).clamp(min=1e-30) / 127.0
        scales[r0 : r0 + 4096] = s
        codes[r0 : r0 + 4096] = (
            torch.round(groups / s[..., None]).clamp(-127, 127).to(torch.int8).reshape(-1, k)
        )
    return Int8Weight(codes, scales)


def fits_int4(out_features: int, in_features: int) -> bool:
    return in_features % GROUP == 0 and out_features % INT4_ROW_TILE == 0


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """Asymmetric round-to-nearest per group (min/max), as gpt-fast and torchao's int4 weight-only do; a
    matrix the kernel cannot take (input width not a multiple of 32, rows not of 16) is kept in int8."""
    n, k = w.shape
    if not fits_int4(n, k):
        return quantize_int8(w)
    groups = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(codes.reshape(n, k), scales, lo + 8.0 * scales)


def dequantize(w: QuantizedWeight | torch.Tensor) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.float()
    if isinstance(w, A8Weight):
        return dequantize(w.w)
    n, k = w.codes.shape
    if isinstance(w, Int8Weight) and w.scales.dim() == 2:
        return (w.codes.float().reshape(n, -1, GROUP) * w.scales[..., None]).reshape(n, k)
    if isinstance(w, Int8Weight):
        return w.codes.float() * w.scales[:, None]
    groups = w.codes.float().reshape(n, k // GROUP, GROUP) - 8.0
    return (groups * w.scales[..., None] + w.zeros[..., None]).reshape(n, k)


def quantizer(mode: str) -> Callable[[torch.Tensor | QuantizedWeight], torch.Tensor | QuantizedWeight]:
    """What becomes of a decoder matrix as the model takes it: `auto` keeps what the loader gave (quantized
    for a GGUF whose kernels pay, dense otherwise); `int8`/`int4` quantize dense matrices on load."""
    check_mode(mode)
    if mode == "int8":
        return lambda w: quantize_int8(w) if isinstance(w, torch.Tensor) else w
    if mode == "int4":
        return lambda w: quantize_int4(w) if isinstance(w, torch.Tensor) else w
    if mode in A8_MODES:
        # a GGUF's come quantized already (models/loader/gguf.py: w4a8 keeps its int4 blocks, the rest int8)
        dense = quantize_int8 if mode == "w8a8" else quantize_int4

        def a8(w: torch.Tensor | QuantizedWeight) -> A8Weight:
            q = dense(w) if isinstance(w, torch.Tensor) else w
            return q if isinstance(q, A8Weight) else A8Weight.of(q)

        return a8
    return lambda w: w


def cat(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Join matrices along their output rows (q/k/v, gate/up). A GGUF may store the parts in different types
    (Q4_K_M keeps some attn_v in Q6_K): beside a dense part (what `auto` makes of a type no kernel runs
    exactly) the join is dense, every part's values as they are; quantized parts of two kinds (the explicit
    modes' int4 beside the int8 of a matrix int4 does not fit) join as int8."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    if all(isinstance(p, A8Weight) for p in parts):
        return A8Weight.of(cat([p.w for p in parts]))  # type: ignore[union-attr, return-value]
    if all(isinstance(p, Int4Weight) for p in parts):
        return Int4Weight(
            torch.cat([p.codes for p in parts]),  # type: ignore[union-attr]
            torch.cat([p.scales for p in parts]),  # type: ignore[union-attr]
            torch.cat([p.zeros for p in parts]),  # type: ignore[union-attr]
        )
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    if dense:
        return torch.cat(
            [p if isinstance(p, torch.Tensor) else dequantize(p).to(dense[0].dtype) for p in parts]
        )
    as_int8 = [p if isinstance(p, Int8Weight) else quantize_int8(dequantize(p)) for p in parts]
    return Int8Weight(torch.cat([p.codes for p in as_int8]), torch.cat([p.scales for p in as_int8]))


# The row limits live on the forms (models/linear.py); these names are theirs, for callers that read them.
KERNEL_MAX_ROWS = linear.TorchInt8.MAX_ROWS
GROUPED_KERNEL_MAX_ROWS = linear.OwnInt8F32.GROUPED_MAX_ROWS
BF16_INT4_KERNEL_MAX_ROWS = linear.TorchInt4.BESIDE_COPY_MAX_ROWS
BF16_GROUPED_KERNEL_MAX_ROWS = linear.OwnInt8F32OnBf16.MAX_ROWS
BF16_GROUPED_AMX_MAX_ROWS = linear.OwnInt8GroupedRowsAmx.BESIDE_COPY_MAX_ROWS
BF16_GROUPED_TILE_MAX_ROWS = linear.OwnInt8GroupedTileRowsBf16.BESIDE_COPY_MAX_ROWS


DenseMatmul = Callable[[torch.Tensor], torch.Tensor]


# Steps of many rows widen a quantized matrix this many output rows at a time into a block that stays in
# cache (1.5 MB at SmolLM2's widest input), then run one dense matmul on the block: faster than the matrix
# widened whole at 64 rows (one thread, 2-core AVX2 EPYC, `python bench/quant_kernels.py --float32`).
WIDEN_BLOCK = 256


def _widened_blocks(x: torch.Tensor, n: int, widen: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x times the matrix whose output rows [j, j + m) widen(j, m) gives in float32, block by block."""
    if n <= WIDEN_BLOCK:
        return F.linear(x, widen(0, n))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for j in range(0, n, WIDEN_BLOCK):
        m = min(WIDEN_BLOCK, n - j)
        out[:, j : j + m] = F.linear(x, widen(j, m))
    return out


def matrix(w: torch.Tensor | QuantizedWeight, dense_copy: bool = False) -> linear.Matrix:
    """What the matmul choice (models/linear.py) reads of a matrix."""
    if isinstance(w, torch.Tensor):
        return linear.Matrix(linear.DENSE, tuple(w.shape))
    if isinstance(w, A8Weight):
        return linear.Matrix(
            linear.INT4_A8 if isinstance(w.w, Int4Weight) else linear.INT8_A8, w.w.codes.shape
        )
    if isinstance(w, Int4Weight):
        kind = linear.INT4
    else:
        kind = linear.INT8_GROUPED if w.scales.dim() == 2 else linear.INT8
    return linear.Matrix(kind, tuple(w.codes.shape), dense_copy)


def own_bf16_kernel(w: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether our AVX512-BF16 kernels run this matrix in bf16 (linear.OWN_INT8_BF16 for int8 with a scale
    per output, OWN_INT4_BF16_TILES for int4)."""
    m, isa = matrix(w), linear.Isa.here(device)
    form = linear.OWN_INT4_BF16_TILES if m.kind == linear.INT4 else linear.OWN_INT8_BF16
    return form.can_run(m, 1, dtype, isa) is None


def dense_copy_pays(w: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `auto` should keep a dense copy of a quantized matrix for steps of many rows
    (linear.copy_pays)."""
    return linear.copy_pays(matrix(w), dtype, linear.Isa.here(device))


def dense_panels_pay(w: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a dense matrix runs on our panel products (DensePanels) rather than the library matmul
    (linear.DENSE_PANELS)."""
    return linear.choose(matrix(w), 1, dtype, linear.Isa.here(device)) is linear.DENSE_PANELS


class DensePanels:
    """A dense float32 or bf16 matrix as our panel products read it (cpu.matmul.f32_panels, bf16_panels), in
    place of the matrix itself: one copy, every step size (linear.DENSE_PANELS)."""

    def __init__(self, w: torch.Tensor) -> None:
        w = w.contiguous()
        self.panels = cpu.matmul.f32_panels(w) if w.dtype == torch.float32 else cpu.matmul.bf16_panels(w)
        self._product = cpu.matmul.bind_panels(self.panels)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x.contiguous())

    def library_products(self) -> list[tuple[float, cpu.matmul.Product | None]]:
        """The library product mm calls, for steps of every size (see _Packed.library_products)."""
        return [(math.inf, self._product)]


class _Packed:
    """A quantized matrix as the model calls it: the forms models/linear.py chooses, a kernel of its own for
    steps of few rows and for more rows a dense copy's matmul (auto keeps one), a kernel of its own again,
    or the matrix widened per call."""

    def __init__(
        self,
        w: QuantizedWeight,
        dtype: torch.dtype,
        device: torch.device,
        dense_mm: DenseMatmul | DensePanels | None,
        batch_invariant: bool = False,
    ) -> None:
        isa = linear.Isa.here(device, batch_invariant=batch_invariant)
        self.few, most, self.many = linear.plan(matrix(w, dense_mm is not None), dtype, isa)
        self.has_kernel = self.few.kernel
        # a kernel that runs every step size is many_rows too, which takes strided rows as they come
        self.kernel_max_rows = most if self.has_kernel and most != math.inf else KERNEL_MAX_ROWS
        panels = dense_mm if isinstance(dense_mm, DensePanels) else None
        self.many_rows: DenseMatmul = panels.mm if panels else dense_mm or self.widened_mm
        # the library product many_rows calls, where it is one (a dense copy's panels, our bf16 kernels)
        self.many_rows_product = panels.library_products()[0][1] if panels else None
        if self.has_kernel and self.many is self.few:
            self.many_rows = self.kernel if most == math.inf else self.in_passes

    def in_passes(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on kernel_max_rows rows at a time: every row summed as in a one-row step (a
        batch-invariant plan, linear.plan)."""
        most = int(self.kernel_max_rows)
        return torch.cat([self.kernel(x[r : r + most].contiguous()) for r in range(0, x.shape[0], most)])

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_kernel and x.shape[0] <= self.kernel_max_rows:
            return self.kernel(x.contiguous())
        return self.many_rows(x)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def library_products(self) -> list[tuple[float, cpu.matmul.Product | None]]:
        """The library product mm calls for each run of step sizes, for a caller that chains the products in
        C++ (cpu.chain.LayerChain): (the most rows of the run, its product), runs in increasing order, the
        last one unbounded; None for a run that is not the library's (torch's int4 kernel for few rows in
        bfloat16, a matrix widened for torch's matmul)."""
        few = getattr(self, "_product", None)
        if self.has_kernel and self.many_rows == self.kernel:
            return [(math.inf, few)]
        if not self.has_kernel:
            return [(math.inf, self.many_rows_product)]
        return [(self.kernel_max_rows, few), (math.inf, self.many_rows_product)]

    def widened_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PackedInt8(_Packed):
    """An int8 matrix as the kernels read it: codes [out, in] (each output's inputs contiguous), scales in
    the compute dtype; for our bf16 kernel the codes in its 16-output tiles and the scales (the same bf16
    values) in float32, and that kernel serves steps of any size unless a dense copy is kept for them."""

    def __init__(
        self,
        w: Int8Weight,
        dtype: torch.dtype,
        device: torch.device,
        dense_mm: DenseMatmul | DensePanels | None = None,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__(w, dtype, device, dense_mm, batch_invariant)
        self.grouped = w.scales.dim() == 2  # only our kernels take a scale per group
        self.own = self.few is linear.OWN_INT8_F32
        self.own_bf16 = self.few is linear.OWN_INT8_BF16
        # a matrix with a scale per group in bf16 (only a Q8_0 head is one: head_form): our float32 kernel on
        # the rows widened to float32, float32 logits out
        self.float32_rows = self.few is linear.OWN_INT8_F32_ON_BF16
        # ... or our product of bf16 rows (AMX tiles from 3 rows), float32 logits out likewise
        self.grouped_rows_amx = self.few is linear.OWN_INT8_GROUPED_ROWS_AMX
        # ... or our AVX512-BF16 product of bf16 rows on 16-output tiles, float32 logits out likewise
        self.grouped_tile_rows = self.few is linear.OWN_INT8_GROUPED_TILE_ROWS_BF16
        self.own_widening = self.many is linear.LIBRARY_WIDEN
        float32_scales = self.float32_rows or self.grouped_rows_amx or self.grouped_tile_rows
        kept = torch.float32 if float32_scales else dtype
        self.scales = w.scales.to(device=device, dtype=kept).contiguous()
        if self.own_bf16:
            self.tiles = cpu.matmul.int8_tiles(w.codes.to(device))
            self.scales = self.scales.float()
            self._product = cpu.matmul.bind_int8_bf16(self.tiles, self.scales)
        else:
            self.codes = w.codes.to(device).contiguous()
            if self.own:
                self._product = cpu.matmul.bind_int8(self.codes, self.scales)
            elif self.float32_rows:  # not _product: a layer chain in bf16 cannot call a float32 product
                self._float32_product = cpu.matmul.bind_int8(self.codes, self.scales)
            elif self.grouped_rows_amx:  # float32 out: not a layer chain's product either
                self._float32_product = cpu.matmul.bind_int8_grouped_rows_bf16(self.codes, self.scales)
            elif self.grouped_tile_rows:
                tiles = cpu.matmul.int8_grouped_tiles(self.codes, self.scales)
                self._float32_product = cpu.matmul.bind_int8_grouped_tile_rows_bf16(*tiles)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_bf16 or self.own:
            return self._product(x)
        if self.float32_rows:
            return self._float32_product(x.float())
        if self.grouped_rows_amx or self.grouped_tile_rows:
            return self._float32_product(x)
        return torch._weight_int8pack_mm(x, self.codes, self.scales)

    def widened_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_widening:
            codes, scales = self.codes, self.scales
            return _widened_blocks(
                x, codes.shape[0], lambda j, m: cpu.matmul.int8_widen(codes[j : j + m], scales[j : j + m])
            )
        if self.grouped:
            n = self.codes.shape[0]
            widened = self.codes.to(self.scales.dtype).view(n, -1, GROUP) * self.scales[..., None]
            return F.linear(x, widened.view(n, -1).to(x.dtype))
        return F.linear(x, self.codes.to(x.dtype)) * self.scales  # int8 values are exact in bf16


class PackedInt4(_Packed):
    """An int4 matrix at half a byte a value. float32 with our kernels: nibbles in their layout
    (cpu.matmul.pack_int4), read by the kernel and by widening alike. bfloat16: for few rows our AVX512-BF16
    product (so a layer chain runs batch-1 and verify steps) on 16-output tiles of the codes (int4_tiles,
    shared with the many-row kernel where it runs), on the same nibbles where AMX tiles run its 2 or more
    rows, or where it is not built torch's packed layout (rows tiled by 16); for many rows, unless a dense
    copy serves them, our AVX512-BF16 kernel's tiles, or else the nibbles again to widen."""

    def __init__(
        self,
        w: Int4Weight,
        dtype: torch.dtype,
        device: torch.device,
        dense_mm: DenseMatmul | DensePanels | None = None,
        batch_invariant: bool = False,
    ) -> None:
        super().__init__(w, dtype, device, dense_mm, batch_invariant)
        self.own = self.few is linear.OWN_INT4_F32
        self.own_bf16 = self.many is linear.OWN_INT4_BF16_TILES
        self.own_rows_bf16 = self.few is linear.OWN_INT4_ROWS_BF16
        self.own_tile_rows_bf16 = self.few is linear.OWN_INT4_TILE_ROWS_BF16
        self.own_widening = self.many is linear.LIBRARY_WIDEN
        if self.own_bf16:  # our tiles' kernel for many rows
            self.tiles, self.tile_scales, self.tile_zeros = cpu.matmul.int4_tiles(
                w.codes.to(device), w.scales.to(device), w.zeros.to(device)
            )
            self._many_rows_bf16 = cpu.matmul.bind_int4_bf16(self.tiles, self.tile_scales, self.tile_zeros)
            self.many_rows, self.many_rows_product = self.many_rows_bf16, self._many_rows_bf16
        if self.few is linear.TORCH_INT4:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 2).to(device)
            self.scales_zeros = torch.stack([w.scales.t(), w.zeros.t()], dim=-1).to(
                device=device, dtype=dtype
            )
        if self.own or self.own_rows_bf16 or self.many in (linear.LIBRARY_WIDEN, linear.TORCH_WIDEN):
            self.nibbles = cpu.matmul.pack_int4(w.codes.to(device))  # [out, in // 2]
            # float32 for our bf16 product as for the float32 one (a GGUF's fp16 scales stay exact)
            kept = torch.float32 if self.own_rows_bf16 else dtype
            self.scales = w.scales.to(device=device, dtype=kept).contiguous()
            # w = code * scale + (zero - 8 * scale): one multiply-add a weight
            self.offsets = (w.zeros - 8.0 * w.scales).to(device=device, dtype=kept).contiguous()
            if self.own:
                self._product = cpu.matmul.bind_int4(self.nibbles, self.scales, self.offsets)
            elif self.own_rows_bf16:
                self._product = cpu.matmul.bind_int4_rows_bf16(self.nibbles, self.scales, self.offsets)

        if self.own_tile_rows_bf16:  # the many-row tiles' codes and scales where they are kept, and offsets
            codes, offsets = w.codes.to(device), (w.zeros.float() - 8.0 * w.scales.float()).to(device)
            tiles, scales, tile_offsets = cpu.matmul.int4_tiles(codes, w.scales.to(device), offsets)
            if self.own_bf16:
                tiles, scales = self.tiles, self.tile_scales
            self._product = cpu.matmul.bind_int4_tile_rows_bf16(tiles, scales, tile_offsets)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.own or self.own_rows_bf16 or self.own_tile_rows_bf16:
            return self._product(x)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def many_rows_bf16(self, x: torch.Tensor) -> torch.Tensor:
        return self._many_rows_bf16(x.contiguous())

    def widened_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.own_widening:
            nibbles, scales, offsets = self.nibbles, self.scales, self.offsets

            def widen(j: int, m: int) -> torch.Tensor:
                return cpu.matmul.int4_widen(nibbles[j : j + m], scales[j : j + m], offsets[j : j + m])

            return _widened_blocks(x, nibbles.shape[0], widen)
        n = self.nibbles.shape[0]
        codes = cpu.matmul.unpack_int4(self.nibbles).view(n, -1, GROUP)
        widened = (codes.to(self.scales.dtype) * self.scales[..., None]).add_(self.offsets[..., None])
        return F.linear(x, widened.view(n, -1).to(x.dtype))


class PackedA8(_Packed):
    """A w8a8 / w4a8 matrix: our integer products (linear.OWN_A8) on its tiles, or the same arithmetic in
    torch (linear.TORCH_A8) on the codes as stored. Ours is also a layer chain's product (cpu.chain): a
    batch-1 step is otherwise mostly the Python loop's calls between products. A Q8_0 head (grouped int8)
    takes float32 rows and gives float32 logits whatever the model's dtype."""

    def __init__(self, w: A8Weight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(w, dtype, device, None)
        inner = w.w
        self.int4 = isinstance(inner, Int4Weight)
        self.grouped = not self.int4 and inner.scales.dim() == 2
        self.codes = inner.codes.to(device)
        self.scales = inner.scales.to(device=device, dtype=torch.float32).contiguous()
        # w = code * scale + (zero - 8 * scale): the offset the w4a8 arithmetic adds per block
        self.offsets = (inner.zeros - 8.0 * inner.scales).float().to(device) if self.int4 else None
        self._product: cpu.matmul.Product | None = None
        if self.few is linear.OWN_A8:
            by_tile = cpu.matmul.by_tile
            if self.int4:
                tiles = cpu.matmul.w4a8_tiles(self.codes)
                # float16 where that holds every value (a GGUF's Q4_0 / Q4_1 blocks): a quarter fewer
                # bytes a weight for a batch-1 step to read, the same arithmetic
                fits = cpu.matmul.fits_half(self.scales) and cpu.matmul.fits_half(self.offsets)
                kept = torch.float16 if fits else torch.float32
                self._product = cpu.matmul.bind_w4a8(
                    tiles, by_tile(self.scales, kept), by_tile(self.offsets, kept), dtype
                )
            elif self.grouped:  # a Q8_0 head's float16 scales likewise
                kept = torch.float16 if cpu.matmul.fits_half(self.scales) else torch.float32
                self._product = cpu.matmul.bind_w8a8_grouped(
                    cpu.matmul.w8a8_tiles(self.codes), by_tile(self.scales, kept)
                )
            else:
                self._product = cpu.matmul.bind_w8a8(cpu.matmul.w8a8_tiles(self.codes), self.scales, dtype)
            del self.codes  # the tiles hold them

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            x = x.float()
        if self._product is not None:
            return self._product(x)
        if self.int4:
            return reference_a8.w4a8_matmul(x, self.codes, self.scales, self.offsets)
        if self.grouped:
            return reference_a8.w8a8_grouped_matmul(x, self.codes, self.scales)
        return reference_a8.w8a8_matmul(x, self.codes, self.scales)


Packed = PackedInt8 | PackedInt4 | PackedA8


def pack(
    w: QuantizedWeight,
    dtype: torch.dtype,
    device: torch.device,
    dense_mm: DenseMatmul | DensePanels | None = None,
    batch_invariant: bool = False,
) -> Packed:
    """`w` for the kernels; `dense_mm`, when given, computes steps of many rows (a dense copy: its matmul, or
    its DensePanels, whose library product a layer chain can then call). batch_invariant: one form for every
    step size (linear.plan), a dense copy unused."""
    if device.type != "cpu":
        # torch's CUDA int4 kernel wants another packing (tensor-core tiles); nothing here can test it.
        raise ValueError(f"quantization: weight-only int8/int4 runs on CPU only, not on {device.type}")
    if isinstance(w, A8Weight):
        return PackedA8(w, dtype, device)
    kind = PackedInt8 if isinstance(w, Int8Weight) else PackedInt4
    return kind(w, dtype, device, dense_mm, batch_invariant)


# A GGUF's Q8_0 LM head, kept as its blocks beside the dense head where the dtype rounds them (bf16): the
# state dict's "lm_head" + HEAD_Q8_0, or "model.embed_tokens" + HEAD_Q8_0 for a tied one (head_form).
HEAD_Q8_0 = ".q8_0"


def _q8_0_of(w: torch.Tensor) -> Int8Weight | None:
    """w as Q8_0 blocks where it holds exactly their values (a GGUF's Q8_0 head dequantized), else None."""
    if w.dim() != 2 or w.shape[1] % GROUP != 0:
        return None
    q = quantize_int8_grouped(w)
    # Compared 4,096 rows at a time: the whole head dequantized twice over (its float codes and their
    # product) was the load peak for the demo GGUF in float32: 235 MiB over the loaded model (bench/load.py).
    for r0 in range(0, w.shape[0], 4096):
        rows = Int8Weight(q.codes[r0 : r0 + 4096], q.scales[r0 : r0 + 4096])
        if not torch.equal(dequantize(rows), w[r0 : r0 + 4096].float()):
            return None
    return q


def head_form(
    w: torch.Tensor, dtype: torch.dtype, device: torch.device, q8_0: Int8Weight | None = None
) -> Int8Weight | None:
    """The LM head as a quantized model's batch-1 logits read it: int8 in groups of 32 (quantize_int8_grouped)
    where our float32 kernels run, else None (dense). At batch 1 on the 2-core AVX2 EPYC, SmolLM2's tied
    49,152 x 576 head is 113 MB of float32 against 106 MB for all 30 layers in int8 (9 GB/s for the pair:
    12.5 ms a token), so with it dense neither target (int8 2.5x, int4 4x fp32) is reachable; in int8 it
    reads 32 MB. A GGUF's Q8_0 head is kept bit for bit; its logits are the quantized model's own, which the
    verifier and logprobs then read (speculation stays lossless)."""
    if not kernels_fast(device, torch.float32) or w.dim() != 2 or w.shape[1] % GROUP != 0:
        return None
    if dtype != torch.float32:
        # the dense head holds the file's values rounded to bf16, the copy the file's own (q8_0): at batch 1
        # it reads 32 MB of SmolLM2's head on our float32 kernel, the dense bf16 head 57 MB. bf16 `auto`'s
        # layers already differ so between step sizes (the GGUF's int4 blocks for few rows, their bf16 copy
        # past them); float32 keeps one set of values at every size
        return q8_0 if q8_0 is not None and q8_0.codes.shape == w.shape else None
    # Only where it holds the head's own values (a Q8_0 head): steps of more rows read the dense head, so a
    # lossy copy would make the model's distribution depend on the step's size, and speculation (whose verify
    # steps have more rows) would no longer be lossless (tests/test_quant.py caught it on a float32 head).
    return _q8_0_of(w)


def a8_head(w: torch.Tensor, dtype: torch.dtype, q8_0: Int8Weight | None = None) -> A8Weight | None:
    """A w8a8 / w4a8 model's LM head where it is Q8_0 blocks (a GGUF's, or a head holding exactly their
    values): those blocks on int8 activations at every step size, as llama.cpp runs a Q8_0 head (its Q8_0 x
    Q8_0 product), else None (the head stays as the weight-only modes run it). Every machine gets the same
    values: ours where the integer products run, the torch spelling of them elsewhere."""
    if q8_0 is not None and q8_0.codes.shape == w.shape and dtype != torch.float32:
        q: Int8Weight | None = q8_0  # the file's blocks, which the dtype's dense head rounds
    else:
        q = _q8_0_of(w)
    # -128 is a code a file may hold but AVX2's sign trick cannot take (A8Weight)
    if q is None or int(q.codes.min()) < -127:
        return None
    return A8Weight(q)


def pack_head(
    w: torch.Tensor,
    dense_mm: DenseMatmul,
    dtype: torch.dtype,
    device: torch.device,
    q8_0: Int8Weight | None = None,
    batch_invariant: bool = False,
    a8: bool = False,
) -> object:
    """The head for the model's linear: with `a8` (a w8a8 / w4a8 model) a8_head's for every step size; else
    head_form's int8 for steps of few rows beside `dense_mm` (the dense head, which the embedding lookup keeps
    anyway when tied) for more, or `w` as is. Batch-invariant: the int8 head for every step size, in passes
    (linear.plan)."""
    if a8:
        head = a8_head(w, dtype, q8_0)
        if head is not None:
            return PackedA8(head, dtype, device)
    q = head_form(w, dtype, device, q8_0)
    return w if q is None else PackedInt8(q, dtype, device, dense_mm, batch_invariant)


def with_packed(dense: Linear) -> Linear:
    """The model's one linear, taking packed quantized matrices and DensePanels as well as dense (or
    prepacked) ones."""

    def linear(x: torch.Tensor, w: object, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, _Packed | DensePanels):
            y = w.mm(x)
            return y if bias is None else y + bias
        return dense(x, w, bias)

    return linear
