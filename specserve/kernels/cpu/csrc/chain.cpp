// A whole step's decoder layers in one call, for steps whose products, attention and elementwise work all run
// in this library (kernels/cpu/chain.py: LayerChain decides which): the same functions the model would call
// one by one from Python, with the same arguments in the same order, so the results are bit for bit
// theirs. What it saves is the Python between them: at batch 1 a step of SmolLM2 made ~270 calls through
// ctypes and torch's dispatcher, 2-2.5 ms of one core while the other waited (figures at LayerChain).
#include "api.h"

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
  kF32Panels, kInt8, kInt8Grouped, kInt4, kBf16Panels, kInt8Bf16, kInt4Bf16, kInt4RowsBf16, kInt4TileRowsBf16,
  kW8a8 = 16, kW4a8, kW8a8Bf16, kW4a8Bf16, kW4a8Half, kW4a8HalfBf16
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
  const auto* sh = static_cast<const u16*>(p.w[1]);  // float16 bits
  const auto* zh = static_cast<const u16*>(p.w[2]);
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
    case kInt4TileRowsBf16: rc = specserve_int4_tile_rows_bf16(xb, k, rows, u8, s, z, n, k, ob, n, threads); break;
    case kW8a8: rc = specserve_w8a8_matmul(xf, k, rows, u8, s, n, k, of, n, threads); break;
    case kW4a8: rc = specserve_w4a8_matmul(xf, k, rows, u8, s, z, n, k, of, n, threads); break;
    case kW8a8Bf16: rc = specserve_w8a8_matmul_bf16(xb, k, rows, u8, s, n, k, ob, n, threads); break;
    case kW4a8Bf16: rc = specserve_w4a8_matmul_bf16(xb, k, rows, u8, s, z, n, k, ob, n, threads); break;
    case kW4a8Half: rc = specserve_w4a8h_matmul(xf, k, rows, u8, sh, zh, n, k, of, n, threads); break;
    case kW4a8HalfBf16: rc = specserve_w4a8h_matmul_bf16(xb, k, rows, u8, sh, zh, n, k, ob, n, threads); break;
    default: return kUnknownProduct;
  }
  if (rc == 0 && p.bias != nullptr)  // y + bias, one rounding as torch's add
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j) of[r * n + j] += p.bias[j];
  return rc;
}

}  // namespace

// Runs the layers over h [rows, hidden] (the residual stream, updated in place) and leaves the last layer's
// MLP output in m [rows, hidden]: the model adds it to h, as its own loop does. kv holds each layer's K and V
// cache pointers (in kv_dtype: dtype, or kDtypeF32Bf16Kv's bfloat16 under float32), ropes each rotary table's
// cos and sin. Returns 0, or the first nonzero code a kernel gave
// (the layers before it have run: the caller raises, and the step is lost, not half-applied silently).
extern "C" int specserve_decoder_layers(const int64_t* layers, int64_t num_layers, void* const* kv,
                                        const void* const* ropes, void* h, void* m, int64_t rows, int64_t hidden,
                                        int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t block_size, const int64_t* positions,
                                        const int64_t* slots, const int32_t* block_tables, int64_t table_stride,
                                        const int32_t* seq_lens, const int32_t* query_start_loc,
                                        const int64_t* seq_ids, int64_t num_seqs, float scale, float eps,
                                        int dtype, int threads, int invariant, int kv_dtype) {
  if (dtype != 0 && dtype != 1) return kNotInBuild;
  if (kv_dtype != dtype && !(dtype == 0 && kv_dtype == kDtypeF32Bf16Kv)) return kNotInBuild;
  const int64_t elem = dtype == 0 ? 4 : 2;
  const int64_t q_size = num_heads * head_dim, qkv_n = (num_heads + 2 * num_kv_heads) * head_dim;
  const auto* descs = reinterpret_cast<const LayerDesc*>(layers);
  for (int64_t i = 0; i < num_layers; ++i) {  // before any layer runs: shapes that disagree change nothing
    const LayerDesc& L = descs[i];
    if (L.qkv.n != qkv_n || L.o.k != q_size || L.gate_up.n != 2 * intermediate || L.down.n != hidden) return kLayerShapes;
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
                                      num_heads, num_kv_heads, head_dim, k_cache, v_cache, slots, kv_dtype,
                                      threads)))
      break;
    if ((rc = specserve_paged_attention_short(qkv, qkv_n, head_dim, k_cache, v_cache, block_tables, table_stride,
                                              seq_lens, query_start_loc, seq_ids, num_seqs, num_heads,
                                              num_kv_heads, head_dim, block_size, scale, attn, q_size, head_dim,
                                              kv_dtype, threads, 0, 0.f, invariant)))
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
