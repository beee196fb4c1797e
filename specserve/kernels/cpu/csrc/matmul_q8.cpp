// Integer products with activations quantized right before them (w8a8, w4a8): each row of x becomes int8
// codes with a float32 scale per 32 inputs (llama.cpp's Q8_0), the weights stay int8 per output channel or
// int4 per group of 32, and each block's dot product is an exact integer sum; the scales are applied in
// float32 in a fixed order, which kernels/reference_a8.py spells out in torch and the tests hold every build
// variant to bit for bit.
//
// Weights come in tiles of 16 outputs, 4 inputs a 32-bit lane (the vpdpbusd operand): w8a8 [n / 16][k / 4]
// [16][4] bytes of code + 128 (unsigned, as vpdpbusd's first operand wants), w4a8 [n / 16][k / 8][16][4]
// bytes whose low nibbles are inputs 8t..8t+3 and high nibbles 8t+4..8t+7. AVX512-VNNI runs a tile in one
// register (vpdpbusd); AVX2 runs its two halves of 8 outputs (vpmaddubsw + vpmaddwd, llama.cpp's sign trick
// for int8: |w| times x signed by w, which needs codes in -127..127, as the quantizers give); other builds
// run the same layout in plain loops.
//
// Per block b of row r (xd: its scale, xs: the sum of its codes, dot: the integer sum for output j):
//   w8a8: acc += xd * dot, then out = acc * scale[j]
//   w4a8: acc += xd * (scale[j, b] * dot + offset[j, b] * xs), offset = zero - 8 * scale
//   w8a8 grouped (a Q8_0 matrix: int8 codes, a scale per output and block, llama.cpp's Q8_0 x Q8_0):
//         acc += xd * (scale[j, b] * dot)
// each product rounded to float32 on its own (no fused multiply-add), blocks summed in input order.
//
// w4a8's scales and offsets come as float32 or, where every one of a matrix's is a float16 value (a GGUF's
// Q4_0 / Q4_1 blocks: fp16 scales and minimums), as those float16 bits (the w4a8h entry points): the same
// values, widened exactly in the kernel, a quarter fewer bytes a weight (0.5625 against 0.75), which is what a
// batch-1 step reads. A grouped w8a8 matrix's scales (a GGUF's Q8_0 blocks) likewise (w8a8gh).
#include "api.h"
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECSERVE_INT_DOT_VNNI 1
#define SPECSERVE_INT_DOT_PATH 1
#elif defined(__AVX2__)
#define SPECSERVE_INT_DOT_PATH 1
#endif

namespace {

constexpr int64_t kQ8Block = 32;
// the weights' forms: int8 with a scale per output, int4 in groups of 32, int8 with a scale per group of 32
constexpr int kW8 = 0, kW4 = 1, kW8G = 2;
constexpr int64_t kQ8Tile = 16;
// rows a tile's pass keeps in registers: a tile's weights (16 x k bytes) stay in L1 across the passes
constexpr int kQ8Rows = 4;
// steps of more rows than this run tiles in pairs where the matrix has an even count of them (measured from 8
// rows up); batch-1 and short verify steps, which read their weights from memory, keep lone tiles
constexpr int64_t kQ8PairBelow = 4;

// A step's activations quantized: codes [rows][k], per block scales and code sums [rows][k / 32].
struct Q8Rows {
  const int8_t* codes;
  const float* scales;
  const int32_t* sums;
  int64_t k, nb;
};

// Q8_0: d = amax / 127 (as amax times float32 1/127), codes round(x / d) half to even, clamped to +-127.
template <typename T>
void quantize_q8(const T* x, int64_t xs, int64_t rows, int64_t k, int8_t* codes, float* scales, int32_t* sums,
                 int num_threads) {
  constexpr float kInv127 = 1.0f / 127.0f;
  const int64_t nb = k / kQ8Block;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(rows, k))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      float v[kQ8Block];
      float amax = 0.f;
      for (int i = 0; i < kQ8Block; ++i) {
        v[i] = load(x + r * xs, b * kQ8Block + i);
        amax = std::max(amax, std::fabs(v[i]));
      }
      // rounded(): -ffast-math would otherwise fold 1 / (amax * (1 / 127)) into 127 / amax, another value
      const float d = rounded(amax * kInv127);
      const float id = d > 0.f ? rounded(1.f / d) : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < kQ8Block; ++i) {
        const float q = std::min(127.f, std::max(-127.f, std::nearbyint(v[i] * id)));
        codes[r * k + b * kQ8Block + i] = static_cast<int8_t>(q);
        sum += static_cast<int32_t>(q);
      }
      scales[r * nb + b] = d;
      sums[r * nb + b] = sum;
    }
}

