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
// (a block's unwritten tail) are never read. A sliding window (Gemma 3, Mistral) is a lower bound the same
// way: a row's softmax starts at its first visible position and the task starts at the block holding its
// earliest row's first one, so blocks wholly before the window are never read. Score soft-capping
// (cap * tanh(s / cap), Gemma 2 style) is applied in the softmax, shared by every path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <omp.h>
#include <type_traits>
#include <vector>


#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// always_inline: the silu loop below is compiled with other float options, across which GCC inlines only
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

// The attention kernels' prefetches for the key tile at position pt. A task of every head trickles them
// beside its loads: this returns where, the same tile of the block `ahead` blocks on in K (nullptr past the
// sequence's last block) and of its own block in V. Other tasks ask for whole blocks (or their head's
// slices: prefetch_block) as a block starts, and get nullptrs.
template <typename T, typename PrefetchBlock>
inline void fetch_tile(bool trickle, const T* kp, const T* vp, const int32_t* table, int64_t BS, int64_t row,
                       int64_t ahead, int64_t num_blocks, int64_t pt, PrefetchBlock prefetch_block,
                       const char** k_ahead, const char** v_now) {
  const int64_t b = pt / BS;
  *k_ahead = *v_now = nullptr;
  if (!trickle) {
    if (pt % BS == 0 && b + ahead < num_blocks) prefetch_block(kp, b + ahead);
    if (pt % BS == 0) prefetch_block(vp, b);
    return;
  }
  const int64_t tile = pt % BS * row;  // the tile's offset in its block, in elements
  const auto block_at = [&](const T* cache, int64_t blk) {
    return reinterpret_cast<const char*>(cache + static_cast<int64_t>(table[blk]) * BS * row + tile);
  };
  if (b + ahead < num_blocks) *k_ahead = block_at(kp, b + ahead);
  *v_now = block_at(vp, b);
}

// The panel products' driver (dense and widened, float32 and bf16): rows in chunks whose activations stay in
// L2 while every panel of outputs passes over them, the panels of a chunk shared out over the threads.
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
#pragma omp for schedule(static) nowait
      for (int64_t pi = 0; pi < num_panels; ++pi) block(c0, nr, pi, aligned);
    }
  }
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

// Softmax of one row of scores over [lo, n), in place, then zeros over [z0, lo) and [n, n_pad) (a row tile
// runs its PV loop from its earliest row's window start to its longest row, and a row must add nothing
// outside its own range). cap > 0: scores are first capped to cap * tanh(s / cap).
// stats, when given, receives the row's max and sum of exponentials (to merge parts of a split row).
inline void softmax_row(float* sr, int64_t z0, int64_t lo, int64_t n, int64_t n_pad, float cap,
                        float* stats = nullptr) {
  if (cap > 0.f) {
    const float inv_cap = 1.f / cap;
    for (int64_t i = lo; i < n; ++i) sr[i] = cap * std::tanh(sr[i] * inv_cap);
  }
  for (int64_t i = z0; i < lo; ++i) sr[i] = 0.f;
  sr += lo;
  n -= lo;
  n_pad -= lo;
  int64_t p = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-3.0e38f);
  for (; p + 16 <= n; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + p));
  float mx = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-3.0e38f);
  for (; p + 8 <= n; p += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sr + p));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float mx = _mm_cvtss_f32(m4);
#else
  float lanes[16];
  for (int j = 0; j < 16; ++j) lanes[j] = -3.0e38f;
  for (; p + 16 <= n; p += 16)
    for (int j = 0; j < 16; ++j) lanes[j] = sr[p + j] > lanes[j] ? sr[p + j] : lanes[j];
  float mx = -3.0e38f;
  for (int j = 0; j < 16; ++j) mx = lanes[j] > mx ? lanes[j] : mx;
#endif
  for (; p < n; ++p) mx = sr[p] > mx ? sr[p] : mx;
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    sr[i] = exp_nonpositive(sr[i] - mx);
    sum += sr[i];
  }
  if (stats) stats[0] = mx, stats[1] = sum;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int64_t i = 0; i < n; ++i) sr[i] *= inv;
  for (int64_t i = n; i < n_pad; ++i) sr[i] = 0.f;
}

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
  int64_t window;  // sliding window in positions (a row sees its own and window - 1 before); 0: none
  float softcap;   // 0: none
};

// First position row `limit` (one past its own position) sees.
inline int64_t window_start(const Args& a, int64_t limit) {
  return a.window > 0 && limit > a.window ? limit - a.window : 0;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bfloat16 caches on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later), for queries of
// any length: decode, speculative verify and prefill chunks.
//
// Keys are taken 16 tokens at a time and transposed in registers, so that one vector holds the same pair
// of dimensions for 16 tokens: a query row's 16 scores are then HD/2 dot-product instructions
// (vdpbf16ps, exact bf16 products summed in float32) against broadcast query pairs, with no horizontal
// sums, and the transpose is shared by every query row of the task. Values are widened to float32 once
// per token for a tile of rows held in registers. A long query is cut into tiles of kQueryTile tokens, each
// a task of its own that reads keys only up to its last token, so prefill chunks spread over the threads.
constexpr int64_t kQueryTile = 16;
constexpr int64_t kPrefetchAhead = 4;

inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

struct Task {
  int64_t seq;       // index into seq_ids
  int64_t h0, h1;    // KV heads [h0, h1)
  int64_t i0, i1;    // query tokens [i0, i1) of the sequence
};

