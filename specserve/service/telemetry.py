"""Metrics (Prometheus text), per-request traces, the access log and the periodic engine line.

Each Telemetry owns its providers and its Prometheus registry, so several services in one process (tests)
do not collide; nothing is installed globally.

Metric names. Where a metric means what one of vLLM's means (vllm/v1/metrics/loggers.py and
vllm/v1/spec_decode/metrics.py in vllm-project/vllm), it carries vLLM's exact name with our prefix in place
of theirs: `vllm:num_requests_running` is `specserve:num_requests_running`, with the same `model_name`
label, the same `finished_reason` label on request_success and the same latency buckets. With
`--metrics-prefix vllm` the prefix is theirs too, so a vLLM dashboard or alert works here unedited; with
ours it works after one textual substitution, and nobody has to learn which of our names means which of
theirs. These are prometheus_client metrics in this Telemetry's registry because OpenTelemetry instrument
names cannot hold the `:`. The request phases are vLLM's with our queue in theirs: request_queue_time is
enqueue (into Redis) to the engine starting the request, prefill is from there to the first token, decode
from the first token to the last, inference the two together. `gpu_cache_usage_perc` is vLLM's older name
of `kv_cache_usage_perc`, kept for the dashboards that still read it; `cache_config_info` carries the KV
cache's settings as labels (num_gpu_blocks is the pool's blocks on whatever device holds it). vLLM metrics
we do not mirror: `spec_decode_num_drafts` (EngineStats counts draft tokens, not drafts).

The `specserve_*` names (OpenTelemetry instruments) stay as they were for whoever charts them, and carry
what vLLM has no word for: the Redis queue (depth, pending, oldest waiting entry's age, dead letters, time
from enqueue to a worker's claim), the API's HTTP requests by route and code, and requests ended by status
(failed, cancelled and expired included, which request_success leaves out).

A process exports only what it knows: an API-only process (`engine_metrics=False`) has no engine, so it has
no engine or per-request series at all rather than ones stuck at 0. Queue gauges come from every process that
refreshes them (chart them with max(), not sum()). Token counters and the request histograms are recorded
when a request ends, so their rates trail the tokens by a request's duration.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.context import Context
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import NoOpTracer, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specserve.queue.consumer import QueueStats

log = logging.getLogger(__name__)
access_log = logging.getLogger("specserve.access")
stats_log = logging.getLogger("specserve.stats")
PREFIX = "specserve:"  # stands where vLLM's "vllm:" does
METRICS_PREFIXES = ("specserve", "vllm")  # --metrics-prefix: ours, or vLLM's for its dashboards unedited

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PER_TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# vLLM's buckets, so a histogram_quantile over ours and theirs interpolates over the same edges.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
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
    # method -> (proposed, accepted): the two above by the method that proposed them
    draft_by_method: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    last_batch_size: int = 0
    model_name: str = ""  # empty until the worker's first refresh: nothing engine-side is exported before
    dead_letters: int = 0  # entries in the dead-letter stream (the worker reads it with the engine's stats)
    # Prefix-aware claiming (service/routing.py): requests this worker passed on, was passed, took back.
    routing_passed: int = 0
    routing_received: int = 0
    routing_taken_back: int = 0
    # The fleet-wide suffix tree (service/suffix_fleet.py): other workers' outputs taken, entries skipped
    # as junk, outputs dropped for want of room in the builder's queue.
    suffix_fleet_received: int = 0
    suffix_fleet_junk: int = 0
    suffix_fleet_dropped: int = 0
    cache_config: dict[str, str] = field(default_factory=dict)  # cache_config_info's labels (set at start)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class RequestPhases:
    """Where a finished request's time went, in seconds (vLLM's request_*_time_seconds)."""

    queue: float  # enqueue to the engine starting it
    prefill: float  # engine start to the first token
    decode: float  # first token to the last

    @property
    def inference(self) -> float:
        return self.prefill + self.decode


@dataclass
class Totals:
    """Counts the periodic engine line takes differences of (the Prometheus counters hold the same)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0


