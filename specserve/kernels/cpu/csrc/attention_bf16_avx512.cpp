// Paged attention, bfloat16 on AVX512-BF16 (specserve_paths() bit 2).
#include "attention.h"

namespace {

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
// K is asked for one block ahead of the tile in hand: into L2 (prefetch_l2), whose latency a block's work
// covers, while more blocks in flight (a task asks for its first ones whole) only queued behind each other.
// SmolLM2's 30 layers (`python bench/kernel_ab.py --case attention --dtype bfloat16 --order shuffled`,
// 2-core Zen 4), one block ahead against four: batch 1 x 700 / 1,500 / 3,000 tokens 1.25 / 2.48 / 4.23 ms
// against 1.43 / 2.83 / 4.70, batch 2 x 1,500 4.16 against 4.97, a verify of 4 at 1 x 600 2.00 against
// 2.37, of 5 at 18 x 200 9.21 against 10.36, 64 x 400 31.8 against 34.7, 18 x 800 level; two ahead was
// between.
constexpr int64_t kPrefetchAhead = 1;

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

// Steps of fewer sequences split their keys (as the float32 kernel's kSplitBelowSeqsF32). Tasks of all heads
// and parts fixed by position against tasks and equal parts of one head, SmolLM2's 30 layers (`python
// bench/kernel_ab.py --case attention --dtype bfloat16 --order shuffled`, 2-core Zen 4): batch 1 x 800
// tokens 2.69 ms against 3.10, 1 x 2,000 3.53 against 5.58, batch 2 / 5 x 800 3.55 / 6.01 against 4.54 /
// 11.25; a verify of 5 at 1 x 600 and 64 x 400 level. Equal parts of all heads ran batch 1 10-15 % faster
// than the parts fixed by position, but a verify step's row then summed otherwise than its decode step.
constexpr int64_t kSplitBelowSeqsBf16 = 4;

struct Task {
  int64_t seq;       // index into seq_ids
  int64_t h0, h1;    // KV heads [h0, h1)
  int64_t i0, i1;    // query tokens [i0, i1) of the sequence
  int64_t p0 = 0, p1 = INT64_MAX;  // key positions [p0, p1): a part of a split sequence, else all
  int64_t part = -1;               // its rows' slot in the parts' buffer (-1: written to out directly)
  int64_t merge = -1;              // a part's index in merges
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

