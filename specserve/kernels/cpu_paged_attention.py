"""A C++ paged attention on CPU, loaded through ctypes: decode, speculative verify and, where the CPU has
a fast path for the dtype, prefill chunks; and a fused rotary embedding + KV write.

The torch reference must gather every sequence's K/V into a padded tensor before SDPA can read it: per layer
that copies the whole KV of the batch and reads it twice more. This kernel (cpu_paged_attention.cpp) walks
the block tables and reads each cached K and V row once, in float32 accumulation.

It is compiled on first use with the system C++ compiler (about a second: no torch headers) into a cache
directory keyed by the source, the flags, the compiler and the CPU, so later processes load it at once. The
instruction set is chosen at build time: -march=native, and the source compiles the fast paths the CPU's
macros allow (AVX2 + FMA: float32 for queries of any length; AVX512-BF16: bfloat16 likewise), which the
library reports (specserve_paths) so Python routes prefill chunks to it. SPECSERVE_KERNEL_ISA=avx2 or
=portable builds a narrower variant instead (tests and benchmarks compare them). Without a compiler, or for
a dtype it does not handle (float16), callers fall back to the reference's gather + SDPA.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
# -ffast-math is safe here: masking is by loop bounds, so no inf or NaN is ever computed on purpose.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]
# Build variants, by the instruction set they may use. native: everything this CPU has. avx2: no AVX-512
# (what an AVX2 machine runs, testable on an AVX-512 one). portable: the compiler's baseline target, so no
# fast path is compiled in and the generic loops run: the code a CPU without AVX2 gets from native.
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"], "portable": []}
ISA_ENV = "SPECSERVE_KERNEL_ISA"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# specserve_paths() bits: the fast kernels that take queries of any length (prefill chunks too), the
# AVX2 + FMA weight-only int8 / int4 products for float32 activations, and the AVX512-BF16 int8 / int4
# products for bfloat16 activations
PATH_F32, PATH_BF16, PATH_QUANT_F32, PATH_QUANT_BF16 = 1, 2, 4, 8
# The bfloat16 products read their codes in tiles of this many outputs (int8_tiles, int4_tiles)
INT8_TILE = 16

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False
_paths = 0  # specserve_paths() of the loaded library


def cache_dir() -> Path:
    if os.environ.get("SPECSERVE_CACHE_DIR"):
        return Path(os.environ["SPECSERVE_CACHE_DIR"]) / "kernels"
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "specserve" / "kernels"


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


def _build(compiler: str, isa: str = "native") -> Path:
    if isa not in ISA_FLAGS:
        raise RuntimeError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, not {isa!r}")
    flags = [*CFLAGS, *ISA_FLAGS[isa]]
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"cpu_paged_attention-{isa}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written library.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, check=True
        )
        os.replace(built, target)
    return target


_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float, "c": ctypes.c_int}


def _bind(lib: ctypes.CDLL, name: str, signature: str) -> None:
    fn = getattr(lib, name)
    fn.argtypes = [_CTYPES[c] for c in signature.split()]
    fn.restype = ctypes.c_int


def build_variant(isa: str) -> ctypes.CDLL:
    """The library built for one ISA variant, its functions bound (raises where it cannot be built)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    lib = ctypes.CDLL(str(_build(compiler, isa)))
    # p: pointer, i: int64, f: float, c: int (every function returns an int status)
    _bind(lib, "specserve_paged_attention_short", "p i i p p p i p p p i i i i i f p i i c c i f")
    _bind(lib, "specserve_rope_write_kv", "p i i p p p i i i p p p c c")
    _bind(lib, "specserve_paths", "")
    _bind(lib, "specserve_int8_matmul", "p i i p p i i p i c")
    _bind(lib, "specserve_int8_grouped_matmul", "p i i p p i i p i c")
    _bind(lib, "specserve_int4_matmul", "p i i p p p i i p i c")
    _bind(lib, "specserve_int8_widen", "p p i i p c")
    _bind(lib, "specserve_int8_matmul_bf16", "p i i p p i i p i c")
    _bind(lib, "specserve_int4_matmul_bf16", "p i i p p p i i p i c")
    _bind(lib, "specserve_int4_widen", "p p p i i p c")
    _bind(lib, "specserve_int4_rows_bf16", "p i i p p p i i p i c")
    _bind(lib, "specserve_bf16_matmul", "p i i p i i p i c")
    _bind(lib, "specserve_f32_matmul", "p i i p i i p i c")
    _bind(lib, "specserve_apply_bitmask", "p i i p i p i i")
    _bind(lib, "specserve_add_rms_norm", "p p p p i i i i i f c c")
    _bind(lib, "specserve_silu_mul", "p p i i i i c c")
    _bind(lib, "specserve_gelu_tanh_mul", "p p i i i i c c")
    _bind(lib, "specserve_rms_norm_heads", "p p i i i i f c c")
    _bind(lib, "specserve_decoder_layers", "p i p p p p i i i i i i i p p p i p p p i f f c c")
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
                log.warning("C++ paged attention unavailable (%s); using gather + SDPA", detail)
                _failed = True
        return _lib


