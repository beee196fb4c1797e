// The int4 few-row product (pack_int4's nibbles, w = code * scale + offset per group of 32 inputs) on AMX
// tiles (specserve_paths() bit 64), for the 3..32 bf16 rows of a verify step. q4_bf16_row (AVX512-BF16)
// pays its unpacking, two vdpbf16ps and its epilogue again for every row, so its cost grows with the rows;
// here each group of 16 outputs x 32 inputs is widened to bf16 once, in registers, into a tile buffer in
// L1, and one tdpbf16ps runs it against every row (rows past 16 take a second tile against the same buffer).
//
// The weights are widened with their scale and offset (one FMA in float32, then rounded to bf16: the values
// a dense bf16 copy holds), so one float32 tile sums every group of a block and nothing is stored between
// groups: scaling each group's sums in registers (exact bf16 codes) cost a tile store and 32 FMAs a group,
// and ran 3 rows of SmolLM2's four layer matrices at 2.3x one row against 1.9x (bench/verify_cost.py's
// kernel alone, 1 thread, 2-core Sapphire Rapids). Its rounding is not q4_bf16_row's: see
// cpu.matmul.INT4_ROWS_BF16_INVARIANT_AMX.
#if defined(SPECSERVE_QUANT_BF16_PATH) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPECSERVE_INT4_AMX_PATH 1
#include <sys/syscall.h>
#include <unistd.h>

namespace {
constexpr int64_t kAmxRows = 16;  // rows of one B tile (its 16 float32 columns of C)

// Linux gives a process the AMX tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
// asked once, the answer kept. torch asks too where oneDNN runs AMX, but this library may run first.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 and 3 the weights (A, groups in turn), 1 and 2 the rows' activations (B, rows 0-15 and 16-31), 4
// and 5 their sums (C).
inline void amx_configure() {
  TileConfig cfg;
  for (int t : {0, 1, 2, 3, 4, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// A group's 16 bytes of codes -> its 32 weights code * scale + offset in bf16, in input order (the low
// nibbles are inputs 0-15, the high ones 16-31).
inline __m512i widen_scaled(const uint8_t* p, float scale, float offset) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
  const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))), s, o);
  const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, o);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// A 16-output block's group g widened into abuf, then run on tile T against the B tiles of group g.
template <int T, int NRB>
inline void q4_amx_group(const uint16_t* bt, const uint8_t* codes, const float* s, const float* o,
                         int64_t groups, int64_t g, uint16_t* abuf) {
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n)
    _mm512_store_si512(abuf + n * 32,
                       widen_scaled(codes + (n * groups + g) * 16, s[n * groups + g], o[n * groups + g]));
  // the intrinsics take tile numbers as literals (they spell the register), hence a branch a tile
  if constexpr (T == 0) _tile_loadd(0, abuf, 64);
  else _tile_loadd(3, abuf, 64);
  _tile_loadd(1, bt + (g * NRB) * 512, 64);
  if constexpr (T == 0) _tile_dpbf16ps(4, 0, 1);
  else _tile_dpbf16ps(4, 3, 1);
  if constexpr (NRB == 2) {
    _tile_loadd(2, bt + (g * NRB + 1) * 512, 64);
    if constexpr (T == 0) _tile_dpbf16ps(5, 0, 2);
    else _tile_dpbf16ps(5, 3, 2);
  }
}

// Rows [0, 16 * NRB) of the B tiles (bt: [groups][NRB][16 pairs][16 rows][2] bf16, zero past the rows)
// against the outputs [j0, j0 + 16).
template <int NRB>
void q4_amx_block(const uint16_t* bt, const uint8_t* packed, const float* scales, const float* offsets,
                  int64_t groups, int64_t j0, int64_t rows, uint16_t* out, int64_t os, uint16_t* abuf,
                  float* cbuf) {
  const uint8_t* codes = packed + j0 * groups * 16;
  const float* s = scales + j0 * groups;
  const float* o = offsets + j0 * groups;
  _tile_zero(4);
  if constexpr (NRB == 2) _tile_zero(5);
  // two A tiles and buffers in turn, so a group's widening need not wait for the last one's product
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    q4_amx_group<0, NRB>(bt, codes, s, o, groups, g, abuf);
    q4_amx_group<3, NRB>(bt, codes, s, o, groups, g + 1, abuf + 512);
  }
  if (g < groups) q4_amx_group<0, NRB>(bt, codes, s, o, groups, g, abuf);
  _tile_stored(4, cbuf, 64);
  if constexpr (NRB == 2) _tile_stored(5, cbuf + 256, 64);
  // cbuf[rb][n][r]: output j0 + n of row 16 rb + r, gathered into rows of 16 outputs
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>((r / 16) * 256 + r % 16)));
    const __m512 y = _mm512_i32gather_ps(at, cbuf, 4);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * os + j0), (__m256i)_mm512_cvtneps_pbh(y));
  }
}

// x [rows, k] bf16 (1..32 rows) times the int4 matrix, n % 16 == 0 -> out [rows, n] bf16.
void q4_bf16_amx(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* packed, const float* scales,
                 const float* offsets, int64_t n, int64_t k, uint16_t* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32, nrb = (rows + kAmxRows - 1) / kAmxRows;
  // B tiles: pair p of group g for row r is x[r, 32g + 2p], x[r, 32g + 2p + 1]; zero past the rows
  std::vector<uint32_t> bt(groups * nrb * 256, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rb = r / kAmxRows, rr = r % kAmxRows;
    for (int64_t g = 0; g < groups; ++g)
      for (int p = 0; p < 16; ++p)
        std::memcpy(&bt[(g * nrb + rb) * 256 + p * 16 + rr], x + r * xs + g * 32 + 2 * p, 4);
  }
  const uint16_t* btp = reinterpret_cast<const uint16_t*>(bt.data());
  const int64_t blocks = n / 16;
#pragma omp parallel num_threads(num_threads) if (n * k >= (int64_t{1} << 16))
  {
    amx_configure();
    alignas(64) uint16_t abuf[2 * 512];
    alignas(64) float cbuf[2 * 256];
#pragma omp for schedule(dynamic, 2)
    for (int64_t b = 0; b < blocks; ++b) {
      if (b + 1 < blocks) prefetch(packed + (b + 1) * 16 * groups * 16, 16 * groups * 16);
      if (nrb == 1) q4_amx_block<1>(btp, packed, scales, offsets, groups, 16 * b, rows, out, os, abuf, cbuf);
      else q4_amx_block<2>(btp, packed, scales, offsets, groups, 16 * b, rows, out, os, abuf, cbuf);
    }
    _tile_release();
  }
}
}  // namespace
#endif
