// The int4 few-row product (pack_int4's nibbles, w = code * scale + offset per group of 32 inputs) on AMX
// tiles (specserve_paths() bit 64), for the 3..32 bf16 rows of a verify step. q4_bf16_row (AVX512-BF16)
// pays its unpacking, two vdpbf16ps and its epilogue again for every row, so its cost grows with the rows;
// here each group of 16 outputs x 32 inputs is widened once, to its exact codes in bf16, into a tile buffer
// in L1, and one tdpbf16ps runs it against every row (rows past 16 take a second tile against the same
// buffer). Products are exact and sums float32, as in q4_bf16_row: each group's tile of sums is stored and
// scaled in registers (y = sum_g scale_g D_g + offset_g xsum_g), in another order than q4_bf16_row's (see
// cpu.matmul.INT4_ROWS_BF16_BELOW_AMX). Widening the weights with their scales into bf16 instead would
// save the per-group stores and scaling but round every weight to bf16.
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
// to 7 the sums (C: groups in turn, and row blocks).
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// One output's codes of groups g and g + 1 (32 bytes; 16 where g is the last) -> each group's 32 codes as
// exact bf16 in input order (the low nibbles are inputs 0-15, the high ones 16-31).
inline void widen_two_groups(const uint8_t* p, bool pair, __m512i table, uint16_t* a0, uint16_t* a1) {
  const __m256i bytes = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                             : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x0F)), table);
  const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
  _mm512_store_si512(a0, _mm512_shuffle_i64x2(lo, hi, 0x44));  // lo's and hi's low halves: group g
  if (pair) _mm512_store_si512(a1, _mm512_shuffle_i64x2(lo, hi, 0xEE));
}

// Group g's codes (widened in abuf) against the B tiles of group g on A tile TA, its sums left in
// cbuf: [NRB][16 outputs][16 rows] float32. The intrinsics take tile numbers as literals (they spell the
// register), hence the branches.
template <int TA, int NRB>
inline void q4_amx_group(const uint16_t* bt, int64_t g, const uint16_t* abuf, float* cbuf) {
  constexpr int TC = TA == 0 ? 4 : 6;  // C tiles: 4 and 5 beside A tile 0, 6 and 7 beside 3
  if constexpr (TA == 0) _tile_loadd(0, abuf, 64);
  else _tile_loadd(3, abuf, 64);
  _tile_loadd(1, bt + (g * NRB) * 512, 64);
  if constexpr (TC == 4) {
    _tile_zero(4);
    _tile_dpbf16ps(4, 0, 1);
    _tile_stored(4, cbuf, 64);
  } else {
    _tile_zero(6);
    _tile_dpbf16ps(6, 3, 1);
    _tile_stored(6, cbuf, 64);
  }
  if constexpr (NRB == 2) {
    _tile_loadd(2, bt + (g * NRB + 1) * 512, 64);
    if constexpr (TC == 4) {
      _tile_zero(5);
      _tile_dpbf16ps(5, 0, 2);
      _tile_stored(5, cbuf + 256, 64);
    } else {
      _tile_zero(7);
      _tile_dpbf16ps(7, 3, 2);
      _tile_stored(7, cbuf + 256, 64);
    }
  }
}

// acc += group g's sums (cbuf) times each output's scale, plus the rows' group sums times its offset.
template <int NRB>
inline void q4_amx_scale(__m512 (&acc)[NRB][16], const float* cbuf, const float* xsum, const float* s,
                         const float* o, int64_t groups, int64_t g) {
#pragma GCC unroll 2
  for (int rb = 0; rb < NRB; ++rb) {
    const __m512 xs = _mm512_loadu_ps(xsum + g * 32 + rb * 16);
#pragma GCC unroll 16
    for (int n = 0; n < 16; ++n) {
      acc[rb][n] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + rb * 256 + n * 16), _mm512_set1_ps(s[n * groups + g]),
                                   acc[rb][n]);
      acc[rb][n] = _mm512_fmadd_ps(xs, _mm512_set1_ps(o[n * groups + g]), acc[rb][n]);
    }
  }
}

