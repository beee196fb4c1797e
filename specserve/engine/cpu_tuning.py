"""Allocator tuning for the CPU path.

Every layer allocates and frees K/V gathers and activations of megabytes. glibc serves blocks that large
with fresh mmap()s and returns them on free, so each one page-faults its memory in again: several ms per
layer. Raising the mmap and trim thresholds keeps freed memory in the heap for reuse (what vLLM's CPU
backend gets from preloading tcmalloc). Linux/glibc only; SPECSERVE_KEEP_MALLOC=1 leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Give the pages of freed blocks back to the OS (glibc's malloc_trim): after loading, the transients of
    casting and fusing weights would otherwise stay in the process's RSS."""
    libc = _libc() if sys.platform.startswith("linux") else None
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def _set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("SPECSERVE_KEEP_MALLOC") == "1":
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))


def return_freed_memory_at_once() -> bool:
    """Called before the model is loaded: every block of 1 MiB or more gets a mapping of its own, returned to
    the OS when freed. Loading frees a tensor for each fused or cast copy it makes; with glibc's adaptive
    threshold those blocks stayed in the heap, and building the demo model's layers in bf16 added 78 MiB
    of such garbage to the load's peak (25 MiB with this)."""
    return _set_thresholds(1 << 20, 1 << 20)


def keep_freed_memory_in_heap() -> bool:
    """Called after the model is loaded: a load's transients are freed for good, a step's are reused."""
    # glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX/2); larger blocks still come from mmap.
    return _set_thresholds(32 << 20, 1 << 30)
