"""The w8a8 / w4a8 integer products (kernels/cpu/csrc/matmul_q8.cpp) in every build variant this CPU runs:
bit for bit the torch spelling of the same arithmetic (kernels/reference_a8.py), and near the float product
of the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_kernels_quant import _variant

from specserve.kernels import reference_a8 as ref

ISAS = ["native", "avx2", "portable"]
DTYPES = [torch.float32, torch.bfloat16]
# 1..4 rows: one pass of a tile; 5..9 and 37: several passes and a remainder (and, with an even count of
# tiles as 576 outputs have, the AVX512-VNNI build's tiles in pairs)
ROWS = [1, 2, 3, 4, 5, 8, 9, 37]
SHAPES = [(16, 32), (48, 96), (576, 576)]


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split())
    return set()


def _activations(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[0, :32] = 0.0  # a block of zeros: scale 0, codes 0
    if rows > 1:
        x[1, 5] = 60.0  # an outlier: the rest of its block rounds to few codes
    return x.to(dtype)


def _w8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return codes, torch.rand(n, generator=g) * 0.02 + 1e-3


def _w4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    return codes, scales, torch.randn(n, k // 32, generator=g) * 0.05


@pytest.mark.parametrize("isa", ISAS)
def test_variants_report_the_integer_path(monkeypatch, isa) -> None:
    cpu = _variant(monkeypatch, isa)
    flags = _cpu_flags()
    if isa == "portable":
        assert not cpu.build.int_dot_fast()
    elif isa == "avx2":
        assert cpu.build.int_dot_fast() and not cpu.build.int_dot_vnni()
    else:
        assert cpu.build.int_dot_fast() == ("avx2" in flags or "avx512bw" in flags)
        assert cpu.build.int_dot_vnni() == ({"avx512_vnni", "avx512bw"} <= flags)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_quantize_as_the_reference(monkeypatch, isa, dtype) -> None:
    cpu = _variant(monkeypatch, isa)
    x = _activations(37, 192, dtype, seed=1)
    # values whose quotient by the block's scale lies on or next to a half (round half to even)
    x[2, 32:64] = torch.arange(32, dtype=torch.float32).to(dtype) * 0.5
    got = cpu.matmul.quantize_q8(x)
    want = ref.quantize_activations(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    codes, scales, sums = got
    assert int(codes.abs().max()) == 127 and torch.equal(scales[0, 0], torch.tensor(0.0))
    assert torch.equal(sums, codes.view(37, -1, 32).int().sum(-1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a8_matmul_equals_the_reference(monkeypatch, isa, dtype, rows, shape) -> None:
    cpu = _variant(monkeypatch, isa)
    n, k = shape
    codes, scales = _w8(n, k, seed=rows)
    x = _activations(rows, k, dtype, seed=rows + 7)
    got = cpu.matmul.bind_w8a8(cpu.matmul.w8a8_tiles(codes), scales, dtype)(x)
    want = ref.w8a8_matmul(x, codes, scales)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_w4a8_matmul_equals_the_reference(monkeypatch, isa, dtype, rows, shape) -> None:
    cpu = _variant(monkeypatch, isa)
    n, k = shape
    codes, scales, offsets = _w4(n, k, seed=rows)
    x = _activations(rows, k, dtype, seed=rows + 7)
    tiles = cpu.matmul.w4a8_tiles(codes)
    got = cpu.matmul.bind_w4a8(tiles, cpu.matmul.by_tile(scales), cpu.matmul.by_tile(offsets), dtype)(x)
    want = ref.w4a8_matmul(x, codes, scales, offsets)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("n", [48, 64])
def test_w4a8_with_float16_scales_and_offsets_equals_the_reference(monkeypatch, isa, dtype, rows, n) -> None:
    """A GGUF's Q4_0 / Q4_1 scales and minimums are float16 values: kept as float16 bits (w4a8h), the
    kernel widens them to the very float32 values, subnormal and negative ones too (64 outputs: tiles in
    pairs where a step has the rows for it)."""
    cpu = _variant(monkeypatch, isa)
    k = 96
    codes, scales, offsets = _w4(n, k, seed=rows)
    offsets[0, 0], offsets[1, 1], scales[2, 2] = 3e-7, -2e-5, 0.0  # float16 subnormals and a zero
    scales, offsets = scales.half().float(), offsets.half().float()
    assert cpu.matmul.fits_half(scales) and cpu.matmul.fits_half(offsets)
    x = _activations(rows, k, dtype, seed=rows + 11)
    tiles = cpu.matmul.w4a8_tiles(codes)
    by_tile = cpu.matmul.by_tile
    half = cpu.matmul.bind_w4a8(tiles, by_tile(scales, torch.float16), by_tile(offsets, torch.float16), dtype)
    assert half.name.startswith("w4a8h_matmul")
    want = ref.w4a8_matmul(x, codes, scales, offsets)
    assert torch.equal(half(x), want)
    assert torch.equal(cpu.matmul.bind_w4a8(tiles, by_tile(scales), by_tile(offsets), dtype)(x), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_w8a8_grouped_matmul_equals_the_reference(monkeypatch, isa, rows, shape) -> None:
    """A Q8_0 matrix (int8 codes, a scale per group of 32) on int8 activations, its scales as float32 and as
    float16 bits (a GGUF's): the same values either way, subnormal and zero scales too."""
    cpu = _variant(monkeypatch, isa)
    n, k = shape
    codes, _ = _w8(n, k, seed=rows)
    scales = (torch.rand(n, k // 32, generator=torch.Generator().manual_seed(rows)) * 0.02 + 1e-3).half()
    scales[0, 0], scales[-1, -1] = 3e-7, 0.0
    scales = scales.float()
    x = _activations(rows, k, torch.float32, seed=rows + 7)
    tiles, by_tile = cpu.matmul.w8a8_tiles(codes), cpu.matmul.by_tile
    want = ref.w8a8_grouped_matmul(x, codes, scales)
    for kept in (torch.float32, torch.float16):
        product = cpu.matmul.bind_w8a8_grouped(tiles, by_tile(scales, kept))
        got = product(x)
        assert got.dtype == torch.float32 and torch.equal(got, want), (kept, product.name)


def test_w4a8_scales_and_offsets_share_a_dtype(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    codes, scales, offsets = _w4(16, 32, seed=0)
    tiles, by_tile = cpu.matmul.w4a8_tiles(codes), cpu.matmul.by_tile
    with pytest.raises(ValueError, match="both float32 or both float16"):
        cpu.matmul.bind_w4a8(tiles, by_tile(scales, torch.float16), by_tile(offsets), torch.float32)
    assert not cpu.matmul.fits_half(torch.tensor([0.1]))


def test_the_reference_is_near_the_float_product() -> None:
    """Quantizing activations per 32 inputs costs about 1/254 of each block's largest value per input."""
    n, k = 64, 256
    x = _activations(9, k, torch.float32, seed=3)
    codes, scales = _w8(n, k, seed=3)
    dense8 = codes.double() * scales.double()[:, None]
    c4, s4, o4 = _w4(n, k, seed=4)
    dense4 = (c4.double().view(n, -1, 32) * s4.double()[..., None] + o4.double()[..., None]).view(n, k)
    denseg = (codes.double().view(n, -1, 32) * s4.double()[..., None]).view(n, k)
    for got, w in (
        (ref.w8a8_matmul(x, codes, scales), dense8),
        (ref.w4a8_matmul(x, c4, s4, o4), dense4),
        (ref.w8a8_grouped_matmul(x, codes, s4), denseg),
    ):
        want = x.double() @ w.t()
        # each input's error is at most half a code of its block: |x - d q| <= d / 2
        bound = (x.double().abs().view(9, -1, 32).amax(-1) / 254).repeat_interleave(32, dim=1) @ w.abs().t()
        assert ((got.double() - want).abs() <= bound * 1.001 + 1e-6).all()


def test_bad_arguments_are_refused(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    codes, scales = _w8(48, 96, seed=0)
    with pytest.raises(ValueError, match="-127..127"):
        cpu.matmul.w8a8_tiles(torch.full((16, 32), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.matmul.w8a8_tiles(codes[:40])
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.matmul.w4a8_tiles(torch.zeros(16, 40, dtype=torch.uint8))
    tiles = cpu.matmul.w8a8_tiles(codes)
    with pytest.raises(ValueError, match="scales"):
        cpu.matmul.bind_w8a8(tiles, scales[:8], torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu.matmul.bind_w8a8(tiles, scales, torch.float16)
    product = cpu.matmul.bind_w8a8(tiles, scales, torch.float32)
    with pytest.raises(ValueError, match="activations"):
        product(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="activations"):
        product(torch.zeros(2, 96, dtype=torch.bfloat16))
    assert product(torch.zeros(0, 96)).shape == (0, 48)
    assert torch.equal(product(torch.zeros(3, 96)), torch.zeros(3, 48))
    lib = cpu.build._lib
    out = torch.empty(1, 48)
    # n not in tiles of 16, k not in blocks of 32: the library's own checks
    assert lib.specserve_w8a8_matmul(out.data_ptr(), 96, 1, tiles.data_ptr(), scales.data_ptr(), 40, 96,
                                     out.data_ptr(), 48, 1) == 1  # fmt: skip
    assert lib.specserve_w8a8_matmul(out.data_ptr(), 96, 1, tiles.data_ptr(), scales.data_ptr(), 48, 72,
                                     out.data_ptr(), 48, 1) == 1  # fmt: skip
