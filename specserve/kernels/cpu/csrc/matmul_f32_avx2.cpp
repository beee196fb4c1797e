// The float32 products on AVX2 + FMA (specserve_paths() bit 4): int8 / int4 few-row kernels, the dense
// float32 panel product, and int8 / int4 widened into panels for it.
#include "common.h"

// ---------------------------------------------------------------------------------------------------------
// Weight-only int8 / int4 matrix products for few activation rows (batch-1 decode), float32 activations and
// float32 accumulation: out[r, j] = sum_i x[r, i] * w[j, i], w dequantized on the fly from
//   int8: codes [n, k] int8 with a scale per output row, w = code * scale;
//   int4: groups of 32 along the input, 16 bytes a group (byte i: code i low nibble, code i + 16 high), a
//         scale and an offset per group (offset = zero - 8 * scale, so w = code * scale + offset).
// A decode step reads every weight once and does little arithmetic with it, so these are memory-bound: on a
// 2-core AVX2 EPYC (9 GB/s for the pair) the float32 matrices of SmolLM2's 30 layers take 47 ms a token,
// int8 reads a quarter of the bytes and int4 three sixteenths. torch's _weight_int8pack_mm and
// _weight_int4pack_mm_for_cpu have no vectorised float32 path (5-15x slower than dense there).
// The int4 product is sum_g scale_g * (sum_i code_i x_i) + offset_g * (sum_i x_i): the group's x sums are
// taken once per call, so the inner loop is one convert and one FMA per weight and row.
// Each thread takes a contiguous run of output rows, so it streams its weights front to back.
namespace {

#if defined(__AVX2__) && defined(__FMA__)
#define SPECSERVE_QUANT_PATH 1

// One output row of int8 against R activation rows. U vectors of 8 weights per step keep U * R independent
// accumulators (FMA latency 4, two a cycle: a single chain would stall; more than ~12 would spill).
template <int R>
inline void q8_row(const float* x, int64_t xs, const int8_t* w, int64_t k, float scale, float* out,
                   int64_t os) {
  constexpr int U = R == 1 ? 4 : (R == 2 ? 4 : (R <= 4 ? 2 : 1));
  __m256 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 * U <= k; i += 8 * U) {
    __m256 wv[U];
    for (int u = 0; u < U; ++u)
      wv[u] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i + 8 * u))));
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u)
        acc[r][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + r * xs + i + 8 * u), acc[r][u]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][u]);
    float s = hsum(acc[r][0]);
    for (int64_t j = i; j < k; ++j) s += static_cast<float>(w[j]) * x[r * xs + j];
    out[r * os] = s * scale;
  }
}

// One output row of int4 against R activation rows; gsum [R, k / 32] holds each group's sum of x.
template <int R>
inline void q4_row(const float* x, int64_t xs, const uint8_t* w, int64_t groups, const float* scales,
                   const float* offsets, const float* gsum, float* out, int64_t os) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w + g * 16;
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));  // codes 0..7
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));  // 8..15
    const __m256 q2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));    // 16..23
    const __m256 q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));    // 24..31
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * xs + g * 32;
      const __m256 t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xr + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(xr)));
      const __m256 u =
          _mm256_fmadd_ps(q3, _mm256_loadu_ps(xr + 24), _mm256_mul_ps(q2, _mm256_loadu_ps(xr + 16)));
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t, u), s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(acc[r]);
    const float* gs = gsum + r * groups;
    for (int64_t g = 0; g < groups; ++g) s += offsets[g] * gs[g];
    out[r * os] = s;
  }
}

// One output row of int8 with a scale per group of 32 inputs (the LM head: GGUF's Q8_0 blocks exactly).
template <int R>
inline void q8g_row(const float* x, int64_t xs, const int8_t* w, int64_t groups, const float* scales, float* out,
                    int64_t os) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* p = w + g * 32;
    __m256 q[4];
    for (int u = 0; u < 4; ++u)
      q[u] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * u))));
    const __m256 s = _mm256_set1_ps(scales[g]);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * xs + g * 32;
      const __m256 t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xr + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xr)));
      const __m256 u =
          _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xr + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xr + 16)));
      acc[r] = _mm256_fmadd_ps(_mm256_add_ps(t, u), s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * os] = hsum(acc[r]);
}

