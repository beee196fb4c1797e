// Paged attention on CPU: what its three forms share (attention_bf16_avx512.cpp, attention_f32_avx2.cpp,
// attention_generic.cpp; attention.cpp picks one).
//
// A task per sequence (all its KV heads) or per (sequence, KV head): the group's query heads times the
// sequence's new tokens form R rows a head. A step of too few sequences for the threads splits each short
// query's keys into parts (see parts_for), each part a task of its own, merged per row after by its max and
// sum of exponentials.
// Scores are computed a block at a time against a transposed float copy of the block's K, so the inner
// loop runs across the block's tokens (one vector register for 16 tokens) with no horizontal sums; a
// two-pass softmax then weights V rows. Every cached row is read once. Causal masking is done by loop
// bounds (a row stops at its own position), so no -inf ever enters the arithmetic and unowned cache slots
// (a block's unwritten tail) are never read. A sliding window (Gemma 3, Mistral) is a lower bound the same
// way: a row's softmax starts at its first visible position and the task starts at the block holding its
// earliest row's first one, so blocks wholly before the window are never read. Score soft-capping
// (cap * tanh(s / cap), Gemma 2 style) is applied in the softmax, shared by every path.
#pragma once

#include <atomic>

#include "common.h"

namespace {

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

// PV asks for the V rows (its head's slice) of the block this many blocks on as it starts a block. The QK pass
// fetched V beside K, but a part or task of many blocks has lost the early ones from L1 and L2 by its PV
// pass, and blocks lie in cache order, not in position order, so the hardware does not see the stream.
// SmolLM2's 30 layers, shuffled blocks, outputs identical (`python bench/kernel_ab.py --case attention
// --dtype float32`, Zen 4): 64 x 400 tokens 76.9 ms against 84.6, batch 1 x 1,500 4.20 against 4.58,
// batch 1 x 3,000 9.02 against 9.51.
constexpr int64_t kPvAhead = 2;

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
  // Every row's arithmetic the same whatever the step holds (its row count, its batch mates, how a prompt was
  // chunked): one score form for every row count and no key split, which depends on the step's tasks.
  bool invariant;
};

// Steps of few sequences split each short query's keys into parts, each a task of all the sequence's heads,
// merged after by their softmax statistics (flash-decoding's split): at batch 1 SmolLM2's three KV heads
// as three tasks on two threads left one thread waiting a third of the step. Both kernels cut parts fixed
// by position (part_starts); under a sliding window the bfloat16 one cuts equal parts of the blocks the
// window leaves (parts_for), and the float32 one does not split. Never in a batch-invariant step
// (Args::invariant): whether a sequence is split depends on the step's sequences.
constexpr int64_t kMaxParts = 64, kMinPartTokens = 64;

// Parts fixed by position alone: octaves [0, 64), [64, 128), [128, 256), ... (each twice the last), each cut
// into kPartPieces parts of whole blocks, none under kPartTokens positions. A row's parts, and so its sums,
// then depend on its own position, not on the step's length. Octaves keep the parts few at long contexts
// (each part starts its prefetch cold): fixed parts of 64 positions took 13.9 ms against 12.1 for 30 layers
// of float32 batch-1 decode at 4,000 tokens, octaves 11.0 against 11.4 (`python bench/kernel_ab.py --case
// attention --batch 1 --context 4000`, 2-core AVX2 EPYC).
constexpr int64_t kPartTokens = 64, kPartPieces = 2;

// The parts' first positions for a sequence of len positions, in order (the last part runs to its end).
inline void part_starts(int64_t len, int64_t BS, std::vector<int64_t>& starts) {
  starts.clear();
  const int64_t base = (kPartTokens + BS - 1) / BS * BS;
  for (int64_t lo = 0, hi = base; lo < len; lo = hi, hi *= 2) {
    const int64_t size = hi - lo, pieces = std::max<int64_t>(1, std::min(kPartPieces, size / base));
    const int64_t step = (size / pieces + BS - 1) / BS * BS;
    for (int64_t at = lo; at < hi && at < len; at += step) starts.push_back(at);
  }
}

// Parts per split sequence: at least enough for two tasks a thread, then the fewest (up to twice that) whose
// total divides evenly among the threads, then no more than the keys hold parts of kMinPartTokens.
inline int64_t parts_for(int64_t tasks, int64_t threads, int64_t keys) {
  int64_t parts = (2 * threads + tasks - 1) / tasks;
  for (int64_t p = parts; p < 2 * parts; ++p)
    if (tasks * p % threads == 0) {
      parts = p;
      break;
    }
  return std::max<int64_t>(1, std::min({parts, keys / kMinPartTokens, kMaxParts}));
}

