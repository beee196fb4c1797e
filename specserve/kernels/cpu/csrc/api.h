// The library's C ABI, every entry point in one place: what kernels/cpu/build.py binds through ctypes (its
// _SIGNATURES spell the same arguments), and what chain.cpp calls layer by layer.
//
// Every function returns an int status (below). dtype arguments: 0 float32, 1 bfloat16 (as uint16_t bits);
// the attention and rope entry points also take kDtypeF32Bf16Kv: float32 activations over bfloat16 KV caches.
// num_threads: the OpenMP threads a call may use (torch's own count, so the two share one libgomp pool).
#pragma once

#include <cstdint>

// Status codes.
constexpr int kOk = 0;
constexpr int kBadArguments = 1;    // shapes, strides or indices the kernel refuses
constexpr int kNotInBuild = 2;      // a dtype or fast path this build does not hold (see specserve_paths)
constexpr int kUnknownProduct = 3;  // specserve_decoder_layers: a product kind it does not know
constexpr int kLayerShapes = 4;     // specserve_decoder_layers: a layer's products disagree with the model

// float32 q, k, v and outputs with the KV caches in bfloat16 (a cache of half the bytes: the engine's
// kv_cache_dtype): K and V are rounded to bfloat16 as they are written, widened as they are read.
constexpr int kDtypeF32Bf16Kv = 2;

// specserve_paths() bits: the fast paths this build holds.
constexpr int kPathAttentionF32 = 1;   // float32 attention on AVX2 + FMA, queries of any length
constexpr int kPathAttentionBf16 = 2;  // bfloat16 attention on AVX512-BF16, queries of any length
constexpr int kPathQuantF32 = 4;       // int8 / int4 / dense panel products for float32, AVX2 + FMA
constexpr int kPathQuantBf16 = 8;      // int8 / int4 / dense panel products for bfloat16, AVX512-BF16
constexpr int kPathIntDot = 16;        // w8a8 / w4a8 integer products on SIMD (AVX512-VNNI or AVX2)
constexpr int kPathIntDotVnni = 32;    // ... on AVX512-VNNI's vpdpbusd
constexpr int kPathInt4Amx = 64;       // the int4 few-row bf16 product on AMX tiles, the kernel permitting
constexpr int kPathInt8GroupedAmx = 128;  // the Q8_0 head's few-row bf16 product on AMX tiles, likewise

extern "C" {

// paths.cpp
int specserve_paths();

// attention.cpp
int specserve_paged_attention_short(const void* q, int64_t q_tok, int64_t q_head, const void* k_cache,
                                    const void* v_cache, const int32_t* block_tables, int64_t table_stride,
                                    const int32_t* seq_lens, const int32_t* query_start_loc,
                                    const int64_t* seq_ids, int64_t num_seqs, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                    void* out, int64_t o_tok, int64_t o_head, int dtype, int num_threads,
                                    int64_t window, float softcap, int invariant);

// attention_tree.cpp: the sequences in seq_ids hold draft trees; tree_mask / tree_depth per packed query row
// (kernels/tree.py), at most 64 rows a sequence.
int specserve_paged_attention_tree(const void* q, int64_t q_tok, int64_t q_head, const void* k_cache,
                                   const void* v_cache, const int32_t* block_tables, int64_t table_stride,
                                   const int32_t* seq_lens, const int32_t* query_start_loc,
                                   const int64_t* seq_ids, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                   void* out, int64_t o_tok, int64_t o_head, int dtype, int num_threads,
                                   int64_t window, float softcap, const int64_t* tree_mask,
                                   const int32_t* tree_depth);

// rope_kv.cpp
int specserve_rope_write_kv(void* qkv, int64_t tok_stride, int64_t num_tokens, const int64_t* positions,
                            const void* cos, const void* sin, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, void* k_cache, void* v_cache, const int64_t* slots, int dtype,
                            int num_threads);

// matmul.cpp: float32 activations
int specserve_int8_matmul(const float* x, int64_t x_stride, int64_t rows, const int8_t* codes,
                          const float* scales, int64_t n, int64_t k, float* out, int64_t out_stride,
                          int num_threads);
int specserve_int8_grouped_matmul(const float* x, int64_t x_stride, int64_t rows, const int8_t* codes,
                                  const float* scales, int64_t n, int64_t k, float* out, int64_t out_stride,
                                  int num_threads);
int specserve_int4_matmul(const float* x, int64_t x_stride, int64_t rows, const uint8_t* packed,
                          const float* scales, const float* offsets, int64_t n, int64_t k, float* out,
                          int64_t out_stride, int num_threads);
int specserve_int8_widen(const int8_t* codes, const float* scales, int64_t n, int64_t k, float* out,
                         int num_threads);
int specserve_int4_widen(const uint8_t* packed, const float* scales, const float* offsets, int64_t n, int64_t k,
                         float* out, int num_threads);
int specserve_f32_matmul(const float* x, int64_t xs, int64_t rows, const float* panels, int64_t n, int64_t k,
                         float* out, int64_t os, int num_threads);

// matmul.cpp: bfloat16 activations
int specserve_int8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* tiles,
                               const float* scales, int64_t n, int64_t k, uint16_t* out, int64_t os,
                               int num_threads);