class _EngineCollector(Collector):
    """vLLM's scheduler gauges and engine counters, read from the latest EngineStats at scrape time."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.t = telemetry

    def collect(self) -> Iterator[Metric]:
        g = self.t.engine
        if not g.model_name:
            return
        label, prefix = [g.model_name], self.t.prefix

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(prefix + name, doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        yield gauge("num_requests_running", "Number of requests in model execution batches.", g.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", g.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", g.kv_usage)
        yield gauge("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", g.kv_usage)
        if g.cache_config:
            doc = "Information of the LLMEngine CacheConfig"
            info = GaugeMetricFamily(prefix + "cache_config_info", doc, labels=[*g.cache_config])
            info.add_metric(list(g.cache_config.values()), 1)
            yield info
        preempted = "Cumulative number of preemption from the engine."
        yield counter("num_preemptions", preempted, g.num_preemptions)
        yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.", g.draft_proposed)
        yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", g.draft_accepted)
        if g.draft_by_method:
            # the two above by the proposer that drafted them (`auto` may hold several): vLLM has no such
            # counter, so the name is ours
            kinds = (("draft", "Draft tokens"), ("accepted", "Accepted draft tokens"))
            for i, (kind, doc) in enumerate(kinds):
                m = CounterMetricFamily(
                    f"{prefix}spec_decode_num_{kind}_tokens_by_method",
                    f"{doc}, by the speculative method that proposed them.",
                    labels=["model_name", "method"],
                )
                for method, counts in sorted(g.draft_by_method.items()):
                    m.add_metric([*label, method], counts[i])
                yield m
        queries = "Prefix cache queries, in terms of number of queried tokens."
        yield counter("prefix_cache_queries", queries, g.prefix_cache_queries)
        hits = "Prefix cache hits, in terms of number of cached tokens."
        yield counter("prefix_cache_hits", hits, g.prefix_cache_hits)


def cache_config_info(engine: Any) -> dict[str, str]:
    """vLLM's cache_config_info labels for an AsyncLLMEngine: the KV cache's layout, size and reuse."""
    llm = engine.engine
    config = llm.config
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(llm.kv_dtype).removeprefix("torch."),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(llm.block_manager.num_blocks),
        "num_cpu_blocks": "0",  # nothing is swapped out to host memory
    }


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
    engine_metrics: bool = True  # False in an API-only process: it has no engine to report on
    metrics_prefix: str = PREFIX.rstrip(":")  # of the vLLM-named series: ours, or "vllm" (METRICS_PREFIXES)
    # /metrics is read without a key: tenants appear there as digests of their names unless this says so
    tenant_names: bool = False

    def __post_init__(self) -> None:
        if self.metrics_prefix not in METRICS_PREFIXES:
            known = list(METRICS_PREFIXES)
            raise ValueError(f"metrics_prefix: {self.metrics_prefix!r} is not one of {known}")
        self.prefix = self.metrics_prefix + ":"
        self.totals = Totals()
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
        m.create_observable_gauge(
            "specserve_queue_waiting",
            [self._waiting_by_band],
            description="requests in the ready queue, by priority band and tenant (queue/ready.py)",
        )
        self.admitted = m.create_counter(
            "specserve_admitted", description="requests taken from the ready queue, by band and tenant"
        )
        self.refused = m.create_counter(
            "specserve_refused", description="requests refused by an admission limit, by limit and tenant"
        )
        if self.engine_metrics:
            self._engine_instruments(gauge, counter)

    def _waiting_by_band(self, _options: Any) -> list[Observation]:
        return [
            Observation(n, {"band": str(band), "tenant": self.tenant_label(tenant)})
            for (band, tenant), n in self.queue.waiting.items()
        ]

    def _engine_instruments(self, gauge, counter) -> None:
        gauge(
            "specserve_dead_letters",
            "entries in the dead-letter stream (requests given up on)",
            lambda: self.engine.dead_letters,
        )
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
        counter(
            "specserve_prefix_routing_passed",
            "requests this worker passed to a worker warm for their prompt",
            lambda: self.engine.routing_passed,
        )
        counter(
            "specserve_prefix_routing_received",
            "requests other workers passed to this one",
            lambda: self.engine.routing_received,
        )
        counter(
            "specserve_prefix_routing_taken_back",
            "passed requests the warm worker did not claim in time, run here after all",
            lambda: self.engine.routing_taken_back,
        )
        counter(
            "specserve_suffix_fleet_received",
            "other workers' finished outputs taken into this worker's suffix tree",
            lambda: self.engine.suffix_fleet_received,
        )
        counter(
            "specserve_suffix_fleet_junk",
            "entries of the suffix stream skipped as not an output",
            lambda: self.engine.suffix_fleet_junk,
        )
        counter(
            "specserve_suffix_fleet_dropped",
            "other workers' outputs dropped, the suffix tree's builder behind",
            lambda: self.engine.suffix_fleet_dropped,
        )
        self.registry.register(_EngineCollector(self))
        reg, model, prefix = self.registry, ["model_name"], self.prefix
        self.vllm_prompt_tokens = Counter(
            prefix + "prompt_tokens", "Number of prefill tokens processed.", model, registry=reg
        )
        self.vllm_generation_tokens = Counter(
            prefix + "generation_tokens", "Number of generation tokens processed.", model, registry=reg
        )
        self.vllm_request_success = Counter(
            prefix + "request_success",
            "Count of successfully processed requests.",
            [*model, "finished_reason"],
            registry=reg,
        )

        def vhist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, model, registry=reg, buckets=buckets)

        self.vllm_ttft = vhist(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS
        )
        self.vllm_tpot = vhist(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            VLLM_TPOT_BUCKETS,
        )
        self.vllm_e2e = vhist(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )
        self.vllm_prompt_len = vhist(
            "request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_COUNT_BUCKETS
        )
        self.vllm_generation_len = vhist(
            "request_generation_tokens", "Number of generation tokens processed.", TOKEN_COUNT_BUCKETS
        )
        self.vllm_itl = vhist(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", VLLM_TPOT_BUCKETS
        )
        phase = "Histogram of time spent in {} phase for request."
        self.vllm_phases = {
            name: vhist(f"request_{name}_time_seconds", phase.format(doc), VLLM_REQUEST_LATENCY_BUCKETS)
            for name, doc in (
                ("queue", "WAITING"),
                ("prefill", "PREFILL"),
                ("decode", "DECODE"),
                ("inference", "RUNNING"),
            )
        }

    def request_ended(
        self,
        model_name: str,
        status: str,
        finish_reason: str | None,
        usage: dict | None,
        e2e: float,
        ttft: float | None,
        tpot: float | None,
        phases: RequestPhases | None = None,
    ) -> None:
        """One request that ran is over (its final entry written): every per-request series at once."""
        self.requests.add(1, {"status": status})
        self.e2e.record(e2e)
        if tpot is not None:
            self.tpot.record(tpot)
        if not self.engine_metrics:
            return
        prompt = int(usage.get("prompt_tokens", 0)) if usage else 0
        generated = int(usage.get("completion_tokens", 0)) if usage else 0
        self.totals.prompt_tokens += prompt
        self.totals.generation_tokens += generated
        self.vllm_prompt_tokens.labels(model_name).inc(prompt)
        self.vllm_generation_tokens.labels(model_name).inc(generated)
        if status != "finished":  # vLLM's request_success counts requests that finished; ours by status above
            return
        self.vllm_request_success.labels(model_name, finish_reason or "stop").inc()
        self.vllm_e2e.labels(model_name).observe(e2e)
        if ttft is not None:
            self.vllm_ttft.labels(model_name).observe(ttft)
        if tpot is not None:
            self.vllm_tpot.labels(model_name).observe(tpot)
        self.vllm_prompt_len.labels(model_name).observe(prompt)
        self.vllm_generation_len.labels(model_name).observe(generated)
        if phases is not None:
            for name, seconds in (
                ("queue", phases.queue),
                ("prefill", phases.prefill),
                ("decode", phases.decode),
                ("inference", phases.inference),
            ):
                self.vllm_phases[name].labels(model_name).observe(seconds)

    def inter_token(self, model_name: str, seconds: float) -> None:
        """Time between two of a request's outputs (one engine step's tokens: several with speculation)."""
        if self.engine_metrics:
            self.vllm_itl.labels(model_name).observe(seconds)

    def tenant_label(self, tenant: str | None) -> str:
        """A tenant as the metrics show it: '' for none; else its name where the operator allows it, or a
        digest that tells tenants apart without naming them to whoever can read /metrics."""
        if not tenant or self.tenant_names:
            return tenant or ""
        return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:12]

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


def access_line(
    request_id: str,
    tenant: str | None,
    status: str,
    finish_reason: str | None,
    usage: dict | None,
    latency_s: float,
) -> str:
    """One request's access-log line, key=value pairs (logfmt) so log pipelines split it without a regex."""
    prompt = usage.get("prompt_tokens", 0) if usage else 0
    completion = usage.get("completion_tokens", 0) if usage else 0
    return (
        f"request_id={request_id} tenant={tenant or '-'} status={status} "
        f"finish_reason={finish_reason or '-'} prompt_tokens={prompt} completion_tokens={completion} "
        f"latency_s={latency_s:.3f}"
    )


