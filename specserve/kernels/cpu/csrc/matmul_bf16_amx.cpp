// The int4 few-row product (pack_int4's nibbles, w = code * scale + offset per group of 32 inputs) on AMX
// tiles (specserve_paths() bit 64), for the 2..32 bf16 rows of a verify step. q4_bf16_row (AVX512-BF16)
// pays its unpacking, two vdpbf16ps and its epilogue again for every row, so its cost grows with the rows;
// here each group of 16 outputs x 32 inputs is widened once, to its weights rounded to bf16 (the values a
// bf16 model holds), into a tile buffer in L1, and one tdpbf16ps runs it against every row (rows past 16
// take a second tile against the same buffer), its sums staying in the C tiles over all groups.
// Keeping the codes exact instead (scales applied to each group's tile of sums in float32) stored and
// rescaled a tile of sums every group; with the weights' prefetch spread over the group loop and B and C
// only as wide as the step's rows, SmolLM2's 30 layers at 3 / 5 / 9 / 16 rows went from 1.89 / 1.93 /
// 1.97 / 2.12x one row to 1.42 / 1.49 / 1.56 / 1.77x (random codes from memory, two threads, both builds
// alternated in one process; 2-core Sapphire Rapids), and with longer claims (over_amx_blocks) to
// 1.07-1.38x. Sums come in another order than q4_bf16_row's (see cpu.matmul.INT4_ROWS_BF16_BELOW_AMX), so
// batch-invariant plans keep to its one-row calls.
//
// The Q8_0 head's few-row product (int8 codes, a float32 scale per 32 inputs; specserve_paths() bit 128) runs
// on the same tiles, loop and sums, each weight widened to bf16(code * scale) (the value the dense bf16 head
// copy holds) and its float32 sums stored as float32 logits.
#if defined(SPECSERVE_QUANT_BF16_PATH) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPECSERVE_INT4_AMX_PATH 1
#define SPECSERVE_INT8_GROUPED_AMX_PATH 1
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

// Tiles: 0 and 3 the weights (A: 16 outputs x 32 inputs), 1, 2, 6 and 7 the rows' activations (B: 16 input
// pairs x the rows of a row block), 4 and 5 the sums (C: 16 outputs x the rows of a row block). B and C are
// as wide as the step's rows, so a verify step of 3 rows loads and multiplies 3 columns, not 16.
inline void amx_configure(int nr0, int nr1) {
  TileConfig cfg;
  auto tile = [&](int t, int colsb) { cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(colsb); };
  tile(0, 64), tile(3, 64);
  tile(1, 4 * nr0), tile(2, 4 * (nr1 > 0 ? nr1 : nr0)), tile(4, 4 * nr0);  // 2: odd groups' B of one block
  if (nr1 > 0) tile(5, 4 * nr1), tile(6, 4 * nr0), tile(7, 4 * nr1);  // two row blocks: 2, 7 and 5 the second's
  _tile_loadconfig(&cfg);
}

// One output's codes of groups g and g + 1 (32 bytes; 16 where g is the last) -> each group's 32 weights
// code * scale + offset rounded to bf16, in input order (the low nibbles are inputs 0-15, the high ones 16-31).
// The 16 values a group's codes can take are one table (g's in lanes 0-15, g + 1's in 16-31) that vpermw
// indexes, so a weight costs no conversion of its own.
inline void widen_two_groups(const uint8_t* p, bool pair, const float* s, const float* o, __m512 codes,
                             __m512i upper, uint16_t* a0, uint16_t* a1) {
  const __m512 t0 = _mm512_fmadd_ps(codes, _mm512_set1_ps(s[0]), _mm512_set1_ps(o[0]));
  const __m512 t1 = pair ? _mm512_fmadd_ps(codes, _mm512_set1_ps(s[1]), _mm512_set1_ps(o[1])) : t0;
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
  const __m256i bytes = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                             : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i lo = _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x0F), upper, 0xEA),
                                              table);  // (w & 0x0F) | upper
  const __m512i hi = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 4), upper), table);
  _mm512_store_si512(a0, _mm512_shuffle_i64x2(lo, hi, 0x44));  // lo's and hi's low halves: group g
  if (pair) _mm512_store_si512(a1, _mm512_shuffle_i64x2(lo, hi, 0xEE));
}

