// Paged attention, float32 on AVX2 + FMA (specserve_paths() bit 1).
#include "attention.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// float32 caches on CPUs with AVX2 + FMA (Haswell, Zen and later; AVX-512 machines too), for queries of any
// length: decode, speculative verify and prefill chunks. The same plan as the bfloat16 kernel in 8-lane
// registers: keys are taken 8 tokens at a time and transposed, so a row's 8 scores are HD FMAs against
// broadcast query elements with no horizontal sums, and the transpose is shared by every row of the task.
// PV keeps a tile of rows' accumulators for a slice of the head in registers (16 ymm: 3 rows x 4 vectors
// + 4 for V). Long queries are cut into tiles of kQueryTileF32 tokens, each its own task.
constexpr int64_t kQueryTileF32 = 16;
// Queries of up to this many tokens (decode, and verify steps of up to 31 drafts) run as short ones: a task
// of all their rows, keys split in parts at batch 1 (part_starts), scores by qk_direct_f32.
constexpr int64_t kShortQueryF32 = 32;
// One block ahead, as the bfloat16 kernel's kPrefetchAhead: against four (`python bench/kernel_ab.py --case
// attention --dtype float32 --order shuffled`, 2-core Zen 4) batch 1 x 700 / 1,500 tokens 2.03 / 3.57 ms
// against 2.52 / 4.03, batch 2 x 1,500 7.52 against 8.57, 64 x 400 and a verify of 5 at 18 x 600 -3 %.
constexpr int64_t kPrefetchAheadF32 = 1;
// A split sequence's keys in parts fixed by position alone (part_starts: octaves of whole blocks). Whether a
// step splits, and a row's parts, and so its sums, depend on the step's sequence count
// and the row's own position, not on the step's length or its team of threads (the engine's adaptive team
// changes size now and then; its scores come from qk_direct_f32 at every query length up to
// kShortQueryF32). A verify step's row then comes out bit for bit as the decode step of that token would
// have it, so greedy speculation a request at a time gives the very tokens decoding without it gives. With
// parts cut from the step's length and team, w4a8's activation codes carried a last-bit difference on until
// 7 of 12 agentic requests took another token (`bench/suffix_traffic.py`). Octaves keep the parts few at
// long contexts (each part starts its prefetch cold): fixed parts of 64 positions took 13.9 ms against 12.1
// for 30 layers of batch-1 decode at 4,000 tokens, octaves 11.0 against 11.4 (`python bench/kernel_ab.py
// --case attention --batch 1 --context 4000`, 2-core AVX2 EPYC).
// Steps of fewer sequences split their keys (two a thread of a 2-core team, as the bf16 kernel's rule)
constexpr int64_t kSplitBelowSeqsF32 = 4;