def fast_paths() -> list[str]:
    """The loaded library's kernels for queries of any length, by dtype ([] before load or when portable)."""
    return [name for bit, name in ((PATH_F32, "float32"), (PATH_BF16, "bfloat16")) if _paths & bit]


def supports(dtype: torch.dtype, block_size: int) -> bool:
    return dtype in DTYPES and block_size <= 256


def supports_long(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether prefill chunks run here too: the float32 AVX2 + FMA path and the bfloat16 AVX512-BF16 one.
    On a 2-core AVX2 EPYC (SmolLM2 shapes, 4 chunks of 256 over 512 cached tokens, one thread) the float32
    kernel took 22.0-22.3 ms a layer against gather + SDPA's 22.5-23.6 (bench/kernels.py --threads 1):
    level, and one code path for every query length; the bf16 one is 3-5x faster than gather + SDPA. Head
    sizes 64, 128 and 256 (Gemma 3's): before 256 was one, Gemma 3 270M's prefill chunks went to gather +
    SDPA and its decode to the generic loops, and the first 32 W1 requests (capped at 128 tokens, 64 in
    flight, bf16, 2-core Zen 4) took 141 ms a step against 127 after."""
    if head_dim not in (64, 128, 256) or block_size > 256:
        return False
    if dtype == torch.float32:
        return bool(_paths & PATH_F32) and block_size % 8 == 0
    return dtype == torch.bfloat16 and bool(_paths & PATH_BF16) and block_size % 16 == 0


def paged_attention_short(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attention for the sequences in seq_ids (int64), written into out; load() must have succeeded.
    Queries longer than a few tokens only where supports_long() says so. window: each query sees its own
    position and the window - 1 before it (blocks wholly before are not read); softcap: scores become
    softcap * tanh(score / softcap) before the softmax.

    q and out are [tokens, heads, head_dim] with head_dim innermost; the caches contiguous; block_tables,
    seq_lens and query_start_loc int32 and contiguous. The dtype of q, out and the caches must match.
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if q.stride(2) != 1 or out.stride(2) != 1 or q.dtype != k_cache.dtype or out.dtype != q.dtype:
        raise ValueError("q and out need head_dim innermost and the caches' dtype")
    for t, dt in (
        (block_tables, torch.int32),
        (seq_lens, torch.int32),
        (query_start_loc, torch.int32),
        (seq_ids, torch.int64),
    ):
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"index tensors must be contiguous {dt}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = _lib.specserve_paged_attention_short(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        seq_ids.data_ptr(),
        seq_ids.numel(),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        DTYPES[q.dtype],
        torch.get_num_threads(),
        window or 0,
        softcap or 0.0,
    )
    if rc != 0:
        raise ValueError(f"paged_attention_short refused its arguments (code {rc})")


# The dtypes rope_write_kv takes (each in every build variant).
ROPE_DTYPES = (torch.float32, torch.bfloat16)


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotary embedding of qkv's q and k heads in place, then the new K and V into the cache (float32 or
    bfloat16; tokens with a negative slot are not cached).

    qkv [tokens, (num_heads + 2 * num_kv_heads) * head_dim] rows (q, k, v heads); cos/sin [max_pos, ...,
    head_dim] contiguous; positions and slot_mapping int64. Bit for bit what LlamaModel's torch path does.
    """
    head_dim = k_cache.shape[-1]
    if (
        qkv.dtype not in ROPE_DTYPES
        or qkv.stride(1) != 1
        or cos.dtype != qkv.dtype
        or sin.dtype != qkv.dtype
        or k_cache.dtype != qkv.dtype
        or v_cache.dtype != qkv.dtype
    ):
        raise ValueError("rope_write_kv takes float32 or bfloat16 qkv rows, rotary tables and caches alike")
    if not (
        cos.is_contiguous() and sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    ):
        raise ValueError("rotary tables and KV caches must be contiguous")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    rc = _lib.specserve_rope_write_kv(
        qkv.data_ptr(),
        qkv.stride(0),
        qkv.shape[0],
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        DTYPES[qkv.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"rope_write_kv refused its arguments (code {rc})")


def _rows(t: torch.Tensor, d: int, what: str) -> None:
    if t.dim() != 2 or t.shape[1] < d or t.stride(1) != 1 or t.dtype not in DTYPES:
        raise ValueError(f"{what} must be float32 or bfloat16 rows of at least {d} contiguous elements")


def add_rms_norm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(h, weight) of rows [n, d], one pass; with `add`, h += add in place first (the residual
    stream, rounded to its dtype as `h + add` is) and the norm is of the sum."""
    n, d = h.shape
    for t, what in ((h, "h"), *(((add, "add"),) if add is not None else ())):
        _rows(t, d, what)
    if weight.shape != (d,) or not weight.is_contiguous() or weight.dtype != h.dtype:
        raise ValueError("weight must be a contiguous vector of h's width and dtype")
    if add is not None and (add.shape[0] != n or add.dtype != h.dtype):
        raise ValueError("add must have h's rows and dtype")
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    rc = _lib.specserve_add_rms_norm(
        h.data_ptr(),
        None if add is None else add.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        n,
        d,
        h.stride(0),
        0 if add is None else add.stride(0),
        out.stride(0),
        eps,
        DTYPES[h.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"add_rms_norm refused its arguments (code {rc})")
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """F.rms_norm over the last dimension of x [n, heads, d] in place, each head alone (q and k norms):
    heads contiguous within a token, tokens at any row stride (a slice of the fused qkv output)."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.dtype not in DTYPES:
        raise ValueError("x must be float32 or bfloat16 [n, heads, d] with each token's heads contiguous")
    n, heads, d = x.shape
    if weight.shape != (d,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError("weight must be a contiguous vector of x's head width and dtype")
    rc = _lib.specserve_rms_norm_heads(
        x.data_ptr(),
        weight.data_ptr(),
        n,
        heads,
        d,
        x.stride(0),
        eps,
        DTYPES[x.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"rms_norm_heads refused its arguments (code {rc})")


def _act_mul(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    n, d2 = gate_up.shape
    _rows(gate_up, d2, "gate_up")
    d = d2 // 2
    out = torch.empty(n, d, dtype=gate_up.dtype)
    fn = getattr(_lib, f"specserve_{name}")
    rc = fn(
        gate_up.data_ptr(),
        out.data_ptr(),
        n,
        d,
        gate_up.stride(0),
        d,
        DTYPES[gate_up.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"{name} refused its arguments (code {rc})")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [n, 2d] holding gate then up (a fused gate_up projection), one pass."""
    return _act_mul("silu_mul", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up (Gemma's GeGLU) for rows [n, 2d] holding gate then up, one
    pass."""
    return _act_mul("gelu_tanh_mul", gate_up)


# The weight-only quantized products (models/quant.py holds the matrices; these only read them). int4 codes
# come packed by pack_int4: 16 bytes per group of INT4_GROUP inputs, byte i holding code i in its low nibble
# and code i + 16 in its high one, so one 16-byte load unpacks into the group's 32 codes in input order.
INT4_GROUP = 32


def quant_fast() -> bool:
    """Whether the loaded library vectorises the int8 / int4 products (AVX2 + FMA builds)."""
    return bool(_paths & PATH_QUANT_F32)


class Product:
    """A weight-only product of the library (specserve_<name>) bound to its weights: their checks and
    pointers are taken once, when bound, so a call checks only its activations. A batch-1 decode step of
    SmolLM2 makes 121 of these calls; bound, a tiny one takes ~4.5 us against ~6.7 when the weights were
    checked at every call (avx2 build, Zen 4). Called as (x, its row stride, rows, *weights, out, its row
    stride, threads); rc != 0 means the library refused its arguments."""

    __slots__ = ("name", "n", "k", "x_dtype", "out_dtype", "_fn", "_args", "_weights")

    def __init__(
        self, name: str, x_dtype: torch.dtype, out_dtype: torch.dtype, n: int, k: int, *weights: torch.Tensor
    ) -> None:
        self.name, self.n, self.k, self.x_dtype, self.out_dtype = name, n, k, x_dtype, out_dtype
        self._fn = getattr(_lib, f"specserve_{name}")
        self._weights = weights  # the pointers below stay valid while these live
        self._args = (*(w.data_ptr() for w in weights), n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.x_dtype or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != self.k:
            raise ValueError(
                f"{self.name} takes {self.x_dtype} activations [rows, {self.k}] with k innermost, "
                f"not {x.dtype} {list(x.shape)}"
            )
        rows = x.shape[0]
        out = torch.empty(rows, self.n, dtype=self.out_dtype)
        if rows == 0:
            return out
        threads = torch.get_num_threads()
        rc = self._fn(x.data_ptr(), x.stride(0), rows, *self._args, out.data_ptr(), self.n, threads)
        if rc != 0:
            raise ValueError(f"{self.name} refused its arguments (code {rc})")
        return out


def quant_bf16_fast() -> bool:
    """Whether the loaded library has the int8 / int4 products for bfloat16 activations (AVX512-BF16)."""
    return bool(_paths & PATH_QUANT_BF16)


def int8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] -> [n // 16, k // 2, 16, 2], the layout int8_matmul_bf16 reads: for each tile of 16
    outputs and each pair of inputs, the 16 outputs' two codes side by side (one vdpbf16ps operand)."""
    n, k = codes.shape
    if codes.dtype != torch.int8 or n % INT8_TILE != 0 or k % 2 != 0:
        raise ValueError(f"int8_tiles takes int8 codes [n, k] with n a multiple of {INT8_TILE} and k even")
    return codes.view(n // INT8_TILE, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def bind_int8_bf16(tiles: torch.Tensor, scales: torch.Tensor) -> Product:
    """x [rows, k] bfloat16 times w^T -> [rows, n] bfloat16, w[j] = codes[j] * scales[j] (float32 [n]), the
    codes in int8_tiles' layout; products exact, sums in float32, rounded once. Needs quant_bf16_fast()."""
    if tiles.dtype != torch.int8 or tiles.dim() != 4 or not tiles.is_contiguous():
        raise ValueError("int8_matmul_bf16 takes the codes as int8_tiles gives them")
    n, k = tiles.shape[0] * INT8_TILE, tiles.shape[1] * 2
    if scales.dtype != torch.float32 or scales.shape != (n,) or not scales.is_contiguous():
        raise ValueError(f"int8_matmul_bf16: float32 scales [{n}]")
    return Product("int8_matmul_bf16", torch.bfloat16, torch.bfloat16, n, k, tiles, scales)


def int8_matmul_bf16(x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return bind_int8_bf16(tiles, scales)(x)


def bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """A dense bfloat16 matrix [n, k] -> the panels panel_matmul reads: [n // 32][k // 2][2][16][2] (the
    int8_tiles layout, two tiles side by side per input pair), a last panel of one tile for an odd n // 16."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % INT8_TILE != 0 or k % 2 != 0:
        raise ValueError(f"bf16_panels takes bfloat16 [n, k] with n a multiple of {INT8_TILE} and k even")
    tiles = weight.view(n // INT8_TILE, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3)  # [tiles, pairs, 16, 2]
    full = n // (2 * INT8_TILE) * 2
    panels = tiles[:full].reshape(full // 2, 2, k // 2, INT8_TILE, 2).transpose(1, 2).reshape(-1)
    return torch.cat([panels, tiles[full:].reshape(-1)]).view(n, k)


def f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """A dense float32 matrix [n, k] -> the panels panel_matmul reads: [n // 16][k][16] (for each input, 16
    outputs' weights side by side), a last panel of 8 outputs when n // 8 is odd."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % 8 != 0:
        raise ValueError("f32_panels takes float32 [n, k] with n a multiple of 8")
    full = n // 16 * 16
    panels = weight[:full].reshape(full // 16, 16, k).transpose(1, 2).reshape(-1)
    return torch.cat([panels, weight[full:].t().reshape(-1)]).view(n, k)


# the dense panel products by the panels' dtype (f32_panels: AVX2 + FMA builds; bf16_panels: AVX512-BF16)
_PANEL_PRODUCTS = {torch.float32: "f32_matmul", torch.bfloat16: "bf16_matmul"}


def bind_panels(panels: torch.Tensor) -> Product:
    """x [rows, k] times w^T -> [rows, n] in the panels' dtype, w held as f32_panels or bf16_panels gives it:
    float32 sums in input order, bf16 ones in float32 rounded once. float32 needs quant_fast(), bf16
    quant_bf16_fast(); other builds refuse the call (code 2)."""
    if panels.dtype not in _PANEL_PRODUCTS or panels.dim() != 2 or not panels.is_contiguous():
        raise ValueError("panel_matmul takes the weight as f32_panels or bf16_panels gives it")
    n, k = panels.shape
    return Product(_PANEL_PRODUCTS[panels.dtype], panels.dtype, panels.dtype, n, k, panels)


def panel_matmul(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    return bind_panels(panels)(x)


def int4_tiles(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 codes [n, k] (0..15) with float32 scales and zeros [n, k // 32] -> the layout int4_matmul_bf16
    reads: codes [n // 16, k // 2, 16] bytes (output j's two codes of an input pair in one byte, the first in
    the low nibble), scales and zeros [n // 16, k // 32, 16]."""
    n, k = codes.shape
    if n % INT8_TILE != 0 or k % INT4_GROUP != 0 or scales.shape != (n, k // INT4_GROUP):
        raise ValueError(f"int4_tiles takes codes [n, k] with n a multiple of {INT8_TILE}, k of {INT4_GROUP}")
    pairs = codes.to(torch.uint8).view(n // INT8_TILE, INT8_TILE, k // 2, 2).permute(0, 2, 1, 3)
    tiles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()

    def by_tile(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // INT8_TILE, INT8_TILE, -1).permute(0, 2, 1).contiguous()

    return tiles, by_tile(scales), by_tile(zeros)


def bind_int4_bf16(tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Product:
    """x [rows, k] bfloat16 times w^T -> [rows, n] bfloat16, w = (code - 8) * scale + zero per group of 32
    inputs, rounded to bf16 as the dense bf16 form (quant.dequantize) holds it, in int4_tiles' layout; sums in
    float32. Written for steps of many rows (few are bind_int4_rows_bf16's). Needs quant_bf16_fast()."""
    if tiles.dtype != torch.uint8 or tiles.dim() != 3 or not tiles.is_contiguous():
        raise ValueError("int4_matmul_bf16 takes the codes as int4_tiles gives them")
    n, k = tiles.shape[0] * INT8_TILE, tiles.shape[1] * 2
    shape = (tiles.shape[0], k // INT4_GROUP, INT8_TILE)
    for t in (scales, zeros):
        if t.dtype != torch.float32 or t.shape != shape or not t.is_contiguous():
            raise ValueError(f"int4_matmul_bf16: float32 scales and zeros {list(shape)} (int4_tiles)")
    return Product("int4_matmul_bf16", torch.bfloat16, torch.bfloat16, n, k, tiles, scales, zeros)


def int4_matmul_bf16(
    x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    return bind_int4_bf16(tiles, scales, zeros)(x)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[n, k] codes in 0..15 (uint8) -> [n, k // 2] uint8 in the kernels' nibble layout."""
    n, k = codes.shape
    halves = codes.to(torch.uint8).reshape(n, k // INT4_GROUP, 2, INT4_GROUP // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [n, k // 2] -> [n, k] codes (uint8)."""
    n = packed.shape[0]
    groups = packed.reshape(n, -1, INT4_GROUP // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=-1).reshape(n, -1)


def _check_contiguous(*tensors: torch.Tensor) -> None:
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("quantized weights, scales and offsets must be contiguous")


def bind_int8(codes: torch.Tensor, scales: torch.Tensor) -> Product:
    """x [rows, k] float32 times w^T -> [rows, n] float32, w = codes [n, k] int8 times scales, float32 [n]
    (one per output row) or [n, k // 32] (one per group of 32 inputs). load() must have succeeded;
    vectorised where quant_fast(): for 1..8 rows, and for more with a scale per output and n a multiple of 8
    (a panel of 16 outputs widened at a time for the dense float32 panel product's register blocks)."""
    _check_contiguous(codes, scales)
    n, k = codes.shape
    grouped = scales.dim() == 2
    if (
        codes.dtype != torch.int8
        or scales.dtype != torch.float32
        or scales.numel() != (n * (k // INT4_GROUP) if grouped else n)
        or (grouped and k % INT4_GROUP != 0)
    ):
        raise ValueError("int8_matmul takes int8 codes [n, k] and float32 scales [n] or [n, k // 32]")
    name = "int8_grouped_matmul" if grouped else "int8_matmul"
    return Product(name, torch.float32, torch.float32, n, k, codes, scales)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return bind_int8(codes, scales)(x)


def _check_int4(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> tuple[int, int]:
    _check_contiguous(packed, scales, offsets)
    n, k = packed.shape[0], packed.shape[1] * 2
    if (
        packed.dtype != torch.uint8
        or k % INT4_GROUP != 0
        or scales.dtype != torch.float32
        or offsets.dtype != torch.float32
        or scales.numel() != n * (k // INT4_GROUP)
        or offsets.numel() != scales.numel()
    ):
        raise ValueError("int4 takes packed uint8 [n, k // 2] and float32 scales and offsets [n, k // 32]")
    return n, k


def bind_int4(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Product:
    """x [rows, k] float32 times w^T, w[j, i] = code * scales[j, g] + offsets[j, g] for i in group g (codes
    from pack_int4) -> [rows, n] float32. load() must have succeeded; vectorised where quant_fast(): for
    1..8 rows, and for more where n is a multiple of 8 (widened panels, as int8_matmul)."""
    n, k = _check_int4(packed, scales, offsets)
    return Product("int4_matmul", torch.float32, torch.float32, n, k, packed, scales, offsets)


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    return bind_int4(packed, scales, offsets)(x)


# The most rows int4_rows_bf16 takes (the float32 few-row kernels' forms).
INT4_ROWS_BF16_MAX = 8


def bind_int4_rows_bf16(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> Product:
    """bind_int4's matrix times x [rows, k] bfloat16 (1..INT4_ROWS_BF16_MAX rows) -> [rows, n] bfloat16: codes
    exact in bf16 products on vdpbf16ps, sums in float32, rounded once. Needs quant_bf16_fast()."""
    n, k = _check_int4(packed, scales, offsets)
    return Product("int4_rows_bf16", torch.bfloat16, torch.bfloat16, n, k, packed, scales, offsets)


def int8_widen(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [n, k] int8 * scales [n] -> [n, k] float32, on every thread."""
    if codes.dtype != torch.int8 or scales.dtype != torch.float32 or scales.numel() != codes.shape[0]:
        raise ValueError("int8_widen takes int8 codes [n, k] and float32 scales [n]")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("int8_widen takes contiguous codes and scales")
    out = torch.empty(codes.shape, dtype=torch.float32)
    n, k = codes.shape
    _lib.specserve_int8_widen(
        codes.data_ptr(), scales.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()
    )
    return out


def int4_widen(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """pack_int4 codes with their scales and offsets -> [n, k] float32, on every thread."""
    if not (packed.is_contiguous() and scales.is_contiguous() and offsets.is_contiguous()):
        raise ValueError("int4_widen takes contiguous codes, scales and offsets")
    n, k = _check_int4(packed, scales, offsets)
    out = torch.empty(n, k, dtype=torch.float32)
    _lib.specserve_int4_widen(
        packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), n, k, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Forbidden tokens' logits to -inf, in place, on `rows` (int64) of float32 logits [R, V]: token t of row
    r is allowed where bit t % 32 of bitmask[r, t // 32] (int32, xgrammar's packing) is set. One thread (a
    parallel region stalls on a loaded machine; see the C++). load() must have succeeded."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("apply_bitmask takes float32 logits [rows, vocab] with vocab innermost")
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.shape[0] < logits.shape[0]:
        raise ValueError("apply_bitmask takes a contiguous int32 bitmask with a row per logits row")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError("the bitmask is narrower than the vocabulary")
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        raise ValueError("apply_bitmask takes contiguous int64 row indices")
    rc = _lib.specserve_apply_bitmask(
        logits.data_ptr(), logits.stride(0), logits.shape[1], bitmask.data_ptr(), bitmask.shape[1],
        rows.data_ptr(), rows.numel(), logits.shape[0],
    )  # fmt: skip
    if rc != 0:
        raise ValueError("apply_bitmask: a row index out of range")


# LayerChain's product kinds (the C++ ProductKind), by the library function a Product calls
_CHAIN_KINDS = {
    "f32_matmul": 0,
    "int8_matmul": 1,
    "int8_grouped_matmul": 2,
    "int4_matmul": 3,
    "bf16_matmul": 4,
    "int8_matmul_bf16": 5,
    "int4_matmul_bf16": 6,
    "int4_rows_bf16": 7,
}


@dataclass(frozen=True)
class ChainLayer:
    """One decoder layer as LayerChain runs it: RMSNorm, qkv, rope + KV write, attention, o, residual add +
    RMSNorm, gate_up, silu * up, down. Products are bound library products; biases float32 or None."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    rope: int  # which of the call's rotary tables
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


class LayerChain:
    """A model's decoder layers run in one library call a step (specserve_decoder_layers), calling the very
    kernels the model's Python loop calls, with the same arguments: outputs are bit for bit the loop's.

    Why: at batch 1 the loop's ~270 calls a step through ctypes and torch's dispatcher kept one core in
    Python while the other spun at the next barrier (perf of SmolLM2's int8 steps, 2-core Zen 4, avx2
    build: 16 % of samples outside the kernels and libgomp, 22 % in libgomp's waits). Chained, in one
    process ABBA (`bench/profile_step.py --batch 1 --dtype float32 --quantization int8 --chain-ab`, avx2
    build): int8 7.6 against 10.0 ms a step, int4 7.6 against 9.7, dense 21.6 against 24.2; at 16
    sequences dense 61.5 against 64.2. The weights' pointers are taken once, here; a call checks only the
    step's tensors."""

    def __init__(
        self,
        layers: list[ChainLayer],
        dtype: torch.dtype,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        if _lib is None:
            raise RuntimeError("LayerChain needs the library: load() first")
        self.dtype, self.hidden, self.intermediate = dtype, hidden, intermediate
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, qkv_n = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {"qkv": (qkv_n, hidden), "o": (hidden, q_size)}
        shapes |= {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        words: list[int] = []
        keep: list[torch.Tensor] = []
        for i, layer in enumerate(layers):
            for norm in (layer.input_norm, layer.mlp_norm):
                if norm.dtype != dtype or norm.shape != (hidden,) or not norm.is_contiguous():
                    raise ValueError(f"layer {i}: norm weights must be contiguous {dtype} [{hidden}]")
            words += [layer.input_norm.data_ptr(), layer.mlp_norm.data_ptr()]
            keep += [layer.input_norm, layer.mlp_norm]
            for name, (n, k) in shapes.items():
                product: Product = getattr(layer, name)
                bias: torch.Tensor | None = getattr(layer, name + "_bias")
                if product.name not in _CHAIN_KINDS or (product.n, product.k) != (n, k):
                    raise ValueError(f"layer {i}: {name} must be a library product [{n}, {k}]")
                if product.x_dtype != dtype or product.out_dtype != dtype:
                    raise ValueError(f"layer {i}: {name} must take and give {dtype}")
                if bias is not None and (
                    dtype != torch.float32
                    or bias.dtype != dtype
                    or bias.shape != (n,)
                    or not bias.is_contiguous()
                ):
                    raise ValueError(f"layer {i}: {name}'s bias must be contiguous float32 [{n}]")
                weights = [w.data_ptr() for w in product._weights]
                words += [_CHAIN_KINDS[product.name], n, k, *weights, *[0] * (3 - len(weights))]
                words.append(0 if bias is None else bias.data_ptr())
                keep += [*product._weights, *([bias] if bias is not None else [])]
            words.append(layer.rope)
        self.num_layers = len(layers)
        self.num_ropes = 1 + max(layer.rope for layer in layers)
        self._words = torch.tensor(words, dtype=torch.int64)
        self._keep = keep  # the pointers above stay valid while these live
        self._kv: tuple[object, torch.Tensor] | None = None

    def _kv_pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # the runner allocates its caches once: their pointers are taken on first sight of the list
        if self._kv is None or self._kv[0] is not kv_caches:
            if len(kv_caches) != self.num_layers:
                raise ValueError(f"LayerChain runs {self.num_layers} layers, given {len(kv_caches)} caches")
            heads = (self.num_kv_heads, self.head_dim)
            for k, v in kv_caches:
                if (
                    k.dtype != self.dtype
                    or v.dtype != self.dtype
                    or not (k.is_contiguous() and v.is_contiguous())
                    or k.shape[2:] != heads
                    or v.shape != k.shape
                ):
                    raise ValueError(f"KV caches: contiguous {self.dtype} [blocks, size, *{heads}]")
            self._kv = (
                kv_caches,
                torch.tensor([t.data_ptr() for kv in kv_caches for t in kv], dtype=torch.int64),
            )
        return self._kv[1]

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_ids: torch.Tensor,
        scale: float,
        eps: float,
    ) -> torch.Tensor:
        """Runs every layer over h [rows, hidden] (contiguous, the embeddings; updated in place as the
        residual stream) and returns the last layer's MLP output, which the caller adds to h. Index tensors
        as paged_attention_short and rope_write_kv take them; ropes: each table's (cos, sin)."""
        rows = h.shape[0]
        if h.dtype != self.dtype or h.shape != (rows, self.hidden) or not h.is_contiguous():
            raise ValueError(f"h must be contiguous {self.dtype} [rows, {self.hidden}]")
        for t, dt in ((positions, torch.int64), (slot_mapping, torch.int64), (seq_ids, torch.int64)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError("positions, slot_mapping and seq_ids must be contiguous int64")
        if positions.numel() != rows or slot_mapping.numel() != rows:
            raise ValueError("positions and slot_mapping need one entry per row")
        for t in (block_tables, seq_lens, query_start_loc):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError("block_tables, seq_lens and query_start_loc must be contiguous int32")
        if len(ropes) < self.num_ropes:
            raise ValueError(f"the layers read {self.num_ropes} rotary tables, given {len(ropes)}")
        for cos, sin in ropes:
            if (
                cos.dtype != self.dtype
                or sin.dtype != self.dtype
                or not (cos.is_contiguous() and sin.is_contiguous())
            ):
                raise ValueError(f"rotary tables must be contiguous {self.dtype}")
        kv = self._kv_pointers(kv_caches)
        rope_ptrs = torch.tensor([t.data_ptr() for pair in ropes for t in pair], dtype=torch.int64)
        block_size = kv_caches[0][0].shape[1]
        m = torch.empty_like(h)
        rc = _lib.specserve_decoder_layers(
            self._words.data_ptr(), self.num_layers, kv.data_ptr(), rope_ptrs.data_ptr(), h.data_ptr(),
            m.data_ptr(), rows, self.hidden, self.intermediate, self.num_heads, self.num_kv_heads,
            self.head_dim, block_size, positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_ids.data_ptr(),
            seq_ids.numel(), scale, eps, DTYPES[self.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"decoder_layers refused its arguments (code {rc})")
        return m