template <int HD>
void run_bf16(const Args& a, int num_threads) {
  static_assert(HD % 32 == 0, "whole 16-lane vectors of pairs");
  const uint16_t* qp = static_cast<const uint16_t*>(a.q);
  const uint16_t* kp = static_cast<const uint16_t*>(a.k_cache);
  const uint16_t* vp = static_cast<const uint16_t*>(a.v_cache);
  uint16_t* op = static_cast<uint16_t*>(a.out);
  const int64_t BS = a.block_size, group = a.num_heads / a.num_kv_heads, KVH = a.num_kv_heads;
  const int64_t row = KVH * HD;  // one token's K (or V) in the cache
  const int64_t block_bytes = BS * row * 2;
  constexpr int kRowTile = HD == 64 ? 6 : (HD == 128 ? 3 : 1);  // PV accumulators: kRowTile * HD / 16

  // Short queries: one task per sequence, taking all KV heads when there are enough sequences to keep the
  // threads busy (the first head prefetches whole blocks, which the others then find in cache). Long
  // queries: a task per head and query tile. Tiles ending later read more keys: they go first.
  std::vector<Task> tasks;
  const bool all_heads = a.num_seqs >= 4 * num_threads;
  for (int64_t n = 0; n < a.num_seqs; ++n) {
    const int64_t s = a.seq_ids[n];
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    if (q_len <= kQueryTile) {
      if (all_heads) tasks.push_back({n, 0, KVH, 0, q_len});
      else
        for (int64_t h = 0; h < KVH; ++h) tasks.push_back({n, h, h + 1, 0, q_len});
      continue;
    }
    for (int64_t i1 = q_len; i1 > 0; i1 -= kQueryTile)
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back({n, h, h + 1, i1 > kQueryTile ? i1 - kQueryTile : 0, i1});
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;
    std::vector<uint16_t> pairs;  // a row tile's weights in bf16, row-major with the scores' stride
    std::vector<uint32_t> qpairs;
    std::vector<int64_t> limit;
    alignas(64) __m512i kt[HD / 2];
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const Task& task = tasks[ti];
      const int64_t s = a.seq_ids[task.seq];
      const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
      const int64_t len = a.seq_lens[s];
      const int32_t* table = a.block_tables + s * a.table_stride;
      const int64_t R = (task.i1 - task.i0) * group;  // row (i - i0) * group + g: query token i, head g
      const int64_t end = len - q_len + task.i1;      // the last row sees positions before this
      const int64_t num_tiles = (end + 15) / 16;
      const int64_t stride = num_tiles * 16;
      const int64_t H = task.h1 - task.h0;
      scores.resize(H * R * stride);  // head h's rows from (h - h0) * R
      pairs.resize(kRowTile * stride + 32);
      qpairs.resize(H * R * HD / 2);
      limit.resize(R);
      // a task of every head fetches whole blocks, a task of one head its slice of each token
      const int64_t fetch = H > 1 ? block_bytes : HD * 2;
      auto prefetch_block = [&](const uint16_t* cache, int64_t b) {
        const uint16_t* start = cache + static_cast<int64_t>(table[b]) * BS * row;
        if (fetch == block_bytes) return prefetch(start, block_bytes);
        for (int64_t t = 0; t < BS; ++t) prefetch(start + t * row + task.h0 * HD, fetch);
      };
      for (int64_t h = task.h0; h < task.h1; ++h)
        for (int64_t i = task.i0; i < task.i1; ++i)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (i - task.i0) * group + g;
            std::memcpy(qpairs.data() + ((h - task.h0) * R + r) * HD / 2,
                        qp + (q0 + i) * a.q_tok + (h * group + g) * a.q_head, HD * 2);
            limit[r] = len - q_len + i + 1;
          }

      // scores[r, p] = scale * q_r . k_p for every 16-token tile some row reaches, every head's rows before
      // the next tile: keys stream from memory once, beside the work. Head by head (as the float32 kernel
      // was before), the first head's pass waited on memory and the others' computed from L2 with memory
      // idle. SmolLM2's 30 layers, each its own cache (bench/kernel_ab.py --dtype bfloat16 --order
      // shuffled, 2-core Zen 4), bit for bit the same: 18 x 800 tokens 26.5 ms against 30.4, 64 x 400 51.0
      // against 56.8, 8 x 1,600 23.2 against 26.1, verify of 5 at 18 x 200 11.3 against 12.1. Blocks lie
      // anywhere in the cache, so K is asked for kPrefetchAhead blocks early and V, needed after the
      // softmax, a block behind it.
      const int64_t num_blocks = (end + BS - 1) / BS;
      const int64_t b0 = window_start(a, limit[0]) / BS;  // blocks before it are outside every window
      for (int64_t b = b0; b < b0 + kPrefetchAhead && b < num_blocks; ++b) prefetch_block(kp, b);
      const __m512 scale = _mm512_set1_ps(a.scale);
      // A task of every head reads a tile's 16 whole token rows of K, one 64-byte line a load: beside each
      // load it asks for a line of the same tile kPrefetchAhead blocks on, and one of its V. All at once,
      // a block's 96 lines filled the core's miss buffers and stalled it; spread, memory streams during
      // the work, bit for bit the same (bench/kernel_ab.py --dtype bfloat16 --order shuffled, 30 layers,
      // 2-core Zen 4): 18 x 800 tokens 24.9 ms against 27.2, 64 x 400 43.1 against 47.2, 8 x 1,600 21.1
      // against 23.1, verify of 5 at 18 x 200 10.1 against 11.5. Two to eight blocks ahead: all alike.
      const bool trickle = H == KVH;  // then a tile has as many loads as its rows have lines
      for (int64_t u = b0 * BS / 16; u < num_tiles; ++u) {
        const int64_t p0 = u * 16, b = p0 / BS;
        const char* k_ahead;
        const char* v_now;
        fetch_tile(trickle, kp, vp, table, BS, row, kPrefetchAhead, num_blocks, p0, prefetch_block, &k_ahead,
                   &v_now);
        int64_t r1 = 0;
        while (r1 < R && limit[r1] <= p0) ++r1;  // rows are ordered by limit: earlier rows end sooner
        for (int64_t h = task.h0; h < task.h1; ++h) {
          // 16 tokens' head slices; the tile's tail past `end` is read (inside the block) but never used
          const uint16_t* kt0 = kp + (static_cast<int64_t>(table[b]) * BS + p0 % BS) * row + h * HD;
          for (int c = 0; c < HD / 32; ++c) {
            __m512i r16[16];
            for (int t = 0; t < 16; ++t) {
              r16[t] = _mm512_loadu_si512(kt0 + t * row + 32 * c);
              if (trickle) {
                const int64_t line = (((h - task.h0) * (HD / 32) + c) * 16 + t) * 64;
                if (k_ahead) __builtin_prefetch(k_ahead + line, 0, 3);
                __builtin_prefetch(v_now + line, 0, 3);
              }
            }
            transpose16(r16);
            for (int j = 0; j < 16; ++j) kt[16 * c + j] = r16[j];
          }
          const uint32_t* qh = qpairs.data() + (h - task.h0) * R * HD / 2;
          float* sh = scores.data() + (h - task.h0) * R * stride;
          int64_t r = r1;
          for (; r + 2 <= R; r += 2) {
            const uint32_t* qa = qh + r * HD / 2;
            const uint32_t* qb = qa + HD / 2;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            for (int j = 0; j < HD / 2; j += 2) {
              a0 = _mm512_dpbf16_ps(a0, (__m512bh)kt[j], (__m512bh)_mm512_set1_epi32(qa[j]));
              b0 = _mm512_dpbf16_ps(b0, (__m512bh)kt[j], (__m512bh)_mm512_set1_epi32(qb[j]));
              a1 = _mm512_dpbf16_ps(a1, (__m512bh)kt[j + 1], (__m512bh)_mm512_set1_epi32(qa[j + 1]));
              b1 = _mm512_dpbf16_ps(b1, (__m512bh)kt[j + 1], (__m512bh)_mm512_set1_epi32(qb[j + 1]));
            }
            _mm512_storeu_ps(sh + r * stride + p0, _mm512_mul_ps(_mm512_add_ps(a0, a1), scale));
            _mm512_storeu_ps(sh + (r + 1) * stride + p0, _mm512_mul_ps(_mm512_add_ps(b0, b1), scale));
          }
          if (r < R) {
            const uint32_t* qa = qh + r * HD / 2;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            for (int j = 0; j < HD / 2; j += 2) {
              a0 = _mm512_dpbf16_ps(a0, (__m512bh)kt[j], (__m512bh)_mm512_set1_epi32(qa[j]));
              a1 = _mm512_dpbf16_ps(a1, (__m512bh)kt[j + 1], (__m512bh)_mm512_set1_epi32(qa[j + 1]));
            }
            _mm512_storeu_ps(sh + r * stride + p0, _mm512_mul_ps(_mm512_add_ps(a0, a1), scale));
          }
        }
      }

      for (int64_t h = task.h0; h < task.h1; ++h) {
        float* const sh = scores.data() + (h - task.h0) * R * stride;
        // softmax and PV, a tile of rows at a time (their accumulators stay in registers). Tokens go in
        // pairs: the two tokens' V rows interleaved (unpacklo/hi_epi16) against the pair of their bf16
        // weights, one vdpbf16ps per 16 dims and row, where widening V to fp32 for an FMA a token took
        // 2.4x the instructions (PV was 40 % of the kernel's hot time on Zen 4). The weights are rounded
        // to bf16, as HF's eager bf16 attention rounds its probabilities before multiplying by V. A
        // 128-bit lane of the interleaved vectors holds dims 8L..8L+3 (lo) or 8L+4..8L+7 (hi).
        for (int64_t r0 = 0; r0 < R; r0 += kRowTile) {
          const int64_t nr = R - r0 < kRowTile ? R - r0 : kRowTile;
          const int64_t n_pad = limit[r0 + nr - 1];
          const int64_t z0 = b0 * BS;
          for (int64_t r = r0; r < r0 + nr; ++r) {
            float* sr = sh + r * stride;
            softmax_row(sr, z0, window_start(a, limit[r]), limit[r], n_pad, a.softcap);
            uint16_t* pr = pairs.data() + (r - r0) * stride;
            int64_t i = z0;
            for (; i + 32 <= n_pad; i += 32)
              _mm512_storeu_si512(pr + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + i + 16),
                                                                       _mm512_loadu_ps(sr + i)));
            for (; i < n_pad; ++i) store(pr, i, sr[i]);
          }
          __m512 acc[kRowTile][HD / 16];
          for (int rr = 0; rr < kRowTile; ++rr)
            for (int c = 0; c < HD / 16; ++c) acc[rr][c] = _mm512_setzero_ps();
          const int64_t nb = (n_pad + BS - 1) / BS;
          for (int64_t b = b0; b < nb; ++b) {
            const uint16_t* vb = vp + static_cast<int64_t>(table[b]) * BS * row + h * HD;
            const int64_t base = b * BS, nt = n_pad - base < BS ? n_pad - base : BS;
            int64_t t = 0;
            for (; t + 2 <= nt; t += 2) {
              __m512i vv[HD / 16];
              for (int c = 0; c < HD / 32; ++c) {
                const __m512i x = _mm512_loadu_si512(vb + t * row + 32 * c);
                const __m512i y = _mm512_loadu_si512(vb + (t + 1) * row + 32 * c);
                vv[2 * c] = _mm512_unpacklo_epi16(x, y);
                vv[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
              }
              const uint16_t* pt = pairs.data() + base + t;
              for (int rr = 0; rr < kRowTile; ++rr) {
                if (rr >= nr) break;
                uint32_t w2;
                std::memcpy(&w2, pt + rr * stride, 4);
                const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(w2));
                for (int c = 0; c < HD / 16; ++c) acc[rr][c] = _mm512_dpbf16_ps(acc[rr][c], (__m512bh)vv[c], w);
              }
            }
            if (t < nt) {  // an odd last token: its V widened, against its weight in bf16 all the same
              const uint16_t* pt = pairs.data() + base + t;
              for (int c = 0; c < HD / 32; ++c) {
                const __m512i x = _mm512_loadu_si512(vb + t * row + 32 * c);
                const __m512i lo = _mm512_unpacklo_epi16(x, _mm512_setzero_si512());
                const __m512i hi = _mm512_unpackhi_epi16(x, _mm512_setzero_si512());
                for (int rr = 0; rr < kRowTile; ++rr) {
                  if (rr >= nr) break;
                  const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pt[rr * stride]));
                  acc[rr][2 * c] = _mm512_dpbf16_ps(acc[rr][2 * c], (__m512bh)lo, w);
                  acc[rr][2 * c + 1] = _mm512_dpbf16_ps(acc[rr][2 * c + 1], (__m512bh)hi, w);
                }
              }
            }
          }
          for (int64_t rr = 0; rr < nr; ++rr) {
            const int64_t r = r0 + rr, i = task.i0 + r / group, g = r % group;
            uint16_t* dst = op + (q0 + i) * a.o_tok + (h * group + g) * a.o_head;
            alignas(64) float tmp[HD];
            for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(tmp + 16 * c, acc[rr][c]);
            for (int d = 0; d < HD; ++d) {  // undo the interleaving's order of dims
              const int c = d / 32, lane = (d % 32) / 8, w = d % 8;
              store(dst, d, tmp[16 * (2 * c + (w >= 4)) + 4 * lane + (w % 4)]);
            }
          }
        }
      }
    }
  }
}
#define SPECSERVE_BF16_PATH 1
#endif