// Spreads a prefetch of [p, p + bytes) over `parts` calls (part = 0 .. parts - 1): a block's loop prefetches
// the next block's weights a slice per group pair, never more lines at once than the core can have in flight.
inline void prefetch_part(const void* p, int64_t bytes, int64_t part, int64_t parts) {
  const int64_t lines = (bytes + 63) / 64, per = (lines + parts - 1) / parts;
  for (int64_t l = part * per; l < std::min(lines, (part + 1) * per); ++l)
    __builtin_prefetch(static_cast<const char*>(p) + l * 64, 0, 3);
}

// One group pair's tdpbf16ps, groups g and g + 1 widened into a (A tile 0) and a + 512 (A tile 3): rows
// [0, 16 * NRB) of the B tiles (bt: [groups][NRB][16 pairs][16 rows][2] bf16, zero past the rows) into C tiles
// that hold the sums over all groups, one chain a row block (4, and 5 for the second), so that every row
// sums its groups in one order whatever the rows of the call: two chains for a single row block (odd groups
// apart) summed a row 16 rows and 17 apart, and ran no faster. Groups' B tiles: 1, 2 even; 6, 7 odd with
// two row blocks, else 2 odd.
template <int NRB>
inline void amx_run_pair(const uint16_t* bt, int64_t g, int64_t groups, const uint16_t* a, int nr0, int nr1) {
  _tile_loadd(0, a, 64);
  _tile_loadd(1, bt + (g * NRB) * 512, 4 * nr0);
  _tile_dpbf16ps(4, 0, 1);
  if constexpr (NRB == 2) {
    _tile_loadd(2, bt + (g * NRB + 1) * 512, 4 * nr1);
    _tile_dpbf16ps(5, 0, 2);
  }
  if (g + 1 >= groups) return;
  _tile_loadd(3, a + 512, 64);
  if constexpr (NRB == 2) {
    _tile_loadd(6, bt + ((g + 1) * NRB) * 512, 4 * nr0);
    _tile_dpbf16ps(4, 3, 6);
    _tile_loadd(7, bt + ((g + 1) * NRB + 1) * 512, 4 * nr1);
    _tile_dpbf16ps(5, 3, 7);
  } else {
    _tile_loadd(2, bt + (g + 1) * 512, 4 * nr0);
    _tile_dpbf16ps(4, 3, 2);
  }
}

inline void amx_zero_sums(bool two_blocks) {
  _tile_zero(4);
  if (two_blocks) _tile_zero(5);
}

// The C tiles' sums of outputs [j0, j0 + 16) -> rows of out (bf16 rounded once, or float32).
inline void store_row(uint16_t* dst, __m512 y) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(y));
}
inline void store_row(float* dst, __m512 y) { _mm512_storeu_ps(dst, y); }

template <int NRB, typename Out>
inline void amx_store_sums(int64_t rows, Out* out, int64_t os, int64_t j0, float* cbuf) {
  // C [16 outputs][16 rows] a row block -> rows of 16 outputs
  _tile_stored(4, cbuf, 64);
  if constexpr (NRB == 2) _tile_stored(5, cbuf + 256, 64);
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>((r / 16) * 256 + r % 16)));
    store_row(out + r * os + j0, _mm512_i32gather_ps(at, cbuf, 4));
  }
}

// Rows [0, 16 * NRB) of the B tiles against the int4 outputs [j0, j0 + 16) (amx_run_pair's tiles).
template <int NRB>
void q4_amx_block(const uint16_t* bt, const uint8_t* packed, const float* scales, const float* offsets,
                  int64_t groups, int64_t j0, int64_t next, int64_t rows, uint16_t* out, int64_t os,
                  uint16_t* abuf, float* cbuf) {
  const uint8_t* codes = packed + j0 * groups * 16;
  const int nr0 = static_cast<int>(std::min<int64_t>(rows, 16)), nr1 = static_cast<int>(rows - nr0);
  const float* s = scales + j0 * groups;
  const float* o = offsets + j0 * groups;
  const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  const int64_t pairs = (groups + 1) / 2;
  amx_zero_sums(NRB == 2);
  // the pair widened last runs on the tiles after the next one is widened: a tile load right after the
  // stores that wrote its buffer waits for them
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    if (next >= 0) {  // the next block's codes, scales and offsets
      prefetch_part(packed + next * groups * 16, 16 * groups * 16, g / 2, pairs);
      prefetch_part(scales + next * groups, 16 * groups * 4, g / 2, pairs);
      prefetch_part(offsets + next * groups, 16 * groups * 4, g / 2, pairs);
    }
    uint16_t* a = abuf + (g / 2 % 2) * 1024;  // two buffers: one widened while the other runs
#pragma GCC unroll 16
    for (int n = 0; n < 16; ++n)
      widen_two_groups(codes + (n * groups + g) * 16, pair, s + n * groups + g, o + n * groups + g, values, upper,
                       a + n * 32, a + 512 + n * 32);
    if (g >= 2) amx_run_pair<NRB>(bt, g - 2, groups, abuf + ((g / 2 + 1) % 2) * 1024, nr0, nr1);
  }
  const int64_t last = (groups - 1) / 2 * 2;
  amx_run_pair<NRB>(bt, last, groups, abuf + (last / 2 % 2) * 1024, nr0, nr1);
  amx_store_sums<NRB>(rows, out, os, j0, cbuf);
}

