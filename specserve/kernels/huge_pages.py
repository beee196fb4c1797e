"""Transparent huge pages under the paged KV cache (Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for transparent huge pages under a large CPU tensor, before its memory is first touched.

    The paged KV cache is read in blocks scattered over hundreds of MB: with 4 KiB pages nearly every block
    misses the TLB, and under a hypervisor each miss is a two-level page walk. Linux only; a no-op where
    THP is off or the tensor is too small to hold an aligned 2 MiB page.
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = (end - aligned) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return False
    return madvise(aligned, length, MADV_HUGEPAGE) == 0
