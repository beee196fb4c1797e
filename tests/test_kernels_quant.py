"""The C++ weight-only int8 / int4 products (kernels/cpu/csrc/matmul*.cpp) in every build variant this CPU
runs, against float64 dense matmuls on the dequantized weights."""

from __future__ import annotations

import platform

import pytest
import torch

from specserve.models import quant

# (out, in): SmolLM2's four layer shapes, and small ones with an int8 input width that is not a multiple of
# the kernel's 32-wide steps (the tail loop) and a single group
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (48, 64), (16, 32)]
INT8_ODD_WIDTHS = [(40, 72), (8, 13), (20, 64)]
# 1..8 rows: the few-row kernels; more: each panel of outputs widened into cache for the dense product's
# register blocks (a block of 6 and a tail; several chunks of rows at 300), where outputs come in whole 8s
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 37, 300]


def _variant(monkeypatch, isa: str):
    from specserve.kernels import cpu

    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    if isa not in cpu.build.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    lib = cpu.build.build_variant(isa)
    monkeypatch.setattr(cpu.build, "_lib", lib)
    monkeypatch.setattr(cpu.build, "_paths", int(lib.specserve_paths()))
    return cpu


def _assert_fp32_rounding(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """Within what float32 accumulation over k terms allows, relative to the terms' magnitude."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all()
    bound = 8 * k**0.5 * torch.finfo(torch.float32).eps * want.abs().max().clamp(min=1.0)
    assert (got.double() - want).abs().max() <= bound


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_variants_report_the_quantized_path(monkeypatch, isa) -> None:
    cpu = _variant(monkeypatch, isa)
    if isa == "portable":
        assert not cpu.build.quant_fast()
    elif platform.machine() in ("x86_64", "AMD64"):
        # available_isas() lists avx2 only where the CPU has AVX2 + FMA, which -march=native then compiles
        assert cpu.build.quant_fast() == ("avx2" in cpu.build.available_isas())


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_matmul_equals_dense_on_the_dequantized_weights(monkeypatch, isa, rows) -> None:
    cpu = _variant(monkeypatch, isa)
    for i, (n, k) in enumerate(SHAPES + INT8_ODD_WIDTHS):
        torch.manual_seed(100 * rows + i)
        w = quant.quantize_int8(torch.randn(n, k))
        x = torch.randn(rows, k)
        want = x.double() @ quant.dequantize(w).double().t()
        _assert_fp32_rounding(cpu.matmul.int8_matmul(x, w.codes, w.scales), want, k)
        # rows read through a stride (a view of wider activations)
        wide = torch.randn(rows, k + 7)
        wide[:, :k] = x
        _assert_fp32_rounding(cpu.matmul.int8_matmul(wide[:, :k], w.codes, w.scales), want, k)


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 16])
def test_grouped_int8_matmul_equals_dense_on_the_dequantized_weights(monkeypatch, isa, rows) -> None:
    """The LM head's form: a scale per group of 32 inputs (GGUF's Q8_0)."""
    cpu = _variant(monkeypatch, isa)
    for i, (n, k) in enumerate([*SHAPES, (1000, 576)]):
        torch.manual_seed(100 * rows + i)
        w = quant.quantize_int8_grouped(torch.randn(n, k) * torch.rand(n, 1))
        assert w.scales.shape == (n, k // quant.GROUP)
        x = torch.randn(rows, k)
        want = x.double() @ quant.dequantize(w).double().t()
        _assert_fp32_rounding(cpu.matmul.int8_matmul(x, w.codes, w.scales), want, k)


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize("rows", ROWS)
def test_int4_matmul_equals_dense_on_the_dequantized_weights(monkeypatch, isa, rows) -> None:
    cpu = _variant(monkeypatch, isa)
    for i, (n, k) in enumerate(SHAPES):
        torch.manual_seed(100 * rows + i)
        w = quant.quantize_int4(torch.randn(n, k) + torch.rand(n, 1))  # zeros away from 0
        assert isinstance(w, quant.Int4Weight)
        nibbles = cpu.matmul.pack_int4(w.codes)
        assert nibbles.shape == (n, k // 2) and torch.equal(cpu.matmul.unpack_int4(nibbles), w.codes)
        offsets = (w.zeros - 8.0 * w.scales).contiguous()
        x = torch.randn(rows, k)
        want = x.double() @ quant.dequantize(w).double().t()
        _assert_fp32_rounding(cpu.matmul.int4_matmul(x, nibbles, w.scales.contiguous(), offsets), want, k)


@pytest.mark.parametrize("isa", ["native", "portable"])
def test_widening_gives_the_dequantized_matrix(monkeypatch, isa) -> None:
    cpu = _variant(monkeypatch, isa)
    torch.manual_seed(3)
    for n, k in SHAPES:
        w8 = quant.quantize_int8(torch.randn(n, k))
        assert torch.equal(
            cpu.matmul.int8_widen(w8.codes, w8.scales), quant.dequantize(w8)
        )  # one product each
        w4 = quant.quantize_int4(torch.randn(n, k))
        offsets = (w4.zeros - 8.0 * w4.scales).contiguous()
        got = cpu.matmul.int4_widen(cpu.matmul.pack_int4(w4.codes), w4.scales.contiguous(), offsets)
        dense = quant.dequantize(w4)
        # code * scale + offset against (code - 8) * scale + zero: a rounding or two of the group's range
        assert (got - dense).abs().max() <= 4 * torch.finfo(torch.float32).eps * dense.abs().max()


def test_no_rows_give_an_empty_product_and_bad_arguments_are_refused(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    w4 = quant.quantize_int4(torch.randn(16, 64))
    assert cpu.matmul.int4_matmul(
        torch.randn(0, 64), cpu.matmul.pack_int4(w4.codes), w4.scales, w4.zeros
    ).shape == (0, 16)
    w = quant.quantize_int8(torch.randn(16, 64))
    with pytest.raises(ValueError, match="float32"):
        cpu.matmul.int8_matmul(torch.randn(1, 64, dtype=torch.bfloat16), w.codes, w.scales)
    with pytest.raises(ValueError, match="int8"):
        cpu.matmul.int8_matmul(torch.randn(1, 32), w.codes, w.scales)
    w4 = quant.quantize_int4(torch.randn(16, 64))
    nibbles = cpu.matmul.pack_int4(w4.codes)
    with pytest.raises(ValueError, match=r"activations \[rows, 64\]"):
        cpu.matmul.int4_matmul(torch.randn(1, 96), nibbles, w4.scales, w4.zeros)


def _assert_bf16_product(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    """got is x @ weights^T (float64 weights, exact in bf16 products) summed in float32 and rounded to bf16
    once: within half a bf16 step of the exact value, plus the float32 sum's own error."""
    k = x.shape[1]
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], weights.shape[0])
    exact = x.double() @ weights.t()
    terms = x.double().abs() @ weights.abs().t()
    bound = exact.abs() * 2.0**-8 + terms * k * torch.finfo(torch.float32).eps
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_only_avx512_bf16_builds_report_the_bf16_int8_product(monkeypatch, isa) -> None:
    cpu = _variant(monkeypatch, isa)
    bf16 = isa == "native" and torch.cpu._is_avx512_bf16_supported()
    assert cpu.build.quant_bf16_fast() == bf16
    if not bf16:  # a build without it refuses the call instead of computing anything
        tiles = cpu.matmul.int8_tiles(torch.zeros(16, 32, dtype=torch.int8))
        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="code 2"):
            cpu.matmul.int8_matmul_bf16(x, tiles, torch.ones(16))
        with pytest.raises(ValueError, match="code 2"):
            cpu.matmul.panel_matmul(x, cpu.matmul.bf16_panels(torch.zeros(16, 32, dtype=torch.bfloat16)))