#if defined(__AVX2__) && defined(__FMA__)
// float32 caches on CPUs with AVX2 + FMA (Haswell, Zen and later; AVX-512 machines too), for queries of any
// length: decode, speculative verify and prefill chunks. The same plan as the bfloat16 kernel in 8-lane
// registers: keys are taken 8 tokens at a time and transposed, so a row's 8 scores are HD FMAs against
// broadcast query elements with no horizontal sums, and the transpose is shared by every row of the task.
// PV keeps a tile of rows' accumulators for a slice of the head in registers (16 ymm: 3 rows x 4 vectors
// + 4 for V). Long queries are cut into tiles of kQueryTileF32 tokens, each its own task.
constexpr int64_t kQueryTileF32 = 16;
constexpr int64_t kPrefetchAheadF32 = 4;

// 8 tokens' slices [8 x 8 floats] at rows p, p + stride, ...: out[j] = element j of every token. The
// 128-bit halves come in by loads (a port of their own), leaving 16 in-lane shuffles instead of 24.
inline void transpose8_load(const float* p, int64_t stride, __m256* out) {
  __m256 r[8];
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + i * stride)),
                                _mm_loadu_ps(p + (i + 4) * stride), 1);
    r[i + 4] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + i * stride + 4)),
                                    _mm_loadu_ps(p + (i + 4) * stride + 4), 1);
  }
  for (int h = 0; h < 8; h += 4) {
    const __m256 t0 = _mm256_unpacklo_ps(r[h], r[h + 1]), t1 = _mm256_unpackhi_ps(r[h], r[h + 1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[h + 2], r[h + 3]), t3 = _mm256_unpackhi_ps(r[h + 2], r[h + 3]);
    out[h] = _mm256_shuffle_ps(t0, t2, 0x44);
    out[h + 1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    out[h + 2] = _mm256_shuffle_ps(t1, t3, 0x44);
    out[h + 3] = _mm256_shuffle_ps(t1, t3, 0xEE);
  }
}

// NR rows' scores against one transposed 8-token tile; two accumulators a row hide the FMA latency.
template <int NR, int HD>
inline void qk_rows_f32(const float* q, const __m256* kt, float* dst, int64_t stride) {
  __m256 acc0[NR], acc1[NR];
  for (int i = 0; i < NR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int d = 0; d < HD; d += 2)
    for (int i = 0; i < NR; ++i) {
      acc0[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + i * HD + d), kt[d], acc0[i]);
      acc1[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + i * HD + d + 1), kt[d + 1], acc1[i]);
    }
  for (int i = 0; i < NR; ++i) _mm256_storeu_ps(dst + i * stride, _mm256_add_ps(acc0[i], acc1[i]));
}

