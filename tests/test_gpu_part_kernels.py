"""The GPU report's kernel part (bench/gpu/part_kernels.py), checked on the CPU.

The smoke run goes through the same code as the GPU run, with Triton in its interpreter: Triton fixes
compile-or-interpret once per process, so it runs in a child started with TRITON_INTERPRET=1 and hands its
Part back as JSON. The harness itself (poisoning, the error bound, the case design's compile budget) is
checked in this process with the torch reference as the kernel under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specserve.kernels import reference

REPO_ROOT = Path(__file__).resolve().parent.parent
# bench/ is scripts, not an installed package: importable from the repository root only.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from bench.gpu import part_kernels  # noqa: E402
from bench.gpu.common import Context  # noqa: E402

FAMILIES = {"decode", "verify", "prefill", "mixed", "split-k", "window", "softcap", "write_kv"}

CHILD = """
import json, pathlib, sys, time, torch
from bench.gpu.common import Context
from bench.gpu import part_kernels
ctx = Context(torch.device("cpu"), True, pathlib.Path(sys.argv[1]), None, None, time.monotonic() + 240)
part = part_kernels.run(ctx)
pathlib.Path(sys.argv[1], "part.json").write_text(json.dumps(
    {"ok": part.ok, "markdown": part.markdown, "data": part.data}, default=str))
"""


@pytest.mark.slow  # about 15 s of CPU in the interpreter
def test_kernel_part_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    part = json.loads((tmp_path / "part.json").read_text())
    data = part["data"]
    failed = [c for c in data["cases"] if not c["passed"]]
    assert part["ok"] and not failed and not data["skipped_cases"], (failed, part["markdown"])
    assert {c["family"] for c in data["cases"]} == FAMILIES
    assert {c["dtype"] for c in data["cases"]} == {"float32", "bfloat16", "float16"}
    for family in FAMILIES:
        assert f"| {family} |" in part["markdown"]
    (cell,) = data["bandwidth"]["cells"]
    assert cell["gbs"] > 0 and cell["bytes"] > cell["kv_bytes"] > 0
    assert data["bandwidth"]["copy_gbs"] > 0


def _context(deadline: float = 60.0) -> Context:
    return Context(torch.device("cpu"), True, Path("."), None, None, time.monotonic() + deadline)


def _cases() -> list[part_kernels.Case]:
    return [c for c in part_kernels.matrix_cases(smoke=True) if c.family in ("prefill", "window", "write_kv")]


def _reference_kernel(q: torch.Tensor, *args, num_splits=None, max_query_len=None, **kwargs) -> torch.Tensor:
    """The reference under the Triton wrapper's signature (its launch hints dropped)."""
    return reference.paged_attention(q, *args, **kwargs)


def _reference_kernels() -> SimpleNamespace:
    return SimpleNamespace(paged_attention=_reference_kernel, write_kv=reference.write_kv)


def test_the_reference_against_itself_passes() -> None:
    matrix = part_kernels.Matrix(_context(), _reference_kernels(), reference, torch.device("cpu"))
    matrix.run(_cases(), time.monotonic() + 60)
    assert matrix.records and all(r["passed"] for r in matrix.records), matrix.records


def test_unwritten_rows_and_skipped_writes_fail() -> None:
    def half_attention(q: torch.Tensor, *args, out: torch.Tensor, **kwargs) -> torch.Tensor:
        result = _reference_kernel(q, *args, **kwargs)
        rows = q.shape[0] // 2
        out[:rows] = result[:rows]  # the rest keeps its NaN poison
        return out

    def write_some(key, value, k_cache, v_cache, slots) -> None:
        dropped = slots.clone()
        dropped[int(torch.nonzero(slots >= 0)[0])] = -1  # one real token's K/V never lands
        reference.write_kv(key, value, k_cache, v_cache, dropped)

    lazy = SimpleNamespace(paged_attention=half_attention, write_kv=write_some)
    matrix = part_kernels.Matrix(_context(), lazy, reference, torch.device("cpu"))
    matrix.run(_cases(), time.monotonic() + 60)
    assert matrix.records and not any(r["passed"] for r in matrix.records), matrix.records
    assert all(r["err"] == float("inf") for r in matrix.records if r["family"] != "write_kv")


def test_a_raising_kernel_is_recorded_and_the_run_goes_on() -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    matrix = part_kernels.Matrix(
        _context(), SimpleNamespace(paged_attention=broken, write_kv=broken), reference, torch.device("cpu")
    )
    cases = _cases()
    matrix.run(cases, time.monotonic() + 60)
    assert len(matrix.records) == len(cases)
    assert all(not r["passed"] and "no kernel image" in r["error"] for r in matrix.records)


def test_out_of_time_skips_the_rest() -> None:
    matrix = part_kernels.Matrix(_context(), _reference_kernels(), reference, torch.device("cpu"))
    cases = _cases()
    matrix.run(cases, time.monotonic() - 1)
    assert not matrix.records and matrix.skipped == [c.name for c in cases]


def test_the_full_matrix_covers_the_families_within_the_compile_budget() -> None:
    cases = part_kernels.matrix_cases(smoke=False)
    attention = [c for c in cases if isinstance(c, part_kernels.AttentionCase)]
    assert {c.family for c in cases} == FAMILIES
    assert {(c.dtype, c.head_dim, c.block_size) for c in attention} == {
        (d, h, b) for d in part_kernels.DTYPES for h in (64, 128, 256) for b in (16, 32)
    }
    assert {c.group for c in attention} == {1, 3, 4, 8}
    verify = {q for c in attention if c.family == "verify" for q in c.query_lens}
    assert verify == set(range(2, 10))
    prefill = [c for c in attention if c.family == "prefill"]
    assert any(q > 200 for c in prefill for q in c.query_lens)
    assert any(ctx % c.block_size and ctx > 0 for c in prefill for ctx in c.context_lens)
    assert any(c.num_splits != 1 for c in attention) and any(
        c.window and c.num_splits != 1 for c in attention
    )
    assert len({c.name for c in cases}) == len(cases)
    assert part_kernels.predicted_variants(cases) <= 40  # each variant is one more compile on the lent GPU
