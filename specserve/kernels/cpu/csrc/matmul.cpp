// The products' entry points: each picks its ISA form (matmul_f32_avx2.cpp, matmul_bf16_avx512.cpp) or the
// generic loops (matmul_generic.cpp) by the build's SPECSERVE_*_PATH macros, the row count and the shape.
#include "api.h"
#include "common.h"

// 9-15 rows run the few-row kernels twice (8, then the rest): reading the weights twice still beats widening
// them once there. SmolLM2's 30 layers (2-core Zen 4, bench/quant_kernels.py --float32 --passes 5), int8 at
// 9 / 12 / 15 rows: 18.8 / 23.7 / 26.2 ms twice against 28.2 / 32.7 / ~35 widened (dense float32 23.0 /
// 25.5 / 29.2); at 16 rows widening is even or ahead (int8 32.6 twice against ~31, int4 36.0 against 29.5).
constexpr int64_t kWidenFromRows = 16;

// specserve_int4_rows_bf16's most rows, and the fewest it runs on AMX tiles: below them q4_bf16_row, whose
// one- and two-row steps cost little more than reading the codes, and whose one-row sums batch-invariant
// plans keep (cpu.matmul.INT4_ROWS_BF16_BELOW_AMX). The tiles take 32 rows a pass (two C tiles of 16); more
// rows run in passes of about equal rows, each reading the codes again, which pays up to two passes.
constexpr int64_t kInt4RowsMax = 64;
constexpr int64_t kInt4AmxFromRows = 2;
constexpr int64_t kInt4AmxPassRows = 32;

// specserve_int4_tile_rows_bf16's and specserve_int8_grouped_tile_rows_bf16's most rows: past them a
// step's widened panels (or a dense copy) read the weights once for many rows
constexpr int64_t kTileRowsMax = 32;

// specserve_int8_grouped_rows_bf16's most rows (a verify step of 1 + 31 drafts), and the fewest on AMX tiles: below
// them q8g_rows on the row widened to float32, what the float32 head runs at one row (the file's own
// weights at batch-1 decode, as fast there). Two rows on the tiles: 1.99 / 2.49 ms against 2.30 / 2.68 on
// q8g_rows<2> (SmolLM2's 49,152 x 576 head, `python bench/head_rows.py --rows 2,1,2 --other-csrc DIR`,
// loaded 2-core Sapphire Rapids).
constexpr int64_t kInt8GroupedRowsMax = 32;
constexpr int64_t kInt8GroupedAmxFromRows = 2;

// Vectorised where specserve_paths() has bit 4 (AVX2 + FMA builds), generic loops elsewhere.
// out[r, j] for r < rows (vectorised: 1..8 rows, and more where n % 8 == 0 on widened panels), j < n.
extern "C" int specserve_int8_matmul(const float* x, int64_t x_stride, int64_t rows, const int8_t* codes,
                                     const float* scales, int64_t n, int64_t k, float* out,
                                     int64_t out_stride, int num_threads) {
  if (rows < 1 || n < 1 || k < 1) return kBadArguments;
#ifdef SPECSERVE_QUANT_PATH
  const auto few = [&](auto r) {
    q8_rows<decltype(r)::value>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads);
  };
  if (with_rows<8>(rows, few)) return kOk;
  if (rows < kWidenFromRows) {
    specserve_int8_matmul(x, x_stride, 8, codes, scales, n, k, out, out_stride, num_threads);
    return specserve_int8_matmul(x + 8 * x_stride, x_stride, rows - 8, codes, scales, n, k,
                                 out + 8 * out_stride, out_stride, num_threads);
  }
  if (n % 8 == 0) return q8_widened(x, x_stride, rows, codes, scales, n, k, out, out_stride, num_threads), kOk;
#endif
  q8_generic(x, x_stride, rows, codes, scales, n, k, out, out_stride, num_threads);
  return kOk;
}

