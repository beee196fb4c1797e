"""Packaging: Triton is optional (the `gpu` extra), and nothing outside the Triton backend needs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest's own dependency

ROOT = Path(__file__).resolve().parents[1]


def requirement_names(requirements: list[str]) -> set[str]:
    return {Requirement(req).name for req in requirements}


def test_triton_is_in_the_gpu_and_dev_extras_only() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "triton" not in requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "triton" in requirement_names(extras["gpu"])
    # The Triton kernels' tests run under TRITON_INTERPRET=1 on CPU, so the dev extra needs Triton too.
    assert "triton" in requirement_names(extras["dev"])


# Runs with `triton` made unimportable (None in sys.modules), as on a CPU-only install.
_WITHOUT_TRITON = """
import importlib, pkgutil, sys
sys.modules["triton"] = None
import specserve
from specserve.kernels import select_backend

skip = {"specserve.kernels.triton_attention"}  # the Triton backend itself, imported only when chosen
for info in pkgutil.walk_packages(specserve.__path__, "specserve."):
    if info.name not in skip:
        importlib.import_module(info.name)
assert select_backend("cpu", "torch").name == "torch"
assert "specserve.kernels.triton_attention" not in sys.modules
"""


def test_every_module_but_the_triton_backend_imports_without_triton() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
