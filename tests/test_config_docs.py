"""docs/configuration.md is generated from ServiceConfig; the committed file must be what the generator
says."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from specserve.service.config import ServiceConfig, markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_committed_configuration_reference_is_the_generated_one() -> None:
    assert DOC.read_text() == markdown(), (
        "docs/configuration.md is stale: run "
        "python -m specserve.service.config --markdown > docs/configuration.md"
    )


def test_the_reference_has_a_row_per_setting_with_flag_variable_and_default() -> None:
    rows = {
        line.split(" | ")[1].strip("`"): line for line in markdown().splitlines() if line.startswith("| `-")
    }
    assert set(rows) == {f.metadata["env"] for f in fields(ServiceConfig)}
    assert rows["SPECSERVE_LOG_STATS_INTERVAL"].startswith("| `--log-stats-interval` |")
    assert "| `10` |" in rows["SPECSERVE_LOG_STATS_INTERVAL"]
    assert "| `off` |" in rows["SPECSERVE_ACCESS_LOG"]
    assert "`ngram`" in rows["SPECSERVE_SPEC_METHOD"]


def test_the_module_prints_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "specserve.service.config", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == markdown()


def test_the_wire_format_states_prefix_routings_defaults_as_the_code_has_them() -> None:
    import re

    from specserve.queue.routing import RoutingConfig

    text = (DOC.parent / "wire-format.md").read_text()
    state = "On" if RoutingConfig.enabled else "Off"
    assert f"{state} by default (`SPECSERVE_PREFIX_ROUTING`" in text
    (wait,) = re.findall(r"`SPECSERVE_PREFIX_ROUTING_WAIT_MS`, default (\d+)", text)
    assert int(wait) == RoutingConfig.wait_ms
    (row,) = [line for line in markdown().splitlines() if "| `SPECSERVE_PREFIX_ROUTING` |" in line]
    assert f"| `{'on' if RoutingConfig.enabled else 'off'}` |" in row