// The same with a scale per group of 32 inputs: scales [n, k / 32].
extern "C" int specserve_int8_grouped_matmul(const float* x, int64_t x_stride, int64_t rows, const int8_t* codes,
                                             const float* scales, int64_t n, int64_t k, float* out,
                                             int64_t out_stride, int num_threads) {
  if (rows < 1 || n < 1 || k < 32 || k % 32 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_PATH
  const auto few = [&](auto r) {
    q8g_rows<decltype(r)::value>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads);
  };
  if (with_rows<8>(rows, few)) return kOk;
  if (rows < kWidenFromRows) {
    specserve_int8_grouped_matmul(x, x_stride, 8, codes, scales, n, k, out, out_stride, num_threads);
    return specserve_int8_grouped_matmul(x + 8 * x_stride, x_stride, rows - 8, codes, scales, n, k,
                                         out + 8 * out_stride, out_stride, num_threads);
  }
#endif
  q8g_generic(x, x_stride, rows, codes, scales, n, k, out, out_stride, num_threads);
  return kOk;
}

extern "C" int specserve_int4_matmul(const float* x, int64_t x_stride, int64_t rows, const uint8_t* packed,
                                     const float* scales, const float* offsets, int64_t n, int64_t k,
                                     float* out, int64_t out_stride, int num_threads) {
  if (rows < 1 || n < 1 || k < 32 || k % 32 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_PATH
  if (rows > 8 && rows < kWidenFromRows) {
    specserve_int4_matmul(x, x_stride, 8, packed, scales, offsets, n, k, out, out_stride, num_threads);
    return specserve_int4_matmul(x + 8 * x_stride, x_stride, rows - 8, packed, scales, offsets, n, k,
                                 out + 8 * out_stride, out_stride, num_threads);
  }
  if (rows > 8 && n % 8 == 0)
    return q4_widened(x, x_stride, rows, packed, scales, offsets, n, k, out, out_stride, num_threads), kOk;
#endif
  const std::vector<float> gsum = group_sums(x, x_stride, rows, k);
#ifdef SPECSERVE_QUANT_PATH
  const float* gs = gsum.data();
  const auto few = [&](auto r) {
    q4_rows<decltype(r)::value>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads);
  };
  if (with_rows<8>(rows, few)) return kOk;
#endif
  q4_generic(x, x_stride, rows, packed, scales, offsets, n, k, gsum.data(), out, out_stride, num_threads);
  return kOk;
}

// The matrices widened to float32 [n, k] (steps of many rows then run one dense matmul on them):
// int8 code * scale, int4 code * scale + offset, as the products above use them.
extern "C" int specserve_int8_widen(const int8_t* codes, const float* scales, int64_t n, int64_t k, float* out,
                                    int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i) out[j * k + i] = static_cast<float>(codes[j * k + i]) * scales[j];
  return kOk;
}

extern "C" int specserve_int4_widen(const uint8_t* packed, const float* scales, const float* offsets,
                                    int64_t n, int64_t k, float* out, int num_threads) {
  if (k % 32 != 0) return kBadArguments;
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = packed + (j * groups + g) * 16;
      const float s = scales[j * groups + g], o = offsets[j * groups + g];
      float* dst = out + j * k + g * 32;
      for (int i = 0; i < 16; ++i) dst[i] = static_cast<float>(p[i] & 0x0F) * s + o;
      for (int i = 0; i < 16; ++i) dst[16 + i] = static_cast<float>(p[i] >> 4) * s + o;
    }
  return kOk;
}

// x [rows, k] bf16 (row stride xs) times the int4 matrix in 16-output tiles (see above) -> out [rows, n]
// bf16 (row stride os). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int4_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                          const float* scales, const float* zeros, int64_t n, int64_t k,
                                          uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || n < 16 || n % 16 != 0 || k < 32 || k % 32 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_BF16_PATH
  q4_bf16(x, xs, rows, tiles, scales, zeros, n, k, out, os, num_threads);
  return kOk;
#else
  (void)x, (void)xs, (void)tiles, (void)scales, (void)zeros, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] bf16 (row stride xs), 1..kTileRowsMax rows, times the int4 matrix in int4_tiles' layout
