// Paged attention for short queries (decode, speculative verify) on CPU.
//
// Plain C++ with a C ABI and OpenMP, loaded through ctypes: no torch headers, so it builds in about a
// second. The process already holds torch's libgomp (same soname), so this shares torch's thread pool
// instead of starting a second one that would fight it for the cores.
//
// One task per (sequence, KV head): the group's query heads times the sequence's new tokens form R rows.
// Scores are computed a block at a time against a transposed float copy of the block's K, so the inner
// loop runs across the block's tokens (one vector register for 16 tokens) with no horizontal sums; a
// two-pass softmax then weights V rows. Every cached row is read once. Causal masking is done by loop
// bounds (a row stops at its own position), so no -inf ever enters the arithmetic and unowned cache slots
// (a block's unwritten tail) are never read.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(uint16_t* p, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
  p[i] = static_cast<uint16_t>(bits >> 16);
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

// Scores of one block's tokens for every row: scores[r * len + pos] = q_r . k_pos (q already scaled).
template <typename T, int HD>
inline void qk_block(const float* qf, const T*, int64_t R, const int64_t* limit, const T* kblock, int64_t row,
                     int64_t D, int64_t base, int64_t nt, float, float* kf, float* scores, int64_t len) {
  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t d = 0; d < D; ++d) kf[d] = load(kblock + t * row, d);
    const int64_t pos = base + t;
    for (int64_t r = 0; r < R; ++r) {
      if (pos >= limit[r]) continue;
      const float* qr = qf + r * D;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kf[d];
      scores[r * len + pos] = dot;
    }
  }
}

// acc[r] += sum over the block's visible tokens of p[r, pos] * v_pos.
template <typename T, int HD>
inline void pv_block(int64_t R, const int64_t* limit, const T* vblock, int64_t row, int64_t D, int64_t base,
                     int64_t nt, const float* scores, int64_t len, float* vb, float* acc) {
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t d = 0; d < D; ++d) vb[t * D + d] = load(vblock + t * row, d);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = limit[r] - base < nt ? limit[r] - base : nt;
    const float* pr = scores + r * len + base;
    float* ar = acc + r * D;
    for (int64_t t = 0; t < n; ++t) {
      const float w = pr[t];
      const float* vt = vb + t * D;
      for (int64_t d = 0; d < D; ++d) ar[d] += w * vt[d];
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bfloat16 caches on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later): dot products straight
// from the cached bf16 pairs into float32 (products of two bf16 are exact in float32), and V converted by
// one instruction. Accumulators live in registers for a whole block.
template <int HD>
inline void qk_block_bf16(const uint16_t* qb, int64_t R, const int64_t* limit, const uint16_t* kblock,
                          int64_t row, int64_t base, int64_t nt, float scale, float* scores, int64_t len) {
  for (int64_t t = 0; t < nt; ++t) {
    const uint16_t* kr = kblock + t * row;
    __m512bh kv[HD / 32];
    for (int j = 0; j < HD / 32; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kr + 32 * j);
    const int64_t pos = base + t;
    for (int64_t r = 0; r < R; ++r) {
      if (pos >= limit[r]) continue;
      __m512 dot = _mm512_setzero_ps();
      for (int j = 0; j < HD / 32; ++j)
        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qb + r * HD + 32 * j), kv[j]);
      scores[r * len + pos] = _mm512_reduce_add_ps(dot) * scale;
    }
  }
}

template <int HD>
inline void pv_block_bf16(int64_t R, const int64_t* limit, const uint16_t* vblock, int64_t row, int64_t base,
                          int64_t nt, const float* scores, int64_t len, float* acc) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = limit[r] - base < nt ? limit[r] - base : nt;
    if (n <= 0) continue;
    const float* pr = scores + r * len + base;
    __m512 a[HD / 16];
    for (int j = 0; j < HD / 16; ++j) a[j] = _mm512_loadu_ps(acc + r * HD + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_set1_ps(pr[t]);
      const uint16_t* vr = vblock + t * row;
      for (int j = 0; j < HD / 16; ++j) {
        const __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * j)));
        a[j] = _mm512_fmadd_ps(w, v, a[j]);
      }
    }
    for (int j = 0; j < HD / 16; ++j) _mm512_storeu_ps(acc + r * HD + 16 * j, a[j]);
  }
}
#define SPECSERVE_BF16_PATH 1
#endif

