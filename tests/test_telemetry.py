"""Telemetry's OpenTelemetry resource: our service name is a default only; the OTEL_* variables win."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
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


def test_without_an_exporter_no_span_is_built_but_the_producers_trace_context_passes_through() -> None:
    """The API's enqueue span as the service builds it: with nowhere to send spans, what reaches the request
    entry is the producer's own traceparent (so an exporting worker continues the producer's trace), and
    nothing when the producer sent none (the worker then starts a trace of its own)."""
    producer = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    telemetry = Telemetry()
    try:
        with telemetry.tracer.start_as_current_span("enqueue", context=Telemetry.extract(producer)) as span:
            assert not span.is_recording()
            assert Telemetry.inject(trace.set_span_in_context(span)) == {"traceparent": producer}
        with telemetry.tracer.start_as_current_span("enqueue", context=Telemetry.extract(None)) as span:
            assert Telemetry.inject(trace.set_span_in_context(span)) == {}
    finally:
        telemetry.shutdown()
    exporter = InMemorySpanExporter()
    exporting = Telemetry(span_exporter=exporter)
    try:
        with exporting.tracer.start_as_current_span("enqueue", context=Telemetry.extract(producer)) as span:
            carried = Telemetry.inject(trace.set_span_in_context(span))["traceparent"]
        (recorded,) = exporter.get_finished_spans()
        assert recorded.parent.span_id == 0x00F067AA0BA902B7
        assert carried.split("-")[1] == producer.split("-")[1] and carried != producer  # same trace, our span
    finally:
        exporting.shutdown()


def test_queue_metrics_per_band_and_tenant() -> None:
    """The shared queue's own metrics: what waits in the ready queue, what was admitted and
    what a limit refused, each by band or limit and tenant (named, as the operator allowed)."""
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.queue.consumer import QueueStats

    telemetry = Telemetry(tenant_names=True)
    try:
        telemetry.queue = QueueStats(3, 0, 0.5, 1, {(0, "a"): 2, (10, ""): 1})
        telemetry.admitted.add(1, {"band": "0", "tenant": "a"})
        telemetry.refused.add(2, {"limit": "tenant_max_queued", "tenant": "b"})
        text = telemetry.metrics_text().decode()
    finally:
        telemetry.shutdown()
    samples = {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k in ("band", "tenant", "limit"))),
        ): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("specserve_queue_waiting", (("band", "0"), ("tenant", "a")))] == 2
    assert samples[("specserve_queue_waiting", (("band", "10"), ("tenant", "")))] == 1
    assert samples[("specserve_admitted_total", (("band", "0"), ("tenant", "a")))] == 1
    assert samples[("specserve_refused_total", (("limit", "tenant_max_queued"), ("tenant", "b")))] == 2


def test_metrics_name_no_tenant_unless_the_operator_allows_it() -> None:
    """/metrics takes no key: by default a tenant shows as a digest of its name, which tells tenants apart
    without telling anyone who they are."""
    from specserve.queue.consumer import QueueStats

    telemetry = Telemetry()
    try:
        telemetry.queue = QueueStats(3, 0, 0.5, 1, {(0, "acme-secret-customer"): 2, (10, ""): 1})
        telemetry.refused.add(
            1, {"limit": "tenant_max_queued", "tenant": telemetry.tenant_label("acme-secret-customer")}
        )
        text = telemetry.metrics_text().decode()
    finally:
        telemetry.shutdown()
    assert "acme-secret-customer" not in text
    digest = telemetry.tenant_label("acme-secret-customer")
    assert digest.startswith("t-") and digest == Telemetry().tenant_label("acme-secret-customer")
    assert f'tenant="{digest}"' in text and telemetry.tenant_label(None) == ""