int specserve_int4_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                               const float* scales, const float* zeros, int64_t n, int64_t k, uint16_t* out,
                               int64_t os, int num_threads);
int specserve_int4_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* packed,
                             const float* scales, const float* offsets, int64_t n, int64_t k, uint16_t* out,
                             int64_t os, int num_threads);
int specserve_int4_tile_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                  const float* scales, const float* offsets, int64_t n, int64_t k, uint16_t* out,
                                  int64_t os, int num_threads);
int specserve_int8_grouped_tile_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* tiles,
                                          const float* scales, int64_t n, int64_t k, float* out, int64_t os,
                                          int num_threads);
int specserve_int8_grouped_rows_bf16(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* codes,
                                     const float* scales, int64_t n, int64_t k, float* out, int64_t os,
                                     int num_threads);
int specserve_bf16_matmul(const uint16_t* x, int64_t xs, int64_t rows, const uint16_t* panels, int64_t n,
                          int64_t k, uint16_t* out, int64_t os, int num_threads);

// matmul_q8.cpp: activations quantized per 32 inputs, integer products (float32 or bfloat16 x and out)
int specserve_quantize_q8(const void* x, int64_t xs, int64_t rows, int64_t k, int8_t* codes, float* scales,
                          int32_t* sums, int dtype, int num_threads);
int specserve_w8a8_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles, const float* scales,
                          int64_t n, int64_t k, float* out, int64_t os, int num_threads);
int specserve_w8a8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                               const float* scales, int64_t n, int64_t k, uint16_t* out, int64_t os,
                               int num_threads);
int specserve_w4a8_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles, const float* scales,
                          const float* offsets, int64_t n, int64_t k, float* out, int64_t os, int num_threads);
int specserve_w4a8_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                               const float* scales, const float* offsets, int64_t n, int64_t k, uint16_t* out,
                               int64_t os, int num_threads);
// ... w4a8 with its scales and offsets as float16 bits (where each is a float16 value)
int specserve_w4a8h_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles, const uint16_t* scales,
                           const uint16_t* offsets, int64_t n, int64_t k, float* out, int64_t os, int num_threads);
int specserve_w4a8h_matmul_bf16(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                                const uint16_t* scales, const uint16_t* offsets, int64_t n, int64_t k,
                                uint16_t* out, int64_t os, int num_threads);
// ... int8 codes with a scale per output and group of 32 (a Q8_0 matrix), float32 or float16 bits; float32 x
int specserve_w8a8g_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles, const float* scales,
                           int64_t n, int64_t k, float* out, int64_t os, int num_threads);
int specserve_w8a8gh_matmul(const float* x, int64_t xs, int64_t rows, const uint8_t* tiles,
                            const uint16_t* scales, int64_t n, int64_t k, float* out, int64_t os, int num_threads);

// bitmask.cpp
int specserve_apply_bitmask(float* logits, int64_t logits_stride, int64_t vocab, const int32_t* bitmask,
                            int64_t mask_stride, const int64_t* rows, int64_t num_rows, int64_t num_logit_rows);

// elementwise.cpp
int specserve_add_rms_norm(void* h, const void* add, const void* w, void* out, int64_t n, int64_t d,
                           int64_t h_stride, int64_t add_stride, int64_t out_stride, float eps, int dtype,
                           int num_threads);
int specserve_silu_mul(const void* gu, void* out, int64_t n, int64_t d, int64_t gu_stride, int64_t out_stride,
                       int dtype, int num_threads);
int specserve_gelu_tanh_mul(const void* gu, void* out, int64_t n, int64_t d, int64_t gu_stride,
                            int64_t out_stride, int dtype, int num_threads);
int specserve_rms_norm_heads(void* x, const void* w, int64_t n, int64_t heads, int64_t d, int64_t stride,
                             float eps, int dtype, int num_threads);

// chain.cpp
int specserve_decoder_layers(const int64_t* layers, int64_t num_layers, void* const* kv, const void* const* ropes,
                             void* h, void* m, int64_t rows, int64_t hidden, int64_t intermediate,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             const int64_t* positions, const int64_t* slots, const int32_t* block_tables,
                             int64_t table_stride, const int32_t* seq_lens, const int32_t* query_start_loc,
                             const int64_t* seq_ids, int64_t num_seqs, float scale, float eps, int dtype,
                             int threads, int invariant, int kv_dtype);

}  // extern "C"
