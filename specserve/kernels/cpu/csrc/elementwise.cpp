// The decoder layer's elementwise steps, fused: residual add + RMSNorm, per-head RMSNorm, silu / gelu-tanh
// times up.
//
// torch runs F.rms_norm on CPU as a chain of ops (widen, pow, mean, add, rsqrt, mul, mul, narrow) and a
// gated MLP's silu(gate) * up as two more, each a pass over memory and, above torch's grain size, a
// parallel region. Under `serve`, where the client and the event loop share the two cores, every region is
// a barrier that waits for a descheduled thread. These do each step in one pass with torch's roundings:
// float32 arithmetic, one rounding to the storage type where torch stores a tensor.
#include "api.h"
#include "common.h"

namespace {

// Threads only from this many elements: a parallel region waits for its slowest thread, and on a shared
// machine that is one the OS has descheduled. bench/profile_step.py --batch 64 (2-core AMX Xeon, bf16, the
// machine at load ~11, indicative only): silu * up of 64 x 1536 took 7.8 ms a call threaded, the serial
// add + norm beside it 0.6 ms; decode steps with it serial ran 0.80x the time, alternated in one process.
// Its cost where the second core is free: ~40 us a layer (medians 86 against 47 us, same machine), ~1 % of
// a step of that batch.
constexpr int64_t kThreadedFrom = int64_t{1} << 18;

__attribute__((always_inline)) inline float round_as(const float*, float v) { return v; }
__attribute__((always_inline)) inline float round_as(const uint16_t*, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  bits &= 0xFFFF0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float sum_squares(const T* x, int64_t d) {
  float ss = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    const float v = load(x, j);
    ss += v * v;
  }
  return ss;
}

// out = x * rsqrt(ss / d + eps) * w, rounded once (out may be x: each element is read before it is written).
template <typename T>
inline void normalise(const T* x, T* out, const T* w, int64_t d, float ss, float eps) {
  const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) store(out, j, load(x, j) * r * load(w, j));
}

// Rows of d: with `add`, h += add (stored rounded, the residual stream as torch keeps it) first; then
// out = h * rsqrt(mean(h^2) + eps) * w, rounded once (F.rms_norm's float32 math).
template <typename T>
void add_rms_norm(T* h, const T* add, const T* w, T* out, int64_t n, int64_t d, int64_t h_stride,
                  int64_t add_stride, int64_t out_stride, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * d >= kThreadedFrom)
  for (int64_t i = 0; i < n; ++i) {
    T* hr = h + i * h_stride;
    T* orow = out + i * out_stride;
    float ss = 0.f;
    if (add != nullptr) {
      const T* ar = add + i * add_stride;
      for (int64_t j = 0; j < d; ++j) {
        const float s = round_as(hr, load(hr, j) + load(ar, j));
        store(hr, j, s);
        ss += s * s;
      }
    } else {
      ss = sum_squares(hr, d);
    }
    normalise(hr, orow, w, d, ss, eps);
  }
}

// Per-head RMSNorm (Qwen3's and Gemma 3's q and k norms) in place: row i of n holds `heads` heads of d at
// x + i * stride, each normalised alone with the one weight vector w, in add_rms_norm's arithmetic. torch's
// norm of the [n, heads, d] view was eight ops, ~130 us a call for Gemma 3 270M's prefill chunks.
template <typename T>
void rms_norm_heads(T* x, const T* w, int64_t n, int64_t heads, int64_t d, int64_t stride, float eps,
                    int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * heads * d >= kThreadedFrom)
  for (int64_t i = 0; i < n * heads; ++i) {
    T* hr = x + (i / heads) * stride + (i % heads) * d;
    normalise(hr, hr, w, d, sum_squares(hr, d), eps);
  }
}

// silu in IEEE division and unreordered arithmetic: under -ffast-math, bfloat16 products came out two
// steps from torch's silu(gate) * up, not one.
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math", "no-associative-math")

