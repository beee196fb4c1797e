// specserve_paths: which fast paths this build holds. unity.cpp includes it last, after every part has
// defined its SPECSERVE_*_PATH macro.
#include "api.h"

// Which fast paths this build holds (a bitmask of api.h's kPath* bits), so Python can route queries of any
// length to them and its products to the forms this CPU runs. 0 is the portable build.
extern "C" int specserve_paths() {
  int paths = 0;
#ifdef SPECSERVE_F32_PATH
  paths |= kPathAttentionF32;
#endif
#ifdef SPECSERVE_QUANT_PATH
  paths |= kPathQuantF32;
#endif
#ifdef SPECSERVE_BF16_PATH
  paths |= kPathAttentionBf16;
#endif
#ifdef SPECSERVE_QUANT_BF16_PATH
  paths |= kPathQuantBf16;
#endif
#ifdef SPECSERVE_INT_DOT_PATH
  paths |= kPathIntDot;
#endif
#ifdef SPECSERVE_INT_DOT_VNNI
  paths |= kPathIntDotVnni;
#endif
#ifdef SPECSERVE_INT4_AMX_PATH
  if (amx_permitted()) paths |= kPathInt4Amx;
#endif
#if defined(SPECSERVE_INT8_GROUPED_AMX_PATH) && defined(SPECSERVE_QUANT_PATH)
  if (amx_permitted()) paths |= kPathInt8GroupedAmx;
#endif
  return paths;
}