template <int R>
void q8g_rows(const float* x, int64_t xs, const int8_t* codes, const float* scales, int64_t n, int64_t k,
              float* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j) {
    if (j + kRowsAhead < n) {
      prefetch(codes + (j + kRowsAhead) * k, k);
      prefetch(scales + (j + kRowsAhead) * groups, groups * 4);
    }
    q8g_row<R>(x, xs, codes + j * k, groups, scales + j * groups, out + j, os);
  }
}

// Weight streams a thread of a one-row int8 product reads at once (q8_rows<1>).
constexpr int kStreams = 3;

// q8_row<1>'s arithmetic for S output rows at once, each from its own stream of weights: outputs bit for
// bit q8_row<1>'s.
template <int S>
inline void q8_row_streams(const float* x, const int8_t* const* w, int64_t k, const float* scale,
                           float* const* out) {
  __m256 acc[S][4];
  for (int t = 0; t < S; ++t)
    for (int u = 0; u < 4; ++u) acc[t][u] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32)
    for (int u = 0; u < 4; ++u) {
      const __m256 xv = _mm256_loadu_ps(x + i + 8 * u);
      for (int t = 0; t < S; ++t) {
        const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[t] + i + 8 * u));
        acc[t][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), xv, acc[t][u]);
      }
    }
  for (int t = 0; t < S; ++t) {
    for (int u = 1; u < 4; ++u) acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
    float s = hsum(acc[t][0]);
    for (int64_t j = i; j < k; ++j) s += static_cast<float>(w[t][j]) * x[j];
    *out[t] = s * scale[t];
  }
}

template <int R>
void q8_rows(const float* x, int64_t xs, const int8_t* codes, const float* scales, int64_t n, int64_t k,
             float* out, int64_t os, int num_threads) {
  if constexpr (R == 1) {
    // Each thread's share as kStreams streams, a row from each at a time. One stream of rows read at
    // ~26 GB/s on two cores, where the dense panels' read at ~33. SmolLM2's 30 layers at one row
    // (bench/kernel_ab.py --case int8 --rows 1 --repeats 40, Zen 4, medians): avx2 build 5.62 / 5.67 / 5.59
    // ms against 6.18 / 6.13 / 6.02, native 5.66 / 5.95 against 6.10 / 6.51. 2 streams and 4 (whose 16
    // accumulators spill) gained 3 %.
    constexpr int S = kStreams;
#pragma omp parallel num_threads(num_threads) if (threaded_for(n, k))
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t j0 = n * t / nt, j1 = n * (t + 1) / nt, part = (j1 - j0) / S;
      for (int64_t i = 0; i < part; ++i) {
        const int8_t* w[S];
        float sc[S];
        float* o[S];
        for (int u = 0; u < S; ++u) {
          const int64_t j = j0 + u * part + i;
          w[u] = codes + j * k, sc[u] = scales[j], o[u] = out + j;
        }
        q8_row_streams<S>(x, w, k, sc, o);
      }
      for (int64_t j = j0 + S * part; j < j1; ++j) q8_row<1>(x, xs, codes + j * k, k, scales[j], out + j, os);
    }
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j) q8_row<R>(x, xs, codes + j * k, k, scales[j], out + j, os);
}

template <int R>
void q4_rows(const float* x, int64_t xs, const uint8_t* packed, const float* scales, const float* offsets,
             int64_t n, int64_t k, const float* gsum, float* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j) {
    if (j + kRowsAhead < n) {
      prefetch(packed + (j + kRowsAhead) * groups * 16, groups * 16);
      prefetch(scales + (j + kRowsAhead) * groups, groups * 4);
      prefetch(offsets + (j + kRowsAhead) * groups, groups * 4);
    }
    q4_row<R>(x, xs, packed + j * groups * 16, groups, scales + j * groups, offsets + j * groups, gsum,
              out + j, os);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Dense float32 weights on AVX2 + FMA, any number of rows: out = x w^T with w held in panels of 16 outputs,
// [n / 16][k][16] floats (a last panel of 8 when n / 8 is odd), read straight from memory once a chunk of
// rows by register blocks of 6 rows x 16 outputs (12 accumulators, the classic AVX2 sgemm block). Each
// output's sum runs over k in order, in one float32 accumulator.
constexpr int kF32RowBlock = 6;

template <int NT, int R>
inline void f32_block(const float* x, int64_t xs, int64_t r0, const float* panel, int64_t k, float* out,
                      int64_t os, int64_t j0) {
  __m256 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    __m256 w[NT];
    for (int t = 0; t < NT; ++t) w[t] = _mm256_loadu_ps(panel + p * 8 * NT + 8 * t);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + (r0 + r) * xs + p);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(w[t], xb, acc[r][t]);
    }
  }
  // unrolled, or GCC 12 keeps acc[][] in memory and stores every accumulator after each FMA (2x slower)
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + (r0 + r) * os + j0 + 8 * t, acc[r][t]);
}