// NR rows' scores against two transposed 8-token tiles at once: each broadcast query element serves two
// FMAs and each tile's vector is loaded once for the NR rows, where qk_rows_f32 loads both for every FMA
// (loads, not FMAs, bounded prefill's QK).
template <int NR, int HD>
inline void qk_rows2_f32(const float* q, const __m256* ka, const __m256* kb, float* dst, int64_t stride) {
  __m256 a[NR], b[NR];
  for (int i = 0; i < NR; ++i) a[i] = b[i] = _mm256_setzero_ps();
  for (int d = 0; d < HD; ++d) {
    __m256 x = ka[d], y = kb[d];
    asm("" : "+x"(x), "+x"(y));  // keep them in registers: GCC otherwise folds a load into every FMA
    for (int i = 0; i < NR; ++i) {
      const __m256 qb = _mm256_broadcast_ss(q + i * HD + d);
      a[i] = _mm256_fmadd_ps(qb, x, a[i]);
      b[i] = _mm256_fmadd_ps(qb, y, b[i]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    _mm256_storeu_ps(dst + i * stride, a[i]);
    _mm256_storeu_ps(dst + i * stride + 8, b[i]);
  }
}

// NR <= 4 rows' scores against 8 tokens' head slices at k0, k0 + row, ... read as they lie: per token and
// row, HD / 8 FMAs across the head's dimensions, then a horizontal sum. For a decode task's few rows (a GQA
// group) this skips the transposes, which cost more than the FMAs they save there. SmolLM2's 30 layers
// (bench/kernel_ab.py, avx2-only build, Zen 4): 64 x 400 tokens 75.9 ms against 83.2 transposed, 12 x 800
// 34.8 against 36.2; native build 18 x 600 30.7 against 33.4.
// ahead and now, where given, are HD / 2 lines (as many as these loads read) for the caller's prefetching,
// two of each asked for beside every four loads (see run_f32's trickle).
template <int NR, int HD>
inline void qk_direct_f32(const float* q, const float* k0, int64_t row, float* dst, int64_t stride,
                          const char* ahead = nullptr, const char* now = nullptr) {
  for (int t0 = 0; t0 < 8; t0 += 4) {
    __m256 acc[NR][4];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < 4; ++t) acc[i][t] = _mm256_setzero_ps();
    for (int c = 0; c < HD / 8; ++c) {
      const int64_t line = ((t0 / 4) * (HD / 8) + c) * 128;
      if (ahead) __builtin_prefetch(ahead + line, 0, 3), __builtin_prefetch(ahead + line + 64, 0, 3);
      if (now) __builtin_prefetch(now + line, 0, 3), __builtin_prefetch(now + line + 64, 0, 3);
      __m256 k[4];
      for (int t = 0; t < 4; ++t) k[t] = _mm256_loadu_ps(k0 + (t0 + t) * row + 8 * c);
      for (int i = 0; i < NR; ++i) {
        const __m256 qv = _mm256_loadu_ps(q + i * HD + 8 * c);
        for (int t = 0; t < 4; ++t) acc[i][t] = _mm256_fmadd_ps(qv, k[t], acc[i][t]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
      _mm_storeu_ps(dst + i * stride + t0, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
}

// acc[rows][8 * W-float slice dc] += p * v over the tokens [0, n_pad) of the rows' softmaxed scores. W = 4:
// 3 rows' 12 accumulators leave no register for V, so GCC loads V again for every row's FMA. W = 2, for
// up to 6 rows: a token's two V vectors stay in registers for the rows (2 loads and NR broadcasts for
// 2 NR FMAs), over twice the passes.
template <int NR, int HD, int W = 4>
inline void pv_rows_f32(const float* scores, int64_t stride, const float* vp, const int32_t* table, int64_t BS,
                        int64_t row, int64_t hoff, int64_t b0, int64_t n_pad, float* const* dst) {
  for (int dc = 0; dc < HD; dc += 8 * W) {
    __m256 acc[NR][W];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < W; ++c) acc[i][c] = _mm256_setzero_ps();
    const int64_t nb = (n_pad + BS - 1) / BS;
    for (int64_t b = b0; b < nb; ++b) {
      const float* vb = vp + static_cast<int64_t>(table[b]) * BS * row + hoff + dc;
      const int64_t base = b * BS, nt = n_pad - base < BS ? n_pad - base : BS;
      const float* pt = scores + base;
      for (int64_t t = 0; t < nt; ++t) {
        __m256 v[W];
        for (int c = 0; c < W; ++c) v[c] = _mm256_loadu_ps(vb + t * row + 8 * c);
        if constexpr (W == 2) asm("" : "+x"(v[0]), "+x"(v[1]));
        for (int i = 0; i < NR; ++i) {
          const __m256 w = _mm256_broadcast_ss(pt + i * stride + t);
          for (int c = 0; c < W; ++c) acc[i][c] = _mm256_fmadd_ps(w, v[c], acc[i][c]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(dst[i] + dc + 8 * c, acc[i][c]);
  }
}

struct TaskF32 {
  int64_t seq;     // index into seq_ids
  int64_t h0, h1;  // KV heads [h0, h1)
  int64_t i0, i1;  // query tokens [i0, i1) of the sequence
  int64_t p0 = 0, p1 = INT64_MAX;  // key positions [p0, p1): a part of a split sequence, else all
  int64_t part = -1;               // its rows' slot in the parts' buffer (-1: written to out directly)
};

// Fewer (sequence, head) tasks than this many a thread split their keys into parts of whole blocks, each a
// task, merged after by their softmax statistics (flash-decoding's split): at batch 1 SmolLM2's three KV
// heads left one of two threads idle a third of the time. One sequence of 546 / 2,000 tokens, SmolLM2's
// heads, 30 layers from L3 (2-core Zen 4): 3.11 / 9.1 ms split against 3.35 / 11.9 whole.
constexpr int64_t kSplitBelowTasksPerThread = 2;
constexpr int64_t kMinPartBlocks = 4, kMaxParts = 64;

template <int HD>
void run_f32(const Args& a, int num_threads) {
  static_assert(HD % 32 == 0, "whole 4-vector slices in PV");
  const float* qp = static_cast<const float*>(a.q);
  const float* kp = static_cast<const float*>(a.k_cache);
  const float* vp = static_cast<const float*>(a.v_cache);
  float* op = static_cast<float*>(a.out);
  const int64_t BS = a.block_size, group = a.num_heads / a.num_kv_heads, KVH = a.num_kv_heads;
  const int64_t row = KVH * HD;
  const int64_t block_bytes = BS * row * 4;

  // Short queries one task per sequence (all heads, one pass over whole blocks) when there are enough
  // sequences, else per head; long ones per head and query tile, latest tiles (the most keys) first.
  std::vector<TaskF32> tasks;
  const bool all_heads = a.num_seqs >= 4 * num_threads;
  const bool split = a.window == 0 && a.num_seqs * KVH < kSplitBelowTasksPerThread * num_threads;
  int64_t part_rows = 0;  // rows in the parts' buffer so far
  for (int64_t n = 0; n < a.num_seqs; ++n) {
    const int64_t s = a.seq_ids[n];
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    if (q_len <= kQueryTileF32) {
      const int64_t blocks = (a.seq_lens[s] + BS - 1) / BS;
      // parts enough for twice the threshold's tasks a thread, of kMinPartBlocks blocks at least
      int64_t parts = split ? (2 * kSplitBelowTasksPerThread * num_threads + a.num_seqs * KVH - 1) /
                                  (a.num_seqs * KVH)
                            : 1;
      parts = std::min({parts, blocks / kMinPartBlocks, kMaxParts});
      if (all_heads) tasks.push_back({n, 0, KVH, 0, q_len});
      else if (parts <= 1)
        for (int64_t h = 0; h < KVH; ++h) tasks.push_back({n, h, h + 1, 0, q_len});
      else
        for (int64_t h = 0; h < KVH; ++h)
          for (int64_t c = 0; c < parts; ++c, part_rows += q_len * group)
            tasks.push_back({n, h, h + 1, 0, q_len, c * blocks / parts * BS,
                             c + 1 < parts ? (c + 1) * blocks / parts * BS : INT64_MAX, part_rows});
      continue;
    }
    for (int64_t i1 = q_len; i1 > 0; i1 -= kQueryTileF32)
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back({n, h, h + 1, i1 > kQueryTileF32 ? i1 - kQueryTileF32 : 0, i1});
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());

  // each part's rows: HD outputs (normalized over the part) and the part's max and sum of exponentials
  std::vector<float> parts(part_rows * (HD + 2));

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, qs;
    std::vector<int64_t> limit;
    std::vector<float*> dst;
    alignas(32) __m256 kt[HD], kt2[HD];
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const TaskF32& task = tasks[ti];
      const int64_t s = a.seq_ids[task.seq];
      const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
      const int64_t len = a.seq_lens[s];
      const int32_t* table = a.block_tables + s * a.table_stride;
      const int64_t R = (task.i1 - task.i0) * group;  // row (i - i0) * group + g: query token i, head g
      const int64_t H = task.h1 - task.h0;  // a head's rows are [hh * R, hh * R + R): hh = h - h0
      // the last row sees positions before len - q_len + i1; a part, those before its p1 too
      const int64_t end = std::min(len - q_len + task.i1, task.p1);
      const int64_t num_tiles = (end + 7) / 8;
      const int64_t stride = num_tiles * 8;
      scores.resize(H * R * stride);
      qs.resize(H * R * HD);
      limit.resize(R);
      dst.resize(H * R);
      for (int64_t hh = 0; hh < H; ++hh)
        for (int64_t i = task.i0; i < task.i1; ++i)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t r = (i - task.i0) * group + g, hr = hh * R + r, h = task.h0 + hh;
            const float* src = qp + (q0 + i) * a.q_tok + (h * group + g) * a.q_head;
            for (int d = 0; d < HD; ++d) qs[hr * HD + d] = src[d] * a.scale;
            limit[r] = len - q_len + i + 1;
            dst[hr] = task.part < 0 ? op + (q0 + i) * a.o_tok + (h * group + g) * a.o_head
                                    : parts.data() + (task.part + r) * (HD + 2);
          }

      // One pass over the keys serves every head of the task (a block's heads from one stream of whole
      // blocks), while V is fetched for the PV passes after. Head by head, the first head's pass waited on
      // memory and the others' computed from L2 with memory idle. SmolLM2's 30 layers, each its own cache
      // (bench/kernel_ab.py, 2-core Zen 4): 64 x 400 tokens 73.3 ms against 81.5, 18 x 600 31.0 against
      // 34.2, verify of 5 at 18 x 600 56.3 against 59.8.
      const int64_t fetch = H > 1 ? block_bytes : HD * 4;
      auto prefetch_block = [&](const float* cache, int64_t b) {
        const float* start = cache + static_cast<int64_t>(table[b]) * BS * row;
        if (fetch == block_bytes) return prefetch(start, block_bytes);
        for (int64_t t = 0; t < BS; ++t) prefetch(start + t * row + task.h0 * HD, fetch);
      };
      const int64_t num_blocks = (end + BS - 1) / BS;
      // blocks before it are outside every window (or before the part)
      const int64_t b0 = std::max(window_start(a, limit[0]), task.p0) / BS;
      for (int64_t b = b0; b < b0 + kPrefetchAheadF32 && b < num_blocks; ++b) prefetch_block(kp, b);
      // A task of every head reads each 8-token tile's whole rows of K: beside its loads it asks for the same
      // tile's lines kPrefetchAheadF32 blocks on and its V, a few at a time (each head a share of the lines),
      // where a block's lines at once filled the core's miss buffers and stalled it (as in run_bf16).
      // bench/kernel_ab.py --order shuffled, 30 layers, 2-core Zen 4, avx2-only build, bit for bit the same:
      // 18 x 800 tokens 40.3 ms against 53.5, 64 x 400 75.3 against 96.0, 8 x 1,600 38.2 against 48.1;
      // native build 18 x 800 40.0 against 50.3. Verify steps' transposed tiles too: 5 tokens at 18 x 600
      // 54.1 against 62.2 (avx2-only), 3 tokens at 64 x 400 101.0 against 112.6 (blocks in order).
      const bool trickle = H == KVH;
      const auto fetch_at = [&](int64_t pt, const char** k_ahead, const char** v_now) {
        fetch_tile(trickle, kp, vp, table, BS, row, kPrefetchAheadF32, num_blocks, pt, prefetch_block, k_ahead,
                   v_now);
      };
      // a transposed chunk's share: 4 lines of each slab beside its 16 loads
      const auto chunk_lines = [](const char* slab, int64_t hh, int c) {
        if (slab) prefetch(slab + hh * HD * 32 + c * 256, 256);
      };
      for (int64_t u = b0 * BS / 8; u < num_tiles; ++u) {
        const int64_t p0 = u * 8, b = p0 / BS;
        const char* k_ahead;
        const char* v_now;
        fetch_at(p0, &k_ahead, &v_now);
        int64_t r = 0;
        while (r < R && limit[r] <= p0) ++r;  // rows are ordered by limit: earlier rows end sooner
        if (R > 4 && u + 1 < num_tiles) {  // many rows (prefill tiles): two key tiles at a time
          const int64_t p1 = p0 + 8, b1 = p1 / BS;
          const char* k_ahead1;
          const char* v_now1;
          fetch_at(p1, &k_ahead1, &v_now1);
          for (int64_t hh = 0; hh < H; ++hh) {
            const int64_t hoff = (task.h0 + hh) * HD;
            const float* ka = kp + (static_cast<int64_t>(table[b]) * BS + p0 % BS) * row + hoff;
            const float* kb = kp + (static_cast<int64_t>(table[b1]) * BS + p1 % BS) * row + hoff;
            for (int c = 0; c < HD / 8; ++c) {
              for (const char* slab : {k_ahead, v_now, k_ahead1, v_now1}) chunk_lines(slab, hh, c);
              transpose8_load(ka + 8 * c, row, kt + 8 * c);
              transpose8_load(kb + 8 * c, row, kt2 + 8 * c);
            }
            const float* q = qs.data() + hh * R * HD;
            float* out = scores.data() + hh * R * stride + p0;
            int64_t rr = r;
            for (; rr + 4 <= R; rr += 4) qk_rows2_f32<4, HD>(q + rr * HD, kt, kt2, out + rr * stride, stride);
            switch (R - rr) {
              case 3: qk_rows2_f32<3, HD>(q + rr * HD, kt, kt2, out + rr * stride, stride); break;
              case 2: qk_rows2_f32<2, HD>(q + rr * HD, kt, kt2, out + rr * stride, stride); break;
              case 1: qk_rows2_f32<1, HD>(q + rr * HD, kt, kt2, out + rr * stride, stride); break;
              default: break;
            }
          }
          ++u;
          continue;
        }
        for (int64_t hh = 0; hh < H; ++hh) {
          // 8 tokens' head slices; the tile's tail past `end` is read (inside the block) but never used
          const float* k0 = kp + (static_cast<int64_t>(table[b]) * BS + p0 % BS) * row + (task.h0 + hh) * HD;
          const float* q = qs.data() + hh * R * HD;
          float* out = scores.data() + hh * R * stride + p0;
          if (r == 0 && R <= 4) {
            const int64_t share = hh * HD * 32;  // this head's HD / 2 lines of the tile's, in bytes
            const char* ka = k_ahead ? k_ahead + share : nullptr;
            const char* vn = v_now ? v_now + share : nullptr;
            switch (R) {
              case 4: qk_direct_f32<4, HD>(q, k0, row, out, stride, ka, vn); break;
              case 3: qk_direct_f32<3, HD>(q, k0, row, out, stride, ka, vn); break;
              case 2: qk_direct_f32<2, HD>(q, k0, row, out, stride, ka, vn); break;
              default: qk_direct_f32<1, HD>(q, k0, row, out, stride, ka, vn); break;
            }
            continue;
          }
          for (int c = 0; c < HD / 8; ++c) {
            for (const char* slab : {k_ahead, v_now}) chunk_lines(slab, hh, c);
            transpose8_load(k0 + 8 * c, row, kt + 8 * c);
          }
          int64_t rr = r;
          for (; rr + 4 <= R; rr += 4) qk_rows_f32<4, HD>(q + rr * HD, kt, out + rr * stride, stride);
          switch (R - rr) {
            case 3: qk_rows_f32<3, HD>(q + rr * HD, kt, out + rr * stride, stride); break;
            case 2: qk_rows_f32<2, HD>(q + rr * HD, kt, out + rr * stride, stride); break;
            case 1: qk_rows_f32<1, HD>(q + rr * HD, kt, out + rr * stride, stride); break;
            default: break;
          }
        }
      }

      // softmax and PV head by head, a few rows at a time (a shorter row's tail up to the tile's longest is
      // zero): prefill tiles' many rows 6 at a time over 16-float slices (4 x 512 tokens, 30 layers,
      // avx2-only build: 247 ms against 288; native 251 against 286), fewer rows 3 over 32-float ones, as
      // the narrow slices' extra passes over V cost a verify of 5 tokens (15 rows), which reads V from
      // memory, 55.1 ms against 52.9 at 18 x 600.
      const int64_t rows_at_once = R >= 24 ? 6 : 3;
      for (int64_t hh = 0; hh < H; ++hh)
        for (int64_t r0 = 0; r0 < R; r0 += rows_at_once) {
          const int64_t nr = R - r0 < rows_at_once ? R - r0 : rows_at_once;
          const int64_t n_pad = std::min(limit[r0 + nr - 1], end);
          float* sc = scores.data() + (hh * R + r0) * stride;
          float* const* d = dst.data() + hh * R + r0;
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t lo = std::max(window_start(a, limit[r0 + r]), b0 * BS);
            softmax_row(sc + r * stride, b0 * BS, lo, std::max(std::min(limit[r0 + r], end), lo), n_pad,
                        a.softcap, task.part < 0 ? nullptr : d[r] + HD);
          }
          const int64_t hoff = (task.h0 + hh) * HD;
          if (rows_at_once == 6) {
            switch (nr) {
              case 6: pv_rows_f32<6, HD, 2>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 5: pv_rows_f32<5, HD, 2>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 4: pv_rows_f32<4, HD, 2>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 3: pv_rows_f32<3, HD, 2>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 2: pv_rows_f32<2, HD, 2>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d); break;
              default: pv_rows_f32<1, HD, 2>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d); break;
            }
          } else if (nr == 3) pv_rows_f32<3, HD>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d);
          else if (nr == 2) pv_rows_f32<2, HD>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d);
          else pv_rows_f32<1, HD>(sc, stride, vp, table, BS, row, hoff, b0, n_pad, d);
        }
    }

    // a split sequence's head: its parts (consecutive tasks, the first at p0 = 0) merged by their statistics;
    // part_rows is the same on every thread, and steps with nothing split skip the second barrier
    if (part_rows > 0) {
#pragma omp for schedule(static)
      for (int64_t ti = 0; ti < num_tasks; ++ti) {
        const TaskF32& first = tasks[ti];
        if (first.part < 0 || first.p0 != 0) continue;
        int64_t last = ti;
        while (tasks[last].p1 != INT64_MAX) ++last;
        const int64_t s = a.seq_ids[first.seq], h = first.h0;
        const int64_t q0 = a.query_start_loc[s], R = first.i1 * group;
        for (int64_t r = 0; r < R; ++r) {
          float mx = -3.0e38f;
          for (int64_t t = ti; t <= last; ++t) {
            const float* st = parts.data() + (tasks[t].part + r) * (HD + 2) + HD;
            if (st[1] > 0.f) mx = std::max(mx, st[0]);
          }
          float weight[kMaxParts], total = 0.f;
          for (int64_t t = ti; t <= last; ++t) {
            const float* st = parts.data() + (tasks[t].part + r) * (HD + 2) + HD;
            weight[t - ti] = st[1] > 0.f ? st[1] * std::exp(st[0] - mx) : 0.f;
            total += weight[t - ti];
          }
          float* o = op + (q0 + r / group) * a.o_tok + (h * group + r % group) * a.o_head;
          for (int d = 0; d < HD; ++d) o[d] = 0.f;
          for (int64_t t = ti; t <= last; ++t) {
            const float w = weight[t - ti] / total;
            const float* part = parts.data() + (tasks[t].part + r) * (HD + 2);
            for (int d = 0; d < HD; ++d) o[d] += w * part[d];
          }
        }
      }
    }
  }
}
#define SPECSERVE_F32_PATH 1
#endif


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

  // The next block of a task's first head: whole block rows (all heads, contiguous) or one head's slices.
  auto prefetch_rows = [&](const T* cache, int32_t block, int64_t h, int64_t bytes) {
    const T* start = cache + static_cast<int64_t>(block) * BS * row;
    if (bytes == block_bytes) return prefetch(start, bytes);
    for (int64_t t = 0; t < BS; ++t) prefetch(start + t * row + h * D, bytes);
  };

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf, scores, acc, kt(BS * D), vb(BS * D);
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
      scores.resize(R * len);
      acc.assign(R * D, 0.f);
      limit.resize(R);
      for (int64_t i = 0; i < q_len; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + (q0 + i) * a.q_tok + (h * group + g) * a.q_head;
          float* dst = qf.data() + (i * group + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = load(src, d) * a.scale;
          limit[i * group + g] = len - q_len + i + 1;  // token i sees positions before this
        }
      const int64_t num_blocks = (len + BS - 1) / BS;
      const int64_t b0 = window_start(a, limit[0]) / BS;  // blocks before it are outside every window

      for (int64_t b = b0; b < num_blocks; ++b) {
        const int64_t base = b * BS, nt = len - base < BS ? len - base : BS;
        const T* kblock = kp + static_cast<int64_t>(table[b]) * BS * row + h * D;
        if (first && b + 1 < num_blocks) prefetch_rows(kp, table[b + 1], h, fetch);
        qk_block<T, HD>(qf.data(), qp, R, limit.data(), kblock, row, D, base, nt, a.scale, kt.data(),
                          scores.data(), len);
      }

      for (int64_t r = 0; r < R; ++r)
        softmax_row(scores.data() + r * len, b0 * BS, window_start(a, limit[r]), limit[r], limit[r], a.softcap);

      for (int64_t b = b0; b < num_blocks; ++b) {
        const int64_t base = b * BS, nt = len - base < BS ? len - base : BS;
        const T* vblock = vp + static_cast<int64_t>(table[b]) * BS * row + h * D;
        if (first && b + 1 < num_blocks) prefetch_rows(vp, table[b + 1], h, fetch);
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

// Which fast paths this build holds (a bitmask), so Python can route queries of any length to them:
// 1, the float32 AVX2 + FMA kernel; 2, the bfloat16 AVX512-BF16 kernel; 4, the AVX2 + FMA int8 / int4
// weight-only products for float32 activations (below); 8, the AVX512-BF16 int8 and int4 products for
// bfloat16 activations. 0 is the portable build.
extern "C" int specserve_paths() {
  int paths = 0;
#ifdef SPECSERVE_F32_PATH
  paths |= 1;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  paths |= 4;
#endif
#ifdef SPECSERVE_BF16_PATH
  paths |= 2;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)  // SPECSERVE_QUANT_BF16_PATH, defined below
  paths |= 8;
#endif
  return paths;
}

extern "C" int specserve_paged_attention_short(
    const void* q, int64_t q_tok, int64_t q_head, const void* k_cache, const void* v_cache,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* seq_ids, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, void* out, int64_t o_tok,
    int64_t o_head, int dtype, int num_threads, int64_t window, float softcap) {
  if (block_size > 256 || num_heads % num_kv_heads != 0 || window < 0) return 1;
  const Args a{q,        q_tok,    q_head,    k_cache,      v_cache,   block_tables, table_stride,
               seq_lens, query_start_loc, seq_ids, num_seqs, num_heads, num_kv_heads, head_dim,
               block_size, scale, out, o_tok, o_head, window, softcap};
  // Head sizes known at compile time let the compiler unroll the dot products into whole registers.
  if (dtype == 0) {
#ifdef SPECSERVE_F32_PATH
    if (block_size % 8 == 0 && head_dim == 64) return run_f32<64>(a, num_threads), 0;
    if (block_size % 8 == 0 && head_dim == 128) return run_f32<128>(a, num_threads), 0;
    if (block_size % 8 == 0 && head_dim == 256) return run_f32<256>(a, num_threads), 0;
#endif
    if (head_dim == 64) run<float, 64>(a, num_threads);
    else if (head_dim == 128) run<float, 128>(a, num_threads);
    else run<float, 0>(a, num_threads);
  } else if (dtype == 1) {
#ifdef SPECSERVE_BF16_PATH
    if (block_size % 16 == 0 && head_dim == 64) return run_bf16<64>(a, num_threads), 0;
    if (block_size % 16 == 0 && head_dim == 128) return run_bf16<128>(a, num_threads), 0;
    if (block_size % 16 == 0 && head_dim == 256) return run_bf16<256>(a, num_threads), 0;
#endif
    if (head_dim == 64) run<uint16_t, 64>(a, num_threads);
    else if (head_dim == 128) run<uint16_t, 128>(a, num_threads);
    else run<uint16_t, 0>(a, num_threads);
  } else {
    return 2;
  }
  return 0;
}

namespace {

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
  if ((dtype != 0 && dtype != 1) || head_dim % 2 != 0 || head_dim > 512) return 2;
  const int64_t half = head_dim / 2, kv = num_kv_heads * head_dim;
  // Threads only for prefill-sized batches: a decode step's 64 tokens take ~10 us on one AVX2 core
  // (bench/kernels.py), about what waking a second thread and meeting it at the barrier costs when idle,
  // and far less than that costs on a busy shared machine.
  const bool threaded = num_tokens >= 256;
  if (dtype == 0) {
    float* base = static_cast<float*>(qkv);
    const float* cp = static_cast<const float*>(cos);
    const float* sp = static_cast<const float*>(sin);
    float* kc = static_cast<float*>(k_cache);
    float* vc = static_cast<float*>(v_cache);
#pragma omp parallel for num_threads(num_threads) if (threaded)
    for (int64_t i = 0; i < num_tokens; ++i) {
      float* row = base + i * tok_stride;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
        rope_f32(row + h * head_dim, cp + positions[i] * head_dim, sp + positions[i] * head_dim, half);
      if (slots[i] < 0) continue;
      std::memcpy(kc + slots[i] * kv, row + num_heads * head_dim, kv * sizeof(float));
      std::memcpy(vc + slots[i] * kv, row + (num_heads + num_kv_heads) * head_dim, kv * sizeof(float));
    }
    return 0;
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
  return 0;
}

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
#define SPECSERVE_QUANT_PATH 1

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j) q8_row<R>(x, xs, codes + j * k, k, scales[j], out + j, os);
}

template <int R>
void q4_rows(const float* x, int64_t xs, const uint8_t* packed, const float* scales, const float* offsets,
             int64_t n, int64_t k, const float* gsum, float* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
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

// The same products in plain loops: what a build without AVX2 + FMA compiles (tests compare the two).
void q8_generic(const float* x, int64_t xs, int64_t rows, const int8_t* codes, const float* scales, int64_t n,
                int64_t k, float* out, int64_t os, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
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

// 9-15 rows run the few-row kernels twice (8, then the rest): reading the weights twice still beats widening
// them once there. SmolLM2's 30 layers (2-core Zen 4, bench/quant_kernels.py --float32 --passes 5), int8 at
// 9 / 12 / 15 rows: 18.8 / 23.7 / 26.2 ms twice against 28.2 / 32.7 / ~35 widened (dense float32 23.0 /
// 25.5 / 29.2); at 16 rows widening is even or ahead (int8 32.6 twice against ~31, int4 36.0 against 29.5).
constexpr int64_t kWidenFromRows = 16;

// Vectorised where specserve_paths() has bit 4 (AVX2 + FMA builds), generic loops elsewhere.
// out[r, j] for r < rows (vectorised: 1..8 rows, and more where n % 8 == 0 on widened panels), j < n.
extern "C" int specserve_int8_matmul(const float* x, int64_t x_stride, int64_t rows, const int8_t* codes,
                                     const float* scales, int64_t n, int64_t k, float* out,
                                     int64_t out_stride, int num_threads) {
  if (rows < 1 || n < 1 || k < 1) return 1;
#ifdef SPECSERVE_QUANT_PATH
  switch (rows) {
    case 1: return q8_rows<1>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 2: return q8_rows<2>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 3: return q8_rows<3>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 4: return q8_rows<4>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 5: return q8_rows<5>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 6: return q8_rows<6>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 7: return q8_rows<7>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 8: return q8_rows<8>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    default:
      if (rows < kWidenFromRows) {
        specserve_int8_matmul(x, x_stride, 8, codes, scales, n, k, out, out_stride, num_threads);
        return specserve_int8_matmul(x + 8 * x_stride, x_stride, rows - 8, codes, scales, n, k,
                                     out + 8 * out_stride, out_stride, num_threads);
      }
      if (n % 8 == 0) return q8_widened(x, x_stride, rows, codes, scales, n, k, out, out_stride, num_threads), 0;
  }
#endif
  q8_generic(x, x_stride, rows, codes, scales, n, k, out, out_stride, num_threads);
  return 0;
}

// The same with a scale per group of 32 inputs: scales [n, k / 32].
extern "C" int specserve_int8_grouped_matmul(const float* x, int64_t x_stride, int64_t rows, const int8_t* codes,
                                             const float* scales, int64_t n, int64_t k, float* out,
                                             int64_t out_stride, int num_threads) {
  if (rows < 1 || n < 1 || k < 32 || k % 32 != 0) return 1;
#ifdef SPECSERVE_QUANT_PATH
  switch (rows) {
    case 1: return q8g_rows<1>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 2: return q8g_rows<2>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 3: return q8g_rows<3>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 4: return q8g_rows<4>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 5: return q8g_rows<5>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 6: return q8g_rows<6>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 7: return q8g_rows<7>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    case 8: return q8g_rows<8>(x, x_stride, codes, scales, n, k, out, out_stride, num_threads), 0;
    default:
      if (rows < kWidenFromRows) {
        specserve_int8_grouped_matmul(x, x_stride, 8, codes, scales, n, k, out, out_stride, num_threads);
        return specserve_int8_grouped_matmul(x + 8 * x_stride, x_stride, rows - 8, codes, scales, n, k,
                                             out + 8 * out_stride, out_stride, num_threads);
      }
  }
#endif
  q8g_generic(x, x_stride, rows, codes, scales, n, k, out, out_stride, num_threads);
  return 0;
}

extern "C" int specserve_int4_matmul(const float* x, int64_t x_stride, int64_t rows, const uint8_t* packed,
                                     const float* scales, const float* offsets, int64_t n, int64_t k,
                                     float* out, int64_t out_stride, int num_threads) {
  if (rows < 1 || n < 1 || k < 32 || k % 32 != 0) return 1;
#ifdef SPECSERVE_QUANT_PATH
  if (rows > 8 && rows < kWidenFromRows) {
    specserve_int4_matmul(x, x_stride, 8, packed, scales, offsets, n, k, out, out_stride, num_threads);
    return specserve_int4_matmul(x + 8 * x_stride, x_stride, rows - 8, packed, scales, offsets, n, k,
                                 out + 8 * out_stride, out_stride, num_threads);
  }
  if (rows > 8 && n % 8 == 0)
    return q4_widened(x, x_stride, rows, packed, scales, offsets, n, k, out, out_stride, num_threads), 0;
#endif
  const std::vector<float> gsum = group_sums(x, x_stride, rows, k);
#ifdef SPECSERVE_QUANT_PATH
  const float* gs = gsum.data();
  switch (rows) {
    case 1: return q4_rows<1>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 2: return q4_rows<2>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 3: return q4_rows<3>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 4: return q4_rows<4>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 5: return q4_rows<5>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 6: return q4_rows<6>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 7: return q4_rows<7>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    case 8: return q4_rows<8>(x, x_stride, packed, scales, offsets, n, k, gs, out, out_stride, num_threads), 0;
    default: break;
  }
#endif
  q4_generic(x, x_stride, rows, packed, scales, offsets, n, k, gsum.data(), out, out_stride, num_threads);
  return 0;
}

// The matrices widened to float32 [n, k] (steps of many rows then run one dense matmul on them):
// int8 code * scale, int4 code * scale + offset, as the products above use them.
extern "C" int specserve_int8_widen(const int8_t* codes, const float* scales, int64_t n, int64_t k, float* out,
                                    int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i) out[j * k + i] = static_cast<float>(codes[j * k + i]) * scales[j];
  return 0;
}

extern "C" int specserve_int4_widen(const uint8_t* packed, const float* scales, const float* offsets,
                                    int64_t n, int64_t k, float* out, int num_threads) {
  if (k % 32 != 0) return 1;
  const int64_t groups = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (threaded_for(n, k))
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = packed + (j * groups + g) * 16;
      const float s = scales[j * groups + g], o = offsets[j * groups + g];
      float* dst = out + j * k + g * 32;
      for (int i = 0; i < 16; ++i) dst[i] = static_cast<float>(p[i] & 0x0F) * s + o;
      for (int i = 0; i < 16; ++i) dst[16 + i] = static_cast<float>(p[i] >> 4) * s + o;
    }
  return 0;
}

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
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= (int64_t{1} << 16))
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