# rows: a single row block (widened in registers), 12 exactly, a block and a tail, several chunks of rows
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 37, 300])
def test_bf16_int8_matmul_is_the_exact_product_rounded_once(monkeypatch, rows) -> None:
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int8 product needs AVX512-BF16")
    # SmolLM2's shapes, an odd number of 16-output tiles (a last panel of one), the smallest matrix
    for i, (n, k) in enumerate([(960, 576), (576, 1536), (48, 64), (16, 2)]):
        torch.manual_seed(10 * rows + i)
        w = quant.quantize_int8(torch.randn(n, k))
        scales = w.scales.to(torch.bfloat16).float()  # the values PackedInt8 passes
        wide = torch.randn(rows, k + 8).to(torch.bfloat16)  # a row stride past the width
        x = wide[:, :k]
        got = cpu.matmul.int8_matmul_bf16(x, cpu.matmul.int8_tiles(w.codes), scales)
        _assert_bf16_product(got, x, w.codes.double() * scales.double()[:, None])


def test_bf16_int8_matmul_refuses_what_it_cannot_take(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    codes = quant.quantize_int8(torch.randn(32, 64)).codes
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.matmul.int8_tiles(codes[:24])
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int8 product needs AVX512-BF16")
    tiles = cpu.matmul.int8_tiles(codes)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert cpu.matmul.int8_matmul_bf16(x[:0], tiles, torch.ones(32)).shape == (0, 32)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        cpu.matmul.int8_matmul_bf16(x.float(), tiles, torch.ones(32))
    with pytest.raises(ValueError, match="float32 scales"):
        cpu.matmul.int8_matmul_bf16(x, tiles, torch.ones(32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"activations \[rows, 64\]"):
        cpu.matmul.int8_matmul_bf16(torch.randn(3, 32).to(torch.bfloat16), tiles, torch.ones(32))


@pytest.mark.parametrize("rows", [1, 9, 12, 13, 37, 300])
def test_bf16_int4_matmul_is_the_product_with_the_weights_in_bf16(monkeypatch, rows) -> None:
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int4 product needs AVX512-BF16")
    for i, (n, k) in enumerate([(960, 576), (576, 1536), (48, 64), (16, 32)]):
        torch.manual_seed(10 * rows + i)
        w = quant.quantize_int4(torch.randn(n, k))
        tiles, scales, zeros = cpu.matmul.int4_tiles(w.codes, w.scales, w.zeros)
        wide = torch.randn(rows, k + 8).to(torch.bfloat16)  # a row stride past the width
        x = wide[:, :k]
        got = cpu.matmul.int4_matmul_bf16(x, tiles, scales, zeros)
        # the weights as the dense bf16 form holds them, the rounding of each step too
        _assert_bf16_product(got, x, quant.dequantize(w).to(torch.bfloat16).double())


def test_bf16_int4_matmul_refuses_what_it_cannot_take(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    w = quant.quantize_int4(torch.randn(32, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.matmul.int4_tiles(w.codes[:24], w.scales[:24], w.zeros[:24])
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int4 product needs AVX512-BF16")
    tiles, scales, zeros = cpu.matmul.int4_tiles(w.codes, w.scales, w.zeros)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert cpu.matmul.int4_matmul_bf16(x[:0], tiles, scales, zeros).shape == (0, 32)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        cpu.matmul.int4_matmul_bf16(x.float(), tiles, scales, zeros)
    with pytest.raises(ValueError, match="scales and zeros"):
        cpu.matmul.int4_matmul_bf16(x, tiles, w.scales, zeros)
    with pytest.raises(ValueError, match=r"activations \[rows, 64\]"):
        cpu.matmul.int4_matmul_bf16(torch.randn(3, 32).to(torch.bfloat16), tiles, scales, zeros)


# 1..8: q4_bf16_row's rows; past them AMX tiles (one B tile to 16 rows, two to 32, passes of up to 32 past
# that) or passes of 8
@pytest.mark.parametrize("rows", [*range(1, 18), 24, 31, 32, 33, 48, 64])
def test_bf16_int4_rows_is_the_product_of_the_blocks_summed_in_float32(monkeypatch, rows) -> None:
    """Few bf16 rows on the int4 matrix as float32 holds it (nibbles, float32 scales and offsets). q4_bf16_row
    takes each code as 1 + code / 16 (exact in bf16) and its group's x sum off again, so the float32 error
    bound counts those larger terms: |x| (|scale| (16 + code) + |offset - 16 scale|) per weight. The AMX
    tiles (2..32 rows where they run) take each weight as code * scale + offset in float32 rounded to bf16,
    the values a bf16 model holds, and sum those products in float32."""
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int4 product needs AVX512-BF16")
    on_tiles = cpu.build.int4_rows_amx() and rows > cpu.matmul.INT4_ROWS_BF16_BELOW_AMX
    # SmolLM2's shapes, an odd number of groups (7: the last one alone), a single group
    for i, (n, k) in enumerate([(960, 576), (576, 1536), (48, 224), (16, 32), (48, 64)]):
        torch.manual_seed(10 * rows + i)
        w = quant.quantize_int4(torch.randn(n, k) + torch.rand(n, 1))  # zeros away from 0
        scales, offsets = w.scales.contiguous(), (w.zeros - 8.0 * w.scales).contiguous()
        wide = torch.randn(rows, k + 8).to(torch.bfloat16)  # a row stride past the width
        x = wide[:, :k]
        got = cpu.matmul.bind_int4_rows_bf16(cpu.matmul.pack_int4(w.codes), scales, offsets)(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        group = torch.arange(k) // quant.GROUP
        s, o = scales.double()[:, group], offsets.double()[:, group]
        if on_tiles:  # one rounding to float32 (the FMA), one to bf16
            weights = (w.codes.double() * s + o).float().to(torch.bfloat16).double()
            exact = x.double() @ weights.t()
            terms = x.double().abs() @ weights.abs().t()
        else:
            exact = x.double() @ (w.codes.double() * s + o).t()
            terms = x.double().abs() @ (s.abs() * (16 + w.codes.double()) + (o - 16 * s).abs()).t()
        bound = exact.abs() * 2.0**-8 + terms * (k + 2) * torch.finfo(torch.float32).eps
        assert ((got.double() - exact).abs() <= bound).all(), (n, k)


def test_bf16_int4_rows_sums_a_row_alike_within_each_form(monkeypatch) -> None:
    """What batch-invariant plans rely on (linear.OwnInt4RowsBf16.invariant_rows): a row's result does not
    depend on the rows beside it within q4_bf16_row's 1..8 rows, nor within the AMX tiles' 2..32, and calls
    of up to INT4_ROWS_BF16_BELOW_AMX rows sum a row as a one-row call does where the tiles run."""
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int4 product needs AVX512-BF16")
    torch.manual_seed(3)
    n, k = 96, 224  # 6 tiles of 16 outputs, 7 groups (the last one alone)
    w = quant.quantize_int4(torch.randn(n, k) + torch.rand(n, 1))
    offsets = (w.zeros - 8.0 * w.scales).contiguous()
    product = cpu.matmul.bind_int4_rows_bf16(cpu.matmul.pack_int4(w.codes), w.scales, offsets)
    x = torch.randn(cpu.matmul.INT4_ROWS_BF16_MAX, k).to(torch.bfloat16)
    one = product(x[:1])
    amx = cpu.build.int4_rows_amx()
    below = cpu.matmul.INT4_ROWS_BF16_BELOW_AMX if amx else cpu.matmul.INT4_ROWS_BF16_AVX512
    for rows in range(1, below + 1):
        assert torch.equal(product(x[:rows])[:1], one), rows
    if amx:
        first = below + 1  # the fewest rows on the tiles
        tiles = product(x[:first])
        for rows in range(first, cpu.matmul.INT4_ROWS_BF16_MAX + 1):
            assert torch.equal(product(x[:rows])[:first], tiles), rows
        # the second B tile's rows as the first tile's
        assert torch.equal(product(x[16:19]), product(x[:19])[16:])


def test_bf16_int4_rows_refuses_what_it_cannot_take(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    w = quant.quantize_int4(torch.randn(32, 64))
    offsets = (w.zeros - 8.0 * w.scales).contiguous()
    product = cpu.matmul.bind_int4_rows_bf16(cpu.matmul.pack_int4(w.codes), w.scales, offsets)
    x = torch.randn(cpu.matmul.INT4_ROWS_BF16_MAX + 1, 64).to(torch.bfloat16)
    if not cpu.build.quant_bf16_fast():  # a build without AVX512-BF16 refuses the call instead of computing
        with pytest.raises(ValueError, match="code 2"):
            product(x[:1])
        return
    assert product(x[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="code 1"):  # past the few-row forms
        product(x)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        product(x[:1].float())
    with pytest.raises(ValueError, match="float32 scales"):
        cpu.matmul.bind_int4_rows_bf16(cpu.matmul.pack_int4(w.codes), w.scales.bfloat16(), w.zeros)


def _tile_rows(n: int, k: int, seed: int):
    """A random int4 matrix in int4_tiles' layout with offsets in its zeros' place, its float64 weights, and
    the magnitudes of their terms, |scale| code + |offset|."""
    from specserve.kernels import cpu

    torch.manual_seed(seed)
    w = quant.quantize_int4(torch.randn(n, k) + torch.rand(n, 1))  # zeros away from 0
    offsets = (w.zeros - 8.0 * w.scales).contiguous()
    tiles = cpu.matmul.int4_tiles(w.codes, w.scales, offsets)
    group = torch.arange(k) // quant.GROUP
    s, o = w.scales.double()[:, group], offsets.double()[:, group]
    return tiles, w.codes.double() * s + o, w.codes.double() * s.abs() + o.abs()


# 1..8 rows: one pass of the tile kernel's registers; 9..32 passes of 8 and a tail
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32])
def test_bf16_int4_tile_rows_is_the_product_of_the_exact_codes_summed_in_float32(monkeypatch, rows) -> None:
    """Few bf16 rows on the int4 tiles: each code exact in bf16, its products with x exact and summed in
    float32 a group at a time, scale and offset applied in float32, rounded to bf16 once: within bf16's
    rounding of the float64 product plus float32's of the terms |x| (|scale| code + |offset|)."""
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int4 tile product needs AVX512-BF16")
    # SmolLM2's shapes, an odd number of groups (7), a single tile and group, three tiles of two groups
    for i, (n, k) in enumerate([(960, 576), (576, 1536), (48, 224), (16, 32), (48, 64)]):
        (tiles, scales, offsets), weights, magnitudes = _tile_rows(n, k, 10 * rows + i)
        wide = torch.randn(rows, k + 8).to(torch.bfloat16)  # a row stride past the width
        x = wide[:, :k]
        got = cpu.matmul.bind_int4_tile_rows_bf16(tiles, scales, offsets)(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        exact = x.double() @ weights.t()
        terms = x.double().abs() @ magnitudes.t()
        bound = exact.abs() * 2.0**-8 + terms * (k + 2) * torch.finfo(torch.float32).eps
        assert ((got.double() - exact).abs() <= bound).all(), (n, k)


def test_bf16_int4_tile_rows_sums_every_row_as_a_one_row_call(monkeypatch) -> None:
    """What speculation's exactness and batch-invariant plans rely on (linear.OwnInt4TileRowsBf16): a row's
    result does not depend on the rows beside it, in any call of 1..TILE_ROWS_BF16_MAX rows."""
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 int4 tile product needs AVX512-BF16")
    (tiles, scales, offsets), _, _ = _tile_rows(96, 224, 3)
    product = cpu.matmul.bind_int4_tile_rows_bf16(tiles, scales, offsets)
    most = cpu.matmul.TILE_ROWS_BF16_MAX
    x = torch.randn(most, 224).to(torch.bfloat16)
    alone = torch.cat([product(x[r : r + 1]) for r in range(most)])
    for rows in range(1, most + 1):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows
    assert torch.equal(product(x[5:14]), alone[5:14])


@pytest.mark.parametrize("isa", ["native", "avx2", "generic"])
def test_bf16_int4_tile_rows_refuses_what_it_cannot_take(monkeypatch, isa) -> None:
    cpu = _variant(monkeypatch, isa)
    (tiles, scales, offsets), _, _ = _tile_rows(32, 64, 0)
    product = cpu.matmul.bind_int4_tile_rows_bf16(tiles, scales, offsets)
    x = torch.randn(cpu.matmul.TILE_ROWS_BF16_MAX + 1, 64).to(torch.bfloat16)
    if not cpu.build.quant_bf16_fast():  # a build without AVX512-BF16 refuses the call instead of computing
        with pytest.raises(ValueError, match="code 2"):
            product(x[:1])
        return
    assert product(x[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="code 1"):  # past the few-row form
        product(x)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        product(x[:1].float())
    with pytest.raises(ValueError, match="float32 scales and offsets"):
        cpu.matmul.bind_int4_tile_rows_bf16(tiles, scales.bfloat16(), offsets)
    with pytest.raises(ValueError, match="as int4_tiles gives them"):
        cpu.matmul.bind_int4_tile_rows_bf16(tiles.view(-1), scales, offsets)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16, 17, 32])
def test_bf16_q8_0_tile_rows_is_the_product_of_the_exact_codes_summed_in_float32(monkeypatch, rows) -> None:
    """Few bf16 rows on a Q8_0 matrix in 16-output tiles, float32 out: each code exact in bf16, its products
    with x exact and summed in float32 a group at a time, the group's scale applied in float32; and every row
    as a one-row call gives it."""
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 Q8_0 tile product needs AVX512-BF16")
    for i, (n, k) in enumerate([(16, 32), (48, 64), (960, 576), (48, 224)]):
        codes, scales = _q8_0(n, k, 10 * rows + i)
        product = cpu.matmul.bind_int8_grouped_tile_rows_bf16(*cpu.matmul.int8_grouped_tiles(codes, scales))
        wide = torch.randn(rows, k + 8).to(torch.bfloat16)  # a row stride past the width
        x = wide[:, :k]
        got = product(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        weights = codes.double() * scales.double().repeat_interleave(quant.GROUP, dim=1)
        exact = x.double() @ weights.t()
        terms = x.double().abs() @ weights.abs().t()
        bound = terms * (k + 2) * torch.finfo(torch.float32).eps
        assert ((got.double() - exact).abs() <= bound).all(), (n, k)
        alone = torch.cat([product(x[r : r + 1]) for r in range(rows)])
        assert torch.equal(got, alone), (n, k)


@pytest.mark.parametrize("isa", ["native", "avx2", "generic"])
def test_bf16_q8_0_tile_rows_refuses_what_it_cannot_take(monkeypatch, isa) -> None:
    cpu = _variant(monkeypatch, isa)
    codes, scales = _q8_0(32, 64, 0)
    tiles, tile_scales = cpu.matmul.int8_grouped_tiles(codes, scales)
    product = cpu.matmul.bind_int8_grouped_tile_rows_bf16(tiles, tile_scales)
    x = torch.randn(cpu.matmul.TILE_ROWS_BF16_MAX + 1, 64).to(torch.bfloat16)
    if not cpu.build.quant_bf16_fast():
        with pytest.raises(ValueError, match="code 2"):
            product(x[:1])
        return
    assert product(x[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="code 1"):
        product(x)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        product(x[:1].float())
    with pytest.raises(ValueError, match="float32 scales"):
        cpu.matmul.bind_int8_grouped_tile_rows_bf16(tiles, tile_scales.bfloat16())
    with pytest.raises(ValueError, match="as int8_grouped_tiles gives them"):
        cpu.matmul.bind_int8_grouped_tile_rows_bf16(codes, tile_scales)
    with pytest.raises(ValueError, match="int8_grouped_tiles takes"):
        cpu.matmul.int8_grouped_tiles(codes, scales[:, :1])


def _grouped_rows_amx(monkeypatch):
    cpu = _variant(monkeypatch, "native")
    if not cpu.build.int8_grouped_rows_amx():
        pytest.skip("the Q8_0 rows product needs AMX tiles (build and kernel)")
    return cpu


def _q8_0(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 blocks: int8 codes [n, k] over the whole range, float32 scales [n, k / 32] of a head's
    magnitude, a few outputs larger than the rest."""
    torch.manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = (torch.rand(n, k // quant.GROUP) * 0.02 * (1 + 9 * (torch.rand(n, 1) > 0.9))).contiguous()
    return codes, scales


# 1: q8g_rows on the row widened to float32; 2..32: AMX tiles, one B tile to 16 rows, two past them
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 24, 31, 32])
def test_q8_0_rows_bf16_is_the_product_of_the_weights_rounded_to_bf16(monkeypatch, rows) -> None:
    """Few bf16 rows on a Q8_0 matrix, float32 out. On the AMX tiles each weight is bf16(code * scale), the
    dense bf16 head's value, and the products of those sum in float32: within float32's rounding of k terms
    of the float64 product of the same weights. One row is the float32 product's (the weights exact)."""
    cpu = _grouped_rows_amx(monkeypatch)
    # a single tile and group, three tiles and two groups, SmolLM2's head width (18 groups), 7 groups
    for i, (n, k) in enumerate([(16, 32), (48, 64), (960, 576), (48, 224), (16, 576)]):
        codes, scales = _q8_0(n, k, 10 * rows + i)
        wide = torch.randn(rows, k + 8).to(torch.bfloat16)  # a row stride past the width
        x = wide[:, :k]
        got = cpu.matmul.bind_int8_grouped_rows_bf16(codes, scales)(x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        weights = codes.float() * scales.repeat_interleave(quant.GROUP, dim=1)
        if rows > cpu.matmul.INT8_GROUPED_ROWS_BF16_BELOW_AMX:
            weights = weights.to(torch.bfloat16)
        exact = x.double() @ weights.double().t()
        terms = x.double().abs() @ weights.double().abs().t()
        assert ((got.double() - exact).abs() <= terms * k * torch.finfo(torch.float32).eps).all(), (n, k)


def test_q8_0_rows_bf16_sums_a_row_alike_within_each_form(monkeypatch) -> None:
    """What batch-invariant plans rely on (linear.OwnInt8GroupedRowsAmx.invariant_rows): calls of up to
    INT8_GROUPED_ROWS_BF16_BELOW_AMX rows sum a row as the float32 product's one-row call does, and within
    the AMX tiles' rows (up to 32) a row's result does not depend on the rows beside it (nor on the B tile
    it falls in)."""
    cpu = _grouped_rows_amx(monkeypatch)
    n, k = 96, 224  # 6 tiles of 16 outputs, 7 groups (the last one alone)
    codes, scales = _q8_0(n, k, 3)
    product = cpu.matmul.bind_int8_grouped_rows_bf16(codes, scales)
    x = torch.randn(cpu.matmul.INT8_GROUPED_ROWS_BF16_MAX, k).to(torch.bfloat16)
    one = cpu.matmul.bind_int8(codes, scales)(x[:1].float())
    for rows in range(1, cpu.matmul.INT8_GROUPED_ROWS_BF16_BELOW_AMX + 1):
        assert torch.equal(product(x[:rows])[:1], one), rows
    first = cpu.matmul.INT8_GROUPED_ROWS_BF16_BELOW_AMX + 1  # the tiles' fewest rows
    tiles = product(x[:first])
    for rows in range(first, cpu.matmul.INT8_GROUPED_ROWS_BF16_MAX + 1):
        assert torch.equal(product(x[:rows])[:first], tiles), rows
    assert torch.equal(product(x[16:19]), product(x[:19])[16:])
    assert torch.equal(product(x[13:16]), product(x)[13:16])


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_builds_without_amx_tiles_refuse_the_q8_0_rows_product(monkeypatch, isa) -> None:
    """No AVX-512 (so no AMX tiles): the path bit is clear, and the call is refused (code 2) rather than run
    some other way, so the form table's refusal (OwnInt8GroupedRowsAmx) is the only route past it."""
    cpu = _variant(monkeypatch, isa)
    assert not cpu.build.int8_grouped_rows_amx()
    codes, scales = _q8_0(32, 64, 7)
    product = cpu.matmul.bind_int8_grouped_rows_bf16(codes, scales)
    for rows in (1, 5):
        with pytest.raises(ValueError, match="code 2"):
            product(torch.randn(rows, 64).to(torch.bfloat16))


def test_q8_0_rows_bf16_refuses_what_it_cannot_take(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    codes, scales = _q8_0(32, 64, 4)
    product = cpu.matmul.bind_int8_grouped_rows_bf16(codes, scales)
    x = torch.randn(cpu.matmul.INT8_GROUPED_ROWS_BF16_MAX + 1, 64).to(torch.bfloat16)
    if not cpu.build.int8_grouped_rows_amx():  # a build or kernel without AMX tiles refuses every call
        with pytest.raises(ValueError, match="code 2"):
            product(x[:3])
        return
    assert product(x[:0]).shape == (0, 32)
    with pytest.raises(ValueError, match="code 1"):  # past a verify step's rows
        product(x)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        product(x[:3].float())
    with pytest.raises(ValueError, match="outputs \\(40\\) must be a multiple of 16"):  # no whole tiles
        cpu.matmul.bind_int8_grouped_rows_bf16(*_q8_0(40, 64, 5))
    with pytest.raises(ValueError, match="inputs \\(48\\)"):
        cpu.matmul.bind_int8_grouped_rows_bf16(torch.zeros(32, 48, dtype=torch.int8), torch.ones(32, 1))
    with pytest.raises(ValueError, match="scales must be contiguous torch.float32"):
        cpu.matmul.bind_int8_grouped_rows_bf16(codes, scales.bfloat16())
    with pytest.raises(ValueError, match="codes must be contiguous torch.int8"):
        cpu.matmul.bind_int8_grouped_rows_bf16(codes.t(), scales)
    with pytest.raises(ValueError, match=r"scales must be \[32, 2\]"):
        cpu.matmul.bind_int8_grouped_rows_bf16(codes, scales[:, :1].contiguous())
    # the library's own checks, past the binding's: n not in whole tiles
    out = torch.empty(3, 40)
    x40 = x[:3].contiguous()
    codes40, scales40 = _q8_0(40, 64, 6)
    rc = cpu.build._lib.specserve_int8_grouped_rows_bf16(
        x40.data_ptr(), 64, 3, codes40.data_ptr(), scales40.data_ptr(), 40, 64, out.data_ptr(), 40, 1
    )
    assert rc == 1


def _panels_variant(monkeypatch, isa: str, dtype: torch.dtype):
    cpu = _variant(monkeypatch, isa)
    built = cpu.build.quant_fast() if dtype == torch.float32 else cpu.build.quant_bf16_fast()
    if not built:
        pytest.skip(f"the {isa} build has no dense {dtype} product")
    return cpu


# rows: one row, a register block and a tail, several chunks of rows (227 / 444 rows a chunk at k = 576)
@pytest.mark.parametrize("rows", [1, 6, 13, 37, 1000])
@pytest.mark.parametrize(
    ("isa", "dtype"), [("native", "float32"), ("avx2", "float32"), ("native", "bfloat16")]
)
def test_panel_matmul_is_the_dense_product(monkeypatch, isa, dtype, rows) -> None:
    dtype = getattr(torch, dtype)
    cpu = _panels_variant(monkeypatch, isa, dtype)
    make = cpu.matmul.f32_panels if dtype == torch.float32 else cpu.matmul.bf16_panels
    # SmolLM2's shapes, an odd number of tiles (a last panel of one), the smallest matrix
    for i, (n, k) in enumerate([(960, 576), (576, 1536), (48, 64), (16, 2)]):
        torch.manual_seed(10 * rows + i)
        w = torch.randn(n, k).to(dtype)
        panels = make(w)
        assert panels.shape == (n, k)
        assert torch.equal(panels.flatten().sort().values, w.flatten().sort().values)  # rearranged only
        x = torch.randn(rows, k + 8).to(dtype)[:, :k]  # a row stride past the width
        got = cpu.matmul.panel_matmul(x, panels)
        if dtype == torch.float32:
            _assert_fp32_rounding(got, x.double() @ w.double().t(), k)
        else:
            _assert_bf16_product(got, x, w.double())


def test_panel_matmul_refuses_what_it_cannot_take(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "native")
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu.matmul.bf16_panels(torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu.matmul.f32_panels(torch.zeros(12, 64))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu.matmul.bf16_panels(torch.zeros(32, 64))
    with pytest.raises(ValueError, match="f32_panels or bf16_panels"):
        cpu.matmul.panel_matmul(torch.zeros(3, 64), torch.zeros(32, 64, dtype=torch.float64))
    if not cpu.build.quant_fast():
        pytest.skip("the dense float32 product needs AVX2 + FMA")
    panels = cpu.matmul.f32_panels(torch.randn(32, 64))
    x = torch.randn(3, 64)
    assert cpu.matmul.panel_matmul(x[:0], panels).shape == (0, 32)
    with pytest.raises(ValueError, match="float32 activations"):
        cpu.matmul.panel_matmul(x.to(torch.bfloat16), panels)
    with pytest.raises(ValueError, match=r"activations \[rows, 64\]"):
        cpu.matmul.panel_matmul(torch.randn(3, 32), panels)


def test_a_portable_build_refuses_the_dense_float32_product(monkeypatch) -> None:
    cpu = _variant(monkeypatch, "portable")
    with pytest.raises(ValueError, match="code 2"):
        cpu.matmul.panel_matmul(torch.zeros(1, 32), cpu.matmul.f32_panels(torch.zeros(16, 32)))