// A split (sequence, heads): its parts are tasks [first, first + count), merged into out by their statistics.
struct Merge {
  int64_t first, count;
};

// A short query's tasks (TaskT: either kernel's, fields {seq, h0, h1, i0, i1, p0, p1, part, merge}): a part
// a task of all heads where starts holds more than one (the latest, the largest, first, so that the threads
// end together; merged in this order too), else one task of all heads, else a task a head.
template <typename TaskT>
inline void short_query_tasks(int64_t n, int64_t q_len, int64_t heads, int64_t group, bool all_heads,
                              const std::vector<int64_t>& starts, std::vector<TaskT>& tasks,
                              std::vector<Merge>& merges, int64_t& part_rows) {
  const int64_t parts = static_cast<int64_t>(starts.size());
  if (parts > 1) {
    const int64_t merge = static_cast<int64_t>(merges.size());
    merges.push_back({static_cast<int64_t>(tasks.size()), parts});
    for (int64_t c = parts - 1; c >= 0; --c, part_rows += heads * q_len * group)
      tasks.push_back({n, 0, heads, 0, q_len, starts[c], c + 1 < parts ? starts[c + 1] : INT64_MAX, part_rows, merge});
  } else if (all_heads) {
    tasks.push_back({n, 0, heads, 0, q_len});
  } else {
    for (int64_t h = 0; h < heads; ++h) tasks.push_back({n, h, h + 1, 0, q_len});
  }
}

// A split task's rows from its parts' (each HD outputs normalized over the part, then the part's max and sum
// of exps, at parts[task.part + hh * R + r] for its head h0 + hh): each weighted by its share of the row's
// exponentials, summed in float32 and stored in T once. A part that saw none of a row's keys has sum 0 and
// weight 0.
template <int HD, typename T, typename TaskT>
inline void merge_parts(const Args& a, const TaskT* tasks, const Merge& m, const float* parts, T* op) {
  const TaskT& first = tasks[m.first];
  const int64_t group = a.num_heads / a.num_kv_heads, s = a.seq_ids[first.seq];
  const int64_t q0 = a.query_start_loc[s], R = first.i1 * group, H = first.h1 - first.h0;
  for (int64_t hr = 0; hr < H * R; ++hr) {
    const int64_t h = first.h0 + hr / R, r = hr % R;
    float mx = -3.0e38f;
    for (int64_t c = 0; c < m.count; ++c) {
      const float* st = parts + (tasks[m.first + c].part + hr) * (HD + 2) + HD;
      if (st[1] > 0.f) mx = std::max(mx, st[0]);
    }
    T* dst = op + (q0 + r / group) * a.o_tok + (h * group + r % group) * a.o_head;
    // A row that sees one part only takes its output as it is, as an unsplit task gives it (weight / total
    // is not exactly 1 under -ffast-math's reciprocals); the f32 kernel's parts, fixed by position, then
    // merge a row alike whatever the step's length (part_starts).
    int64_t seen = 0, only = 0;
    for (int64_t c = 0; c < m.count; ++c)
      if (parts[(tasks[m.first + c].part + hr) * (HD + 2) + HD + 1] > 0.f) ++seen, only = c;
    if (seen == 1) {
      const float* part = parts + (tasks[m.first + only].part + hr) * (HD + 2);
      for (int d = 0; d < HD; ++d) store(dst, d, part[d]);
      continue;
    }
    // a part's weight, taken twice (the same value both times: parts fixed by position have no bound on
    // their count); the total summed in part order, never reassociated, so that parts the row sees nothing
    // of add exact zeros
    const auto weight = [&](int64_t c) {
      const float* st = parts + (tasks[m.first + c].part + hr) * (HD + 2) + HD;
      return st[1] > 0.f ? st[1] * std::exp(st[0] - mx) : 0.f;
    };
    float total = 0.f;
    for (int64_t c = 0; c < m.count; ++c) total = rounded(total + weight(c));
    alignas(64) float o[HD] = {};
    for (int64_t c = 0; c < m.count; ++c) {
      const float w = weight(c) / total;
      if (w == 0.f) continue;  // a part the row sees nothing of adds nothing
      const float* part = parts + (tasks[m.first + c].part + hr) * (HD + 2);
      for (int d = 0; d < HD; ++d) o[d] += w * part[d];
    }
    for (int d = 0; d < HD; ++d) store(dst, d, o[d]);
  }
}

// First position row `limit` (one past its own position) sees.
inline int64_t window_start(const Args& a, int64_t limit) {
  return a.window > 0 && limit > a.window ? limit - a.window : 0;
}

}  // namespace