struct Args {
  const void* q;
  int64_t q_tok, q_head;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  const int64_t* seq_ids;
  int64_t num_seqs;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  void* out;
  int64_t o_tok, o_head;
};

template <typename T, int HD>
void run(const Args& a, int num_threads) {
  const T* qp = static_cast<const T*>(a.q);
  const T* kp = static_cast<const T*>(a.k_cache);
  const T* vp = static_cast<const T*>(a.v_cache);
  T* op = static_cast<T*>(a.out);
  const int64_t D = HD > 0 ? HD : a.head_dim, BS = a.block_size, group = a.num_heads / a.num_kv_heads;
  const int64_t row = a.num_kv_heads * D;  // one token's K (or V) in the cache
  // Blocks sit at random places in the cache and a head's slice of a row is a third or less of it, a
  // pattern the hardware prefetcher does not follow. So a task takes all KV heads of a sequence: the first
  // head prefetches whole blocks (contiguous) and the others find them in L2. Small batches split heads
  // across tasks instead, to keep every thread busy.
  const int64_t heads_per_task = a.num_seqs >= 4 * num_threads ? a.num_kv_heads : 1;
  const int64_t tasks_per_seq = a.num_kv_heads / heads_per_task;
  const int64_t num_tasks = a.num_seqs * tasks_per_seq;
  const int64_t block_bytes = BS * row * static_cast<int64_t>(sizeof(T));
#ifdef SPECSERVE_BF16_PATH
  constexpr bool kBf16Path = std::is_same<T, uint16_t>::value && HD > 0 && HD % 32 == 0;
  auto qk_bf16 = [](const uint16_t* qb, int64_t R, const int64_t* limit, const void* kblock, int64_t row,
                    int64_t base, int64_t nt, float scale, float* scores, int64_t len) {
    if constexpr (kBf16Path)
      qk_block_bf16<HD>(qb, R, limit, static_cast<const uint16_t*>(kblock), row, base, nt, scale, scores, len);
  };
  auto pv_bf16 = [](int64_t R, const int64_t* limit, const void* vblock, int64_t row, int64_t base, int64_t nt,
                    const float* scores, int64_t len, float* acc) {
    if constexpr (kBf16Path)
      pv_block_bf16<HD>(R, limit, static_cast<const uint16_t*>(vblock), row, base, nt, scores, len, acc);
  };
#else
  constexpr bool kBf16Path = false;
  auto qk_bf16 = [](const uint16_t*, int64_t, const int64_t*, const void*, int64_t, int64_t, int64_t, float,
                    float*, int64_t) {};
  auto pv_bf16 = [](int64_t, const int64_t*, const void*, int64_t, int64_t, int64_t, const float*, int64_t,
                    float*) {};
#endif

  // The next block of a task's first head: whole block rows (all heads, contiguous) or one head's slices.
  auto prefetch_rows = [&](const T* cache, int32_t block, int64_t h, int64_t bytes) {
    const T* start = cache + static_cast<int64_t>(block) * BS * row;
    if (bytes == block_bytes) return prefetch(start, bytes);
    for (int64_t t = 0; t < BS; ++t) prefetch(start + t * row + h * D, bytes);
  };

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf, scores, acc, kt(BS * D), vb(BS * D);
    std::vector<uint16_t> qb;
    std::vector<int64_t> limit;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task)
    for (int64_t h = (task % tasks_per_seq) * heads_per_task, h_end = h + heads_per_task; h < h_end; ++h) {
      const int64_t s = a.seq_ids[task / tasks_per_seq];
      const bool first = h == (task % tasks_per_seq) * heads_per_task;
      const int64_t fetch = heads_per_task > 1 ? block_bytes : D * static_cast<int64_t>(sizeof(T));
      const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
      const int64_t len = a.seq_lens[s];
      const int64_t R = q_len * group;  // rows: query token i, query head g -> i * group + g
      const int32_t* table = a.block_tables + s * a.table_stride;
      qf.resize(R * D);
      qb.resize(kBf16Path ? R * D : 0);
      scores.resize(R * len);
      acc.assign(R * D, 0.f);
      limit.resize(R);
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + (q0 + i) * a.q_tok + (h * group + g) * a.q_head;
          float* dst = qf.data() + (i * group + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = load(src, d) * a.scale;
          if (kBf16Path) std::memcpy(qb.data() + (i * group + g) * D, src, D * sizeof(T));
          limit[i * group + g] = len - q_len + i + 1;  // token i sees positions before this
        }
      const int64_t num_blocks = (len + BS - 1) / BS;

      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t base = b * BS, nt = len - base < BS ? len - base : BS;
        const T* kblock = kp + static_cast<int64_t>(table[b]) * BS * row + h * D;
        if (first && b + 1 < num_blocks) prefetch_rows(kp, table[b + 1], h, fetch);
        if (kBf16Path)
          qk_bf16(qb.data(), R, limit.data(), kblock, row, base, nt, a.scale, scores.data(), len);
        else
          qk_block<T, HD>(qf.data(), qp, R, limit.data(), kblock, row, D, base, nt, a.scale, kt.data(),
                          scores.data(), len);
      }

      for (int64_t r = 0; r < R; ++r) {
        float* sr = scores.data() + r * len;
        const int64_t n = limit[r];
        float lanes[16];
        for (int j = 0; j < 16; ++j) lanes[j] = -3.0e38f;
        int64_t p = 0;
        for (; p + 16 <= n; p += 16)
          for (int j = 0; j < 16; ++j) lanes[j] = sr[p + j] > lanes[j] ? sr[p + j] : lanes[j];
        float mx = -3.0e38f;
        for (int j = 0; j < 16; ++j) mx = lanes[j] > mx ? lanes[j] : mx;
        for (; p < n; ++p) mx = sr[p] > mx ? sr[p] : mx;
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sr[i] = exp_nonpositive(sr[i] - mx);
          sum += sr[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sr[i] *= inv;
      }

      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t base = b * BS, nt = len - base < BS ? len - base : BS;
        const T* vblock = vp + static_cast<int64_t>(table[b]) * BS * row + h * D;
        if (first && b + 1 < num_blocks) prefetch_rows(vp, table[b + 1], h, fetch);
        if (kBf16Path)
          pv_bf16(R, limit.data(), vblock, row, base, nt, scores.data(), len, acc.data());
        else
          pv_block<T, HD>(R, limit.data(), vblock, row, D, base, nt, scores.data(), len, vb.data(), acc.data());
      }

      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < group; ++g) {
          T* dst = op + (q0 + i) * a.o_tok + (h * group + g) * a.o_head;
          const float* src = acc.data() + (i * group + g) * D;
          for (int64_t d = 0; d < D; ++d) store(dst, d, src[d]);
        }
    }
  }
}

}  // namespace

extern "C" int specserve_paged_attention_short(
    const void* q, int64_t q_tok, int64_t q_head, const void* k_cache, const void* v_cache,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* seq_ids, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, void* out, int64_t o_tok,
    int64_t o_head, int dtype, int num_threads) {
  if (block_size > 256 || num_heads % num_kv_heads != 0) return 1;
  const Args a{q,        q_tok,    q_head,    k_cache,      v_cache,   block_tables, table_stride,
               seq_lens, query_start_loc, seq_ids, num_seqs, num_heads, num_kv_heads, head_dim,
               block_size, scale, out, o_tok, o_head};
  // Head sizes known at compile time let the compiler unroll the dot products into whole registers.
  if (dtype == 0) {
    if (head_dim == 64) run<float, 64>(a, num_threads);
    else if (head_dim == 128) run<float, 128>(a, num_threads);
    else run<float, 0>(a, num_threads);
  } else if (dtype == 1) {
    if (head_dim == 64) run<uint16_t, 64>(a, num_threads);
    else if (head_dim == 128) run<uint16_t, 128>(a, num_threads);
    else run<uint16_t, 0>(a, num_threads);
  } else {
    return 2;
  }
  return 0;
}