// x [rows, k] bf16 (row stride xs) times the int4 matrix in 16-output tiles (see above) -> out [rows, n]
// bf16 (row stride os). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int4_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                          const float* scales, const float* zeros, int64_t n, int64_t k,
                                          uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || n < 16 || n % 16 != 0 || k < 32 || k % 32 != 0) return 1;
#ifdef SPECSERVE_QUANT_BF16_PATH
  q4_bf16(x, xs, rows, tiles, scales, zeros, n, k, out, os, num_threads);
  return 0;
#else
  (void)x, (void)xs, (void)tiles, (void)scales, (void)zeros, (void)out, (void)os, (void)num_threads;
  return 2;
#endif
}

// x [rows, k] bf16 (row stride xs), 1..8 rows, times the int4 matrix of specserve_int4_matmul (pack_int4's
// nibbles, float32 scales and offsets) -> out [rows, n] bf16 (row stride os), sums in float32 rounded once
// (q4_bf16_row). For the few-row steps of a bf16 model whose int4 matrices keep their blocks: the library's
// own, so a layer chain runs them, where torch's int4 kernel had to be called from Python. Returns 2 where
// the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int4_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* packed,
                                        const float* scales, const float* offsets, int64_t n, int64_t k,
                                        uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || rows > 8 || n < 1 || k < 32 || k % 32 != 0) return 1;
