"""Building and loading the C++ CPU kernel library (csrc/), and what the loaded build holds.

The library is compiled on first use with the system C++ compiler (no torch headers: seconds) from one
translation unit, csrc/unity.cpp, which includes every part. The result is cached in a directory keyed by
every source file under csrc/, the flags, the compiler and the CPU, so later processes load it at once and
editing any part rebuilds. Without a compiler load() returns None and callers fall back to torch.

The instruction set is chosen at build time: -march=native, and the source compiles the fast paths the CPU's
macros allow (AVX2 + FMA: float32 attention for queries of any length and the float32 products; AVX512-BF16:
bfloat16 likewise), which the library reports (specserve_paths) so Python routes work to them.
SPECSERVE_KERNEL_ISA=avx2 or =portable builds a narrower variant instead (tests and benchmarks compare them).

The loaded library is this module's `_lib` (its path bits `_paths`): every kernel module reads it at call
time, so tests and benchmarks may swap in another variant's build (build_variant).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

import specserve.cache

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
UNITY = "unity.cpp"  # the translation unit; the other files are its parts
# -ffast-math is safe here: masking is by loop bounds, so no inf or NaN is ever computed on purpose.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
# Build variants, by the instruction set they may use. native: everything this CPU has. avx2: no AVX-512
# (what an AVX2 machine runs, testable on an AVX-512 one). portable: the compiler's baseline target, so no
# fast path is compiled in and the generic loops run: the code a CPU without AVX2 gets from native.
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"], "portable": []}
ISA_ENV = "SPECSERVE_KERNEL_ISA"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The attention and rope entry points' dtype code by (activations, KV caches): their own dtypes, or float32
# over bfloat16 caches (csrc/api.h: kDtypeF32Bf16Kv)
KV_DTYPES = {
    (torch.float32, torch.float32): 0,
    (torch.bfloat16, torch.bfloat16): 1,
    (torch.float32, torch.bfloat16): 2,
}
# specserve_paths() bits (csrc/api.h's kPath*): the fast attention kernels that take queries of any length
# (prefill chunks too), the AVX2 + FMA weight-only int8 / int4 and dense products for float32 activations,
# and the AVX512-BF16 ones for bfloat16 activations
PATH_F32, PATH_BF16, PATH_QUANT_F32, PATH_QUANT_BF16 = 1, 2, 4, 8
# and the w8a8 / w4a8 integer products on SIMD (AVX512-VNNI or AVX2), the first on AVX512-VNNI
PATH_INT_DOT, PATH_INT_DOT_VNNI = 16, 32
# and the int4 few-row bf16 product on AMX tiles (built for an AMX CPU, the tile state granted by the kernel)
PATH_INT4_AMX = 64
# and the Q8_0 head's few-row bf16 product on AMX tiles (likewise)
PATH_INT8_GROUPED_AMX = 128

# Every entry point of csrc/api.h by its arguments: p pointer, i int64, f float, c int (each returns an int
# status: 0 done, 1 refused arguments, 2 a dtype or path not in this build).
_SIGNATURES = {
    "specserve_paths": "",
    "specserve_paged_attention_short": "p i i p p p i p p p i i i i i f p i i c c i f c",
    "specserve_paged_attention_tree": "p i i p p p i p p p i i i i i f p i i c c i f p p",
    "specserve_rope_write_kv": "p i i p p p i i i p p p c c",
    "specserve_int8_matmul": "p i i p p i i p i c",
    "specserve_int8_grouped_matmul": "p i i p p i i p i c",
    "specserve_int4_matmul": "p i i p p p i i p i c",
    "specserve_int8_widen": "p p i i p c",
    "specserve_int8_matmul_bf16": "p i i p p i i p i c",
    "specserve_int4_matmul_bf16": "p i i p p p i i p i c",
    "specserve_int4_widen": "p p p i i p c",
    "specserve_int4_rows_bf16": "p i i p p p i i p i c",
    "specserve_int4_tile_rows_bf16": "p i i p p p i i p i c",
    "specserve_int8_grouped_tile_rows_bf16": "p i i p p i i p i c",
    "specserve_int8_grouped_rows_bf16": "p i i p p i i p i c",
    "specserve_bf16_matmul": "p i i p i i p i c",
    "specserve_f32_matmul": "p i i p i i p i c",
    "specserve_quantize_q8": "p i i i p p p c c",
    "specserve_w8a8_matmul": "p i i p p i i p i c",
    "specserve_w8a8_matmul_bf16": "p i i p p i i p i c",
    "specserve_w4a8_matmul": "p i i p p p i i p i c",
    "specserve_w4a8_matmul_bf16": "p i i p p p i i p i c",
    "specserve_w4a8h_matmul": "p i i p p p i i p i c",
    "specserve_w4a8h_matmul_bf16": "p i i p p p i i p i c",
    "specserve_w8a8g_matmul": "p i i p p i i p i c",
    "specserve_w8a8gh_matmul": "p i i p p i i p i c",
    "specserve_apply_bitmask": "p i i p i p i i",
    "specserve_add_rms_norm": "p p p p i i i i i f c c",
    "specserve_silu_mul": "p p i i i i c c",
    "specserve_gelu_tanh_mul": "p p i i i i c c",
    "specserve_rms_norm_heads": "p p i i i i f c c",
    "specserve_decoder_layers": "p i p p p p i i i i i i i p p p i p p p i f f c c c c",
}
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float, "c": ctypes.c_int}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False
_paths = 0  # specserve_paths() of the loaded library


def cache_dir() -> Path:
    return specserve.cache.cache_dir("kernels")


def _cpu_signature() -> str:
    """-march=native code is only valid on a CPU with the same flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def available_isas() -> list[str]:
    """The build variants this CPU can run: native and portable always, avx2 where it has AVX2 + FMA."""
    flags = set(_cpu_signature().split())
    return ["native", *(["avx2"] if {"avx2", "fma"} <= flags else []), "portable"]


