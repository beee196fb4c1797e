// Paged attention for sequences whose new rows form a draft tree (kernels/tree.py): row i sees the committed
// context and the new rows set in its ancestor mask, at position context + depth(i) for a sliding window.
// Plain loops in float32 accumulation for every dtype and head size: a tree is a verify step's few rows, and
// keeping it out of the fast paths leaves their causal loop bounds (and a chain's bits) untouched.
#include "attention.h"

namespace {

// T: q and out; C: the KV caches
template <typename T, typename C = T>
void run_tree(const Args& a, const int64_t* tree_mask, const int32_t* tree_depth, int num_threads) {
  const T* qp = static_cast<const T*>(a.q);
  const C* kp = static_cast<const C*>(a.k_cache);
  const C* vp = static_cast<const C*>(a.v_cache);
  T* op = static_cast<T*>(a.out);
  const int64_t D = a.head_dim, BS = a.block_size, group = a.num_heads / a.num_kv_heads;
  const int64_t row = a.num_kv_heads * D;
  const int64_t num_tasks = a.num_seqs * a.num_kv_heads;

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf(D), acc(D), scores;
    std::vector<int64_t> slots;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t s = a.seq_ids[task / a.num_kv_heads], h = task % a.num_kv_heads;
      const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
      const int64_t ctx = a.seq_lens[s] - q_len;
      const int32_t* table = a.block_tables + s * a.table_stride;
      const auto slot = [&](int64_t pos) { return (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * row + h * D; };
      for (int64_t i = 0; i < q_len; ++i) {
        const uint64_t bits = static_cast<uint64_t>(tree_mask[q0 + i]);
        const int64_t at = ctx + tree_depth[q0 + i];
        const int64_t lo = a.window > 0 && at + 1 > a.window ? at + 1 - a.window : 0;
        slots.clear();
        for (int64_t p = lo; p < ctx; ++p) slots.push_back(slot(p));
        for (int64_t j = 0; j < q_len && j < 64; ++j) {
          if (!((bits >> j) & 1u)) continue;
          if (a.window > 0 && ctx + tree_depth[q0 + j] <= at - a.window) continue;
          slots.push_back(slot(ctx + j));
        }
        const int64_t n = static_cast<int64_t>(slots.size());
        scores.resize(n);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = h * group + g;
          const T* src = qp + (q0 + i) * a.q_tok + head * a.q_head;
          for (int64_t d = 0; d < D; ++d) qf[d] = load(src, d) * a.scale;
          for (int64_t t = 0; t < n; ++t) {
            const C* k = kp + slots[t];
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qf[d] * load(k, d);
            scores[t] = dot;
          }
          softmax_row(scores.data(), 0, 0, n, n, a.softcap);
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t t = 0; t < n; ++t) {
            const C* v = vp + slots[t];
            const float w = scores[t];
            for (int64_t d = 0; d < D; ++d) acc[d] += w * load(v, d);
          }
          T* dst = op + (q0 + i) * a.o_tok + head * a.o_head;
          for (int64_t d = 0; d < D; ++d) store(dst, d, acc[d]);
        }
      }
    }
  }
}

}  // namespace

extern "C" int specserve_paged_attention_tree(
    const void* q, int64_t q_tok, int64_t q_head, const void* k_cache, const void* v_cache,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* seq_ids, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, void* out, int64_t o_tok,
    int64_t o_head, int dtype, int num_threads, int64_t window, float softcap, const int64_t* tree_mask,
    const int32_t* tree_depth) {
  if (num_heads % num_kv_heads != 0 || window < 0) return kBadArguments;
  for (int64_t n = 0; n < num_seqs; ++n) {
    const int64_t s = seq_ids[n];
    if (query_start_loc[s + 1] - query_start_loc[s] > 64) return kBadArguments;
  }
  const Args a{q,        q_tok,    q_head,    k_cache,      v_cache,   block_tables, table_stride,
               seq_lens, query_start_loc, seq_ids, num_seqs, num_heads, num_kv_heads, head_dim,
               block_size, scale, out, o_tok, o_head, window, softcap, false};
  if (dtype == 0) run_tree<float>(a, tree_mask, tree_depth, num_threads);
  else if (dtype == 1) run_tree<uint16_t>(a, tree_mask, tree_depth, num_threads);
  else if (dtype == kDtypeF32Bf16Kv) run_tree<float, uint16_t>(a, tree_mask, tree_depth, num_threads);
  else return kNotInBuild;
  return kOk;
}