#ifdef SPECSERVE_QUANT_BF16_PATH
  const int64_t groups = k / 32, xis = (groups + 1) / 2 * 64;
  std::vector<uint16_t> xi(rows * xis);
  for (int64_t r = 0; r < rows; ++r) interleave_groups(x + r * xs, k, xi.data() + r * xis);
  const std::vector<float> xsum = group_sums(x, xs, rows, k);
  const uint16_t* xp = xi.data();
  const float* sp = xsum.data();
  switch (rows) {
#define SPECSERVE_Q4_ROWS(R) \
  case R: q4_bf16_rows<R>(xp, xis, packed, scales, offsets, n, k, sp, out, os, num_threads); break;
    SPECSERVE_Q4_ROWS(1) SPECSERVE_Q4_ROWS(2) SPECSERVE_Q4_ROWS(3) SPECSERVE_Q4_ROWS(4)
    SPECSERVE_Q4_ROWS(5) SPECSERVE_Q4_ROWS(6) SPECSERVE_Q4_ROWS(7) SPECSERVE_Q4_ROWS(8)
#undef SPECSERVE_Q4_ROWS
  }
  return 0;
#else
  (void)x, (void)xs, (void)packed, (void)scales, (void)offsets, (void)out, (void)os, (void)num_threads;
  return 2;
