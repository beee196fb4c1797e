// The bfloat16 products on AVX512-BF16 (specserve_paths() bit 8): int8 and int4 in 16-output tiles, int4
// few-row, and the dense bf16 panel product.
#include "common.h"

// ---------------------------------------------------------------------------------------------------------
// Weight-only int8 for bfloat16 activations on AVX512-BF16, any number of rows: out = x w^T, w[j, i] =
// code[j, i] * scale[j], rounded to bf16 once (products exact, sums in float32). torch's
// _weight_int8pack_mm runs 64 rows of SmolLM2's four matrices in 3.5 ms a layer against 1.6 ms dense, and
// widening the codes for oneDNN each call 2.2 ms, so int8 cost throughput wherever a step had many rows.
// Codes come in tiles of 16 outputs: tiles [n / 16, k / 2, 16, 2], so one 32-byte load holds an input pair
// for 16 outputs, which widened to bf16 is one vdpbf16ps operand against a row's broadcast input pair. A
// panel of two tiles is widened once into a thread's buffer and then used by every row block of 12 rows
// (24 accumulators in registers): the arithmetic of a dense bf16 GEMM, plus one widening a panel and chunk.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define SPECSERVE_QUANT_BF16_PATH 1
namespace {
constexpr int kQ8RowBlock = 12;

// 32 int8 codes -> 32 bf16 (exact: |code| <= 128 fits bf16's 8 significant bits).
inline __m512i widen_codes_bf16(const int8_t* p) {
  const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w16)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w16, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// R rows [r0, r0 + R) against NT tiles of weights: widened already (Direct false: panel [k / 2][NT][32]
// bf16) or widened here from the codes (Direct: tiles of the layout above, for a single row block).
// Direct reads ask for the codes this many bytes on in their tile (one line a 64 bytes read): its 16 outputs'
// codes are one stream of k * 16 bytes, which the hardware prefetcher ran too few lines ahead of.
constexpr int64_t kQ8Ahead = 1024;
template <int NT, int R, bool Direct = false>
inline void q8_bf16_block(const uint16_t* x, int64_t xs, int64_t r0, const void* weights, int64_t pairs,
                          const float* scales, uint16_t* out, int64_t os, int64_t j0) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NT];
    for (int t = 0; t < NT; ++t) {
      if constexpr (Direct) {
        const int8_t* codes = static_cast<const int8_t*>(weights) + (t * pairs + p) * 32;
        if (p % 2 == 0) __builtin_prefetch(codes + kQ8Ahead, 0, 3);
        w[t] = (__m512bh)widen_codes_bf16(codes);
      } else {
        w[t] = (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(weights) + (p * NT + t) * 32);
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t xp;
      std::memcpy(&xp, x + (r0 + r) * xs + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w[t], xb);
    }
  }
  // Unrolled like the loops above: a rolled loop here kept acc[][] in memory, and GCC 12 then stored every
  // accumulator to the stack after each of its dot products.
#pragma GCC unroll 4
  for (int t = 0; t < NT; ++t) {  // no scales: the panel holds the weights themselves (int4's)
    const __m512 s = scales ? _mm512_loadu_ps(scales + j0 + 16 * t) : _mm512_set1_ps(1.f);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + r) * os + j0 + 16 * t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][t], s)));
  }
}

template <int NT, bool Direct = false>
void q8_bf16_rows(const uint16_t* x, int64_t xs, int64_t r0, int64_t rows, const void* weights, int64_t pairs,
                  const float* scales, uint16_t* out, int64_t os, int64_t j0) {
  int64_t r = r0;
  for (; r + kQ8RowBlock <= r0 + rows; r += kQ8RowBlock)
    q8_bf16_block<NT, kQ8RowBlock, Direct>(x, xs, r, weights, pairs, scales, out, os, j0);
  switch (r0 + rows - r) {
#define SPECSERVE_Q8_TAIL(R) \
  case R: return q8_bf16_block<NT, R, Direct>(x, xs, r, weights, pairs, scales, out, os, j0);
    SPECSERVE_Q8_TAIL(1) SPECSERVE_Q8_TAIL(2) SPECSERVE_Q8_TAIL(3) SPECSERVE_Q8_TAIL(4)
    SPECSERVE_Q8_TAIL(5) SPECSERVE_Q8_TAIL(6) SPECSERVE_Q8_TAIL(7) SPECSERVE_Q8_TAIL(8)
    SPECSERVE_Q8_TAIL(9) SPECSERVE_Q8_TAIL(10) SPECSERVE_Q8_TAIL(11)
#undef SPECSERVE_Q8_TAIL
    default: return;
  }
}