// with offsets in place of zeros (w = code * scale + offset) -> out [rows, n] bf16 (row stride os): codes
// exact in bf16 products on vdpbf16ps, sums in float32, rounded once, each row summed alike for any rows
// (tile_rows). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int4_tile_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                             const float* scales, const float* offsets, int64_t n, int64_t k,
                                             uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || rows > kTileRowsMax || n < 16 || n % 16 != 0 || k < 32 || k % 32 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_BF16_PATH
  tile_rows<true>(x, xs, rows, tiles, scales, offsets, n, k, out, os, num_threads);
  return kOk;
#else
  (void)x, (void)xs, (void)tiles, (void)scales, (void)offsets, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] bf16 (row stride xs), 1..kTileRowsMax rows, times a Q8_0 matrix in int8_tiles' layout with
// its scales [n / 16, k / 32, 16] float32 -> out [rows, n] float32 (row stride os): codes exact in bf16
// products on vdpbf16ps, sums and scales in float32, each row summed alike for any rows (tile_rows): a
// bf16 model's head at decode and verify steps. Returns 2 where the build has no AVX512-BF16.
extern "C" int specserve_int8_grouped_tile_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows,
                                                     const int8_t* tiles, const float* scales, int64_t n,
                                                     int64_t k, float* out, int64_t os, int num_threads) {
  if (rows < 1 || rows > kTileRowsMax || n < 16 || n % 16 != 0 || k < 32 || k % 32 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_BF16_PATH
  tile_rows<false>(x, xs, rows, reinterpret_cast<const uint8_t*>(tiles), scales, nullptr, n, k, out, os,
                   num_threads);
  return kOk;
#else
  (void)x, (void)xs, (void)tiles, (void)scales, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] bf16 (row stride xs), 1..kInt4RowsMax rows, times the int4 matrix of specserve_int4_matmul
// (pack_int4's nibbles, float32 scales and offsets) -> out [rows, n] bf16 (row stride os), sums in float32,
// rounded once: products of the codes exact in q4_bf16_row, of the weights rounded to bf16 on the AMX tiles.
// For the few-row steps of a bf16 model whose int4 matrices keep their blocks (decode, verify steps): the
// library's own, so a layer chain runs them, where torch's int4 kernel had to be called from Python. One row
// runs q4_bf16_row; 2 or more the AMX tiles (passes of up to 32 rows) where the build and the kernel allow
// them (specserve_paths() bit 64, outputs in whole tiles of 16), else q4_bf16_row in passes of up to 8 rows.
// Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int4_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* packed,
                                        const float* scales, const float* offsets, int64_t n, int64_t k,
                                        uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || rows > kInt4RowsMax || n < 1 || k < 32 || k % 32 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_BF16_PATH
#ifdef SPECSERVE_INT4_AMX_PATH
  if (rows >= kInt4AmxFromRows && n % 16 == 0 && amx_permitted()) {
    const int64_t passes = (rows + kInt4AmxPassRows - 1) / kInt4AmxPassRows;
    for (int64_t p = 0, r0 = 0; p < passes; ++p) {
      const int64_t r1 = rows * (p + 1) / passes;
      q4_bf16_amx(x + r0 * xs, xs, r1 - r0, packed, scales, offsets, n, k, out + r0 * os, os, num_threads);
      r0 = r1;
    }
    return kOk;
  }
#endif
  if (rows > 8) {
    specserve_int4_rows_bf16(x, xs, 8, packed, scales, offsets, n, k, out, os, num_threads);
    return specserve_int4_rows_bf16(x + 8 * xs, xs, rows - 8, packed, scales, offsets, n, k, out + 8 * os, os,
                                    num_threads);
  }
  const int64_t groups = k / 32, xis = (groups + 1) / 2 * 64;
  std::vector<uint16_t> xi(rows * xis);
  for (int64_t r = 0; r < rows; ++r) interleave_groups(x + r * xs, k, xi.data() + r * xis);
  const std::vector<float> xsum = group_sums(x, xs, rows, k);
  const uint16_t* xp = xi.data();
  const float* sp = xsum.data();
  with_rows<8>(rows, [&](auto r) {
    q4_bf16_rows<decltype(r)::value>(xp, xis, packed, scales, offsets, n, k, sp, out, os, num_threads);
  });
  return kOk;
#else
  (void)x, (void)xs, (void)packed, (void)scales, (void)offsets, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] bf16 (row stride xs), 1..32 rows, times the Q8_0 matrix of specserve_int8_grouped_matmul (int8
// codes [n, k], float32 scales [n, k / 32]) -> out [rows, n] float32 (row stride os): a bf16 model's Q8_0
// head for the few-row steps of decode and verification, its logits in float32. One row: q8g_rows on the
// row widened to float32 (exact), the float32 head's own sums; 2..32 AMX tiles on each weight rounded to
// bf16 as the dense bf16 head copy holds it, sums in float32. n % 16 != 0 is refused (code 1: outputs come in
// whole tiles), as are more rows. Returns 2 where the build or the kernel do not run AMX tiles
// (specserve_paths() bit 128 clear).
extern "C" int specserve_int8_grouped_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* codes,
                                                const float* scales, int64_t n, int64_t k, float* out, int64_t os,
                                                int num_threads) {
  if (rows < 1 || rows > kInt8GroupedRowsMax || n < 16 || n % 16 != 0 || k < 32 || k % 32 != 0)
    return kBadArguments;
#if defined(SPECSERVE_INT8_GROUPED_AMX_PATH) && defined(SPECSERVE_QUANT_PATH)
  if (!amx_permitted()) return kNotInBuild;
  if (rows >= kInt8GroupedAmxFromRows)
    return q8g_bf16_amx(x, xs, rows, codes, scales, n, k, out, os, num_threads), kOk;
  std::vector<float> wide(rows * k);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) wide[r * k + i] = load(x + r * xs, i);
  return specserve_int8_grouped_matmul(wide.data(), k, rows, codes, scales, n, k, out, os, num_threads);