#endif
}

// x [rows, k] bf16 (row stride xs) times the int8 matrix in 16-output tiles (see above) -> out [rows, n]
// bf16 (row stride os). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_int8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* tiles,
                                          const float* scales, int64_t n, int64_t k, uint16_t* out, int64_t os,
                                          int num_threads) {
  if (rows < 1 || n < 16 || n % 16 != 0 || k < 2 || k % 2 != 0) return 1;
#ifdef SPECSERVE_QUANT_BF16_PATH
  q8_bf16(x, xs, rows, tiles, scales, n, k, out, os, num_threads);
  return 0;
#else
  (void)x, (void)xs, (void)tiles, (void)scales, (void)out, (void)os, (void)num_threads;
  return 2;
#endif
}

// x [rows, k] bf16 (row stride xs) times a dense bf16 matrix held as panels (see dense_bf16) -> out [rows, n]
// bf16 (row stride os). Returns 2 where the build has no AVX512-BF16 (specserve_paths() bit 8 clear).
extern "C" int specserve_bf16_matmul(const uint16_t* x, int64_t xs, int64_t rows, const uint16_t* panels,
                                     int64_t n, int64_t k, uint16_t* out, int64_t os, int num_threads) {
  if (rows < 1 || n < 16 || n % 16 != 0 || k < 2 || k % 2 != 0) return 1;
#ifdef SPECSERVE_QUANT_BF16_PATH
  dense_bf16(x, xs, rows, panels, n, k, out, os, num_threads);
  return 0;
#else
  (void)x, (void)xs, (void)panels, (void)out, (void)os, (void)num_threads;
  return 2;
#endif
}

// x [rows, k] float32 (row stride xs) times a dense float32 matrix held as panels (see dense_f32) -> out
// [rows, n] (row stride os). Returns 2 where the build has no AVX2 + FMA (specserve_paths() bit 4 clear).
extern "C" int specserve_f32_matmul(const float* x, int64_t xs, int64_t rows, const float* panels, int64_t n,
                                    int64_t k, float* out, int64_t os, int num_threads) {
  if (rows < 1 || n < 8 || n % 8 != 0 || k < 1) return 1;
#ifdef SPECSERVE_DENSE_F32_PATH
  dense_f32(x, xs, rows, panels, n, k, out, os, num_threads);
  return 0;
#else
  (void)x, (void)xs, (void)panels, (void)out, (void)os, (void)num_threads;
  return 2;
#endif
}