// Rows a chunk so that its activations (k bf16 each) stay in L2 beside the panel while every panel of the
// chunk passes over them. 512 KB rather than 256: int4's panels cost more to widen, and SmolLM2's layers at
// 256 / 2,048 rows took 134.7 / 1,081 ms against 156.5 / 1,168 (Zen 4, 1 MB of L2 a core).
inline int64_t panel_chunk_rows(int64_t k) {
  const int64_t rows = (512 * 1024) / (2 * k);
  return rows < kQ8RowBlock ? kQ8RowBlock : rows / kQ8RowBlock * kQ8RowBlock;
}

// out = x w^T by panels of two 16-output tiles, each widened by widen(t0, nt, panel) into a thread's buffer
// ([k / 2][nt][32] bf16) once a chunk of rows; scales (per output, or null) applied to the float32 sums.
// With `direct` (int8 tiles), a step of one row block widens the codes in registers instead.
template <typename Widen>
void panel_product(const uint16_t* x, int64_t xs, int64_t rows, int64_t n, int64_t k, const float* scales,
                   uint16_t* out, int64_t os, int num_threads, const int8_t* direct, Widen widen) {
  const int64_t pairs = k / 2, num_tiles = n / 16, num_panels = (num_tiles + 1) / 2;
  over_panels<uint16_t>(
      rows, panel_chunk_rows(k), num_panels, rows * n * k >= (int64_t{1} << 18), num_threads,
      [&](int64_t c0, int64_t nr, int64_t pi, uint16_t* panel) {
        const int64_t t0 = 2 * pi, nt = num_tiles - t0 < 2 ? 1 : 2;
        if (direct && rows <= kQ8RowBlock) {  // one row block: each weight is used once
          // a tile at a time, so a thread reads one stream front to back (its panels' tiles lie in turn):
          // SmolLM2's 30 layers (bench/kernel_ab.py --case int8-bf16, Zen 4, medians) at 1 / 3 / 8 / 12 rows
          // took 5.7 / 6.5 / 8.4 / 9.7 ms, this and kQ8Ahead, against 7.5 / 8.2 / 9.9 / 10.9 reading both
          // tiles of a panel side by side with no prefetch
          const int8_t* w = direct + t0 * pairs * 32;
          for (int64_t t = 0; t < nt; ++t)
            q8_bf16_rows<1, true>(x, xs, 0, rows, w + t * pairs * 32, pairs, scales, out, os, 16 * (t0 + t));
          return;
        }
        widen(t0, nt, panel);
        if (nt == 2) q8_bf16_rows<2>(x, xs, c0, nr, panel, pairs, scales, out, os, 16 * t0);
        else q8_bf16_rows<1>(x, xs, c0, nr, panel, pairs, scales, out, os, 16 * t0);
      },
      pairs * 2 * 32);
}

void q8_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* tiles, const float* scales, int64_t n,
             int64_t k, uint16_t* out, int64_t os, int num_threads) {
  const int64_t pairs = k / 2;
  panel_product(x, xs, rows, n, k, scales, out, os, num_threads, tiles,
                [&](int64_t t0, int64_t nt, uint16_t* panel) {
                  for (int64_t p = 0; p < pairs; ++p)
                    for (int64_t t = 0; t < nt; ++t)
                      _mm512_storeu_si512(panel + (p * nt + t) * 32,
                                          widen_codes_bf16(tiles + ((t0 + t) * pairs + p) * 32));
                });
}

