"""The GPU report's driver (bench/gpu/run.py) on the CPU: every part's section lands in the report, a part
that raises is recorded as failed and the run goes on, and the scripts the GPU machine runs parse."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def test_a_failing_part_is_reported_and_the_next_one_runs(tmp_path, monkeypatch):
    from bench.gpu import run
    from bench.gpu.common import Part

    boom = types.ModuleType("bench.gpu.part_boom")

    def explode(ctx):
        raise RuntimeError("the kernel did not compile")

    boom.run = explode
    after = types.ModuleType("bench.gpu.part_after")
    after.run = lambda ctx: Part("after", True, "| a | b |\n|---|---|\n| 1 | 2 |", {"figure": 3.0})
    monkeypatch.setitem(sys.modules, "bench.gpu.part_boom", boom)
    monkeypatch.setitem(sys.modules, "bench.gpu.part_after", after)
    monkeypatch.setattr(run, "PARTS", {"env": 5, "boom": 5, "after": 5})
    rc = run.main(["--out", str(tmp_path), "--smoke", "--parts", "env,boom,after"])
    assert rc == 1
    report = (tmp_path / "report.md").read_text()
    assert "| boom | FAILED |" in report and "the kernel did not compile" in report
    assert "| after | ok |" in report and "| env | ok |" in report
    blob = json.loads((tmp_path / "report.json").read_text())
    assert blob["parts"]["after"]["figure"] == 3.0
    assert blob["parts"]["env"]["copy_gbs"] > 0
    assert blob["header"]["device"] == "cpu"


def test_unknown_parts_are_refused(tmp_path):
    from bench.gpu import run

    with pytest.raises(SystemExit, match="unknown part"):
        run.main(["--out", str(tmp_path), "--smoke", "--parts", "env,nonsense"])


@pytest.mark.parametrize("script", ["pack.sh", "device.sh"])
def test_the_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu" / script)], check=True)
