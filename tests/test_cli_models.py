"""`specserve models` lists what the engine reads; `specserve serve --model X` for an architecture it does not
read exits non-zero with one line naming it and the supported list, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specserve.models.config import ARCHITECTURES


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, REDIS_URL="")
    return subprocess.run(
        [sys.executable, "-m", "specserve.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_models_lists_every_architecture_and_the_gguf_types(tmp_path):
    out = _cli("models", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for arch in ARCHITECTURES:
        assert arch in out.stdout
    assert "Q4_K" in out.stdout and "Q8_0" in out.stdout


def test_an_unsupported_model_is_one_line_and_a_nonzero_exit(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    out = _cli("worker", "--model", str(model), "--redis-url", "redis://127.0.0.1:1", cwd=tmp_path)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    assert "GPT2LMHeadModel" in errors[0] and "Qwen3ForCausalLM" in errors[0]


def test_enqueue_from_another_directory_names_data_dir_and_redis_url(tmp_path):
    """`serve` keeps its embedded server's URL under a data dir relative to where it ran; an `enqueue` run
    elsewhere finds nothing there, and says where it looked and how to point it at the server."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, REDIS_URL="", PYTHONPATH=str(repo))
    env.pop("SPECSERVE_DATA_DIR", None)
    out = subprocess.run(
        [sys.executable, "-m", "specserve.service.cli", "enqueue", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--data-dir" in out.stderr and "REDIS_URL" in out.stderr
    assert str(tmp_path.resolve() / ".specserve" / "valkey" / "url") in out.stderr
