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


def exported_resource(telemetry: Telemetry, exporter: InMemorySpanExporter) -> dict:
    """The resource attributes a span actually leaves with (what a collector sees)."""
    with telemetry.tracer.start_as_current_span("probe"):
        pass
    (span,) = exporter.get_finished_spans()
    return dict(span.resource.attributes)


def make(service_name: str | None = None) -> tuple[Telemetry, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    if service_name is None:
        return Telemetry(span_exporter=exporter), exporter
    return Telemetry(service_name, span_exporter=exporter), exporter


def test_default_service_name_without_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    telemetry, exporter = make()
    try:
        assert exported_resource(telemetry, exporter)["service.name"] == "specserve"
        assert telemetry.resource.attributes["service.name"] == "specserve"
    finally:
        telemetry.shutdown()
    telemetry, exporter = make("specserve-api")
    try:
        assert exported_resource(telemetry, exporter)["service.name"] == "specserve-api"
    finally:
        telemetry.shutdown()


def test_otel_service_name_overrides_ours(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_SERVICE_NAME", "llm-workers-eu")
    telemetry, exporter = make("specserve")
    try:
        assert exported_resource(telemetry, exporter)["service.name"] == "llm-workers-eu"
        assert telemetry.resource.attributes["service.name"] == "llm-workers-eu"
    finally:
        telemetry.shutdown()


def test_otel_resource_attributes_override_ours(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,deployment.environment=staging")
    telemetry, exporter = make()
    try:
        attrs = exported_resource(telemetry, exporter)
        assert attrs["service.name"] == "from-attrs" and attrs["deployment.environment"] == "staging"
    finally:
        telemetry.shutdown()
    # Both set: OTEL_SERVICE_NAME takes precedence, as the specification says.
    clean_env.setenv("OTEL_SERVICE_NAME", "from-service-name")
    telemetry, exporter = make()
    try:
        attrs = exported_resource(telemetry, exporter)
        assert attrs["service.name"] == "from-service-name" and attrs["deployment.environment"] == "staging"
    finally:
        telemetry.shutdown()