// Rows [0, 16 * NRB) of the B tiles (bt: [groups][NRB][16 pairs][16 rows][2] bf16, zero past the rows; xsum
// [groups][32]) against the outputs [j0, j0 + 16). Groups go in pairs, each on its own A and C tiles, and a
// pair's sums are scaled while the next pair's products run: a tile's sums are ready only some tens of
// cycles after its tdpbf16ps, which one C tile scaled group after group would wait for each time.
template <int NRB>
void q4_amx_block(const uint16_t* bt, const float* xsum, const uint8_t* packed, const float* scales,
                  const float* offsets, int64_t groups, int64_t j0, int64_t rows, uint16_t* out, int64_t os,
                  uint16_t* abuf, float* cbuf, __m512i table) {
  const uint8_t* codes = packed + j0 * groups * 16;
  const float* s = scales + j0 * groups;
  const float* o = offsets + j0 * groups;
  __m512 acc[NRB][16];
  for (int rb = 0; rb < NRB; ++rb)
    for (int n = 0; n < 16; ++n) acc[rb][n] = _mm512_setzero_ps();
  constexpr int64_t kSlot = NRB * 256;  // cbuf floats a group: slots 0, 1 one pair, 2, 3 the other
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    float* c = cbuf + (g / 2 % 2) * 2 * kSlot;
#pragma GCC unroll 16
    for (int n = 0; n < 16; ++n) widen_two_groups(codes + (n * groups + g) * 16, pair, table, abuf + n * 32,
                                                  abuf + 512 + n * 32);
    q4_amx_group<0, NRB>(bt, g, abuf, c);
    if (pair) q4_amx_group<3, NRB>(bt, g + 1, abuf + 512, c + kSlot);
    if (g >= 2) {  // the pair before
      float* before = cbuf + ((g / 2 + 1) % 2) * 2 * kSlot;
      q4_amx_scale<NRB>(acc, before, xsum, s, o, groups, g - 2);
      q4_amx_scale<NRB>(acc, before + kSlot, xsum, s, o, groups, g - 1);
    }
  }
  const int64_t last = (groups - 1) / 2 * 2;  // the last pair's first group
  float* c = cbuf + (last / 2 % 2) * 2 * kSlot;
  q4_amx_scale<NRB>(acc, c, xsum, s, o, groups, last);
  if (last + 1 < groups) q4_amx_scale<NRB>(acc, c + kSlot, xsum, s, o, groups, last + 1);
  // acc[rb][n] holds output j0 + n of rows 16 rb + lane: through cbuf into rows of 16 outputs
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int rb = 0; rb < NRB; ++rb)
    for (int n = 0; n < 16; ++n) _mm512_store_ps(cbuf + rb * 256 + n * 16, acc[rb][n]);
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
  std::vector<float> xsum(groups * 32, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rb = r / kAmxRows, rr = r % kAmxRows;
    for (int64_t g = 0; g < groups; ++g) {
      for (int p = 0; p < 16; ++p)
        std::memcpy(&bt[(g * nrb + rb) * 256 + p * 16 + rr], x + r * xs + g * 32 + 2 * p, 4);
      float t = 0.f;
      for (int i = 0; i < 32; ++i) t += load(x + r * xs, g * 32 + i);  // as group_sums
      xsum[g * 32 + r] = t;
    }
  }
  const float* xsp = xsum.data();
  const __m512i table = nibble_table();
  const uint16_t* btp = reinterpret_cast<const uint16_t*>(bt.data());
  const int64_t blocks = n / 16;
#pragma omp parallel num_threads(num_threads) if (n * k >= (int64_t{1} << 16))
  {
    amx_configure();
    alignas(64) uint16_t abuf[2 * 512];
    alignas(64) float cbuf[4 * 2 * 256];
#pragma omp for schedule(dynamic, 2)
    for (int64_t b = 0; b < blocks; ++b) {
      if (b + 1 < blocks) prefetch(packed + (b + 1) * 16 * groups * 16, 16 * groups * 16);
      if (nrb == 1)
        q4_amx_block<1>(btp, xsp, packed, scales, offsets, groups, 16 * b, rows, out, os, abuf, cbuf, table);
      else
        q4_amx_block<2>(btp, xsp, packed, scales, offsets, groups, 16 * b, rows, out, os, abuf, cbuf, table);
    }
    _tile_release();
  }
}
}  // namespace
#endif
