// The float32 int8 / int4 products in plain loops: what a build without AVX2 + FMA compiles (tests compare
// the two).
#include "common.h"

namespace {

void q8_generic(const float* x, int64_t xs, int64_t rows, const int8_t* codes, const float* scales, int64_t n,
                int64_t k, float* out, int64_t os, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* w = codes + j * k;
      const float* xr = x + r * xs;
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s += static_cast<float>(w[i]) * xr[i];
      out[r * os + j] = s * scales[j];
    }
}

void q8g_generic(const float* x, int64_t xs, int64_t rows, const int8_t* codes, const float* scales, int64_t n,
                 int64_t k, float* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * xs;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* p = codes + j * k + g * 32;
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += static_cast<float>(p[i]) * xr[g * 32 + i];
        total += s * scales[j * groups + g];
      }
      out[r * os + j] = total;
    }
}

void q4_generic(const float* x, int64_t xs, int64_t rows, const uint8_t* packed, const float* scales,
                const float* offsets, int64_t n, int64_t k, const float* gsum, float* out, int64_t os,
                int num_threads) {
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, kRowsPerClaim) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * xs;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = packed + (j * groups + g) * 16;
        float s = 0.f;
        for (int i = 0; i < 16; ++i) s += static_cast<float>(p[i] & 0x0F) * xr[g * 32 + i];
        for (int i = 0; i < 16; ++i) s += static_cast<float>(p[i] >> 4) * xr[g * 32 + 16 + i];
        total += s * scales[j * groups + g] + offsets[j * groups + g] * gsum[r * groups + g];
      }
      out[r * os + j] = total;
    }
}

}  // namespace