  // Short queries: one task per sequence, taking all KV heads (whole token rows of K and V, one stream
  // the trickled prefetch keeps ahead of) when there is a sequence a thread, else a task per head; steps of
  // fewer sequences than kSplitBelowSeqsBf16 split each one's keys into parts, each part all its heads.
  // Long queries: a task per head and query tile. Tiles ending later read more keys: they go first.
  // A task of one head reads a third of each of SmolLM2's token rows at a stride, and parts of one head
  // streamed at ~10 GB/s: see the float32 kernel's figures (attention_f32_avx2.cpp), and this kernel's at
  // kSplitBelowSeqsBf16.
  std::vector<Task> tasks;
  std::vector<Merge> merges;
  const bool all_heads = a.num_seqs >= num_threads;
  // which parts a sequence gets depends on the step's sequences, so a batch-invariant step never splits; not
  // on the team of threads (the engine's adaptive team changes size now and then), as the float32 kernel's
  const bool split = !a.invariant && a.num_seqs < kSplitBelowSeqsBf16;
  int64_t part_rows = 0;  // rows in the parts' buffer so far
  std::vector<int64_t> starts;
  for (int64_t n = 0; n < a.num_seqs; ++n) {
    const int64_t s = a.seq_ids[n];
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    if (q_len <= kQueryTile) {
      // Without a window, parts fixed by position (part_starts), so that a verify step's row sums as the
      // decode step of its token would; with one, equal parts of the blocks the window leaves (from the one
      // holding its first row's window start)
      const int64_t len = a.seq_lens[s], b_lo = window_start(a, len - q_len + 1) / BS;
      if (split && a.window == 0) {
        part_starts(len, BS, starts);
      } else {
        starts.clear();
        const int64_t blocks = (len + BS - 1) / BS - b_lo;
        const int64_t parts = split ? parts_for(a.num_seqs, num_threads, len - b_lo * BS) : 1;
        for (int64_t c = 0; c < parts; ++c) starts.push_back((b_lo + c * blocks / parts) * BS);
      }
      short_query_tasks(n, q_len, KVH, group, all_heads, starts, tasks, merges, part_rows);
      continue;
    }
    for (int64_t i1 = q_len; i1 > 0; i1 -= kQueryTile)
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back({n, h, h + 1, i1 > kQueryTile ? i1 - kQueryTile : 0, i1});
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t num_merges = static_cast<int64_t>(merges.size());
  // each part's rows: HD outputs (normalized over the part, in float32) and the part's max and sum of exps
  std::vector<float> parts(part_rows * (HD + 2));
  // parts of each merge not yet done: the task that finishes the last one merges them, so no thread waits
  // on a barrier between the parts and the merges (on a busy machine each barrier can cost a thread's wakeup)
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[num_merges]);
  for (int64_t mi = 0; mi < num_merges; ++mi) remaining[mi].store(merges[mi].count, std::memory_order_relaxed);

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;
    std::vector<uint16_t> pairs;  // a row tile's weights in bf16, row-major with the scores' stride
    std::vector<uint32_t> qpairs;
    std::vector<int64_t> limit;
    alignas(64) __m512i kt[HD / 2];
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const Task& task = tasks[ti];
      const int64_t s = a.seq_ids[task.seq];
      const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
      const int64_t len = a.seq_lens[s];
      const int32_t* table = a.block_tables + s * a.table_stride;
      const int64_t R = (task.i1 - task.i0) * group;  // row (i - i0) * group + g: query token i, head g
      // the last row sees positions before len - q_len + i1; a part, those before its p1 too
      const int64_t end = std::min(len - q_len + task.i1, task.p1);
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
        if (fetch == block_bytes) return prefetch_l2(start, block_bytes);
        for (int64_t t = 0; t < BS; ++t) prefetch_l2(start + t * row + task.h0 * HD, fetch);
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
      // blocks before it are outside every window (or before the part)
      const int64_t b0 = std::max(window_start(a, limit[0]), task.p0) / BS;
      for (int64_t b = b0; b < b0 + kPrefetchAhead && b < num_blocks; ++b) prefetch_block(kp, b);
      const __m512 scale = _mm512_set1_ps(a.scale);
      // A task of every head reads a tile's 16 whole token rows of K, one 64-byte line a load: beside each
      // load it asks for a line of the same tile kPrefetchAhead blocks on, and one of its V. All at once,
      // a block's 96 lines filled the core's miss buffers and stalled it; spread, memory streams during
      // the work, bit for bit the same (bench/kernel_ab.py --dtype bfloat16 --order shuffled, 30 layers,
      // 2-core Zen 4): 18 x 800 tokens 24.9 ms against 27.2, 64 x 400 43.1 against 47.2, 8 x 1,600 21.1
      // against 23.1, verify of 5 at 18 x 200 10.1 against 11.5 (four blocks ahead then).
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
                if (k_ahead) __builtin_prefetch(k_ahead + line, 0, 2);
                __builtin_prefetch(v_now + line, 0, 2);
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
        const int64_t hr0 = (h - task.h0) * R;  // the head's first row in the task's (and its part's) rows
        float* const sh = scores.data() + hr0 * stride;
        // softmax and PV, a tile of rows at a time (their accumulators stay in registers). Tokens go in
        // pairs: the two tokens' V rows interleaved (unpacklo/hi_epi16) against the pair of their bf16
        // weights, one vdpbf16ps per 16 dims and row, where widening V to fp32 for an FMA a token took
        // 2.4x the instructions (PV was 40 % of the kernel's hot time on Zen 4). The weights are rounded
        // to bf16, as HF's eager bf16 attention rounds its probabilities before multiplying by V. A
        // 128-bit lane of the interleaved vectors holds dims 8L..8L+3 (lo) or 8L+4..8L+7 (hi).
        for (int64_t r0 = 0; r0 < R; r0 += kRowTile) {
          const int64_t nr = R - r0 < kRowTile ? R - r0 : kRowTile;
          const int64_t n_pad = std::min(limit[r0 + nr - 1], end);
          const int64_t z0 = b0 * BS;
          for (int64_t r = r0; r < r0 + nr; ++r) {
            float* sr = sh + r * stride;
            // a part's row may see none of its keys (a window starting past it): sum 0, weight 0 in the merge
            const int64_t lo = std::min(std::max(window_start(a, limit[r]), z0), n_pad);
            softmax_row(sr, z0, lo, std::max(std::min(limit[r], end), lo), n_pad, a.softcap,
                        task.part < 0 ? nullptr : parts.data() + (task.part + hr0 + r) * (HD + 2) + HD);
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
            if (b + kPvAhead < nb) {
              const uint16_t* va = vp + static_cast<int64_t>(table[b + kPvAhead]) * BS * row + h * HD;
              for (int64_t u = 0; u < BS; ++u) prefetch_l2(va + u * row, HD * 2);
            }
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
            alignas(64) float tmp[HD];
            for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(tmp + 16 * c, acc[rr][c]);
            const auto dim = [&](int d) {  // undo the interleaving's order of dims
              const int c = d / 32, lane = (d % 32) / 8, w = d % 8;
              return tmp[16 * (2 * c + (w >= 4)) + 4 * lane + (w % 4)];
            };
            if (task.part >= 0) {
              float* dst = parts.data() + (task.part + hr0 + r) * (HD + 2);
              for (int d = 0; d < HD; ++d) dst[d] = dim(d);
              continue;
            }
            uint16_t* dst = op + (q0 + i) * a.o_tok + (h * group + g) * a.o_head;
            for (int d = 0; d < HD; ++d) store(dst, d, dim(d));
          }
        }
      }
      // acq_rel: the last part's thread sees every other part's rows before it merges them
      if (task.merge >= 0 && remaining[task.merge].fetch_sub(1, std::memory_order_acq_rel) == 1)
        merge_parts<HD>(a, tasks.data(), merges[task.merge], parts.data(), op);
    }
  }
}
#define SPECSERVE_BF16_PATH 1
#endif

}  // namespace
