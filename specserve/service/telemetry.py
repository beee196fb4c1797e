"""Metrics (OpenTelemetry, exported as Prometheus text) and per-request traces.

Each Telemetry owns its providers and its Prometheus registry, so several services in one process (tests)
do not collide; nothing is installed globally.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import NoOpTracer, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specserve.queue.consumer import QueueStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
_propagator = TraceContextTextMapPropagator()


@dataclass
class EngineGauges:
    """Latest engine statistics, refreshed by the worker and read at scrape time."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    last_batch_size: int = 0


def build_resource(default_service_name: str) -> Resource:
    """Our service name as a default only: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override it."""
    # Resource.create() lets explicit attributes win over the environment's, so apply the environment last.
    return Resource.create({SERVICE_NAME: default_service_name}).merge(OTELResourceDetector().detect())


@dataclass
class Telemetry:
    service_name: str = "specserve"  # the default service.name; the OTEL_* environment variables win
    otlp_endpoint: str | None = None
    span_exporter: SpanExporter | None = None  # e.g. an in-memory exporter in tests
    engine: EngineGauges = field(default_factory=EngineGauges)
    queue: QueueStats = field(default_factory=lambda: QueueStats(0, 0, 0.0, 0))

    def __post_init__(self) -> None:
        self.resource = resource = build_resource(self.service_name)
        self.registry = CollectorRegistry(auto_describe=True)
        self._reader = PrometheusMetricReader(
            registry=self.registry, disable_target_info=True, scope_info_enabled=False
        )
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[self._reader])
        self.tracer_provider = TracerProvider(resource=resource)
        exporting = False
        if self.span_exporter is not None:
            self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.span_exporter))
            exporting = True
        if self.otlp_endpoint:
            exporting = self._add_otlp(self.otlp_endpoint) or exporting
        # With nowhere to send spans, building them is ~20 us each, several per request on the loop that does
        # everyone's I/O. The no-op tracer still hands on a producer's trace context (its spans are the
        # parent's), so a worker that does export continues the producer's trace.
        self.tracer: Tracer = self.tracer_provider.get_tracer("specserve") if exporting else NoOpTracer()
        m = self.meter_provider.get_meter("specserve")

        def hist(name: str, desc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
            return m.create_histogram(
                name, unit="s", description=desc, explicit_bucket_boundaries_advisory=buckets
            )

        self.ttft = hist("specserve_time_to_first_token", "enqueue to first token")
        self.tpot = hist("specserve_time_per_output_token", "decode time per output token", PER_TOKEN_BUCKETS)
        self.e2e = hist("specserve_e2e_latency", "enqueue to final output written")
        self.queue_wait = hist("specserve_queue_wait", "enqueue to a worker starting the request")
        self.requests = m.create_counter("specserve_requests", description="requests ended, by status")
        self.http_requests = m.create_counter("specserve_http_requests", description="API requests, by route")

        def gauge(name: str, desc: str, read, unit: str = "") -> None:
            m.create_observable_gauge(name, [lambda _o: [Observation(read())]], unit=unit, description=desc)

        def counter(name: str, desc: str, read) -> None:
            m.create_observable_counter(name, [lambda _o: [Observation(read())]], description=desc)

        gauge(
            "specserve_queue_depth",
            "requests waiting in Redis, not yet taken by a worker",
            lambda: self.queue.depth,
        )
        gauge(
            "specserve_queue_pending",
            "requests taken by workers and not yet acknowledged",
            lambda: self.queue.pending,
        )
        gauge("specserve_queue_lag", "age of the oldest waiting request", lambda: self.queue.lag_seconds, "s")
        gauge("specserve_running_requests", "sequences in the running batch", lambda: self.engine.num_running)
        gauge(
            "specserve_waiting_requests",
            "sequences admitted, waiting to run",
            lambda: self.engine.num_waiting,
        )
        gauge(
            "specserve_batch_size", "sequences in the last engine step", lambda: self.engine.last_batch_size
        )
        gauge("specserve_kv_blocks_used", "KV cache blocks in use", lambda: self.engine.kv_blocks_used)
        gauge("specserve_kv_blocks_total", "KV cache blocks in the pool", lambda: self.engine.kv_blocks_total)
        counter(
            "specserve_preemptions", "sequences preempted for KV space", lambda: self.engine.num_preemptions
        )
        counter(
            "specserve_draft_tokens_proposed", "draft tokens proposed", lambda: self.engine.draft_proposed
        )
        counter(
            "specserve_draft_tokens_accepted", "draft tokens accepted", lambda: self.engine.draft_accepted
        )

    def _add_otlp(self, endpoint: str) -> bool:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT set but opentelemetry-exporter-otlp-proto-http is missing"
            )
            return False
        url = (
            endpoint.rstrip("/") + "/v1/traces"
            if not endpoint.rstrip("/").endswith("/v1/traces")
            else endpoint
        )
        self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        return True

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    def shutdown(self) -> None:
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()

    @staticmethod
    def extract(traceparent: str | None, tracestate: str | None = None) -> Context | None:
        """The producer's W3C trace context from a stream entry (None when absent or malformed)."""
        if not traceparent:
            return None
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        return _propagator.extract(carrier)

    @staticmethod
    def inject(context: Context | None = None) -> dict[str, str]:
        carrier: dict[str, str] = {}
        _propagator.inject(carrier, context=context)
        return carrier
