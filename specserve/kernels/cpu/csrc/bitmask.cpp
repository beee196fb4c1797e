// Structured output: logits[r][t] = -inf wherever bit t of the packed token bitmask row (xgrammar's layout:
// little-endian 32-bit words, bit t % 32 of word t / 32 set = allowed) is clear, on the listed rows, in
// place. On one thread on purpose: it is ~20 us a row (a store per forbidden token), while a parallel
// region on a shared, loaded 2-core machine waits for a core another process holds (torch's bitmask ops
// took 21-32 ms a step at batch 1-8 there, load ~5). -inf is stored as its bit pattern, so -ffast-math has
// no infinity to reason about. Returns 1 when a row index is out of range.
#include "api.h"

extern "C" int specserve_apply_bitmask(float* logits, int64_t logits_stride, int64_t vocab,
                                       const int32_t* bitmask, int64_t mask_stride, const int64_t* rows,
                                       int64_t num_rows, int64_t num_logit_rows) {
  constexpr uint32_t kNegInf = 0xFF800000u;
  for (int64_t r = 0; r < num_rows; ++r)
    if (rows[r] < 0 || rows[r] >= num_logit_rows) return kBadArguments;
  for (int64_t r = 0; r < num_rows; ++r) {
    uint32_t* x = reinterpret_cast<uint32_t*>(logits + rows[r] * logits_stride);
    const uint32_t* m = reinterpret_cast<const uint32_t*>(bitmask + rows[r] * mask_stride);
    const int64_t full = vocab / 32;
    for (int64_t w = 0; w < full; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      uint32_t* dst = x + w * 32;
      if (bits == 0) {
        for (int i = 0; i < 32; ++i) dst[i] = kNegInf;
      } else {
        for (int i = 0; i < 32; ++i) dst[i] = ((bits >> i) & 1u) ? dst[i] : kNegInf;
      }
    }
    for (int64_t t = full * 32; t < vocab; ++t)
      if (!((m[t / 32] >> (t % 32)) & 1u)) x[t] = kNegInf;
  }
  return kOk;
}