inline int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// float16 bits -> float32, exactly (the generic build's widening of w4a8h's scales and offsets)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {  // zero and subnormals: man * 2^-24, exact in float32
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  bits = sign | (exp == 31 ? 0x7F800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }

// One tile of 16 outputs for rows [r0, r0 + R): res[r][j], in the arithmetic above. F picks the weights' form
// (kW8, kW4, kW8G), S its scales' and offsets' type (float, or uint16_t for float16 bits; w8a8's per-output
// scales are float).
#ifdef SPECSERVE_INT_DOT_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <int R, int F, typename S>
inline void q8_tile(const Q8Rows& a, int64_t r0, const uint8_t* w, const S* scales, const S* offsets,
                    float (*res)[kQ8Tile]) {
  constexpr bool W4 = F == kW4;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nb; ++b) {
    // two sums a row, added at the block's end: one row's vpdpbusd would otherwise wait on the one before
    // (a chain of 8 a block); integer sums, so the order changes nothing
    __m512i dot[R], dot2[R];
    for (int r = 0; r < R; ++r) dot[r] = dot2[r] = _mm512_setzero_si512();
    const int8_t* xb = a.codes + r0 * a.k + b * kQ8Block;
    if constexpr (W4) {
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(w + (b * 4 + q) * 64);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xb + r * a.k + q * 8;
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(four_codes(x)));
          dot2[r] = _mm512_dpbusd_epi32(dot2[r], hi, _mm512_set1_epi32(four_codes(x + 4)));
        }
      }
      for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], dot2[r]);
      const __m512 s = load16(scales + b * kQ8Tile), o = load16(offsets + b * kQ8Tile);
      for (int r = 0; r < R; ++r) {
        const int64_t blk = (r0 + r) * a.nb + b;
        const __m512 sd = rounded(_mm512_mul_ps(s, _mm512_cvtepi32_ps(dot[r])));
        const __m512 os = rounded(_mm512_mul_ps(o, _mm512_set1_ps(static_cast<float>(a.sums[blk]))));
        const __m512 t = _mm512_add_ps(sd, os);
        acc[r] = _mm512_add_ps(acc[r], rounded(_mm512_mul_ps(_mm512_set1_ps(a.scales[blk]), t)));
      }
    } else {
      for (int q = 0; q < 8; q += 2) {
        const __m512i v = _mm512_loadu_si512(w + (b * 8 + q) * 64);
        const __m512i v2 = _mm512_loadu_si512(w + (b * 8 + q + 1) * 64);
        for (int r = 0; r < R; ++r) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], v, _mm512_set1_epi32(four_codes(xb + r * a.k + q * 4)));
          dot2[r] = _mm512_dpbusd_epi32(dot2[r], v2, _mm512_set1_epi32(four_codes(xb + r * a.k + q * 4 + 4)));
        }
      }
      for (int r = 0; r < R; ++r) dot[r] = _mm512_add_epi32(dot[r], dot2[r]);
      for (int r = 0; r < R; ++r) {
        const int64_t blk = (r0 + r) * a.nb + b;
        // the codes were stored + 128: take 128 times the block's activation sum back off
        const __m512i exact = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * a.sums[blk]));
        __m512 p = _mm512_cvtepi32_ps(exact);
        if constexpr (F == kW8G) p = rounded(_mm512_mul_ps(load16(scales + b * kQ8Tile), p));
        p = rounded(_mm512_mul_ps(_mm512_set1_ps(a.scales[blk]), p));
        acc[r] = _mm512_add_ps(acc[r], p);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (F == kW8) acc[r] = _mm512_mul_ps(acc[r], load16(scales));
    _mm512_storeu_ps(res[r], acc[r]);
  }
}