// int4 (Int4Weight: groups of 32 inputs, w = (code - 8) * scale + zero) for steps of many rows: codes in
// 16-output tiles [n / 16, k / 2, 16] bytes (byte j: output j's codes of an input pair, the first in the low
// nibble), scales and zeros in tiles [n / 16, k / 32, 16] float32. A panel is widened to the weights
// themselves, rounded as torch's dequantization rounds them (product, then sum) and then to bf16: the values
// of the dense bf16 copy `auto` used to keep for such steps. The int8 product's register blocks run it.
// Few rows are torch's int4 kernel's: at one row it reads SmolLM2's 30 layers in 3.9 ms, this form 10.4 ms,
// and a form that rescaled each group's sums in registers 5.6 ms (bench/quant_kernels.py, Zen 4).
inline __m512i nibble_table() {  // bf16 of 0..15, twice (vpermw indexes 32 lanes)
  alignas(64) float v[16];
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i);
  const __m512 f = _mm512_load_ps(v);
  return (__m512i)_mm512_cvtne2ps_pbh(f, f);
}

// 16 bytes of a tile's input pair -> its 32 codes as float32, in pair order: lanes (j, first), (j, second)
// for outputs j = 8h .. 8h + 7 in half h.
inline void widen_nibbles(const uint8_t* p, __m512i table, __m512* half0, __m512* half1) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(0x0F));
  const __m512i hi = _mm512_slli_epi32(_mm512_srli_epi32(b, 4), 16);
  const __m512i codes = _mm512_permutexvar_epi16(_mm512_or_si512(lo, hi), table);  // 32 bf16
  const __m512i wide0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(codes));
  const __m512i wide1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(codes, 1));
  *half0 = _mm512_castsi512_ps(_mm512_slli_epi32(wide0, 16));  // bf16 -> float32: the bits, 16 up
  *half1 = _mm512_castsi512_ps(_mm512_slli_epi32(wide1, 16));
}

void q4_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles, const float* scales,
             const float* zeros, int64_t n, int64_t k, uint16_t* out, int64_t os, int num_threads) {
  const int64_t pairs = k / 2, groups = k / 32;
  const __m512i table = nibble_table();
  // a tile's 16 scales spread to pair order: lanes 2j and 2j + 1 hold output j's (j = 0..7, then 8..15)
  const __m512i spread0 = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i spread1 = _mm512_add_epi32(spread0, _mm512_set1_epi32(8));
  const __m512 eight = _mm512_set1_ps(8.f);
  auto widen = [&](int64_t t0, int64_t nt, uint16_t* panel) {
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = ((t0 + t) * groups + g) * 16;
        const __m512 s = _mm512_loadu_ps(scales + at), z = _mm512_loadu_ps(zeros + at);
        const __m512 s0 = _mm512_permutexvar_ps(spread0, s), s1 = _mm512_permutexvar_ps(spread1, s);
        const __m512 z0 = _mm512_permutexvar_ps(spread0, z), z1 = _mm512_permutexvar_ps(spread1, z);
        for (int64_t p = 16 * g; p < 16 * g + 16; ++p) {
          __m512 c0, c1;
          widen_nibbles(tiles + ((t0 + t) * pairs + p) * 16, table, &c0, &c1);
          const __m512 w0 = _mm512_add_ps(rounded(_mm512_mul_ps(_mm512_sub_ps(c0, eight), s0)), z0);
          const __m512 w1 = _mm512_add_ps(rounded(_mm512_mul_ps(_mm512_sub_ps(c1, eight), s1)), z1);
          _mm512_storeu_si512(panel + (p * nt + t) * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
      }
  };
  panel_product(x, xs, rows, n, k, nullptr, out, os, num_threads, nullptr, widen);
}

// int4 in pack_int4's nibbles (specserve_int4_matmul's matrix: w = code * scale + offset per group of 32)
// for few bf16 rows (batch-1 decode, verify steps), on vdpbf16ps. A code c goes to the bf16 1 + c / 16
// (0x3F80 | c << 3: the shift, mask and OR in two ops), exact, so a group's dot product with x, D = sum x_i
// (1 + c_i / 16), is products exact and sums in float32, and sum c_i x_i = 16 (D - sum x_i). A row is then
//   sum_g scale_g * 16 * D_g + (offset_g - 16 * scale_g) * xsum_g,
// the first sum in registers, the second a short vector dot at the row's end. Two groups a step: 32 bytes of
// codes widen to 64 words, the low nibbles of both groups in one register and the high ones in another, so
// x is read interleaved the same way (xi below). The float32 kernel widened every code to a float32 lane: at
// one row, SmolLM2's 30 layers of codes from memory took 3.5-4.2 ms in it against 2.9-3.0 in this form and
// 2.5 for reading them alone (a C++ loop over the layers, 2-core Zen 4).
inline void interleave_groups(const uint16_t* x, int64_t k, uint16_t* xi) {
  const int64_t groups = k / 32;
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    for (int i = 0; i < 16; ++i) {
      xi[g * 32 + i] = x[g * 32 + i];
      xi[g * 32 + 16 + i] = pair ? x[(g + 1) * 32 + i] : 0;
      xi[g * 32 + 32 + i] = x[g * 32 + 16 + i];
      xi[g * 32 + 48 + i] = pair ? x[(g + 1) * 32 + 16 + i] : 0;
    }
  }
}

