// Helpers every kernel family shares: bf16 <-> float loads and stores, the int4 products' group sums, exp for
// the softmax and the activations, prefetches, horizontal sums, the panel products' thread driver, and the
// one dispatch from a runtime row count to the templates written for each count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <omp.h>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// always_inline: the silu loop (elementwise.cpp) is compiled with other float options, across which GCC inlines only
// what is marked so (a call left in the loop keeps it from vectorising).
__attribute__((always_inline)) inline float load(const float* p, int64_t i) { return p[i]; }
__attribute__((always_inline)) inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
__attribute__((always_inline)) inline void store(float* p, int64_t i, float v) { p[i] = v; }
__attribute__((always_inline)) inline void store(uint16_t* p, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
  p[i] = static_cast<uint16_t>(bits >> 16);
}

// Each row's sums of x over groups of 32 inputs, [rows, k / 32]: the int4 products' offset terms.
template <typename T>
std::vector<float> group_sums(const T* x, int64_t xs, int64_t rows, int64_t k) {
  const int64_t groups = k / 32;
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.f;
      for (int i = 0; i < 32; ++i) t += load(x + r * xs, g * 32 + i);
      sums[r * groups + g] = t;
    }
  return sums;
}

// exp(x) for x <= 0 (scores minus the row max): 2^(x log2 e) split into integer and fraction, the fraction
// by a degree-6 polynomial (relative error ~2e-7). Written so that the compiler vectorises the loop.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  const float p =
      1.f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f +
                 f * (0.00961812911f + f * (0.00133335581f + f * 0.000154035304f)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, 3);
}

// Lines wanted some microseconds on, into L2 (prefetcht1) rather than L1: an L1 prefetch holds one of the
// core's few L1 miss buffers until its line arrives from memory, so a stream asked for far ahead is throttled
// to what those buffers carry in one memory latency; L2 tracks many more misses, and a load then finds its
// line there. Paged attention's K and V, SmolLM2's 30 layers, shuffled blocks, outputs identical (`python
// bench/kernel_ab.py --case attention`, Zen 4): bfloat16 64 x 400 tokens 27.4 ms against 42.7, 18 x 800
// 14.7 against 24.2, batch 1 x 1,500 3.14 against 3.46; float32 64 x 400 56.8 against 75.1, a verify of 5
// at 18 x 600 40.5 against 51.7, batch 1 x 1,000 one thread 3.88 against 5.06.
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, 2);
}

// Keeps a product in a register of its own, so that with -ffast-math the compiler cannot fuse it with the
// following add into an FMA (one rounding instead of torch's two): float32 rope must match torch bit for bit.
template <typename V>
inline V rounded(V v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile V keep = v;
  v = keep;
#endif
  return v;
}

inline bool threaded_for(int64_t n, int64_t k) { return n * k >= (int64_t{1} << 16); }

// The int4 and grouped int8 few-row products prefetch the weights of the output row this many ahead: their
// rows are short streams in two or three arrays (SmolLM2's int4: 288 bytes of codes, 72 of scales, 72 of
// offsets), which the hardware prefetcher did not run far enough ahead of. bench/kernel_ab.py, avx2-only
// build, Zen 4, 1 row: int4 over 30 layers 5.91 / 6.05 ms against 6.08 / 6.35 (3 or 16 ahead did as
// well); a Q8_0 head of 49,152 x 576, four copies in turn, 3.85 ms against 5.10 (4 rows 8.13 against
// 8.56; the native build 4.81 against 5.76). The per-output int8 product's rows of 576-1,536 bytes ran
// no faster with it (6.17 against 6.16 ms).
constexpr int64_t kRowsAhead = 8;

#if defined(__AVX2__) && defined(__FMA__)
// The sum of a vector's 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// Loops over output rows hand them out this many at a time, from a shared counter rather than in fixed
// halves: on a shared node a thread can be descheduled for a whole time slice, and the region then ends when
// the others have done its rows instead of when it comes back to do them. 32 rows is a few microseconds of
// work (576-wide rows), against one atomic add per claim, and keeps the row prefetch (kRowsAhead) running
// within a claim.
constexpr int64_t kRowsPerClaim = 32;

// The panel products' driver (dense and widened, float32 and bf16): rows in chunks whose activations stay in
// L2 while every panel of outputs passes over them, the panels of a chunk claimed one at a time by whichever
// thread is free (kRowsPerClaim says why).
// block(c0, nr, pi, buffer) computes rows [c0, c0 + nr) against panel pi; buffer is the thread's own
// `scratch` elements of T (where a quantized panel is widened).
template <typename T = float, typename Block>
void over_panels(int64_t rows, int64_t chunk, int64_t num_panels, bool threaded, int num_threads, Block block,
                 int64_t scratch = 0) {
#pragma omp parallel num_threads(num_threads) if (threaded)
  {
    // on a cache line: malloc's 16-byte alignment split every other 32-byte load (every 64-byte one) in two
    std::vector<T> buffer(scratch + 64 / sizeof(T));
    T* aligned = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
      const int64_t nr = rows - c0 < chunk ? rows - c0 : chunk;
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t pi = 0; pi < num_panels; ++pi) block(c0, nr, pi, aligned);
    }
  }
}

// f(std::integral_constant<int, R>{}) for R = rows when 1 <= rows <= Max, returning true; false (nothing run)
// for any other count. The few-row kernels are templates on their row count (R accumulators in registers),
// and this is the one place a runtime count picks the instantiation.
template <typename F, int... R>
inline bool with_rows_in(int64_t rows, F&& f, std::integer_sequence<int, R...>) {
  return ((rows == R + 1 ? (f(std::integral_constant<int, R + 1>{}), true) : false) || ...);
}

template <int Max, typename F>
inline bool with_rows(int64_t rows, F&& f) {
  return with_rows_in(rows, std::forward<F>(f), std::make_integer_sequence<int, Max>{});
}

}  // namespace
