// The CPU kernel library, compiled as this one translation unit (kernels/cpu/build.py): one compiler run, as
// when the library was one file, and every kernel inlinable into a caller in another part (chain.cpp calls
// them all).
//
// Plain C++ with a C ABI (api.h) and OpenMP, loaded through ctypes: no torch headers, so it builds in
// seconds. The process already holds torch's libgomp (same soname), so this shares torch's thread pool
// instead of starting a second one that would fight it for the cores.
//
// Each op family has its ISA forms side by side (<family>_<dtype>_<isa>.cpp, compiled where the build's
// -march allows them, and <family>_generic.cpp for every build) and an entry file that picks among them; the
// entry files come after their forms, and paths.cpp after everything, so each sees the SPECSERVE_*_PATH
// macros the forms define.
#include "api.h"
#include "common.h"

#include "attention_bf16_avx512.cpp"
#include "attention_f32_avx2.cpp"
#include "attention_generic.cpp"
#include "attention.cpp"
#include "attention_tree.cpp"
#include "rope_kv.cpp"
#include "matmul_f32_avx2.cpp"
#include "matmul_generic.cpp"
#include "matmul_bf16_avx512.cpp"
#include "matmul_bf16_amx.cpp"
#include "matmul.cpp"
#include "matmul_q8.cpp"
#include "bitmask.cpp"
#include "elementwise.cpp"
#include "chain.cpp"
#include "paths.cpp"