def _sources(csrc: Path) -> list[Path]:
    return sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))


def _build(compiler: str, isa: str = "native", csrc: Path = CSRC) -> Path:
    if isa not in ISA_FLAGS:
        raise RuntimeError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, not {isa!r}")
    flags = [*CFLAGS, *ISA_FLAGS[isa]]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (" ".join(flags).encode(), version.encode(), _cpu_signature().encode()):
        digest.update(part + b"\0")
    for source in _sources(csrc):  # every part: an edit to any of them is a new library
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    target = cache_dir() / f"specserve_cpu-{isa}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(csrc / UNITY), "-o", str(built)],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(built, target)
    return target


def _bind(lib: ctypes.CDLL, strict: bool) -> None:
    """Argument and return types of every entry point; strict=False skips those the library lacks (an older
    revision's source, built by bench/kernel_ab.py)."""
    for name, signature in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            if strict:
                raise RuntimeError(f"the kernel library has no {name}")
            continue
        fn.argtypes = [_CTYPES[c] for c in signature.split()]
        fn.restype = ctypes.c_int


def build_variant(isa: str, csrc: Path = CSRC) -> ctypes.CDLL:
    """The library built for one ISA variant from csrc (its unity.cpp), its functions bound (raises where it
    cannot be built). Another csrc (an older revision's sources) binds only the entry points it has."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    lib = ctypes.CDLL(str(_build(compiler, isa, csrc)))
    _bind(lib, strict=csrc == CSRC)
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library, or None when it cannot be built here (the caller falls back)."""
    global _lib, _failed, _paths
    with _lock:
        if _lib is None and not _failed:
            try:
                lib = build_variant(os.environ.get(ISA_ENV) or "native")
                _paths = int(lib.specserve_paths())
                _lib = lib
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                detail = getattr(exc, "stderr", "") or exc
                log.warning("C++ CPU kernels unavailable (%s); using torch", detail)
                _failed = True
        return _lib


def fast_paths() -> list[str]:
    """The loaded library's attention kernels for queries of any length, by dtype ([] before load or when
    portable)."""
    return [name for bit, name in ((PATH_F32, "float32"), (PATH_BF16, "bfloat16")) if _paths & bit]


def quant_fast() -> bool:
    """Whether the loaded library vectorises the int8 / int4 products (AVX2 + FMA builds)."""
    return bool(_paths & PATH_QUANT_F32)


def quant_bf16_fast() -> bool:
    """Whether the loaded library has the int8 / int4 products for bfloat16 activations (AVX512-BF16)."""
    return bool(_paths & PATH_QUANT_BF16)


def int_dot_fast() -> bool:
    """Whether the loaded library runs the w8a8 / w4a8 integer products on SIMD (AVX512-VNNI or AVX2)."""
    return bool(_paths & PATH_INT_DOT)


def int_dot_vnni() -> bool:
    """Whether those products run on AVX512-VNNI (vpdpbusd) rather than AVX2 (vpmaddubsw + vpmaddwd)."""
    return bool(_paths & PATH_INT_DOT_VNNI)


def int4_rows_amx() -> bool:
    """Whether the int4 few-row bf16 product runs its steps of 2 or more rows on AMX tiles (passes of 32)."""
    return bool(_paths & PATH_INT4_AMX)


def int8_grouped_rows_amx() -> bool:
    """Whether the library has the Q8_0 head's few-row bf16 product (int8_grouped_rows_bf16: AMX tiles)."""
    return bool(_paths & PATH_INT8_GROUPED_AMX)


def check(rc: int, name: str) -> None:
    """Raises where a library call refused its arguments (a nonzero status)."""
    if rc != 0:
        raise ValueError(f"{name} refused its arguments (code {rc})")
