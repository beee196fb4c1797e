"""Hugging Face model ids: `org/name` resolves through huggingface_hub's cache, offline here
(HF_HUB_OFFLINE=1 against a cache directory laid out as the hub writes it), with a revision; an id that is not
there, or a path that does not exist, is one line naming it, from the Python API and from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from valkey_helpers import REPO

from specserve import LLM, SamplingParams
from specserve.models.loader import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "acme/tiny-llama"


@pytest.fixture(scope="module")
def hub_cache(tiny_model_dir, tmp_path_factory) -> Path:
    """A hub cache holding REPO_ID at COMMIT, with refs main and v1 pointing at it."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    return cache


def _offline(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(REPO)}


def _generate_in_a_fresh_process(
    cache: Path, model: str, revision: str | None
) -> subprocess.CompletedProcess:
    # huggingface_hub reads HF_HUB_OFFLINE and the cache location when imported: a fresh process sees them
    code = (
        "import json, sys\n"
        "from specserve import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, dtype='float32', revision={revision!r})\n"
        "params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)\n"
        "out = llm.generate(['Hello there'], params)\n"
        "print(json.dumps({'ids': out[0].token_ids, 'name': llm.engine.model_name}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=_offline(cache), capture_output=True, text=True, timeout=300
    )


def test_an_id_in_the_cache_loads_offline_and_generates_as_the_local_dir(hub_cache, tiny_model_dir):
    want = LLM(str(tiny_model_dir), dtype="float32").generate(
        ["Hello there"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )[0]
    for revision in (None, "v1", COMMIT):
        proc = _generate_in_a_fresh_process(hub_cache, REPO_ID, revision)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got == {"ids": want.token_ids, "name": REPO_ID}


def test_a_missing_id_or_revision_is_one_clear_line(hub_cache):
    proc = _generate_in_a_fresh_process(hub_cache, "acme/not-there", None)
    assert (
        proc.returncode != 0
        and "acme/not-there" in proc.stderr
        and "not in the Hugging Face cache" in proc.stderr
    )
    proc = _generate_in_a_fresh_process(hub_cache, REPO_ID, "v2")
    assert proc.returncode != 0 and "at revision v2" in proc.stderr


def test_the_cli_names_a_missing_model_and_exits_2(hub_cache, tmp_path):
    env = {**_offline(hub_cache), "REDIS_URL": "redis://127.0.0.1:1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.service.cli",
            "worker",
            "--model",
            "acme/not-there",
            "--health-port",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "acme/not-there" in line]
    assert lines and "Traceback" not in proc.stderr


def test_local_paths_are_taken_as_they_are_and_nonsense_is_refused(tiny_model_dir, tmp_path):
    assert resolve_model(tiny_model_dir) == tiny_model_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "missing" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("not-an-id")
