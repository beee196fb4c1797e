"""Packaging: Triton is optional (the `gpu` extra), and nothing outside the Triton backend needs it."""

from __future__ import annotations

import shutil
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


def test_a_wheel_carries_every_file_the_package_reads() -> None:
    """`pip install .` builds a wheel: a file under specserve/ that no package-data glob names (the CPU
    kernel's C++ source) would be missing from it, and its code would fail only once installed."""
    tomllib = pytest.importorskip("tomllib")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "specserve"
    data = [
        p.relative_to(package)
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert data, "the package has data files (the C++ kernel); this test would check nothing without them"
    for path in data:
        assert any(path.match(pattern) for pattern in globs["specserve"]), f"{path} is left out of the wheel"


def test_the_source_tree_version_is_pyprojects() -> None:
    tomllib = pytest.importorskip("tomllib")
    import specserve

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == specserve.__version__


def test_version_flag_prints_the_installed_version() -> None:
    from importlib.metadata import version

    proc = subprocess.run(
        [sys.executable, "-m", "specserve.service.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"specserve {version('specserve')}"


def test_version_falls_back_to_the_package_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    import specserve
    from specserve.service import cli

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.version() == specserve.__version__


def _make_plan(target: str, tmp: Path) -> str:
    """What `make <target>` would run on a fresh checkout (`make -n`: nothing is installed)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make here")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp / name)
    # under a parent make (`make test` runs this suite) a sub-make says "Entering directory" unless told
    proc = subprocess.run(
        [make, "--no-print-directory", "-n", target], cwd=tmp, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_serve_installs_the_runtime_and_make_test_the_dev_extras_on_top(tmp_path: Path) -> None:
    serve = _make_plan("serve", tmp_path)
    assert "[dev]" not in serve  # no pytest, ruff or Helm SDK to run the service
    # Triton (the gpu extra) only where torch sees CUDA
    assert "torch.cuda.is_available()" in serve and '-e ".[gpu]"' in serve and "pip install -e .;" in serve
    assert serve.rstrip().endswith("specserve.service.cli serve")
    test = _make_plan("test", tmp_path)
    assert test.index("pip install -e .;") < test.index('pip install -e ".[dev]"')
    assert test.rstrip().endswith("pytest -q")
