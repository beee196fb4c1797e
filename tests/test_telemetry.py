"""Telemetry's OpenTelemetry resource: our service name is a default only; the OTEL_* variables win."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specserve.service.telemetry import Telemetry


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    # The machine running the tests may set these itself.
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def exported_resource(service_name: str | None = None) -> tuple[dict, dict]:
    """(attributes a span actually leaves with, i.e. what a collector sees; Telemetry.resource's attributes)
    for a Telemetry built with this default service name (None: the class default)."""
    exporter = InMemorySpanExporter()
    kw = {} if service_name is None else {"service_name": service_name}
    telemetry = Telemetry(span_exporter=exporter, **kw)
    try:
        with telemetry.tracer.start_as_current_span("probe"):
            pass
        (span,) = exporter.get_finished_spans()
        return dict(span.resource.attributes), dict(telemetry.resource.attributes)
    finally:
        telemetry.shutdown()


def test_default_service_name_without_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    exported, resource = exported_resource()
    assert exported["service.name"] == resource["service.name"] == "specserve"
    assert exported_resource("specserve-api")[0]["service.name"] == "specserve-api"


def test_otel_service_name_overrides_ours(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_SERVICE_NAME", "llm-workers-eu")
    exported, resource = exported_resource("specserve")
    assert exported["service.name"] == resource["service.name"] == "llm-workers-eu"


def test_otel_resource_attributes_override_ours(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,deployment.environment=staging")
    attrs, _ = exported_resource()
    assert attrs["service.name"] == "from-attrs" and attrs["deployment.environment"] == "staging"
    # Both set: OTEL_SERVICE_NAME takes precedence, as the specification says.
    clean_env.setenv("OTEL_SERVICE_NAME", "from-service-name")
    attrs, _ = exported_resource()
    assert attrs["service.name"] == "from-service-name" and attrs["deployment.environment"] == "staging"
