"""The operator docs name only settings, metrics and OpenAI fields that exist, and cover
every OpenAI field the API checks."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.queue.keys import Keys
from specserve.service.config import ServiceConfig
from specserve.service.openai import protocol as openai_api
from specserve.service.telemetry import Telemetry

DOCS = Path(__file__).resolve().parent.parent / "docs"
OPERATOR_DOCS = ["openai-compatibility.md", "tuning.md", "deployment.md", "troubleshooting.md"]


def table_fields(text: str, heading: str) -> set[str]:
    """Backquoted names in the first column of the table under `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([a-z_]+)`", line.split(" | ")[0]))
    return names


def test_openai_matrix_lists_every_field_the_api_checks_in_the_right_table() -> None:
    text = (DOCS / "openai-compatibility.md").read_text()
    accepted = table_fields(text, "## Accepted\n") | table_fields(text, "## Our extensions")
    neutral = table_fields(text, "## Accepted only at their neutral value")
    checked = openai_api.COMPLETION_FIELDS | openai_api.CHAT_FIELDS
    assert neutral == set(openai_api.NEUTRAL)
    assert openai_api.EXTENSIONS <= table_fields(text, "## Our extensions")
    assert (checked - set(openai_api.NEUTRAL)) | {"best_of"} == accepted | {"best_of"}
    assert accepted | neutral == checked


def exported_metric_families() -> set[str]:
    telemetry = Telemetry()
    try:
        telemetry.engine.model_name = "m"
        telemetry.request_ended(
            "m", "finished", "stop", {"prompt_tokens": 1, "completion_tokens": 2}, 1, 0.1, 0.1
        )
        telemetry.ttft.record(0.1)
        telemetry.queue_wait.record(0.1)
        telemetry.http_requests.add(1, {"route": "/", "method": "GET", "code": 200})
        text = telemetry.metrics_text().decode()
    finally:
        telemetry.shutdown()
    families = list(text_string_to_metric_families(text))
    return {f.name for f in families} | {s.name for f in families for s in f.samples}


@pytest.mark.parametrize("doc", OPERATOR_DOCS)
def test_docs_name_only_settings_and_metrics_that_exist(doc: str) -> None:
    text = (DOCS / doc).read_text()
    envs = {f.metadata["env"] for f in fields(ServiceConfig)}
    named = set(re.findall(r"\bSPECSERVE_[A-Z_]+[A-Z]\b", text))
    assert named - envs == set()
    flags = {"--" + f.name.replace("_", "-") for f in fields(ServiceConfig)} | {"--log-level"}
    named_flags = set(re.findall(r"`(--[a-z-]+)", text))
    assert named_flags - flags == set()
    metrics = set(re.findall(r"\bspecserve[:_][a-z0-9_:]*[a-z0-9]\b", text)) - {"specserve_"}
    redis_keys = {Keys().dead, Keys().requests}  # redis-cli examples, not metrics
    metrics = {m for m in metrics if m.startswith(("specserve:", "specserve_"))} - redis_keys
    assert metrics - exported_metric_families() == set()


@pytest.mark.parametrize("doc", [*OPERATOR_DOCS, "configuration.md", "wire-format.md"])
def test_links_between_docs_resolve(doc: str) -> None:
    for target in re.findall(r"\]\(([^)#:]+\.md)", (DOCS / doc).read_text()):
        assert (DOCS / target).exists(), target


def test_wire_format_tells_utf16_readers_how_to_count_text_offset() -> None:
    text = (DOCS / "wire-format.md").read_text()
    section = text.split("### `text_offset` counts Unicode code points", 1)[1].split("\n## ", 1)[0]
    assert "Array.from" in section and "surrogate" in section
    # The doc's example, as Python (which counts what text_offset counts) and UTF-16 see it.
    sample = "héllo 😀!"
    assert f'"{sample}"` is 8' in section and "`text_offset` 7" in section
    assert len(sample) == 8 and sample.index("!") == 7
    assert len(sample.encode("utf-16-le")) // 2 == 9  # what JS's .length says