// exp(x) to about an ulp, in SLEEF's expf_u10 scheme: x = q ln2 + s with ln2 in two parts, a degree-7
// minimax polynomial in s, then 2^q. (The attention softmax's exp_nonpositive is ~1e-5 relative: silu
// through it was 1e-5 from float64's, against torch's 1e-7.) About 1 in 1,000 bfloat16 results still
// differ from torch's by one step: float32 results a few ulps apart, rounded from either side of a tie.
inline float exp_sleef(float x) {
  const float q = __builtin_rintf(x * 1.442695040888963407359924681001892137f);  // std:: is not inlined
  float s = __builtin_fmaf(q, -0.693145751953125f, x);
  s = __builtin_fmaf(q, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = __builtin_fmaf(u, s, 0.00139304355252534151077271f);
  u = __builtin_fmaf(u, s, 0.00833336077630519866943359f);
  u = __builtin_fmaf(u, s, 0.0416664853692054748535156f);
  u = __builtin_fmaf(u, s, 0.166666671633720397949219f);
  u = __builtin_fmaf(u, s, 0.5f);
  u = __builtin_fmaf(s * s, u, s + 1.0f);
  // 2^q in two factors, as SLEEF's ldexp2k: q reaches 128 just below the overflow threshold
  const int32_t qi = static_cast<int32_t>(q);
  const int32_t half = qi >> 1;
  const uint32_t b1 = static_cast<uint32_t>(half + 127) << 23, b2 = static_cast<uint32_t>(qi - half + 127) << 23;
  float f1, f2;
  std::memcpy(&f1, &b1, sizeof f1);
  std::memcpy(&f2, &b2, sizeof f2);
  u = u * f1 * f2;
  u = x < -104.f ? 0.f : u;
  return x > 88.72283935546875f ? __builtin_inff() : u;
}

// out[:, :d] = act(gu[:, :d]) * gu[:, d:2d]: the activation rounded to T, then the product rounded (two torch
// ops).
template <typename T, typename Act>
void act_mul(const T* gu, T* out, int64_t n, int64_t d, int64_t gu_stride, int64_t out_stride,
             int num_threads, Act act) {
#pragma omp parallel for num_threads(num_threads) if (n * d >= kThreadedFrom)
  for (int64_t i = 0; i < n; ++i) {
    const T* g = gu + i * gu_stride;
    const T* u = g + d;
    T* o = out + i * out_stride;
    for (int64_t j = 0; j < d; ++j) store(o, j, round_as(g, act(load(g, j))) * load(u, j));
  }
}

// Past exp's range both are 0 outright: under -ffast-math's finite-only arithmetic x / (1 + exp) took exp's
// unchecked 2^q to a NaN there (silu(-200) was NaN in the vectorised loop; its true value is under 1e-80).
struct Silu {
  __attribute__((always_inline)) float operator()(float x) const {
    return x < -88.f ? 0.f : x / (1.f + exp_sleef(-x));
  }
};

// gelu in its tanh form as torch's F.gelu(x, approximate="tanh") writes it, 0.5 x (1 + tanh(sqrt(2 / pi)
// (x + 0.044715 x^3))). 0.5 (1 + tanh(u)) is sigmoid(2u) = 1 / (1 + exp(-2u)): no cancellation where tanh
// nears -1 (torch's float32 1 + tanh loses all but a few bits there).
struct GeluTanh {
  __attribute__((always_inline)) float operator()(float x) const {
    const float e = -2.f * 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return e > 88.f ? 0.f : x / (1.f + exp_sleef(e));
  }
};
#pragma GCC pop_options

}  // namespace

namespace {
// f(T{}) with T the storage type of `dtype` (0 float32, 1 bfloat16 bits); 2 for any other dtype.
template <typename F>
int by_dtype(int dtype, F f) {
  if (dtype == 0) f(float{});
  else if (dtype == 1) f(uint16_t{});
  else return kNotInBuild;
  return kOk;
}
}  // namespace

extern "C" int specserve_add_rms_norm(void* h, const void* add, const void* w, void* out, int64_t n,
                                      int64_t d, int64_t h_stride, int64_t add_stride, int64_t out_stride,
                                      float eps, int dtype, int num_threads) {
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm(static_cast<T*>(h), static_cast<const T*>(add), static_cast<const T*>(w),
                 static_cast<T*>(out), n, d, h_stride, add_stride, out_stride, eps, num_threads);
  });
}

extern "C" int specserve_silu_mul(const void* gu, void* out, int64_t n, int64_t d, int64_t gu_stride,
                                  int64_t out_stride, int dtype, int num_threads) {
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    act_mul(static_cast<const T*>(gu), static_cast<T*>(out), n, d, gu_stride, out_stride, num_threads,
            Silu{});
  });
}

extern "C" int specserve_gelu_tanh_mul(const void* gu, void* out, int64_t n, int64_t d, int64_t gu_stride,
                                       int64_t out_stride, int dtype, int num_threads) {
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    act_mul(static_cast<const T*>(gu), static_cast<T*>(out), n, d, gu_stride, out_stride, num_threads,
            GeluTanh{});
  });
}

extern "C" int specserve_rms_norm_heads(void* x, const void* w, int64_t n, int64_t heads, int64_t d,
                                        int64_t stride, float eps, int dtype, int num_threads) {
  return by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_heads(static_cast<T*>(x), static_cast<const T*>(w), n, heads, d, stride, eps, num_threads);
  });
}
