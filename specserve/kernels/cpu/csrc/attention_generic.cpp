// Paged attention in plain loops, any dtype, head size and block size: what a build without the fast paths
// runs (the portable variant), and what the others run for shapes their fast paths do not take.
#include "attention.h"

namespace {

// T: q and out; C: the KV caches
template <typename T, int HD, typename C = T>
void run(const Args& a, int num_threads) {
  const T* qp = static_cast<const T*>(a.q);
  const C* kp = static_cast<const C*>(a.k_cache);
  const C* vp = static_cast<const C*>(a.v_cache);
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
  const int64_t block_bytes = BS * row * static_cast<int64_t>(sizeof(C));

  // The next block of a task's first head: whole block rows (all heads, contiguous) or one head's slices.
  auto prefetch_rows = [&](const C* cache, int32_t block, int64_t h, int64_t bytes) {
    const C* start = cache + static_cast<int64_t>(block) * BS * row;
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
      const int64_t fetch = heads_per_task > 1 ? block_bytes : D * static_cast<int64_t>(sizeof(C));
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
        const C* kblock = kp + static_cast<int64_t>(table[b]) * BS * row + h * D;
        if (first && b + 1 < num_blocks) prefetch_rows(kp, table[b + 1], h, fetch);
        qk_block<C, HD>(qf.data(), kp, R, limit.data(), kblock, row, D, base, nt, a.scale, kt.data(),
                          scores.data(), len);
      }

      for (int64_t r = 0; r < R; ++r)
        softmax_row(scores.data() + r * len, b0 * BS, window_start(a, limit[r]), limit[r], limit[r], a.softcap);

      for (int64_t b = b0; b < num_blocks; ++b) {
        const int64_t base = b * BS, nt = len - base < BS ? len - base : BS;
        const C* vblock = vp + static_cast<int64_t>(table[b]) * BS * row + h * D;
        if (first && b + 1 < num_blocks) prefetch_rows(vp, table[b + 1], h, fetch);
        pv_block<C, HD>(R, limit.data(), vblock, row, D, base, nt, scores.data(), len, vb.data(), acc.data());
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