template <int R>
inline void q4_bf16_row(const uint16_t* xi, int64_t xis, const uint8_t* w, int64_t groups, const float* scales,
                        const float* offsets, const float* xsum, uint16_t* out, int64_t os) {
  const __m512i mask = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
  // lanes 0-7 take the first group's scale, 8-15 the second's
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;  // an odd last group: its partner's codes 0, x 0 and scale 0
    const uint8_t* p = w + g * 16;
    const __m256i bytes = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                               : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i words = _mm512_cvtepu8_epi16(bytes);
    const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(words, 3), mask, one, 0xEA);
    const __m512bh hi = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 1), mask, one, 0xEA);
    const __m128 s2 = pair ? _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scales + g)))
                           : _mm_load_ss(scales + g);
    const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s2));
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = xi + r * xis + g * 32;
      __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(xr));
      d = _mm512_dpbf16_ps(d, hi, (__m512bh)_mm512_loadu_si512(xr + 32));
      acc[r] = _mm512_fmadd_ps(d, s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xs = xsum + r * groups;
    __m512 t = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) {
      const __m512 s = _mm512_loadu_ps(scales + g), o = _mm512_loadu_ps(offsets + g);
      t = _mm512_fmadd_ps(_mm512_fnmadd_ps(s, _mm512_set1_ps(16.f), o), _mm512_loadu_ps(xs + g), t);
    }
    float y = 16.f * _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(t);
    for (; g < groups; ++g) y += (offsets[g] - 16.f * scales[g]) * xs[g];
    store(out + r * os, 0, y);
  }
}

template <int R>
void q4_bf16_rows(const uint16_t* xi, int64_t xis, const uint8_t* packed, const float* scales,
                  const float* offsets, int64_t n, int64_t k, const float* xsum, uint16_t* out, int64_t os,
                  int num_threads) {
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (n * k >= (int64_t{1} << 16))
  for (int64_t j = 0; j < n; ++j) {
    if (j + kRowsAhead < n) {  // as q4_rows: a row's codes, scales and offsets are three short streams
      prefetch(packed + (j + kRowsAhead) * groups * 16, groups * 16);
      prefetch(scales + (j + kRowsAhead) * groups, groups * 4);
      prefetch(offsets + (j + kRowsAhead) * groups, groups * 4);
    }
    q4_bf16_row<R>(xi, xis, packed + j * groups * 16, groups, scales + j * groups, offsets + j * groups, xsum,
                   out + j, os);
  }
}

// Few bf16 rows on 16-output tiles, on vdpbf16ps with the 16 lanes 16 outputs: int4 in int4_tiles' layout
// (codes [n / 16, k / 2, 16], scales and offsets [n / 16, k / 32, 16] float32, w = code * scale + offset,
// bf16 out), or a Q8_0 matrix in int8_tiles' layout (codes [n / 16, k / 2, 16, 2], scales [n / 16, k / 32,
// 16] float32, w = code * scale, float32 out: a bf16 model's head). A tile's input pair is one vdpbf16ps
// operand, its codes widened to their exact bf16 values (int4: one table lookup, vpermw; int8: by float32),
// against a row's broadcast input pair. A row's sums never cross lanes, so there is no per-output reduction
// (q4_bf16_row pays two every output and row), and the codes are widened once a pass of up to kTileRows
// rows. Each row sums its groups alike whatever the rows of the call: a group's pairs in kTileChains chains
// (p % kTileChains) added in order, then acc += scale * D (and int4's acc += offset * xsum), so a verify
// step's rows come out as the decode steps of those tokens would have them. Eight rows a pass in two chains
// against four in four: SmolLM2's int4 layers (30, random codes from memory, both alternated in one process,
// 2-core Zen 4) level at 1-2 rows, 5 / 8 / 16 rows 4.8 / 6.6 / 11.5 ms against 6.5 / 8.1 / 14.7.
constexpr int kTileRows = 8, kTileChains = 2;

