// Rotary embedding + KV-cache write, fused (float32 and bfloat16, every build; float32 over bfloat16 caches).
#include "api.h"
#include "common.h"

namespace {

// x [head_dim] rotated in place: lo = x1 c - x2 s, hi = x2 c' + x1 s', each product rounded, then the sum,
// as torch's x * cos + rotate_half(x) * sin computes them.
inline void rope_f32(float* x, const float* c, const float* s, int64_t half) {
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + d + half);
    const __m256 lo = _mm256_sub_ps(rounded(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d))),
                                    rounded(_mm256_mul_ps(x2, _mm256_loadu_ps(s + d))));
    const __m256 hi = _mm256_add_ps(rounded(_mm256_mul_ps(x2, _mm256_loadu_ps(c + d + half))),
                                    rounded(_mm256_mul_ps(x1, _mm256_loadu_ps(s + d + half))));
    _mm256_storeu_ps(x + d, lo);
    _mm256_storeu_ps(x + d + half, hi);
  }
#endif
  for (; d < half; ++d) {
    const float x1 = x[d], x2 = x[d + half];
    const float lo = rounded(x1 * c[d]) - rounded(x2 * s[d]);
    const float hi = rounded(x2 * c[d + half]) + rounded(x1 * s[d + half]);
    x[d] = lo;
    x[d + half] = hi;
  }
}

}  // namespace

// Rotary embedding of the q and k parts of a fused qkv projection, in place, and the new tokens' K and V
// written into the cache: what a layer does between its qkv matmul and attention, one call instead of
// a score of small torch ops. Results are those of x * cos + rotate_half(x) * sin in torch, bit for bit:
// in bfloat16 each product and the sum are rounded to bfloat16 as torch's own bfloat16 ops round them; in
// float32 each is rounded once, without FMA. Tokens with a negative slot are rotated but not cached.
//   qkv [tokens, tok_stride]: q heads, then k heads, then v heads, head_dim each
//   cos, sin [max_position, head_dim]; positions, slots int64 [tokens]
extern "C" int specserve_rope_write_kv(void* qkv, int64_t tok_stride, int64_t num_tokens,
                                       const int64_t* positions, const void* cos, const void* sin,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, void* k_cache,
                                       void* v_cache, const int64_t* slots, int dtype, int num_threads) {
  if ((dtype != 0 && dtype != 1 && dtype != kDtypeF32Bf16Kv) || head_dim % 2 != 0 || head_dim > 512)
    return kNotInBuild;
  const int64_t half = head_dim / 2, kv = num_kv_heads * head_dim;
  // Threads only for prefill-sized batches: a decode step's 64 tokens take ~10 us on one AVX2 core
  // (bench/kernels.py), about what waking a second thread and meeting it at the barrier costs when idle,
  // and far less than that costs on a busy shared machine.
  const bool threaded = num_tokens >= 256;
  if (dtype == 0 || dtype == kDtypeF32Bf16Kv) {
    float* base = static_cast<float*>(qkv);
    const float* cp = static_cast<const float*>(cos);
    const float* sp = static_cast<const float*>(sin);
#pragma omp parallel for num_threads(num_threads) if (threaded)
    for (int64_t i = 0; i < num_tokens; ++i) {
      float* row = base + i * tok_stride;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
        rope_f32(row + h * head_dim, cp + positions[i] * head_dim, sp + positions[i] * head_dim, half);
      if (slots[i] < 0) continue;
      const float* k = row + num_heads * head_dim;
      const float* v = k + kv;
      if (dtype == 0) {
        std::memcpy(static_cast<float*>(k_cache) + slots[i] * kv, k, kv * sizeof(float));
        std::memcpy(static_cast<float*>(v_cache) + slots[i] * kv, v, kv * sizeof(float));
        continue;
      }
      // rounded to nearest even, as torch's .to(torch.bfloat16) rounds the reference's cache writes
      uint16_t* kc = static_cast<uint16_t*>(k_cache) + slots[i] * kv;
      uint16_t* vc = static_cast<uint16_t*>(v_cache) + slots[i] * kv;
      for (int64_t d = 0; d < kv; ++d) store(kc, d, k[d]), store(vc, d, v[d]);
    }
    return kOk;
  }
  uint16_t* base = static_cast<uint16_t*>(qkv);
  const uint16_t* cp = static_cast<const uint16_t*>(cos);
  const uint16_t* sp = static_cast<const uint16_t*>(sin);
  uint16_t* kc = static_cast<uint16_t*>(k_cache);
  uint16_t* vc = static_cast<uint16_t*>(v_cache);
  auto round_bf16 = [](float v) {
    uint16_t b;
    store(&b, 0, v);
    return load(&b, 0);
  };
#pragma omp parallel for num_threads(num_threads) if (threaded)
  for (int64_t i = 0; i < num_tokens; ++i) {
    uint16_t* row = base + i * tok_stride;
    const uint16_t* c = cp + positions[i] * head_dim;
    const uint16_t* s = sp + positions[i] * head_dim;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      uint16_t* x = row + h * head_dim;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = load(x, d), x2 = load(x, d + half);
        const float lo = round_bf16(x1 * load(c, d)) - round_bf16(x2 * load(s, d));
        const float hi = round_bf16(x2 * load(c, d + half)) + round_bf16(x1 * load(s, d + half));
        store(x, d, lo);
        store(x, d + half, hi);
      }
    }
    if (slots[i] < 0) continue;
    std::memcpy(kc + slots[i] * kv, row + num_heads * head_dim, kv * sizeof(uint16_t));
    std::memcpy(vc + slots[i] * kv, row + (num_heads + num_kv_heads) * head_dim, kv * sizeof(uint16_t));
  }
  return kOk;
}