// Structured output: logits[r][t] = -inf wherever bit t of the packed token bitmask row (xgrammar's layout:
// little-endian 32-bit words, bit t % 32 of word t / 32 set = allowed) is clear, on the listed rows, in
// place. On one thread on purpose: it is ~20 us a row (a store per forbidden token), while a parallel
// region on a shared, loaded 2-core machine waits for a core another process holds (torch's bitmask ops
// took 21-32 ms a step at batch 1-8 there, load ~5). -inf is stored as its bit pattern, so -ffast-math has
// no infinity to reason about. Returns 1 when a row index is out of range.
extern "C" int specserve_apply_bitmask(float* logits, int64_t logits_stride, int64_t vocab,
                                       const int32_t* bitmask, int64_t mask_stride, const int64_t* rows,
                                       int64_t num_rows, int64_t num_logit_rows) {
  constexpr uint32_t kNegInf = 0xFF800000u;
  for (int64_t r = 0; r < num_rows; ++r)
    if (rows[r] < 0 || rows[r] >= num_logit_rows) return 1;
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
  return 0;
}


// ---- the decoder layer's elementwise steps, fused --------------------------------------------------------
//
// torch runs F.rms_norm on CPU as a chain of ops (widen, pow, mean, add, rsqrt, mul, mul, narrow) and a
// gated MLP's silu(gate) * up as two more, each a pass over memory and, above torch's grain size, a
// parallel region. Under `serve`, where the client and the event loop share the two cores, every region is
// a barrier that waits for a descheduled thread. These do each step in one pass with torch's roundings:
// float32 arithmetic, one rounding to the storage type where torch stores a tensor.

namespace {

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
#pragma omp parallel for num_threads(num_threads) if (n * d >= 65536)
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
#pragma omp parallel for num_threads(num_threads) if (n * heads * d >= 65536)
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
#pragma omp parallel for num_threads(num_threads) if (n * d >= 65536)
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
  else return 2;
  return 0;
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

// A whole step's decoder layers in one call, for steps whose products, attention and elementwise work all run
// in this library (cpu_paged_attention.LayerChain decides which): the same functions the model would call
// one by one from Python, with the same arguments in the same order, so the results are bit for bit
// theirs. What it saves is the Python between them: at batch 1 a step of SmolLM2 made ~270 calls through
// ctypes and torch's dispatcher, 2-2.5 ms of one core while the other waited (figures at LayerChain).
namespace {

// One matrix's product: which library function, its shape, up to three weight arrays (codes, scales,
// offsets, or panels), and a bias added after (float32 only). Words of an int64 array built in Python.
struct ProductDesc {
  int64_t kind, n, k;
  const void* w[3];
  const float* bias;
};

// One layer: its two norms, four products, and the index of its rotary table in the call's tables.
struct LayerDesc {
  const void* input_norm;
  const void* mlp_norm;
  ProductDesc qkv, o, gate_up, down;
  int64_t rope;
};
static_assert(sizeof(ProductDesc) == 7 * 8 && sizeof(LayerDesc) == 31 * 8, "LayerChain's words");

enum ProductKind : int64_t {
  kF32Panels, kInt8, kInt8Grouped, kInt4, kBf16Panels, kInt8Bf16, kInt4Bf16, kInt4RowsBf16
};

int run_product(const ProductDesc& p, const void* x, int64_t rows, void* out, int threads) {
  using u16 = uint16_t;
  const auto* xf = static_cast<const float*>(x);
  auto* of = static_cast<float*>(out);
  const auto* xb = static_cast<const u16*>(x);
  auto* ob = static_cast<u16*>(out);
  const auto* i8 = static_cast<const int8_t*>(p.w[0]);
  const auto* u8 = static_cast<const uint8_t*>(p.w[0]);
  const auto* f32 = static_cast<const float*>(p.w[0]);
  const auto* b16 = static_cast<const u16*>(p.w[0]);
  const auto* s = static_cast<const float*>(p.w[1]);
  const auto* z = static_cast<const float*>(p.w[2]);
  const int64_t n = p.n, k = p.k;
  int rc;
  switch (p.kind) {
    case kF32Panels: rc = specserve_f32_matmul(xf, k, rows, f32, n, k, of, n, threads); break;
    case kInt8: rc = specserve_int8_matmul(xf, k, rows, i8, s, n, k, of, n, threads); break;
    case kInt8Grouped: rc = specserve_int8_grouped_matmul(xf, k, rows, i8, s, n, k, of, n, threads); break;
    case kInt4: rc = specserve_int4_matmul(xf, k, rows, u8, s, z, n, k, of, n, threads); break;
    case kBf16Panels: rc = specserve_bf16_matmul(xb, k, rows, b16, n, k, ob, n, threads); break;
    case kInt8Bf16: rc = specserve_int8_matmul_bf16(xb, k, rows, i8, s, n, k, ob, n, threads); break;
    case kInt4Bf16: rc = specserve_int4_matmul_bf16(xb, k, rows, u8, s, z, n, k, ob, n, threads); break;
    case kInt4RowsBf16: rc = specserve_int4_rows_bf16(xb, k, rows, u8, s, z, n, k, ob, n, threads); break;
    default: return 3;
  }
  if (rc == 0 && p.bias != nullptr)  // y + bias, one rounding as torch's add
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) of[r * n + j] += p.bias[j];
  return rc;
}

}  // namespace

// Runs the layers over h [rows, hidden] (the residual stream, updated in place) and leaves the last layer's
// MLP output in m [rows, hidden]: the model adds it to h, as its own loop does. kv holds each layer's K and V
// cache pointers, ropes each rotary table's cos and sin. Returns 0, or the first nonzero code a kernel gave
// (the layers before it have run: the caller raises, and the step is lost, not half-applied silently).
extern "C" int specserve_decoder_layers(const int64_t* layers, int64_t num_layers, void* const* kv,
                                        const void* const* ropes, void* h, void* m, int64_t rows, int64_t hidden,
                                        int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t block_size, const int64_t* positions,
                                        const int64_t* slots, const int32_t* block_tables, int64_t table_stride,
                                        const int32_t* seq_lens, const int32_t* query_start_loc,
                                        const int64_t* seq_ids, int64_t num_seqs, float scale, float eps,
                                        int dtype, int threads) {
  if (dtype != 0 && dtype != 1) return 2;
  const int64_t elem = dtype == 0 ? 4 : 2;
  const int64_t q_size = num_heads * head_dim, qkv_n = (num_heads + 2 * num_kv_heads) * head_dim;
  const auto* descs = reinterpret_cast<const LayerDesc*>(layers);
  for (int64_t i = 0; i < num_layers; ++i) {  // before any layer runs: shapes that disagree change nothing
    const LayerDesc& L = descs[i];
    if (L.qkv.n != qkv_n || L.o.k != q_size || L.gate_up.n != 2 * intermediate || L.down.n != hidden) return 4;
  }
  // uninitialised: every buffer is written before it is read (a vector would zero ~60 MB a 2,048-row chunk)
  const int64_t per_row = hidden + qkv_n + q_size + hidden + 3 * intermediate;
  const std::unique_ptr<char[]> scratch(new char[elem * rows * per_row]);
  char* x = scratch.get();
  char* qkv = x + elem * rows * hidden;
  char* attn = qkv + elem * rows * qkv_n;
  char* o = attn + elem * rows * q_size;
  char* gate_up = o + elem * rows * hidden;
  char* act = gate_up + elem * rows * 2 * intermediate;
  int rc = 0;
  for (int64_t i = 0; i < num_layers && rc == 0; ++i) {
    const LayerDesc& L = descs[i];
    void* k_cache = kv[2 * i];
    void* v_cache = kv[2 * i + 1];
    if ((rc = specserve_add_rms_norm(h, i ? m : nullptr, L.input_norm, x, rows, hidden, hidden, hidden, hidden,
                                     eps, dtype, threads)))
      break;
    if ((rc = run_product(L.qkv, x, rows, qkv, threads))) break;
    if ((rc = specserve_rope_write_kv(qkv, qkv_n, rows, positions, ropes[2 * L.rope], ropes[2 * L.rope + 1],
                                      num_heads, num_kv_heads, head_dim, k_cache, v_cache, slots, dtype,
                                      threads)))
      break;
    if ((rc = specserve_paged_attention_short(qkv, qkv_n, head_dim, k_cache, v_cache, block_tables, table_stride,
                                              seq_lens, query_start_loc, seq_ids, num_seqs, num_heads,
                                              num_kv_heads, head_dim, block_size, scale, attn, q_size, head_dim,
                                              dtype, threads, 0, 0.f)))
      break;
    if ((rc = run_product(L.o, attn, rows, o, threads))) break;
    if ((rc = specserve_add_rms_norm(h, o, L.mlp_norm, x, rows, hidden, hidden, hidden, hidden, eps, dtype,
                                     threads)))
      break;
    if ((rc = run_product(L.gate_up, x, rows, gate_up, threads))) break;
    if ((rc = specserve_silu_mul(gate_up, act, rows, intermediate, 2 * intermediate, intermediate, dtype,
                                 threads)))
      break;
    rc = run_product(L.down, act, rows, m, threads);
  }
  return rc;
}