// One output's 32 int8 codes of a group -> its weights bf16(code * scale) in input order (an A tile row):
// the float32 product rounded to nearest even, as torch's (codes * scale).bfloat16() and the dense bf16
// head copy round it.
inline void widen_q8_group(const int8_t* p, float scale, uint16_t* a) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512 lo =
      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), s);
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))), s);
  _mm512_store_si512(a, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Rows [0, 16 * NRB) of the B tiles against the Q8_0 outputs [j0, j0 + 16) (codes [n, k], scales
// [n, k / 32]; amx_run_pair's tiles) -> float32 sums: a row's logits do not depend on the rows beside it.
template <int NRB>
void q8g_amx_block(const uint16_t* bt, const int8_t* codes, const float* scales, int64_t groups, int64_t j0,
                   int64_t next, int64_t rows, float* out, int64_t os, uint16_t* abuf, float* cbuf) {
  const int64_t k = groups * 32;
  const int8_t* c = codes + j0 * k;
  const float* s = scales + j0 * groups;
  const int nr0 = static_cast<int>(std::min<int64_t>(rows, 16)), nr1 = static_cast<int>(rows - nr0);
  const int64_t pairs = (groups + 1) / 2;
  amx_zero_sums(NRB == 2);
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    if (next >= 0) {  // the next block's codes (16 whole rows, one stream) and scales
      prefetch_part(codes + next * k, 16 * k, g / 2, pairs);
      prefetch_part(scales + next * groups, 16 * groups * 4, g / 2, pairs);
    }
    uint16_t* a = abuf + (g / 2 % 2) * 1024;
#pragma GCC unroll 16
    for (int n = 0; n < 16; ++n) {
      widen_q8_group(c + n * k + g * 32, s[n * groups + g], a + n * 32);
      if (pair) widen_q8_group(c + n * k + g * 32 + 32, s[n * groups + g + 1], a + 512 + n * 32);
    }
    if (g >= 2) amx_run_pair<NRB>(bt, g - 2, groups, abuf + ((g / 2 + 1) % 2) * 1024, nr0, nr1);
  }
  const int64_t last = (groups - 1) / 2 * 2;
  amx_run_pair<NRB>(bt, last, groups, abuf + (last / 2 % 2) * 1024, nr0, nr1);
  amx_store_sums<NRB>(rows, out, os, j0, cbuf);
}

// The rows as B tiles, a slot of 256 pairs each group and row block: pair p of group g for row r of a block
// of nr rows is x[r, 32g + 2p], x[r, 32g + 2p + 1], at p * nr + r.
inline std::vector<uint32_t> amx_row_tiles(const uint16_t* x, int64_t xs, int64_t rows, int64_t groups) {
  const int64_t nrb = (rows + kAmxRows - 1) / kAmxRows;
  std::vector<uint32_t> bt(groups * nrb * 256);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rb = r / kAmxRows, rr = r % kAmxRows, nr = std::min(kAmxRows, rows - rb * kAmxRows);
    for (int64_t g = 0; g < groups; ++g)
      for (int p = 0; p < 16; ++p)
        std::memcpy(&bt[(g * nrb + rb) * 256 + p * nr + rr], x + r * xs + g * 32 + 2 * p, 4);
  }
  return bt;
}