#else
  (void)x, (void)xs, (void)codes, (void)scales, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] bf16 (row stride xs) times the int8 matrix in 16-output tiles (see above) -> out [rows, n]
// bf16 (row stride os). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* tiles,
                                          const float* scales, int64_t n, int64_t k, uint16_t* out, int64_t os,
                                          int num_threads) {
  if (rows < 1 || n < 16 || n % 16 != 0 || k < 2 || k % 2 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_BF16_PATH
  q8_bf16(x, xs, rows, tiles, scales, n, k, out, os, num_threads);
  return kOk;
#else
  (void)x, (void)xs, (void)tiles, (void)scales, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] bf16 (row stride xs) times a dense bf16 matrix held as panels (see dense_bf16) -> out [rows, n]
// bf16 (row stride os). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_bf16_matmul(const uint16_t* x, int64_t xs, int64_t rows, const uint16_t* panels,
                                     int64_t n, int64_t k, uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || n < 16 || n % 16 != 0 || k < 2 || k % 2 != 0) return kBadArguments;
#ifdef SPECSERVE_QUANT_BF16_PATH
  dense_bf16(x, xs, rows, panels, n, k, out, os, num_threads);
  return kOk;
#else
  (void)x, (void)xs, (void)panels, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}

// x [rows, k] float32 (row stride xs) times a dense float32 matrix held as panels (see dense_f32) -> out
// [rows, n] (row stride os). Returns 2 where the build has no AVX2 + FMA (specserve_paths() bit 4 clear).
extern "C" int specserve_f32_matmul(const float* x, int64_t xs, int64_t rows, const float* panels, int64_t n,
                                    int64_t k, float* out, int64_t os, int num_threads) {
  if (rows < 1 || n < 8 || n % 8 != 0 || k < 1) return kBadArguments;
#ifdef SPECSERVE_DENSE_F32_PATH
  dense_f32(x, xs, rows, panels, n, k, out, os, num_threads);
  return kOk;
#else
  (void)x, (void)xs, (void)panels, (void)out, (void)os, (void)num_threads;
  return kNotInBuild;
#endif
}
