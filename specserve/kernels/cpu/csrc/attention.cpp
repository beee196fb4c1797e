// specserve_paged_attention_short: picks the attention form for the dtype and shape. unity.cpp includes it after
// the forms, whose SPECSERVE_*_PATH macros say which this build holds.
#include "api.h"
#include "attention.h"

extern "C" int specserve_paged_attention_short(
    const void* q, int64_t q_tok, int64_t q_head, const void* k_cache, const void* v_cache,
    const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
    const int32_t* query_start_loc, const int64_t* seq_ids, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, void* out, int64_t o_tok,
    int64_t o_head, int dtype, int num_threads, int64_t window, float softcap, int invariant) {
  if (block_size > 256 || num_heads % num_kv_heads != 0 || window < 0) return kBadArguments;
  const Args a{q,        q_tok,    q_head,    k_cache,      v_cache,   block_tables, table_stride,
               seq_lens, query_start_loc, seq_ids, num_seqs, num_heads, num_kv_heads, head_dim,
               block_size, scale, out, o_tok, o_head, window, softcap, invariant != 0};
  // Head sizes known at compile time let the compiler unroll the dot products into whole registers.
  if (dtype == 0) {
#ifdef SPECSERVE_F32_PATH
    if (block_size % 8 == 0 && head_dim == 64) return run_f32<64>(a, num_threads), kOk;
    if (block_size % 8 == 0 && head_dim == 128) return run_f32<128>(a, num_threads), kOk;
    if (block_size % 8 == 0 && head_dim == 256) return run_f32<256>(a, num_threads), kOk;
#endif
    if (head_dim == 64) run<float, 64>(a, num_threads);
    else if (head_dim == 128) run<float, 128>(a, num_threads);
    else run<float, 0>(a, num_threads);
  } else if (dtype == 1) {
#ifdef SPECSERVE_BF16_PATH
    if (block_size % 16 == 0 && head_dim == 64) return run_bf16<64>(a, num_threads), kOk;
    if (block_size % 16 == 0 && head_dim == 128) return run_bf16<128>(a, num_threads), kOk;
    if (block_size % 16 == 0 && head_dim == 256) return run_bf16<256>(a, num_threads), kOk;
#endif
    if (head_dim == 64) run<uint16_t, 64>(a, num_threads);
    else if (head_dim == 128) run<uint16_t, 128>(a, num_threads);
    else run<uint16_t, 0>(a, num_threads);
  } else if (dtype == kDtypeF32Bf16Kv) {
#ifdef SPECSERVE_F32_PATH
    if (block_size % 8 == 0 && head_dim == 64) return run_f32<64, uint16_t>(a, num_threads), kOk;
    if (block_size % 8 == 0 && head_dim == 128) return run_f32<128, uint16_t>(a, num_threads), kOk;
    if (block_size % 8 == 0 && head_dim == 256) return run_f32<256, uint16_t>(a, num_threads), kOk;
#endif
    if (head_dim == 64) run<float, 64, uint16_t>(a, num_threads);
    else if (head_dim == 128) run<float, 128, uint16_t>(a, num_threads);
    else run<float, 0, uint16_t>(a, num_threads);
  } else {
    return kNotInBuild;
  }
  return kOk;
}