template <int R, bool Int4, typename Out>
inline void tile_pass(const uint16_t* x, int64_t xs, const float* xsum, int64_t groups, const uint8_t* codes,
                      const float* scales, const float* offsets, Out* out, int64_t os, __m512i table) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[R][kTileChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kTileChains; ++c) d[r][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      __m512bh w;
      if constexpr (Int4) {
        const uint8_t* at = codes + (g * 16 + p) * 16;
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        // (b | b << 12) & 0x000F000F: the first code in the low word, the second in the high one
        const __m512i index = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), nibbles, 0xA8);
        w = (__m512bh)_mm512_permutexvar_epi16(index, table);
      } else {
        w = (__m512bh)widen_codes_bf16(reinterpret_cast<const int8_t*>(codes) + (g * 16 + p) * 32);
      }
      for (int r = 0; r < R; ++r) {
        int32_t xp;
        std::memcpy(&xp, x + r * xs + g * 32 + 2 * p, 4);
        d[r][p % kTileChains] = _mm512_dpbf16_ps(d[r][p % kTileChains], w, (__m512bh)_mm512_set1_epi32(xp));
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + g * 16);
    for (int r = 0; r < R; ++r) {
      __m512 dot = d[r][0];
      for (int c = 1; c < kTileChains; ++c) dot = _mm512_add_ps(dot, d[r][c]);
      acc[r] = _mm512_fmadd_ps(s, dot, acc[r]);
      if constexpr (Int4)
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(offsets + g * 16), _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (std::is_same_v<Out, float>)
      _mm512_storeu_ps(out + r * os, acc[r]);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * os), (__m256i)_mm512_cvtneps_pbh(acc[r]));
  }
}

template <bool Int4, typename Out>
void tile_rows(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles, const float* scales,
               const float* offsets, int64_t n, int64_t k, Out* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32, num_tiles = n / 16;
  const std::vector<float> xsum = Int4 ? group_sums(x, xs, rows, k) : std::vector<float>();
  alignas(64) uint16_t words[32];
  for (int i = 0; i < 32; ++i) store(words, i, static_cast<float>(i % 16));  // bf16 of 0..15, twice
  const __m512i table = _mm512_load_si512(words);
  const int64_t tile_bytes = groups * 16 * (Int4 ? 16 : 32);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= (int64_t{1} << 16))
  for (int64_t t = 0; t < num_tiles; ++t) {
    const uint8_t* codes = tiles + t * tile_bytes;
    const float* s = scales + t * groups * 16;
    const float* o = Int4 ? offsets + t * groups * 16 : nullptr;
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int64_t nr = std::min<int64_t>(kTileRows, rows - r0);
      with_rows<kTileRows>(nr, [&](auto r) {
        tile_pass<decltype(r)::value, Int4>(x + r0 * xs, xs, Int4 ? xsum.data() + r0 * groups : nullptr, groups,
                                            codes, s, o, out + r0 * os + t * 16, os, table);
      });
    }
  }
}

// Dense bf16 weights held as the panels above already are: [n / 32][k / 2][2][16][2] (a last panel of one
// tile when n / 16 is odd), so a step reads each panel straight from memory, once a chunk of rows.
void dense_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint16_t* panels, int64_t n, int64_t k,
                uint16_t* out, int64_t os, int num_threads) {
  const int64_t pairs = k / 2, num_tiles = n / 16, num_panels = (num_tiles + 1) / 2;
  const int64_t chunk = panel_chunk_rows(k);
  over_panels(rows, chunk, num_panels, rows * n * k >= (int64_t{1} << 18), num_threads,
              [&](int64_t c0, int64_t nr, int64_t pi, float*) {
                const uint16_t* w = panels + pi * pairs * 64;
                if (num_tiles - 2 * pi >= 2) q8_bf16_rows<2>(x, xs, c0, nr, w, pairs, nullptr, out, os, 32 * pi);
                else q8_bf16_rows<1>(x, xs, c0, nr, w, pairs, nullptr, out, os, 32 * pi);
              });
}
}  // namespace
#endif
