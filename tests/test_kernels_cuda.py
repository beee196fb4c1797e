"""The interpreter tests' cases (test_kernels_triton.py) compiled and run on a CUDA device, and the torch
reference on CUDA tensors; skipped without a GPU. The float64 oracle is computed on the CPU from the same
seeded inputs, so a wrong result on the device cannot also be in the oracle.

One check runs everywhere: importing the Triton kernels on a machine with no GPU and without
TRITON_INTERPRET must work, as the CPU image's `specserve[gpu]` install and select_backend rely on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import assert_close, dense_attention, make_batch, tolerance
from test_kernels_triton import CASES, WRITE_KV_CASES, Case, _batch, _query, _write_kv_inputs
from test_kernels_window import dense_window_attention, poison_outside_window

from specserve.kernels import reference

REPO_ROOT = Path(__file__).resolve().parent.parent
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device; test_kernels_triton.py runs these cases on CPU",
)
CUDA_CASES = [
    "decode-gqa4-d128-b16-f32",
    "verify-gqa8-d64-b32-bf16",
    "verify-gqa3-d64-b16-f16",
    "prompts-gqa3-d128-b32-f32",
    "mixed-gqa3-d64-b16-bf16",
    "splitk-decode-gqa4-d64-b16-f32",
    "splitk-mixed-gqa8-d128-b32-bf16",
    "window8-verify-gqa2-d64-b16-f32",
    "window16-chunk-cap-gqa4-d64-b16-bf16",
    "window37-splitk-gqa4-d64-b16-f16",
]


@pytest.fixture(scope="module")
def triton_kernels():
    triton_attention = pytest.importorskip("specserve.kernels.triton_attention")
    if triton_attention.interpreted():
        pytest.skip("this pytest process runs Triton in its interpreter (TRITON_INTERPRET=1 was set)")
    return triton_attention


def _oracle(batch, case: Case) -> torch.Tensor:
    if case.window or case.softcap:
        return dense_window_attention(batch, case.window, case.softcap)
    return dense_attention(batch)


@needs_cuda
@pytest.mark.parametrize("name", CUDA_CASES)
def test_triton_attention_on_cuda(triton_kernels, name: str) -> None:
    case = CASES[name]
    batch = _batch(case)
    if case.window:
        poison_outside_window(batch, case.query_lens, case.window)
    num_tokens = batch.q.shape[0]
    q = _query(batch, case).cuda()
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    args = [t.cuda() for t in (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)]
    triton_kernels.paged_attention(
        q,
        *args,
        batch.query_start_loc.cuda(),
        batch.scale,
        out=out,
        num_splits=case.num_splits,
        window=case.window,
        softcap=case.softcap,
    )
    out = out.cpu()
    assert torch.isnan(out[num_tokens:]).all(), "padding rows past the last sequence were written"
    assert_close(out[:num_tokens], _oracle(batch, case), tolerance(case.dtype))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_split_k_chosen_by_the_device(triton_kernels, dtype: torch.dtype) -> None:
    """Two decodes over long contexts: too few programs for the SMs, so the launch splits the KV range."""
    batch = make_batch(
        [1, 1], [3000, 1501], num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=dtype, seed=3
    )
    out = triton_kernels.paged_attention(
        batch.q.cuda(),
        batch.k_cache.cuda(),
        batch.v_cache.cuda(),
        batch.block_tables.cuda(),
        batch.seq_lens.cuda(),
        batch.query_start_loc.cuda(),
        batch.scale,
    )
    assert_close(out.cpu(), dense_attention(batch), tolerance(dtype))


@needs_cuda
@pytest.mark.parametrize("name", list(WRITE_KV_CASES))
def test_triton_write_kv_on_cuda(triton_kernels, name: str) -> None:
    src_dtype, cache_dtype, block_size, slot_dtype = WRITE_KV_CASES[name]
    key, value, slots, shape = _write_kv_inputs(src_dtype, block_size, slot_dtype)
    caches = [torch.full(shape, float("nan"), dtype=cache_dtype) for _ in range(2)]
    k_cuda, v_cuda = (c.cuda() for c in caches)
    triton_kernels.write_kv(key.cuda(), value.cuda(), k_cuda, v_cuda, slots.cuda())
    reference.write_kv(key, value, *caches, slots)
    torch.testing.assert_close(k_cuda.cpu(), caches[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cuda.cpu(), caches[1], rtol=0, atol=0, equal_nan=True)


@needs_cuda
@pytest.mark.parametrize(
    "name", ["verify-gqa8-d64-b32-bf16", "mixed-gqa1-d128-b32-f32", "window8-verify-gqa2-d64-b16-f32"]
)
def test_reference_on_cuda_tensors(name: str) -> None:
    """The torch backend on a GPU: its plans are built on the host and index CUDA tensors."""
    case = CASES[name]
    batch = _batch(case)
    if case.window:
        poison_outside_window(batch, case.query_lens, case.window)
    tensors = (
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
    )
    out = reference.paged_attention(
        *(t.cuda() for t in tensors), batch.scale, window=case.window, softcap=case.softcap
    )
    assert_close(out.cpu(), _oracle(batch, case), tolerance(case.dtype))


def test_triton_kernels_import_without_a_gpu_or_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    code = (
        "import torch; from specserve.kernels import triton_attention as t; "
        "assert not torch.cuda.is_available(); assert not t.interpreted(); print('imported')"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]
