"""The README's examples run as written: its curl, `specserve` and Python blocks against a live `specserve
serve` (a tiny model served under the demo's name), its install lines against the Makefile and pyproject."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from valkey_helpers import serve_process

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DEMO_NAME = "SmolLM2-135M-Instruct"
README_BASE = "localhost:8000"
README_REDIS = "redis://localhost:6379"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def commands(language: str = "bash") -> list[str]:
    """Each shell command of the README's blocks: continuation lines joined, comments dropped."""
    out: list[str] = []
    for block in blocks(language):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def test_the_readme_has_the_examples_a_user_looks_for() -> None:
    joined = "\n".join(commands())
    assert "make serve" in joined and "make test" in joined
    assert any(c.startswith("curl ") for c in commands())
    assert any("from openai import OpenAI" in b for b in blocks("python"))
    assert any("xadd" in b for b in blocks("python"))
    assert len(README.splitlines()) <= 260


def test_make_and_pip_lines_name_targets_and_extras_that_exist() -> None:
    makefile = (REPO / "Makefile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^(\w+) = \[", section, flags=re.M))
    for command in commands():
        words = shlex.split(command)
        if words[0] == "make":
            assert re.search(rf"^{words[1]}:", makefile, flags=re.M), command
        if words[:2] == ["pip", "install"]:
            for extra in re.findall(r"\[(\w+)\]", command):
                assert extra in extras, command


def test_specserve_lines_parse_with_the_cli() -> None:
    from specserve.service.cli import _parser

    parser = _parser()
    for command in commands():
        words = shlex.split(command)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)  # environment assignments before the command
        if words and words[0] == "specserve":
            parser.parse_args(words[1:])  # exits 2 (fails the test) on a flag the command does not take


def test_every_doc_the_readme_links_exists() -> None:
    for target in re.findall(r"\]\(([^)#:]+)", README):
        assert (REPO / target).exists(), target
    for page in (REPO / "docs").glob("*.md"):
        assert f"docs/{page.name}" in README, f"docs/{page.name} is not in the README's index"


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("readme")
    with serve_process(tiny_model_dir, tmp, SPECSERVE_SERVED_MODEL_NAME=DEMO_NAME) as base:
        yield base, (tmp / "data" / "url").read_text().strip()


def _run(args: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_curl_lines_answer(live) -> None:
    base, _ = live
    curls = [c for c in commands() if c.startswith("curl ")]
    for command in curls:
        out = _run(["bash", "-c", command.replace(README_BASE, base.removeprefix("http://"))])
        assert '"choices"' in out, out


@pytest.mark.slow
def test_the_enqueue_line_runs(live) -> None:
    _, redis_url = live
    (line,) = [c for c in commands() if c.startswith("specserve enqueue")]
    args = shlex.split(line)[1:]
    out = _run([sys.executable, "-m", "specserve.service.cli", *args], {"REDIS_URL": redis_url})
    assert out.strip()


@pytest.mark.slow
def test_the_openai_and_redis_examples_run(live) -> None:
    base, redis_url = live
    for block in blocks("python"):
        if "from specserve import LLM" in block:
            continue  # loads the demo model: the next test
        code = block.replace(f"http://{README_BASE}", base).replace(README_REDIS, redis_url)
        out = _run([sys.executable, "-c", code])
        assert out.strip(), block


@pytest.mark.slow
def test_the_python_api_example_runs() -> None:
    (block,) = [b for b in blocks("python") if "from specserve import LLM" in b]
    out = _run([sys.executable, "-c", block])
    assert out.strip()