// Two adjacent tiles (32 outputs) for rows [r0, r0 + R): the same sums as q8_tile on each, in the same order.
// Each broadcast of four activation codes feeds two vpdpbusd and each block's scales are broadcast once for
// both, where a lone tile spent a broadcast on each: on Zen 4 the broadcasts and the block's float epilogue
// share the vector pipes with vpdpbusd, and steps of many rows are bound by those pipes.
template <int R, int F, typename S>
inline void q8_tile_pair(const Q8Rows& a, int64_t r0, const uint8_t* w, int64_t tile_bytes, const S* scales,
                         const S* offsets, int64_t scale_stride, float (*res)[2 * kQ8Tile]) {
  constexpr bool W4 = F == kW4;
  const uint8_t* w1 = w + tile_bytes;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i dot[R][2];
    const int8_t* xb = a.codes + r0 * a.k + b * kQ8Block;
    if constexpr (W4) {
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) {
        const __m512i v0 = _mm512_loadu_si512(w + (b * 4 + q) * 64);
        const __m512i v1 = _mm512_loadu_si512(w1 + (b * 4 + q) * 64);
        const __m512i lo0 = _mm512_and_si512(v0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xb + r * a.k + q * 8;
          const __m512i xl = _mm512_set1_epi32(four_codes(x)), xh = _mm512_set1_epi32(four_codes(x + 4));
          dot[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][0], lo0, xl), hi0, xh);
          dot[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[r][1], lo1, xl), hi1, xh);
        }
      }
      const __m512 s[2] = {load16(scales + b * kQ8Tile), load16(scales + scale_stride + b * kQ8Tile)};
      const __m512 o[2] = {load16(offsets + b * kQ8Tile), load16(offsets + scale_stride + b * kQ8Tile)};
      for (int r = 0; r < R; ++r) {
        const int64_t blk = (r0 + r) * a.nb + b;
        const __m512 xs = _mm512_set1_ps(static_cast<float>(a.sums[blk])), xd = _mm512_set1_ps(a.scales[blk]);
        for (int h = 0; h < 2; ++h) {
          const __m512 sd = rounded(_mm512_mul_ps(s[h], _mm512_cvtepi32_ps(dot[r][h])));
          const __m512 t = _mm512_add_ps(sd, rounded(_mm512_mul_ps(o[h], xs)));
          acc[r][h] = _mm512_add_ps(acc[r][h], rounded(_mm512_mul_ps(xd, t)));
        }
      }
    } else {
      // the codes were stored + 128: each sum starts at minus 128 times the block's activation sum
      for (int r = 0; r < R; ++r)
        dot[r][0] = dot[r][1] = _mm512_set1_epi32(-128 * a.sums[(r0 + r) * a.nb + b]);
      for (int q = 0; q < 8; ++q) {
        const __m512i v0 = _mm512_loadu_si512(w + (b * 8 + q) * 64);
        const __m512i v1 = _mm512_loadu_si512(w1 + (b * 8 + q) * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_set1_epi32(four_codes(xb + r * a.k + q * 4));
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], v0, x);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], v1, x);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xd = _mm512_set1_ps(a.scales[(r0 + r) * a.nb + b]);
        for (int h = 0; h < 2; ++h) {
          __m512 p = _mm512_cvtepi32_ps(dot[r][h]);
          if constexpr (F == kW8G) p = rounded(_mm512_mul_ps(load16(scales + h * scale_stride + b * kQ8Tile), p));
          acc[r][h] = _mm512_add_ps(acc[r][h], rounded(_mm512_mul_ps(xd, p)));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      if constexpr (F == kW8) acc[r][h] = _mm512_mul_ps(acc[r][h], load16(scales + h * scale_stride));
      _mm512_storeu_ps(res[r] + h * kQ8Tile, acc[r][h]);
    }
}
#elif defined(SPECSERVE_INT_DOT_PATH)
// AVX2: the tile's two halves of 8 outputs in turn (bytes [0, 32) and [32, 64) of each 64-byte group).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <int R, int F, typename S>
inline void q8_tile(const Q8Rows& a, int64_t r0, const uint8_t* w, const S* scales, const S* offsets,
                    float (*res)[kQ8Tile]) {
  constexpr bool W4 = F == kW4;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(-128);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.nb; ++b) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      const int8_t* xb = a.codes + r0 * a.k + b * kQ8Block;
      if constexpr (W4) {
        for (int q = 0; q < 4; ++q) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 4 + q) * 64 + h * 32));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const int8_t* x = xb + r * a.k + q * 8;
            // codes 0..15 times |x| <= 127: a pair's sum stays far inside int16
            const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_codes(x)));
            const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_codes(x + 4)));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones));
          }
        }
        const __m256 s = load8(scales + b * kQ8Tile + h * 8);
        const __m256 o = load8(offsets + b * kQ8Tile + h * 8);
        for (int r = 0; r < R; ++r) {
          const int64_t blk = (r0 + r) * a.nb + b;
          const __m256 sd = rounded(_mm256_mul_ps(s, _mm256_cvtepi32_ps(dot[r])));
          const __m256 os = rounded(_mm256_mul_ps(o, _mm256_set1_ps(static_cast<float>(a.sums[blk]))));
          const __m256 t = _mm256_add_ps(sd, os);
          acc[r] = _mm256_add_ps(acc[r], rounded(_mm256_mul_ps(_mm256_set1_ps(a.scales[blk]), t)));
        }
      } else {
        for (int q = 0; q < 8; ++q) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b * 8 + q) * 64 + h * 32));
          const __m256i ws = _mm256_xor_si256(v, flip);  // code + 128 back to the signed code
          // |w| times x signed by w (both within +-127, so a pair's sum fits int16): |w| once for the rows,
          // where |x| and w signed by x took an abs a row (SmolLM2's w8a8 layers, `python bench/kernel_ab.py
          // --case w8a8 --rows 64`, 2-core AVX2 EPYC: 110.8 ms against 129.0; 9 rows 22.0 against 25.4)
          const __m256i aw = _mm256_abs_epi8(ws);
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_set1_epi32(four_codes(xb + r * a.k + q * 4));
            const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, ws));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(p, ones));
          }
        }
        for (int r = 0; r < R; ++r) {
          const int64_t blk = (r0 + r) * a.nb + b;
          __m256 p = _mm256_cvtepi32_ps(dot[r]);
          if constexpr (F == kW8G) p = rounded(_mm256_mul_ps(load8(scales + b * kQ8Tile + h * 8), p));
          p = rounded(_mm256_mul_ps(_mm256_set1_ps(a.scales[blk]), p));
          acc[r] = _mm256_add_ps(acc[r], p);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if constexpr (F == kW8) acc[r] = _mm256_mul_ps(acc[r], load8(scales + h * 8));
      _mm256_storeu_ps(res[r] + h * 8, acc[r]);
    }
  }
}
#else
template <int R, int F, typename S>
inline void q8_tile(const Q8Rows& a, int64_t r0, const uint8_t* w, const S* scales, const S* offsets,
                    float (*res)[kQ8Tile]) {
  constexpr bool W4 = F == kW4;
  float acc[R][kQ8Tile] = {};
  for (int64_t b = 0; b < a.nb; ++b)
    for (int r = 0; r < R; ++r) {
      const int8_t* x = a.codes + (r0 + r) * a.k + b * kQ8Block;
      const int64_t blk = (r0 + r) * a.nb + b;
      for (int j = 0; j < kQ8Tile; ++j) {
        int32_t dot = 0;
        for (int i = 0; i < kQ8Block; ++i) {
          int32_t c;
          if constexpr (W4) {
            const uint8_t byte = w[((b * 4 + i / 8) * kQ8Tile + j) * 4 + i % 4];
            c = (i % 8 < 4) ? (byte & 0x0F) : (byte >> 4);
          } else {
            c = static_cast<int32_t>(w[((b * 8 + i / 4) * kQ8Tile + j) * 4 + i % 4]) - 128;
          }
          dot += c * x[i];
        }
        if constexpr (W4) {
          const float sd = rounded(scalar(scales, b * kQ8Tile + j) * static_cast<float>(dot));
          const float os = rounded(scalar(offsets, b * kQ8Tile + j) * static_cast<float>(a.sums[blk]));
          acc[r][j] = acc[r][j] + rounded(a.scales[blk] * (sd + os));
        } else if constexpr (F == kW8G) {
          const float sd = rounded(scalar(scales, b * kQ8Tile + j) * static_cast<float>(dot));
          acc[r][j] = acc[r][j] + rounded(a.scales[blk] * sd);
        } else {
          acc[r][j] = acc[r][j] + rounded(a.scales[blk] * static_cast<float>(dot));
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kQ8Tile; ++j) res[r][j] = F == kW8 ? acc[r][j] * scalar(scales, j) : acc[r][j];
}
#endif

// The matrix's tiles P at a time (P = 2: q8_tile_pair), each for every row in passes of kQ8Rows.
template <int P, int F, typename T, typename S>
void q8_tiles(const Q8Rows& a, int64_t rows, const uint8_t* tiles, int64_t tile_bytes, const S* scales,
              const S* offsets, int64_t scale_stride, int64_t n, T* out, int64_t os, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n * rows, a.k))
  for (int64_t t = 0; t < n / kQ8Tile; t += P) {
    const uint8_t* w = tiles + t * tile_bytes;
    const S* s = scales + t * scale_stride;
    const S* o = F == kW4 ? offsets + t * scale_stride : nullptr;
    float res[kQ8Rows][P * kQ8Tile];
    for (int64_t r0 = 0; r0 < rows; r0 += kQ8Rows) {
      const int64_t nr = std::min<int64_t>(kQ8Rows, rows - r0);
      with_rows<kQ8Rows>(nr, [&](auto r) {
        constexpr int R = decltype(r)::value;
#ifdef SPECSERVE_INT_DOT_VNNI
        if constexpr (P == 2)
          q8_tile_pair<R, F, S>(a, r0, w, tile_bytes, s, o, scale_stride, res);
        else
#endif
          q8_tile<R, F, S>(a, r0, w, s, o, res);
      });
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t j = 0; j < P * kQ8Tile; ++j) store(out + (r0 + r) * os, t * kQ8Tile + j, res[r][j]);
    }
  }
}