template <int NT>
void f32_rows(const float* x, int64_t xs, int64_t r0, int64_t rows, const float* panel, int64_t k, float* out,
              int64_t os, int64_t j0) {
  int64_t r = r0;
  for (; r + kF32RowBlock <= r0 + rows; r += kF32RowBlock)
    f32_block<NT, kF32RowBlock>(x, xs, r, panel, k, out, os, j0);
  switch (r0 + rows - r) {
    case 1: return f32_block<NT, 1>(x, xs, r, panel, k, out, os, j0);
    case 2: return f32_block<NT, 2>(x, xs, r, panel, k, out, os, j0);
    case 3: return f32_block<NT, 3>(x, xs, r, panel, k, out, os, j0);
    case 4: return f32_block<NT, 4>(x, xs, r, panel, k, out, os, j0);
    case 5: return f32_block<NT, 5>(x, xs, r, panel, k, out, os, j0);
    default: return;
  }
}

// Rows a chunk so that its activations (k floats a row) stay in L2 while every panel passes over them.
inline int64_t f32_chunk_rows(int64_t k) {
  const int64_t rows = (512 * 1024) / (4 * k);
  return rows < kF32RowBlock ? kF32RowBlock : rows / kF32RowBlock * kF32RowBlock;
}

void dense_f32(const float* x, int64_t xs, int64_t rows, const float* panels, int64_t n, int64_t k, float* out,
               int64_t os, int num_threads) {
  const int64_t num_tiles = n / 8, num_panels = (num_tiles + 1) / 2;
  over_panels(rows, f32_chunk_rows(k), num_panels, rows * n * k >= (int64_t{1} << 18), num_threads,
              [&](int64_t c0, int64_t nr, int64_t pi, float*) {
                const float* w = panels + pi * k * 16;
                if (num_tiles - 2 * pi >= 2) f32_rows<2>(x, xs, c0, nr, w, k, out, os, 16 * pi);
                else f32_rows<1>(x, xs, c0, nr, w, k, out, os, 16 * pi);
              });
}
#define SPECSERVE_DENSE_F32_PATH 1

