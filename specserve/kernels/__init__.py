"""Paged attention backends: the torch reference on CPU, Triton kernels on CUDA, behind one signature."""

from specserve.kernels.backend import AttentionBackend, select_backend

__all__ = ["AttentionBackend", "select_backend"]