// x [rows, k] (row stride xs) times the tiled matrix -> out [rows, n] (row stride os), in T.
template <int F, typename T, typename S = float>
int q8_matmul(const T* x, int64_t xs, int64_t rows, const uint8_t* tiles, const S* scales, const S* offsets,
              int64_t n, int64_t k, T* out, int64_t os, int num_threads) {
  if (rows < 1 || n < kQ8Tile || n % kQ8Tile != 0 || k < kQ8Block || k % kQ8Block != 0) return kBadArguments;
  const int64_t nb = k / kQ8Block;
  std::vector<int8_t> codes(rows * k);
  std::vector<float> xd(rows * nb);
  std::vector<int32_t> sums(rows * nb);
  quantize_q8(x, xs, rows, k, codes.data(), xd.data(), sums.data(), num_threads);
  const Q8Rows a{codes.data(), xd.data(), sums.data(), k, nb};
  const int64_t tile_bytes = kQ8Tile * (F == kW4 ? k / 2 : k);
  // a tile's scales (and w4a8's offsets) as they lie: per output (w8a8), or per block of each output
  const int64_t scale_stride = F == kW8 ? kQ8Tile : nb * kQ8Tile;
#ifdef SPECSERVE_INT_DOT_VNNI
  if (rows > kQ8PairBelow && n % (2 * kQ8Tile) == 0) {
    q8_tiles<2, F>(a, rows, tiles, tile_bytes, scales, offsets, scale_stride, n, out, os, num_threads);
    return kOk;
  }
#endif
  q8_tiles<1, F>(a, rows, tiles, tile_bytes, scales, offsets, scale_stride, n, out, os, num_threads);
  return kOk;
}