// block(b, next, two_row_blocks, abuf, cbuf) for every block b of 16 outputs on the threads, each with its
// tiles configured for the rows and its own A and C buffers; next: the following block's first output (-1
// for the last), whose weights the block prefetches. Threads claim `claim` blocks at a time: the prefetch of
// the next block is for the same thread only within a claim.
template <typename Block>
void over_amx_blocks(int64_t rows, int64_t n, int64_t k, int64_t claim, int num_threads, Block block) {
  const int64_t blocks = n / 16;
#pragma omp parallel num_threads(num_threads) if (n * k >= (int64_t{1} << 16))
  {
    amx_configure(static_cast<int>(std::min(rows, kAmxRows)), static_cast<int>(std::max<int64_t>(rows - kAmxRows, 0)));
    alignas(64) uint16_t abuf[2 * 1024];
    alignas(64) float cbuf[2 * 256] = {};
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < (blocks + claim - 1) / claim; ++c)
      for (int64_t b = c * claim; b < std::min(blocks, (c + 1) * claim); ++b)
        block(b, b + 1 < blocks ? 16 * (b + 1) : -1, rows > kAmxRows, abuf, cbuf);
    _tile_release();
  }
}

// x [rows, k] bf16 (1..32 rows) times the int4 matrix, n % 16 == 0 -> out [rows, n] bf16.
void q4_bf16_amx(const uint16_t* x, int64_t xs, int64_t rows, const uint8_t* packed, const float* scales,
                 const float* offsets, int64_t n, int64_t k, uint16_t* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
  const std::vector<uint32_t> bt = amx_row_tiles(x, xs, rows, groups);
  const uint16_t* btp = reinterpret_cast<const uint16_t*>(bt.data());
  // claims of several blocks, about four a thread: a block prefetches the one after it, which a claim of
  // two left to the other thread half the time (its first block then waited on memory). SmolLM2's layers
  // at 3 / 5 / 9 rows: 1.07 / 1.15 / 1.22x one row against 1.35 / 1.47 / 1.59x in claims of two (A/B in one
  // process, two threads, 2-core Sapphire Rapids)
  const int64_t claim = std::max<int64_t>(2, n / 16 / (4 * num_threads));
  over_amx_blocks(rows, n, k, claim, num_threads, [&](int64_t b, int64_t next, bool two, uint16_t* abuf,
                                                      float* cbuf) {
    if (two) q4_amx_block<2>(btp, packed, scales, offsets, groups, 16 * b, next, rows, out, os, abuf, cbuf);
    else q4_amx_block<1>(btp, packed, scales, offsets, groups, 16 * b, next, rows, out, os, abuf, cbuf);
  });
}

// The Q8_0 head's blocks a thread claims at a time: the int4 layers' two made every other block's prefetch
// the other thread's (SmolLM2's 49,152 x 576 head at 3 / 9 / 17 rows, two threads: 3.75 / 3.47 / 3.62 ms in
// claims of 2 against 2.75 / 2.55 / 2.66 in claims of 16; `python bench/head_rows.py --rows 3,9,17
// --other-csrc DIR`, loaded 2-core Sapphire Rapids). 3,072 blocks of ~1.5 us keep the claims small against
// a thread descheduled.
constexpr int64_t kQ8AmxClaim = 16;

// x [rows, k] bf16 (1..32 rows) times the Q8_0 matrix (codes [n, k], scales [n, k / 32]), n % 16 == 0 ->
// out [rows, n] float32.
void q8g_bf16_amx(const uint16_t* x, int64_t xs, int64_t rows, const int8_t* codes, const float* scales,
                  int64_t n, int64_t k, float* out, int64_t os, int num_threads) {
  const int64_t groups = k / 32;
  const std::vector<uint32_t> bt = amx_row_tiles(x, xs, rows, groups);
  const uint16_t* btp = reinterpret_cast<const uint16_t*>(bt.data());
  over_amx_blocks(rows, n, k, kQ8AmxClaim, num_threads,
                  [&](int64_t b, int64_t next, bool two, uint16_t* abuf, float* cbuf) {
    if (two) q8g_amx_block<2>(btp, codes, scales, groups, 16 * b, next, rows, out, os, abuf, cbuf);
    else q8g_amx_block<1>(btp, codes, scales, groups, 16 * b, next, rows, out, os, abuf, cbuf);
  });
}
}  // namespace
#endif