class StatsLine:
    """vLLM's periodic engine line: throughput since the previous line, the batch, KV use, and (with
    speculation on) the share of draft tokens accepted over the interval."""

    def __init__(self, telemetry: Telemetry, clock: Callable[[], float] = time.monotonic) -> None:
        self.t = telemetry
        self.clock = clock
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[float, int, int, int, int]:
        t = self.t
        return (
            self.clock(),
            t.totals.prompt_tokens,
            t.totals.generation_tokens,
            t.engine.draft_proposed,
            t.engine.draft_accepted,
        )

    def line(self) -> tuple[str, bool]:
        """(the line, whether anything happened since the previous one: an idle engine logs at DEBUG)."""
        now = self._snapshot()
        (t0, p0, g0, d0, a0), (t1, p1, g1, d1, a1) = self._last, now
        self._last = now
        dt = max(t1 - t0, 1e-9)
        e, q = self.t.engine, self.t.queue
        text = (
            f"Avg prompt throughput: {(p1 - p0) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(g1 - g0) / dt:.1f} tokens/s, "
            f"Running: {e.num_running} reqs, Waiting: {e.num_waiting} reqs, "
            f"KV cache usage: {100 * e.kv_usage:.1f}%, "
            f"Queued in Redis: {q.depth} (oldest {q.lag_seconds:.1f}s)"
        )
        if d1 > d0:
            rate = 100 * (a1 - a0) / (d1 - d0)
            text += f", Draft acceptance rate: {rate:.1f}% ({a1 - a0}/{d1 - d0} tokens)"
        busy = p1 > p0 or g1 > g0 or e.num_running > 0 or e.num_waiting > 0 or q.depth > 0
        return text, busy


async def log_stats_every(telemetry: Telemetry, interval: float) -> None:
    """Log the engine line every `interval` s until cancelled."""
    stats = StatsLine(telemetry)
    while True:
        await asyncio.sleep(interval)
        text, busy = stats.line()
        stats_log.log(logging.INFO if busy else logging.DEBUG, "%s", text)