constexpr const float* kNoOffsets = nullptr;  // w8a8's: typed, so that q8_matmul's S is float

}  // namespace

extern "C" int specserve_quantize_q8(const void* x, int64_t xs, int64_t rows, int64_t k, int8_t* codes,
                                     float* scales, int32_t* sums, int dtype, int num_threads) {
  if (rows < 1 || k < kQ8Block || k % kQ8Block != 0) return kBadArguments;
  if (dtype == 0)
    quantize_q8(static_cast<const float*>(x), xs, rows, k, codes, scales, sums, num_threads);
  else if (dtype == 1)
    quantize_q8(static_cast<const uint16_t*>(x), xs, rows, k, codes, scales, sums, num_threads);
  else
    return kNotInBuild;
  return kOk;
}

extern "C" int specserve_w8a8_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                     const float* scales, int64_t n, int64_t k, float* out, int64_t os,
                                     int num_threads) {
  return q8_matmul<kW8>(x, xs, rows, tiles, scales, kNoOffsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w8a8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                          const float* scales, int64_t n, int64_t k, uint16_t* out, int64_t os,
                                          int num_threads) {
  return q8_matmul<kW8>(x, xs, rows, tiles, scales, kNoOffsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w4a8_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                     const float* scales, const float* offsets, int64_t n, int64_t k, float* out,
                                     int64_t os, int num_threads) {
  return q8_matmul<kW4>(x, xs, rows, tiles, scales, offsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w4a8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                          const float* scales, const float* offsets, int64_t n, int64_t k,
                                          uint16_t* out, int64_t os, int num_threads) {
  return q8_matmul<kW4>(x, xs, rows, tiles, scales, offsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w4a8h_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                      const uint16_t* scales, const uint16_t* offsets, int64_t n, int64_t k,
                                      float* out, int64_t os, int num_threads) {
  return q8_matmul<kW4>(x, xs, rows, tiles, scales, offsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w4a8h_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                           const uint16_t* scales, const uint16_t* offsets, int64_t n, int64_t k,
                                           uint16_t* out, int64_t os, int num_threads) {
  return q8_matmul<kW4>(x, xs, rows, tiles, scales, offsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w8a8g_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                      const float* scales, int64_t n, int64_t k, float* out, int64_t os,
                                      int num_threads) {
  return q8_matmul<kW8G>(x, xs, rows, tiles, scales, kNoOffsets, n, k, out, os, num_threads);
}

extern "C" int specserve_w8a8gh_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                       const uint16_t* scales, int64_t n, int64_t k, float* out, int64_t os,
                                       int num_threads) {
  return q8_matmul<kW8G>(x, xs, rows, tiles, scales, static_cast<const uint16_t*>(nullptr), n, k, out, os,
                         num_threads);
}