// 8 rows of 16 bytes -> 16 columns of 8 bytes (one byte of each row, in row order): v[m] holds columns 2m
// (low half) and 2m + 1 (high half). Transposing the codes before they widen costs 24 shuffles a 128 bytes,
// against 24 a 64 floats after (int4's panels took 40.3 ms for SmolLM2's 30 layers at 9 rows that way).
inline void transpose_bytes(const __m128i a[8], __m128i v[8]) {
  __m128i t[8], u[8];
  for (int h = 0; h < 4; ++h) {
    t[2 * h] = _mm_unpacklo_epi8(a[2 * h], a[2 * h + 1]);
    t[2 * h + 1] = _mm_unpackhi_epi8(a[2 * h], a[2 * h + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // h: rows 0-3, then 4-7
    u[4 * h] = _mm_unpacklo_epi16(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm_unpackhi_epi16(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm_unpacklo_epi16(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm_unpackhi_epi16(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    v[2 * m] = _mm_unpacklo_epi32(u[m], u[m + 4]);
    v[2 * m + 1] = _mm_unpackhi_epi32(u[m], u[m + 4]);
  }
}

// Quantized float32 matrices for steps of many rows (more than the few-row kernels'): each panel of 16
// outputs is widened into a thread's buffer in the f32_panels layout once a chunk of rows, and the dense
// product's register blocks run it. Widening whole matrices for MKL's sgemm instead (256 outputs at a
// time) made int8 the slower form wherever a step had many rows, now that dense float32 runs on panels.
// widen(j0, nt, panel) writes outputs [j0, j0 + 8 nt) as f32_panels holds them: panel[i * 8 nt + j - j0].
template <typename Widen>
void widened_f32(const float* x, int64_t xs, int64_t rows, int64_t n, int64_t k, float* out, int64_t os,
                 int num_threads, Widen widen) {
  const int64_t num_tiles = n / 8, num_panels = (num_tiles + 1) / 2;
  over_panels(
      rows, f32_chunk_rows(k), num_panels, rows * n * k >= (int64_t{1} << 18), num_threads,
      [&](int64_t c0, int64_t nr, int64_t pi, float* panel) {
        const int64_t nt = num_tiles - 2 * pi >= 2 ? 2 : 1;
        widen(16 * pi, nt, panel);
        if (nt == 2) f32_rows<2>(x, xs, c0, nr, panel, k, out, os, 16 * pi);
        else f32_rows<1>(x, xs, c0, nr, panel, k, out, os, 16 * pi);
      },
      16 * k);
}

// int8 codes [n, k] with a scale per output: each weight code * scale, as specserve_int8_widen gives it.
void q8_widened(const float* x, int64_t xs, int64_t rows, const int8_t* codes, const float* scales, int64_t n,
                int64_t k, float* out, int64_t os, int num_threads) {
  widened_f32(x, xs, rows, n, k, out, os, num_threads, [&](int64_t j0, int64_t nt, float* panel) {
    for (int64_t t = 0; t < nt; ++t) {
      const int8_t* w = codes + (j0 + 8 * t) * k;
      const float* s = scales + j0 + 8 * t;
      const __m256 scale = _mm256_loadu_ps(s);
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) {
        __m128i a[8], v[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k + i));
        transpose_bytes(a, v);
        for (int c = 0; c < 16; ++c) {
          const __m128i col = c % 2 ? _mm_unpackhi_epi64(v[c / 2], v[c / 2]) : v[c / 2];
          _mm256_storeu_ps(panel + (i + c) * 8 * nt + 8 * t,
                           _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(col)), scale));
        }
      }
      for (; i < k; ++i)
        for (int j = 0; j < 8; ++j) panel[i * 8 * nt + 8 * t + j] = static_cast<float>(w[j * k + i]) * s[j];
    }
  });
}

// int4 in pack_int4's nibbles [n, k / 2] with a scale and offset per output and group of 32: each weight
// code * scale + offset (one rounding).
void q4_widened(const float* x, int64_t xs, int64_t rows, const uint8_t* packed, const float* scales,
                const float* offsets, int64_t n, int64_t k, float* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
  const __m256i low = _mm256_set1_epi32(0x0F);
  widened_f32(x, xs, rows, n, k, out, os, num_threads, [&](int64_t j0, int64_t nt, float* panel) {
    // the next panel's codes, scales and offsets (a thread's panels are consecutive): 16 rows of a few
    // hundred bytes each are too short a stream for the hardware prefetcher. SmolLM2's 30 layers at 18 rows,
    // avx2-only build (bench/kernel_ab.py --case int4, Zen 4): 30.4 ms against 31.5
    for (int64_t j = j0 + 16; j < j0 + 32 && j < n; ++j) {
      prefetch(packed + j * groups * 16, groups * 16);
      prefetch(scales + j * groups, groups * 4);
      prefetch(offsets + j * groups, groups * 4);
    }
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t row0 = j0 + 8 * t;
      const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(static_cast<int>(groups)));
      for (int64_t g = 0; g < groups; ++g) {
        // the group's 8 scales and offsets, one an output; byte b of a row holds inputs b and b + 16
        const __m256 s = _mm256_i32gather_ps(scales + row0 * groups + g, at, 4);
        const __m256 o = _mm256_i32gather_ps(offsets + row0 * groups + g, at, 4);
        __m128i a[8], v[8];
        for (int j = 0; j < 8; ++j)
          a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + ((row0 + j) * groups + g) * 16));
        transpose_bytes(a, v);
        for (int c = 0; c < 16; ++c) {
          const __m256i b = _mm256_cvtepu8_epi32(c % 2 ? _mm_unpackhi_epi64(v[c / 2], v[c / 2]) : v[c / 2]);
          _mm256_storeu_ps(panel + (32 * g + c) * 8 * nt + 8 * t,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), s, o));
          _mm256_storeu_ps(panel + (32 * g + 16 + c) * 8 * nt + 8 * t,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s, o));
        }
      }
    }
  });
}
#endif

}  // namespace
