"""Which product runs a matrix at a step of N rows: one ordered table of forms (FORMS), walked by `choose`;
the first form that does not refuse runs the step, and each refusal says why in a few words.

A matrix is described by what the choice reads (`Matrix`: stored kind, shape, whether a dense copy is kept
beside it) and the machine by what its builds run (`Isa`). The table decides; models/quant.py builds the
chosen forms' data (PackedInt8, PackedInt4, DensePanels) and models/llama.py the dense ones. A packed matrix
asks once, when built (`plan`: the runs of step sizes and their forms), so a step pays nothing for the choice.

Batch-invariant plans (`Isa.batch_invariant`, the engine's `batch_invariant`): a row's product must not depend
on how many rows its step has, so a matrix gets one form for every step size, the one its one-row steps
take, run in passes of at most `Form.invariant_rows` rows (as many as give each row the arithmetic of a
one-row call); forms whose rounding depends on the step's rows (oneDNN's, a dense copy beside a kernel) are
not chosen.

The row limits below were read off `python bench/quant_kernels.py` (SmolLM2's four layer matrices over all
30 layers, weights from memory) on a 2-core Zen 4 unless a form says otherwise.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from specserve.kernels import cpu

log = logging.getLogger(__name__)

DENSE, INT8, INT8_GROUPED, INT4 = "dense", "int8", "int8 grouped", "int4"
QUANTIZED = (INT8, INT8_GROUPED, INT4)
# w8a8 / w4a8: the same weights, activations quantized per 32 inputs before integer products (quant.A8Weight)
INT8_A8, INT4_A8 = "int8 a8", "int4 a8"


@dataclass(frozen=True)
class Matrix:
    """What the choice reads of a matrix: its stored kind (DENSE; INT8 with a scale per output; INT8_GROUPED
    with a scale per group of 32 inputs, a Q8_0 head; INT4 in groups of 32), its shape [out, in], and whether
    a dense copy of a quantized one is kept beside it for steps of many rows (`auto`: copy_pays)."""

    kind: str
    shape: tuple[int, ...]
    dense_copy: bool = False

    @property
    def out(self) -> int:
        return self.shape[0]

    @property
    def inner(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True)
class Isa:
    """What this machine runs: our C++ library's products (kernels/cpu: float32 ones on AVX2 + FMA builds,
    bfloat16 ones on AVX512-BF16), AMX tiles (oneDNN's bf16 matmuls), oneDNN's prepacked bf16 linear."""

    cpu: bool
    library: bool
    avx2_fma: bool
    avx512_bf16: bool
    amx: bool
    onednn_bf16: bool = False
    # not what the machine runs but how it must run it: one form a matrix, whatever a step's rows
    batch_invariant: bool = False
    int_dot: bool = False  # the library's w8a8 / w4a8 integer products on SIMD (AVX512-VNNI or AVX2)
    int4_rows_amx: bool = False  # the library's int4 few-row bf16 product runs 2 or more rows on AMX tiles
    int8_grouped_rows_amx: bool = False  # ... and its Q8_0 few-row bf16 product (AMX tiles from 2 rows)

    @classmethod
    def here(cls, device: torch.device, onednn_bf16: bool = False, batch_invariant: bool = False) -> Isa:
        library = device.type == "cpu" and cpu.build.load() is not None
        return cls(
            cpu=device.type == "cpu",
            library=library,
            avx2_fma=library and cpu.build.quant_fast(),
            avx512_bf16=library and cpu.build.quant_bf16_fast(),
            amx=torch.cpu._is_amx_tile_supported(),
            onednn_bf16=onednn_bf16,
            batch_invariant=batch_invariant,
            int_dot=library and cpu.build.int_dot_fast(),
            int4_rows_amx=library and cpu.build.int4_rows_amx(),
            int8_grouped_rows_amx=library and cpu.build.int8_grouped_rows_amx(),
        )


def invariance_refusal(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why batch-invariant decoding cannot run in `dtype` on this machine, or None. bf16 needs the library's
    AVX512-BF16 products and attention: without them (an AVX2-only CPU) its products and prefill attention
    are torch's, whose rounding of a row depends on the step's rows: beside one mate a request's greedy
    tokens parted from its tokens alone at the fifth (tests/test_batch_invariance.py, AVX2 EPYC). float32,
    such a CPU's native dtype, runs our AVX2 + FMA forms, which keep it."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    if Isa.here(device).avx512_bf16:
        return None
    return "bfloat16 needs AVX512-BF16 products, which this CPU lacks; use dtype float32 (its native dtype)"


class Form:
    """One way to run a matrix. `kinds`: the stored kinds it takes; `kernel`: a few-row product of the packed
    matrix itself (PackedInt8 / PackedInt4 call it for steps of up to max_rows rows); `copy_pays`: whether a
    dense copy should be kept for steps of many rows where this form would run them without one."""

    name = ""
    kinds: tuple[str, ...] = ()
    kernel = False
    MAX_ROWS: float = math.inf  # the most rows a step may have for this form (a kernel's few-row limit)

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        """Why this form cannot run the matrix at any step size, or None."""
        return None

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return self.MAX_ROWS

    # The most rows one call may take with each row's arithmetic that of a one-row call (a kernel templated
    # on its row count whose per-row sums do not change with it); batch-invariant plans run passes of it.
    INVARIANT_ROWS: float = math.inf

    def invariant_rows(self, m: Matrix, isa: Isa) -> float:
        return self.INVARIANT_ROWS

    def can_run(self, m: Matrix, rows: float, dtype: torch.dtype, isa: Isa) -> str | None:
        """None where this form runs a step of `rows` rows, else a short reason."""
        if m.kind not in self.kinds:
            return f"takes {' / '.join(self.kinds)} only"
        reason = self.refuse(m, dtype, isa)
        if reason is not None:
            return reason
        most = self.max_rows(m, dtype, isa)
        return f"more than {most} rows" if rows > most else None

    def copy_pays(self, isa: Isa) -> bool:
        return True

    def __repr__(self) -> str:
        return self.name


def _needs(dtype: torch.dtype, want: torch.dtype, isa: Isa, path: str) -> str | None:
    if dtype != want:
        return f"{want} only"
    if not isa.library:
        return "our library is not built here"
    if path == "avx2_fma" and not isa.avx2_fma:
        return "the library has no AVX2 + FMA products"
    if path == "avx512_bf16" and not isa.avx512_bf16:
        return "the library has no AVX512-BF16 products"
    return None


class OwnInt8Bf16(Form):
    """Our AVX512-BF16 int8 product (cpu.matmul.bind_int8_bf16) on its 16-output tiles, every step size
    (faster than torch's _weight_int8pack_mm at every one, within ~10% of dense bf16 panels past 8 rows)."""

    name = "ours int8 bf16"
    kinds = (INT8,)
    kernel = True
    # a dense copy is kept only with AMX, whose oneDNN tiles run it 3-4x faster past batch-1 decode's rows
    BESIDE_COPY_MAX_ROWS = 8

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if m.out % cpu.matmul.INT8_TILE or m.inner % 2:
            return f"outputs not in tiles of {cpu.matmul.INT8_TILE} or an odd input width"
        return _needs(dtype, torch.bfloat16, isa, "avx512_bf16")

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return self.BESIDE_COPY_MAX_ROWS if m.dense_copy else math.inf

    def copy_pays(self, isa: Isa) -> bool:
        # without AMX it beats the copy at 64 in flight (`bench/quant.py --in-flight`, 2-core Zen 4)
        return isa.amx


class OwnInt8F32(Form):
    """Our AVX2 + FMA int8 product (cpu.matmul.bind_int8): few-row forms for 1..8 rows, and for more rows
    panels widened into cache where the outputs come in whole tiles of 8 and a scale per output."""

    name = "ours int8 f32"
    kinds = (INT8, INT8_GROUPED)
    kernel = True
    # the C++ few-row forms cover 1..8 rows; past them its widened panels, a dense copy or a widening run
    FEW_ROWS = 8
    # the C++ kernel's kWidenFromRows - 1 (a Q8_0 head in 8-row passes): past it the dense float32 head's
    # panels win (`python bench/quant_kernels.py`, SmolLM2's head, 2-core Zen 4 avx2-only build)
    GROUPED_MAX_ROWS = 15

    def invariant_rows(self, m: Matrix, isa: Isa) -> float:
        # q8_row keeps 4 accumulators a row for 1-2 rows and fewer past them (another order of sums);
        # q8g_row sums each row alike for its 1..8 rows
        return self.FEW_ROWS if m.kind == INT8_GROUPED else 2

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        return _needs(dtype, torch.float32, isa, "avx2_fma")

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        if m.kind == INT8_GROUPED:
            return self.GROUPED_MAX_ROWS
        return math.inf if _own_panels(m) else self.FEW_ROWS

    def copy_pays(self, isa: Isa) -> bool:
        # its panels run as fast as dense float32 (`bench/quant.py --in-flight`, 2-core Zen 4)
        return False


class OwnInt8GroupedRowsAmx(Form):
    """A bf16 model's Q8_0 head on our few-row product for bf16 rows (cpu.matmul.bind_int8_grouped_rows_bf16),
    float32 logits out: one row as OwnInt8F32OnBf16 runs it, 2..32 on AMX tiles, each weight rounded to
    bf16 as the dense bf16 head holds it. A verify step's rows on AMX cost little more than one row, where
    the float32 product's grow with them and the dense copy reads twice the bytes."""

    name = "ours Q8_0 rows on AMX"
    kinds = (INT8_GROUPED,)
    kernel = True
    # up to a 16-draft verify step's 17 rows beside the dense copy (`python bench/head_rows.py`, loaded
    # 2-core Sapphire Rapids); past them the copy's oneDNN tiles, which run prefill-sized steps
    BESIDE_COPY_MAX_ROWS = 17

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if dtype != torch.bfloat16:
            return f"{torch.bfloat16} only"
        if not isa.int8_grouped_rows_amx:
            return "the library runs no AMX tiles here"
        if m.out % cpu.matmul.INT8_TILE or m.inner % cpu.matmul.INT4_GROUP:
            return f"outputs not in tiles of {cpu.matmul.INT8_TILE} or inputs not in groups"
        if isa.batch_invariant:
            # passes of invariant_rows would run 1 row a call where OwnInt8F32OnBf16 runs 8 alike
            return "batch-invariant: the float32 product sums more rows a call alike"
        return None

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return self.BESIDE_COPY_MAX_ROWS if m.dense_copy else cpu.matmul.INT8_GROUPED_ROWS_BF16_MAX

    def invariant_rows(self, m: Matrix, isa: Isa) -> float:
        # the AMX tiles round the weights to bf16 and sum in another order than the one-row calls
        return cpu.matmul.INT8_GROUPED_ROWS_BF16_BELOW_AMX


class OwnInt8GroupedTileRowsBf16(Form):
    """A bf16 model's Q8_0 head on our AVX512-BF16 product of bf16 rows on 16-output tiles
    (cpu.matmul.bind_int8_grouped_tile_rows_bf16), float32 logits out, on CPUs without its AMX form: the
    head's own values (codes exact in bf16 products), every row summed as a one-row call sums it."""

    name = "ours Q8_0 tile rows bf16"
    kinds = (INT8_GROUPED,)
    kernel = True
    # beside the dense bf16 head up to 8 rows: past them level or behind it, a step of 9 / 12 / 17 rows 19.0 /
    # 23.0 / 25.3 ms on the tiles against 17.7 / 22.6 / 23.8 (`python bench/verify_cost.py --dtype bfloat16
    # --head-rows-beside-copy 16`, the whole step, 2-core Zen 4)
    BESIDE_COPY_MAX_ROWS = 8

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if isa.int8_grouped_rows_amx:
            return "AMX tiles run the Q8_0 rows"
        if m.out % cpu.matmul.INT8_TILE or m.inner % cpu.matmul.INT4_GROUP:
            return f"outputs not in tiles of {cpu.matmul.INT8_TILE} or inputs not in groups"
        return _needs(dtype, torch.bfloat16, isa, "avx512_bf16")

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return self.BESIDE_COPY_MAX_ROWS if m.dense_copy else cpu.matmul.TILE_ROWS_BF16_MAX

    def invariant_rows(self, m: Matrix, isa: Isa) -> float:
        return cpu.matmul.TILE_ROWS_BF16_MAX


class OwnInt8F32OnBf16(Form):
    """A bf16 model's Q8_0 head on our float32 int8 product, the rows widened to float32 and float32 logits
    out: the head's own values, which the dense bf16 head rounds."""

    name = "ours int8 f32 (bf16 rows)"
    kinds = (INT8_GROUPED,)
    kernel = True
    # past 3 rows the dense bf16 head's panels win (SmolLM2's 49,152 x 576 head alone, 2-core Zen 4)
    MAX_ROWS = 3
    INVARIANT_ROWS = OwnInt8F32.FEW_ROWS  # q8g_row's, as OwnInt8F32's grouped passes

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if dtype != torch.bfloat16:
            return f"{torch.bfloat16} only"
        return None if isa.avx2_fma else "the library has no AVX2 + FMA products"


class TorchInt8(Form):
    """torch's packed int8 kernel (_weight_int8pack_mm), bf16: pays at batch-1 decode only."""

    name = "torch int8pack"
    kinds = (INT8,)
    kernel = True
    # it beats dense prepacked only at batch-1 decode's few rows (`bench/quant_kernels.py`, AMX Xeon)
    MAX_ROWS = 8
    INVARIANT_ROWS = 1  # torch's: nothing says how its sums depend on the rows

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if dtype != torch.bfloat16:
            return f"{torch.bfloat16} only"
        return None if isa.cpu else "CPU only"


class OwnInt4TileRowsBf16(Form):
    """Our AVX512-BF16 int4 few-row product on 16-output tiles (cpu.matmul.bind_int4_tile_rows_bf16), on CPUs
    without AMX int4 tiles: the lanes are outputs, so a row costs its vdpbf16ps and no per-output sums, and
    every row of a call is summed as a one-row call sums it (a verify step's rows as their decode steps)."""

    name = "ours int4 tile rows bf16"
    kinds = (INT4,)
    kernel = True
    # beside a dense copy up to 16 rows: a step of 9 / 12 / 16 rows 17.0 / 19.4 / 23.6 ms against 18.0 / 21.0
    # / 24.6 on the copy's bf16 panels, 17 / 24 rows 27.4 / 34.3 against 22.7 / 27.8 (`python
    # bench/verify_cost.py --dtype bfloat16 --rows 1,9,12,16,17,24 --int4-rows-beside-copy N`, the whole
    # step, 2-core Zen 4); without a copy up to the kernel's most rows, then the tiles' widened panels
    BESIDE_COPY_MAX_ROWS = 16

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if isa.int4_rows_amx:
            return "AMX tiles run the int4 rows"
        if m.out % cpu.matmul.INT8_TILE:
            return f"outputs not in whole tiles of {cpu.matmul.INT8_TILE}"
        return _needs(dtype, torch.bfloat16, isa, "avx512_bf16")

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return self.BESIDE_COPY_MAX_ROWS if m.dense_copy else cpu.matmul.TILE_ROWS_BF16_MAX

    def invariant_rows(self, m: Matrix, isa: Isa) -> float:
        return cpu.matmul.TILE_ROWS_BF16_MAX


class OwnInt4RowsBf16(Form):
    """Our AVX512-BF16 int4 few-row product (cpu.matmul.bind_int4_rows_bf16), 2 or more rows on AMX tiles
    where the library runs them (Isa.int4_rows_amx): a layer chain can call it."""

    name = "ours int4 rows bf16"
    kinds = (INT4,)
    kernel = True
    # past 2 rows a dense copy's bf16 panels win (`bench/quant_kernels.py --rows 1,2,4,6,8`, 2-core Zen 4)
    BESIDE_COPY_MAX_ROWS = 2
    # on AMX tiles (passes of 32 rows) up to 64 rows: a step of 25 / 32 rows 47.6 / 54.1 ms against 80.2 /
    # 86.4 on the dense copy's oneDNN tiles (`bench/verify_cost.py --dtype bfloat16 --rows 1,25,32
    # --int4-rows-beside-copy 32`, the whole step, 2-core Sapphire Rapids); in two passes 33 / 48 / 64 rows
    # 60.8 / 78.6 / 95.7 ms against 71.3 / 84.9 / 99.2 (`--rows 1,17,32,33,48,64 --int4-rows-beside-copy 64`,
    # same machine): the gain falls as passes read the codes again, so the copy takes the steps past 64
    AMX_BESIDE_COPY_MAX_ROWS = 64

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        return _needs(dtype, torch.bfloat16, isa, "avx512_bf16")

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        if not m.dense_copy:  # without AMX, past q4_bf16_row's rows the tiles form's widened panels
            return cpu.matmul.INT4_ROWS_BF16_MAX if isa.int4_rows_amx else cpu.matmul.INT4_ROWS_BF16_AVX512
        return self.AMX_BESIDE_COPY_MAX_ROWS if isa.int4_rows_amx else self.BESIDE_COPY_MAX_ROWS

    def invariant_rows(self, m: Matrix, isa: Isa) -> float:
        # the AMX tiles round the weights to bf16 and sum in another order than q4_bf16_row's 1..8 rows
        if isa.int4_rows_amx:
            return cpu.matmul.INT4_ROWS_BF16_BELOW_AMX
        return cpu.matmul.INT4_ROWS_BF16_AVX512


class TorchInt4(Form):
    """torch's packed int4 kernel (_weight_int4pack_mm_for_cpu), bf16, where ours is not built."""

    name = "torch int4pack"
    kinds = (INT4,)
    kernel = True
    # past 4 rows a dense copy's bf16 panels win (`bench/quant_kernels.py --rows 1,2,4,6,8`, 2-core Zen 4)
    BESIDE_COPY_MAX_ROWS = 4
    # without a copy it takes the few rows every packed-int kernel does; past them ours or a widening run
    MAX_ROWS = TorchInt8.MAX_ROWS
    INVARIANT_ROWS = 1  # torch's: nothing says how its sums depend on the rows

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if dtype != torch.bfloat16:
            return f"{torch.bfloat16} only"
        if OWN_INT4_ROWS_BF16.refuse(m, dtype, isa) is None:
            return "our int4 rows product runs these"
        return None

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return self.BESIDE_COPY_MAX_ROWS if m.dense_copy else self.MAX_ROWS


class OwnInt4F32(Form):
    """Our AVX2 + FMA int4 product (cpu.matmul.bind_int4): few-row forms, and widened panels for more rows
    where the outputs come in whole tiles of 8 (as OwnInt8F32)."""

    name = "ours int4 f32"
    kinds = (INT4,)
    kernel = True
    FEW_ROWS = OwnInt8F32.FEW_ROWS
    INVARIANT_ROWS = FEW_ROWS  # q4_row sums each row alike for 1..8 rows; its widened panels otherwise

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        return _needs(dtype, torch.float32, isa, "avx2_fma")

    def max_rows(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> float:
        return math.inf if _own_panels(m) else self.FEW_ROWS

    def copy_pays(self, isa: Isa) -> bool:
        # as fast as the copy at 64 in flight (`bench/quant.py --in-flight`, 2-core Zen 4), which is 7x int4
        return False


class OwnInt4Bf16Tiles(Form):
    """Our AVX512-BF16 int4 product on its 16-output tiles (cpu.matmul.bind_int4_bf16) for steps of many
    rows without a dense copy."""

    name = "ours int4 bf16 tiles"
    kinds = (INT4,)

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if m.dense_copy:
            return "a dense copy runs many rows"
        if m.out % cpu.matmul.INT8_TILE or m.inner % cpu.matmul.INT4_GROUP:
            return f"outputs not in tiles of {cpu.matmul.INT8_TILE} or inputs not in groups"
        return _needs(dtype, torch.bfloat16, isa, "avx512_bf16")


class DenseCopy(Form):
    """The dense copy kept beside a quantized matrix (auto), in its own dense form."""

    name = "dense copy"
    kinds = QUANTIZED

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        return None if m.dense_copy else "no dense copy kept"


class LibraryWiden(Form):
    """The matrix widened to float32 by our library a block of rows at a time (any build: both cores), then
    torch's matmul on each block."""

    name = "library widen"
    kinds = (INT8, INT4)

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        return _needs(dtype, torch.float32, isa, "")


class TorchWiden(Form):
    """The matrix widened by torch ops per call, then torch's matmul: what runs where nothing else does."""

    name = "torch widen"
    kinds = QUANTIZED


class DensePanelsForm(Form):
    """A dense matrix on our panel products (quant.DensePanels): float32 on AVX2 + FMA, bf16 on AVX512-BF16
    without AMX. MKL's sgemm reads few-row weights at ~7-11 GB/s and oneDNN's bf16 at ~12: ours ran 1 to 2,048
    rows faster on the 2-core Zen 4 (`python bench/quant_kernels.py`)."""

    name = "ours dense panels"
    kinds = (DENSE,)

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if len(m.shape) != 2:
            return "not a matrix"
        if dtype == torch.float32:
            if m.out % 8:
                return "outputs not in tiles of 8"
            return _needs(dtype, torch.float32, isa, "avx2_fma")
        if m.out % cpu.matmul.INT8_TILE or m.inner % 2:
            return f"outputs not in tiles of {cpu.matmul.INT8_TILE} or an odd input width"
        reason = _needs(dtype, torch.bfloat16, isa, "avx512_bf16")
        if reason is None and isa.amx and not isa.batch_invariant:
            # oneDNN's AMX tiles run 64 rows of SmolLM2's four matrices in 0.28 ms, 3-4x any AVX-512 loop
            return "AMX: oneDNN's tiles are faster"
        return reason


class OneDnnPrepacked(Form):
    """oneDNN's bf16 linear on the weight reordered once into its blocked layout (about 1.5x F.linear on
    decode-sized steps, which reorders at each call)."""

    name = "onednn prepacked"
    kinds = (DENSE,)

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if isa.batch_invariant:
            return "its rounding of a row depends on the step's rows"
        return None if isa.onednn_bf16 and dtype == torch.bfloat16 else "no oneDNN bf16 prepacked linear"


class TorchDense(Form):
    name = "torch linear"
    kinds = (DENSE,)


class OwnA8(Form):
    """Our w8a8 / w4a8 integer products (cpu.matmul.bind_w8a8, bind_w4a8), float32 or bf16 in and out, every
    step size: vpdpbusd on AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2."""

    name = "ours integer a8"
    kinds = (INT8_A8, INT4_A8)
    kernel = True

    def refuse(self, m: Matrix, dtype: torch.dtype, isa: Isa) -> str | None:
        if dtype not in (torch.float32, torch.bfloat16):
            return "float32 or bfloat16 only"
        tile, block = cpu.matmul.Q8_TILE, cpu.matmul.Q8_BLOCK
        if m.out % tile or m.inner % block:
            return f"outputs not in tiles of {tile} or inputs not in blocks of {block}"
        if not isa.library:
            return "our library is not built here"
        return None if isa.int_dot else "the library has no integer SIMD products (AVX512-VNNI or AVX2)"


class TorchA8(Form):
    """The same integer arithmetic in torch (kernels/reference_a8.py): slow, and the model's values stay the
    same wherever ours does not run."""

    name = "torch integer a8"
    kinds = (INT8_A8, INT4_A8)
    kernel = True


def _own_panels(m: Matrix) -> bool:
    """Whether our float32 product runs steps of many rows too, on panels of 16 outputs widened into cache
    (outputs in whole tiles of 8, a scale per output; none where a dense copy runs them): 2-3x faster than
    the matrix widened for MKL at 18 and 64 rows (`python bench/quant_kernels.py --float32`, 2-core Zen 4)."""
    return not m.dense_copy and m.out % 8 == 0 and m.kind in (INT8, INT4)


OWN_INT8_BF16 = OwnInt8Bf16()
OWN_INT8_F32 = OwnInt8F32()
OWN_INT8_GROUPED_ROWS_AMX = OwnInt8GroupedRowsAmx()
OWN_INT8_GROUPED_TILE_ROWS_BF16 = OwnInt8GroupedTileRowsBf16()
OWN_INT8_F32_ON_BF16 = OwnInt8F32OnBf16()
TORCH_INT8 = TorchInt8()
OWN_INT4_TILE_ROWS_BF16 = OwnInt4TileRowsBf16()
OWN_INT4_ROWS_BF16 = OwnInt4RowsBf16()
TORCH_INT4 = TorchInt4()
OWN_INT4_F32 = OwnInt4F32()
OWN_INT4_BF16_TILES = OwnInt4Bf16Tiles()
DENSE_COPY = DenseCopy()
LIBRARY_WIDEN = LibraryWiden()
TORCH_WIDEN = TorchWiden()
DENSE_PANELS = DensePanelsForm()
ONEDNN_PREPACKED = OneDnnPrepacked()
TORCH_DENSE = TorchDense()
OWN_A8 = OwnA8()
TORCH_A8 = TorchA8()

# In order: the first whose can_run has no objection runs the step.
FORMS: tuple[Form, ...] = (
    OWN_INT8_BF16,
    OWN_INT8_F32,
    OWN_INT8_GROUPED_ROWS_AMX,
    OWN_INT8_GROUPED_TILE_ROWS_BF16,
    OWN_INT8_F32_ON_BF16,
    TORCH_INT8,
    OWN_INT4_TILE_ROWS_BF16,
    OWN_INT4_ROWS_BF16,
    TORCH_INT4,
    OWN_INT4_F32,
    OWN_INT4_BF16_TILES,
    DENSE_COPY,
    LIBRARY_WIDEN,
    TORCH_WIDEN,
    DENSE_PANELS,
    ONEDNN_PREPACKED,
    TORCH_DENSE,
    OWN_A8,
    TORCH_A8,
)


@functools.lru_cache(maxsize=4096)
def _walk(m: Matrix, rows: float, dtype: torch.dtype, isa: Isa) -> tuple[Form, tuple[tuple[str, str], ...]]:
    refused = []
    for form in FORMS:
        if m.kind not in form.kinds:
            continue
        reason = form.can_run(m, rows, dtype, isa)
        if reason is None:
            return form, tuple(refused)
        refused.append((form.name, reason))
    raise ValueError(f"no matmul form runs a {m.kind} matrix {list(m.shape)} in {dtype}")  # TORCH_* take all


def choose(m: Matrix, rows: float, dtype: torch.dtype, isa: Isa) -> Form:
    """The form that runs a step of `rows` rows (cached per matrix description and step size)."""
    return _walk(m, rows, dtype, isa)[0]


@functools.cache
def _log_choice(
    kind: str, rows: str, dtype: torch.dtype, form: str, refused: tuple[tuple[str, str], ...]
) -> None:
    why = "; ".join(f"{name}: {reason}" for name, reason in refused) or "first in the table"
    log.debug("matmul %s at %s rows in %s: %s (%s)", kind, rows, dtype, form, why)


def plan(m: Matrix, dtype: torch.dtype, isa: Isa) -> tuple[Form, float, Form]:
    """(the form of few-row steps, the most rows it takes, the form past them): every step size's choice,
    as the packed matrix calls it. Logged at DEBUG once per kind and run of step sizes. Batch-invariant:
    (the one-row form, the rows of its passes, that form again); no dense copy serves it."""
    if isa.batch_invariant:
        one = Matrix(m.kind, m.shape)
        few, refused = _walk(one, 1, dtype, isa)
        passes = few.invariant_rows(one, isa)
        _log_choice(m.kind, f"all, in passes of {passes}", dtype, few.name, refused)
        return few, passes, few
    few, refused = _walk(m, 1, dtype, isa)
    most = few.max_rows(m, dtype, isa)
    _log_choice(m.kind, f"1..{most}", dtype, few.name, refused)
    if most == math.inf:
        return few, most, few
    many, refused = _walk(m, most + 1, dtype, isa)
    _log_choice(m.kind, f"{most + 1}..", dtype, many.name, refused)
    return few, most, many


def copy_pays(m: Matrix, dtype: torch.dtype, isa: Isa) -> bool:
    """Whether `auto` should keep a dense copy of a quantized matrix for steps of many rows: where the form
    that would run them without one is slower than the copy's (Form.copy_pays)."""
    if isa.batch_invariant:
        return False  # a copy's rounding differs from the kernel's, so the step's rows would pick a model
    return choose(Matrix(m.kind, m.shape), math.inf, dtype, isa).copy_pays(isa)