// The caches' elements widened to float32: float32 as they are, bfloat16 (kDtypeF32Bf16Kv) by a shift.
inline __m128 cache4(const float* p) { return _mm_loadu_ps(p); }
inline __m256 cache8(const float* p) { return _mm256_loadu_ps(p); }
inline __m128 cache4(const uint16_t* p) {
  const __m128i bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(bits), 16));
}
inline __m256 cache8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 tokens' slices [8 x 8 floats] at rows p, p + stride, ...: out[j] = element j of every token. The
// 128-bit halves come in by loads (a port of their own), leaving 16 in-lane shuffles instead of 24.
template <typename C>
inline void transpose8_load(const C* p, int64_t stride, __m256* out) {
  __m256 r[8];
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(cache4(p + i * stride)), cache4(p + (i + 4) * stride), 1);
    r[i + 4] = _mm256_insertf128_ps(_mm256_castps128_ps256(cache4(p + i * stride + 4)),
                                    cache4(p + (i + 4) * stride + 4), 1);
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
// ahead and now, where given, are HD * sizeof(C) / 8 lines (as many as these loads read) for the caller's
// prefetching, sizeof(C) / 2 of each asked for beside every four loads (see run_f32's trickle).
template <int NR, int HD, typename C>
inline void qk_direct_f32(const float* q, const C* k0, int64_t row, float* dst, int64_t stride,
                          const char* ahead = nullptr, const char* now = nullptr) {
  constexpr int64_t kStep = 32 * sizeof(C);  // bytes of the lines asked for beside four loads
  for (int t0 = 0; t0 < 8; t0 += 4) {
    __m256 acc[NR][4];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < 4; ++t) acc[i][t] = _mm256_setzero_ps();
    for (int c = 0; c < HD / 8; ++c) {
      const int64_t line = ((t0 / 4) * (HD / 8) + c) * kStep;
      for (int64_t at = 0; at < kStep; at += 64) {
        if (ahead) __builtin_prefetch(ahead + line + at, 0, 2);
        if (now) __builtin_prefetch(now + line + at, 0, 2);
      }
      __m256 k[4];
      for (int t = 0; t < 4; ++t) k[t] = cache8(k0 + (t0 + t) * row + 8 * c);
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

// acc[rows][8 * W-float slice dc] += p * v over the tokens [0, n_pad) of the rows' softmaxed scores (each
// row's held from position z, blocks before b0 never read). W = 4:
// 3 rows' 12 accumulators leave no register for V, so GCC loads V again for every row's FMA. W = 2, for
// up to 6 rows: a token's two V vectors stay in registers for the rows (2 loads and NR broadcasts for
// 2 NR FMAs), over twice the passes.
template <int NR, int HD, int W = 4, typename C>
inline void pv_rows_f32(const float* scores, int64_t stride, int64_t z, const C* vp, const int32_t* table,
                        int64_t BS, int64_t row, int64_t hoff, int64_t b0, int64_t n_pad, float* const* dst) {
  for (int dc = 0; dc < HD; dc += 8 * W) {
    __m256 acc[NR][W];
    for (int i = 0; i < NR; ++i)
      for (int c = 0; c < W; ++c) acc[i][c] = _mm256_setzero_ps();
    const int64_t nb = (n_pad + BS - 1) / BS;
    for (int64_t b = b0; b < nb; ++b) {
      const C* vb = vp + static_cast<int64_t>(table[b]) * BS * row + hoff + dc;
      const int64_t base = b * BS, nt = n_pad - base < BS ? n_pad - base : BS;
      if (b + kPvAhead < nb) {
        const C* va = vp + static_cast<int64_t>(table[b + kPvAhead]) * BS * row + hoff + dc;
        for (int64_t t = 0; t < BS; ++t) prefetch_l2(va + t * row, 8 * W * sizeof(C));
      }
      const float* pt = scores + (base - z);
      for (int64_t t = 0; t < nt; ++t) {
        __m256 v[W];
        for (int c = 0; c < W; ++c) v[c] = cache8(vb + t * row + 8 * c);
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
  int64_t merge = -1;              // a part's index in merges
};

// Steps of fewer than kSplitBelowSeqsF32 sequences split their keys into parts fixed by position
// (part_starts), each part all of the sequence's heads (run_f32).

// C: the caches' element, float or bfloat16 bits (kDtypeF32Bf16Kv); q and out are float32 either way
template <int HD, typename C = float>
void run_f32(const Args& a, int num_threads) {
  static_assert(HD % 32 == 0, "whole 4-vector slices in PV");
  const float* qp = static_cast<const float*>(a.q);
  const C* kp = static_cast<const C*>(a.k_cache);
  const C* vp = static_cast<const C*>(a.v_cache);
  float* op = static_cast<float*>(a.out);
  const int64_t BS = a.block_size, group = a.num_heads / a.num_kv_heads, KVH = a.num_kv_heads;
  const int64_t row = KVH * HD;
  constexpr int64_t kElem = sizeof(C);
  const int64_t block_bytes = BS * row * kElem;

  // Short queries one task per sequence (all heads, one pass over whole blocks) when there is a sequence a
  // thread, else per head; long ones per head and query tile, latest tiles (the most keys) first. A task of
  // one head reads a third of each of SmolLM2's token rows at a stride: 30 layers at 1,500 tokens, shuffled
  // blocks (`python bench/kernel_ab.py --case attention --context 1500 --order shuffled`, 2-core AVX2 EPYC),
  // batch 4 20.7 ms a task a sequence against 32.7 a task a head, 5 28.1 against 43.8, 7 37.1 against 59.5.
  std::vector<TaskF32> tasks;
  std::vector<Merge> merges;
  const bool all_heads = a.num_seqs >= num_threads;
  // Fewer sequences than kSplitBelowSeqsF32: each short query's keys in parts, every part a task of all the
  // sequence's heads (whole token rows of K and V, the trickled prefetch of all-heads tasks).
  // Parts of one head each read a third of every row at a stride and streamed at ~10 GB/s: SmolLM2's 30
  // layers at 1,500 tokens (`python bench/kernel_ab.py --case attention --context 1500`, 2-core AVX2 EPYC)
  // batch 1 5.60 ms against 7.32, batch 2 11.9 against 17.0, batch 3 16.1 against 26.4 (shuffled blocks).
  const bool split = !a.invariant && a.window == 0 && a.num_seqs < kSplitBelowSeqsF32;
  int64_t part_rows = 0;  // rows in the parts' buffer so far
  std::vector<int64_t> starts;
  for (int64_t n = 0; n < a.num_seqs; ++n) {
    const int64_t s = a.seq_ids[n];
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    if (q_len <= kShortQueryF32) {
      if (split) part_starts(a.seq_lens[s], BS, starts);
      else starts.clear();
      short_query_tasks(n, q_len, KVH, group, all_heads, starts, tasks, merges, part_rows);
      continue;
    }
    for (int64_t i1 = q_len; i1 > 0; i1 -= kQueryTileF32)
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back({n, h, h + 1, i1 > kQueryTileF32 ? i1 - kQueryTileF32 : 0, i1});
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());

  // each part's rows: HD outputs (normalized over the part) and the part's max and sum of exponentials
  std::vector<float> parts(part_rows * (HD + 2));
  // parts of each merge not yet done: the task that finishes the last one merges them (as in run_bf16)
  const int64_t num_merges = static_cast<int64_t>(merges.size());
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[num_merges]);
  for (int64_t mi = 0; mi < num_merges; ++mi) remaining[mi].store(merges[mi].count, std::memory_order_relaxed);

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, qs;
    std::vector<int64_t> limit;
    std::vector<float*> dst;
    alignas(32) __m256 kt[HD], kt2[HD];
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const TaskF32& task = tasks[ti];
      const int64_t s = a.seq_ids[task.seq];
      const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
      const int64_t len = a.seq_lens[s];
      const int32_t* table = a.block_tables + s * a.table_stride;
      const int64_t R = (task.i1 - task.i0) * group;  // row (i - i0) * group + g: query token i, head g
      // decode and verify rows: every row's scores in one form, whatever the row count (part_starts)
      const bool short_rows = !a.invariant && q_len <= kShortQueryF32;
      const int64_t H = task.h1 - task.h0;  // a head's rows are [hh * R, hh * R + R): hh = h - h0
      // the last row sees positions before len - q_len + i1; a part, those before its p1 too
      const int64_t end = std::min(len - q_len + task.i1, task.p1);
      const int64_t num_tiles = (end + 7) / 8;
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
                                    : parts.data() + (task.part + hr) * (HD + 2);
          }

      // One pass over the keys serves every head of the task (a block's heads from one stream of whole
      // blocks), while V is fetched for the PV passes after. Head by head, the first head's pass waited on
      // memory and the others' computed from L2 with memory idle. SmolLM2's 30 layers, each its own cache
      // (bench/kernel_ab.py, 2-core Zen 4): 64 x 400 tokens 73.3 ms against 81.5, 18 x 600 31.0 against
      // 34.2, verify of 5 at 18 x 600 56.3 against 59.8.
      const int64_t fetch = H > 1 ? block_bytes : HD * kElem;
      auto prefetch_block = [&](const C* cache, int64_t b) {
        const C* start = cache + static_cast<int64_t>(table[b]) * BS * row;
        if (fetch == block_bytes) return prefetch_l2(start, block_bytes);
        for (int64_t t = 0; t < BS; ++t) prefetch_l2(start + t * row + task.h0 * HD, fetch);
      };
      const int64_t num_blocks = (end + BS - 1) / BS;
      // blocks before it are outside every window (or before the part)
      const int64_t b0 = std::max(window_start(a, limit[0]), task.p0) / BS;
      // a row's scores for positions [z, num_tiles * 8): a part's, not every position before it
      const int64_t z = b0 * BS, stride = num_tiles * 8 - z;
      scores.resize(H * R * stride);
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
      // a transposed chunk's share: 4 lines of each slab (2 in bfloat16) beside its 16 loads
      const auto chunk_lines = [](const char* slab, int64_t hh, int c) {
        if (slab) prefetch_l2(slab + hh * HD * 8 * kElem + c * 64 * kElem, 64 * kElem);
      };
      for (int64_t u = b0 * BS / 8; u < num_tiles; ++u) {
        const int64_t p0 = u * 8, b = p0 / BS;
        const char* k_ahead;
        const char* v_now;
        fetch_at(p0, &k_ahead, &v_now);
        int64_t r = 0;
        while (r < R && limit[r] <= p0) ++r;  // rows are ordered by limit: earlier rows end sooner
        // qk_rows2_f32 and qk_direct_f32 sum a score in other orders than qk_rows_f32: which one a key tile
        // gets depends on the task's rows and end, so the invariant form runs qk_rows_f32 for every tile
        if (!short_rows && !a.invariant && R > 4 && u + 1 < num_tiles) {  // prefill tiles: two key tiles at once
          const int64_t p1 = p0 + 8, b1 = p1 / BS;
          const char* k_ahead1;
          const char* v_now1;
          fetch_at(p1, &k_ahead1, &v_now1);
          for (int64_t hh = 0; hh < H; ++hh) {
            const int64_t hoff = (task.h0 + hh) * HD;
            const C* ka = kp + (static_cast<int64_t>(table[b]) * BS + p0 % BS) * row + hoff;
            const C* kb = kp + (static_cast<int64_t>(table[b1]) * BS + p1 % BS) * row + hoff;
            for (int c = 0; c < HD / 8; ++c) {
              for (const char* slab : {k_ahead, v_now, k_ahead1, v_now1}) chunk_lines(slab, hh, c);
              transpose8_load(ka + 8 * c, row, kt + 8 * c);
              transpose8_load(kb + 8 * c, row, kt2 + 8 * c);
            }
            const float* q = qs.data() + hh * R * HD;
            float* out = scores.data() + hh * R * stride + (p0 - z);
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
          const C* k0 = kp + (static_cast<int64_t>(table[b]) * BS + p0 % BS) * row + (task.h0 + hh) * HD;
          const float* q = qs.data() + hh * R * HD;
          float* out = scores.data() + hh * R * stride + (p0 - z);
          if (short_rows) {
            const int64_t share = hh * HD * 8 * kElem;  // this head's share of the tile's lines, in bytes
            const char* ka = k_ahead ? k_ahead + share : nullptr;
            const char* vn = v_now ? v_now + share : nullptr;
            for (int64_t rr = r; rr < R; rr += 4, ka = vn = nullptr) {  // the lines asked for once
              const float* qr = q + rr * HD;
              float* o = out + rr * stride;
              switch (std::min<int64_t>(4, R - rr)) {
                case 4: qk_direct_f32<4, HD>(qr, k0, row, o, stride, ka, vn); break;
                case 3: qk_direct_f32<3, HD>(qr, k0, row, o, stride, ka, vn); break;
                case 2: qk_direct_f32<2, HD>(qr, k0, row, o, stride, ka, vn); break;
                default: qk_direct_f32<1, HD>(qr, k0, row, o, stride, ka, vn); break;
              }
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
            const int64_t lo = std::max(window_start(a, limit[r0 + r]), z);
            softmax_row(sc + r * stride, 0, lo - z, std::max(std::min(limit[r0 + r], end), lo) - z, n_pad - z,
                        a.softcap, task.part < 0 ? nullptr : d[r] + HD);
          }
          const int64_t hoff = (task.h0 + hh) * HD;
          if (rows_at_once == 6) {
            switch (nr) {
              case 6: pv_rows_f32<6, HD, 2>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 5: pv_rows_f32<5, HD, 2>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 4: pv_rows_f32<4, HD, 2>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 3: pv_rows_f32<3, HD, 2>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d); break;
              case 2: pv_rows_f32<2, HD, 2>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d); break;
              default: pv_rows_f32<1, HD, 2>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d); break;
            }
          } else if (nr == 3) pv_rows_f32<3, HD>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d);
          else if (nr == 2) pv_rows_f32<2, HD>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d);
          else pv_rows_f32<1, HD>(sc, stride, z, vp, table, BS, row, hoff, b0, n_pad, d);
        }
      // acq_rel: the last part's thread sees every other part's rows before it merges them
      if (task.merge >= 0 && remaining[task.merge].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_parts<HD>(a, tasks.data(), merges[task.merge], parts.data(), op);
    }
  }
}
#define SPECSERVE_F32_PATH 1
#endif

}  // namespace
