"""Service configuration: every setting is an environment variable and a CLI flag (Helm's names)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specserve.queue.client import Durability, Limits
from specserve.queue.consumer import ConsumerConfig
from specserve.queue.keys import DEFAULT_PREFIX, Keys
from specserve.queue.ready import FairShare
from specserve.queue.routing import RoutingConfig


@dataclass(frozen=True)
class HttpLimits:
    """What the API's and the health server's HTTP listeners put up with (service/http.py `serve`)."""

    max_connections: int = 1000  # open client connections; more are answered 503 and closed at once
    header_timeout_s: float = 15.0  # connect (or a kept-alive connection's next first byte) to full headers
    body_timeout_s: float = 60.0  # to read a whole request body
    keepalive_timeout_s: float = 75.0  # an idle kept-alive connection; above common proxies' 60 s reuse


@dataclass
class ApiSettings:
    """What the API (service/gateway.py) needs besides its Redis client."""

    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 200_000
    api_keys: list[str] = field(default_factory=list)  # `name:token` or bare tokens (http.parse_api_keys)
    key_priority_floor: int | None = None  # the most urgent priority a key may ask for, unless its own says
    served_models: list[str] = field(default_factory=list)  # names this API answers for besides live workers'
    model_stale_s: float = 600.0  # how long the word of a worker that gives no ttl_s for it holds
    max_file_bytes: int = 20 << 20  # an uploaded batch file (held in Redis for the request TTL)
    tool_call_parser: str = "hermes"  # how tool_choice "auto" reads calls out of text (openai/tool_calls.py)
    # Grammars are checked in this many child processes (engine/prepare.py GrammarPool), each job within
    # the budget; vLLM's max_logprobs bounds logprobs and prompt_logprobs.
    prepare_workers: int = 2
    prepare_timeout_s: float = 2.0
    max_logprobs: int = 20
    # n choices each with `logprobs` alternatives a token (and the prompt's, for the first): every row of a
    # step sorts the vocabulary for them and the answer carries n x k of them a token
    max_total_logprobs: int = 100


_LIMITS, _API, _QUEUE = HttpLimits(), ApiSettings(), ConsumerConfig()
# openai/tool_calls.py TOOL_PARSERS' names (that module imports the HTTP layer, which imports this one)
TOOL_CALL_PARSERS = ["hermes", "llama3_json"]


@dataclass(frozen=True)
class WorkerConfig:
    """What the worker (service/worker.py) needs besides its engine and Redis client. The queue's settings
    default to the queue layer's own (queue/consumer.py ConsumerConfig), the limits to the API's."""

    ttl_s: float = _QUEUE.ttl_ms / 1000
    claim_timeout_s: float = _QUEUE.claim_timeout_ms / 1000
    max_deliveries: int = _QUEUE.max_deliveries
    cancel_poll_s: float = 0.1
    trim_interval_s: float = 30.0
    stats_interval_s: float = 1.0
    # Raw XADDs skip the API's limits, so the worker applies the same ones before it parses or tokenizes.
    max_body_chars: int = _API.max_body_bytes
    max_prompt_chars: int = _API.max_prompt_chars
    dead_letter_maxlen: int = _QUEUE.dead_maxlen
    dead_letter_ttl_s: float = _QUEUE.dead_ttl_ms / 1000
    reply_maxlen: int = 10_000  # a producer's reply stream is trimmed (MAXLEN ~) to about this many entries
    access_log: bool = False  # one log line per request that ends (logger specserve.access)
    # the suffix proposer also drafts from the other workers' finished outputs (service/suffix_fleet.py)
    suffix_fleet: bool = True
    routing: RoutingConfig = RoutingConfig()  # prefix-aware claiming (queue/routing.py)
    fair_share: FairShare = FairShare()  # the ready queue's bands and round robin (queue/ready.py)
    limits: Limits = Limits()  # the API's admission limits, applied to raw XADDs as they are sorted in
    served_model_names: tuple[str, ...] = ()  # the model's names, primary first (none: the engine's)
    # Tokenizing, bad words and grammar compiles run in this many threads (engine/prepare.py PreparePool),
    # each request within the budget
    prepare_workers: int = _API.prepare_workers
    prepare_timeout_s: float = _API.prepare_timeout_s
    max_logprobs: int = _API.max_logprobs

    @property
    def heartbeat_s(self) -> float:
        return self.claim_timeout_s / 4

    @property
    def model_ttl_s(self) -> float:
        """How long the worker's word that it serves its model holds (GET /v1/models): two heartbeats, so
        one late heartbeat does not drop a live model, and a stopped worker's model is gone soon after."""
        return 2 * self.heartbeat_s

    @property
    def reclaim_s(self) -> float:
        return min(5.0, self.claim_timeout_s / 2)

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            ttl_ms=int(self.ttl_s * 1000),
            max_deliveries=self.max_deliveries,
            claim_timeout_ms=int(self.claim_timeout_s * 1000),
            dead_maxlen=self.dead_letter_maxlen,
            dead_ttl_ms=int(self.dead_letter_ttl_s * 1000),
        )


_WORKER = WorkerConfig()


def _opt(env: str | None, default: Any, help: str, flag: str | None = None, **kw: Any) -> Any:
    return field(default=default, metadata={"env": env, "help": help, "flag": flag, **kw})


@dataclass
class ServiceConfig:
    redis_url: str | None = _opt(
        "REDIS_URL", None, "Redis/Valkey URL (redis:// or rediss://); none: embedded"
    )
    redis_seed_nodes: str | None = _opt(
        "SPECSERVE_REDIS_SEED_NODES",
        None,
        "more nodes of a Redis Cluster (host:port, space- or comma-separated) to find it by when REDIS_URL's "
        "node is down; same credentials and TLS as REDIS_URL",
        nargs="+",
    )
    prefix: str = _opt("SPECSERVE_PREFIX", DEFAULT_PREFIX, "prefix of every Redis key")
    queue_shards: int = _opt(
        "SPECSERVE_QUEUE_SHARDS",
        1,
        "request streams the queue is split into, by CRC-32 of the request id (docs/wire-format.md); on a "
        "cluster each shard's keys share a slot of their own, so the shards spread over its masters; every "
        "worker and producer of a fleet must use the same value (the first to start records it)",
    )
    model: str | None = _opt(
        "SPECSERVE_MODEL",
        None,
        "HF model dir, GGUF file or Hugging Face id (org/name; HF_TOKEN, HF_HOME, HF_HUB_OFFLINE apply) "
        "(default: demo SmolLM2-135M)",
    )
    served_model_name: str | None = _opt(
        "SPECSERVE_SERVED_MODEL_NAME",
        None,
        "names clients give in `model` (vLLM's --served-model-name; several, space- or comma-separated: the "
        "first names the model in /v1/models' first entry and metrics' model_name label; default: --model)",
        nargs="+",
    )
    revision: str | None = _opt(
        "SPECSERVE_REVISION", None, "branch, tag or commit of a Hugging Face model id (default: main)"
    )
    dtype: str = _opt(
        "SPECSERVE_DTYPE",
        "auto",
        "weights/activations dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    device: str = _opt("SPECSERVE_DEVICE", "auto", "where the model runs", choices=["auto", "cpu", "cuda"])
    speculative_method: str = _opt(
        "SPECSERVE_SPEC_METHOD",
        "ngram",
        "speculative decoding (n-gram by default: requests' `auto` drafts only where it pays)",
        choices=["none", "ngram", "draft_model", "suffix", "suffix,ngram", "eagle3", "eagle3,ngram"],
    )
    speculative_model: str | None = _opt(
        "SPECSERVE_SPEC_MODEL",
        None,
        "draft model (method draft_model), or an EAGLE-3 head's directory in speculators' format (eagle3)",
    )
    num_speculative_tokens: int | None = _opt(
        "SPECSERVE_NUM_SPEC_TOKENS",
        None,
        "draft tokens per step (upper bound); unset: 16 with suffix (its tree depth, vLLM's default), else 4",
        kind=int,
    )
    speculative_token_tree: str | None = _opt(
        "SPECSERVE_SPEC_TOKEN_TREE",
        None,
        "eagle3 drafts trees: vLLM's list of paths ('[(0,), (1,), (0, 0)]') or "
        "\"{'depth': 3, 'branching': 2}\"; unset: chains",
    )
    # The engine's knobs (vLLM's names); unset, the engine's own default (engine/config.py) applies.
    max_num_seqs: int | None = _opt("SPECSERVE_MAX_NUM_SEQS", None, "most sequences in a batch", kind=int)
    kv_cache_bytes: int | None = _opt(
        "SPECSERVE_KV_CACHE_BYTES",
        None,
        "KV cache size in bytes (unset: CUDA, gpu_memory_utilization of the device; CPU, a tenth of the "
        "memory limit within 0.25-8 GiB)",
        kind=int,
    )
    gpu_memory_utilization: float | None = _opt(
        "SPECSERVE_GPU_MEMORY_UTILIZATION",
        None,
        "CUDA: share of the device's memory the engine may fill, weights and KV cache (0.9)",
        kind=float,
    )
    max_num_batched_tokens: int | None = _opt(
        "SPECSERVE_MAX_NUM_BATCHED_TOKENS", None, "most tokens in one engine step (prefill chunks)", kind=int
    )
    block_size: int | None = _opt("SPECSERVE_BLOCK_SIZE", None, "tokens per KV cache block", kind=int)
    max_model_len: int | None = _opt(
        "SPECSERVE_MAX_MODEL_LEN", None, "longest sequence (prompt + output) in tokens", kind=int
    )
    enable_chunked_prefill: bool | None = _opt(
        "SPECSERVE_ENABLE_CHUNKED_PREFILL", None, "split long prompts over steps (on by default)", kind=bool
    )
    # The service bounds it (the engine's own default, for offline batches, does not): with 16 streams in
    # flight, arrivals' prefill made the p99 of inter-token latency 266-451 ms against vLLM's 222-230; at
    # 128 it was 187-194 ms at the same throughput, and 256 cut less (bench/serve_peer.py, README).
    prefill_tokens_beside_decode: int = _opt(
        "SPECSERVE_PREFILL_TOKENS_BESIDE_DECODE",
        128,
        "prompt tokens a step computes while other sequences decode (0: up to max_num_batched_tokens); "
        "bounds the stall that arrivals' prefill puts between two tokens of a stream",
        kind=int,
    )
    enable_prefix_caching: bool | None = _opt(
        "SPECSERVE_ENABLE_PREFIX_CACHING",
        None,
        "reuse the KV of prompt prefixes already computed (on by default)",
        kind=bool,
    )
    prompt_lookup_max: int | None = _opt(
        "SPECSERVE_PROMPT_LOOKUP_MAX", None, "longest n-gram the ngram method matches", kind=int
    )
    quantization: str | None = _opt(
        "SPECSERVE_QUANTIZATION",
        None,
        "quantized decoder matrices (default auto: keep a GGUF's 4-bit blocks as they are where the int "
        "kernels pay and dequantize the other types, never re-quantizing; none: dequantize; int8/int4: "
        "weight-only, quantized on load; w8a8/w4a8: the activations quantized too, per 32 inputs, for "
        "integer SIMD products on AVX512-VNNI or AVX2)",
        choices=[None, "auto", "none", "int8", "int4", "w8a8", "w4a8"],
    )
    batch_invariant: bool | None = _opt(
        "SPECSERVE_BATCH_INVARIANT",
        None,
        "a request's tokens and logprobs do not depend on its batch mates, chunking, prefix hits or "
        "speculation: one matmul form per matrix at every step size (off by default: it costs several times "
        "the throughput of forms picked by the step's rows, docs/benchmarks.md); bf16 needs a CPU with "
        "AVX512-BF16, float32 holds on AVX2",
        kind=bool,
    )
    enforce_eager: bool | None = _opt(
        "SPECSERVE_ENFORCE_EAGER",
        None,
        "run every step eagerly (vLLM's flag): no CUDA graphs for the decode and verify steps, which are "
        "captured at start on CUDA only (off by default)",
        kind=bool,
    )
    adaptive_threads: bool | None = _opt(
        "SPECSERVE_ADAPTIVE_THREADS",
        None,
        "CPU: pick the thread team by trial between the CPU budget and one thread fewer, keeping the faster "
        "(a busy neighbour on a core can make the smaller team faster); on by default, never with tensor "
        "parallelism, batch_invariant or OMP_NUM_THREADS set",
        kind=bool,
    )
    tensor_parallel_size: int | None = _opt(
        "SPECSERVE_TENSOR_PARALLEL_SIZE",
        None,
        "ranks one worker's model is split over (vLLM's name; default 1): one GPU each on CUDA, processes "
        "sharing the cores on CPU; the model's heads and MLP must divide by it",
        kind=int,
    )
    chat_template: str | None = _opt(
        "SPECSERVE_CHAT_TEMPLATE",
        None,
        "a Jinja chat template, or a file holding one (vLLM's flag), replacing the model's own; a model "
        "with no template of its own and none given here answers chat requests with a 400",
    )
    # The service orders by priority (the engine's own default is vLLM's fcfs): requests are band 0 unless
    # they say otherwise, which orders them as fcfs does, and Batch API lines (band 10) then stay out of the
    # way of interactive ones (bench/shared_queue.py).
    scheduling_policy: str = _opt(
        "SPECSERVE_SCHEDULING_POLICY",
        "priority",
        "order inside the engine: priority (lower `priority` first; a better arrival may preempt worse "
        "sequences when slots or KV blocks are short, and worse bands share background_tokens a step while "
        "better work runs) or fcfs (arrival order, priorities ignored)",
        choices=["fcfs", "priority"],
    )
    background_tokens: int | None = _opt(
        "SPECSERVE_BACKGROUND_TOKENS",
        None,
        "under the priority policy, tokens a step gives sequences of worse bands while better ones run "
        "(the rest pause, keeping their KV; default 1)",
        kind=int,
    )
    attention_backend: str | None = _opt(
        "SPECSERVE_ATTENTION_BACKEND",
        None,
        "attention kernels (default auto: Triton on CUDA, the C++ kernel on CPU)",
        choices=[None, "auto", "torch", "cpu", "triton"],
    )
    kv_cache_dtype: str | None = _opt(
        "SPECSERVE_KV_CACHE_DTYPE",
        None,
        "the KV cache's dtype (default auto: the model's; bfloat16 under a float32 model on CPU holds twice "
        "the tokens and reads half the bytes, K and V rounded to bfloat16)",
        choices=[None, "auto", "bfloat16"],
    )
    host: str = _opt("SPECSERVE_HOST", "127.0.0.1", "API bind address (0.0.0.0 in containers)")
    port: int = _opt("SPECSERVE_PORT", 8000, "API port")
    health_port: int = _opt("SPECSERVE_HEALTH_PORT", 8001, "worker's /healthz /readyz /metrics port (0: off)")
    api_keys: str | None = _opt(
        "SPECSERVE_API_KEYS", None, "comma-separated bearer tokens, `tenant:token` or bare (none: no auth)"
    )
    api_keys_file: str | None = _opt(
        "SPECSERVE_API_KEYS_FILE", None, "file with one bearer token a line (`tenant:token` or a bare token)"
    )
    key_priority_floor: int | None = _opt(
        "SPECSERVE_KEY_PRIORITY_FLOOR",
        None,
        "the most urgent priority a request made with an API key may ask for (lower runs sooner; a key entry "
        "`tenant@N:token` sets its own; unset: any)",
        kind=int,
    )
    allow_unauthenticated: bool = _opt(
        "SPECSERVE_ALLOW_UNAUTHENTICATED",
        False,
        "let the API run with no keys on a non-loopback address (it refuses to otherwise)",
    )
    drain_timeout: float = _opt(
        "SPECSERVE_DRAIN_TIMEOUT", 30.0, "seconds to finish in-flight work on SIGTERM"
    )
    metrics_prefix: str = _opt(
        "SPECSERVE_METRICS_PREFIX",
        "specserve",
        "prefix of the metrics named as vLLM's (vllm: a vLLM dashboard reads them unedited)",
        choices=["specserve", "vllm"],  # service/telemetry.py METRICS_PREFIXES
    )
    metrics_tenant_names: bool = _opt(
        "SPECSERVE_METRICS_TENANT_NAMES",
        False,
        "label the queue's metrics with tenants' names (off: a digest of each, since /metrics takes no key)",
    )
    otlp_endpoint: str | None = _opt("OTEL_EXPORTER_OTLP_ENDPOINT", None, "OTLP/HTTP endpoint for traces")
    # Beyond the chart's surface: tuning with sane defaults.
    data_dir: str = _opt("SPECSERVE_DATA_DIR", ".specserve/valkey", "embedded server's data folder")
    result_ttl: float = _opt("SPECSERVE_RESULT_TTL", _WORKER.ttl_s, "seconds every per-request key lives")
    claim_timeout: float = _opt(
        "SPECSERVE_CLAIM_TIMEOUT",
        _WORKER.claim_timeout_s,
        "idle seconds before a dead worker's work is taken over",
    )
    max_deliveries: int = _opt(
        "SPECSERVE_MAX_DELIVERIES", _WORKER.max_deliveries, "deliveries before the dead-letter stream"
    )
    max_body_bytes: int = _opt("SPECSERVE_MAX_BODY_BYTES", _API.max_body_bytes, "largest request body")
    max_prompt_chars: int = _opt(
        "SPECSERVE_MAX_PROMPT_CHARS", _API.max_prompt_chars, "longest prompt the API (and a worker) accepts"
    )
    max_connections: int = _opt(
        "SPECSERVE_MAX_CONNECTIONS",
        _LIMITS.max_connections,
        "open HTTP connections; more are answered 503 and closed",
    )
    header_timeout: float = _opt(
        "SPECSERVE_HEADER_TIMEOUT", _LIMITS.header_timeout_s, "seconds for a client to send request headers"
    )
    body_timeout: float = _opt(
        "SPECSERVE_BODY_TIMEOUT", _LIMITS.body_timeout_s, "seconds for a client to send a request body"
    )
    keepalive_timeout: float = _opt(
        "SPECSERVE_KEEPALIVE_TIMEOUT",
        _LIMITS.keepalive_timeout_s,
        "seconds an idle HTTP connection stays open",
    )
    embedded_maxmemory: str = _opt(
        "SPECSERVE_EMBEDDED_MAXMEMORY", "1gb", "embedded server's maxmemory (noeviction; 0: no limit)"
    )
    dead_letter_maxlen: int = _opt(
        "SPECSERVE_DEAD_LETTER_MAXLEN",
        _WORKER.dead_letter_maxlen,
        "dead letters kept at most (oldest trimmed first)",
    )
    dead_letter_ttl: float = _opt(
        "SPECSERVE_DEAD_LETTER_TTL", _WORKER.dead_letter_ttl_s, "seconds a dead letter is kept"
    )
    max_file_bytes: int = _opt(
        "SPECSERVE_MAX_FILE_BYTES", _API.max_file_bytes, "largest file for the Batch API (kept in Redis)"
    )
    tool_call_parser: str = _opt(
        "SPECSERVE_TOOL_CALL_PARSER",
        _API.tool_call_parser,
        "how tool_choice auto reads a chat answer's tool calls (vLLM's --tool-call-parser; hermes: "
        "<tool_call>{...}</tool_call>, Qwen's and Hermes' format; llama3_json: Llama 3.x's JSON)",
        choices=TOOL_CALL_PARSERS,
    )
    durable_enqueue: int = _opt(
        "SPECSERVE_DURABLE_ENQUEUE",
        0,
        "replicas that must hold an enqueue (WAIT) before it is accepted, so a failover cannot lose it; "
        "fewer in time: 503, retry with the same id (0: off)",
    )
    durable_enqueue_timeout: float = _opt(
        "SPECSERVE_DURABLE_ENQUEUE_TIMEOUT", 1.0, "seconds an enqueue waits for its replicas"
    )
    prepare_workers: int = _opt(
        "SPECSERVE_PREPARE_WORKERS",
        _API.prepare_workers,
        "requests prepared at once off the event loop and the step thread: grammar checks (API, child "
        "processes), tokenizing, bad words and grammar compiles (worker, threads)",
    )
    prepare_timeout: float = _opt(
        "SPECSERVE_PREPARE_TIMEOUT",
        _API.prepare_timeout_s,
        "CPU seconds one request's preparation may spend (time waited for a core is not counted, up to 30 "
        "times this); past it the request is refused naming the field (structured_outputs, tools, bad_words, "
        "prompt, messages)",
    )
    max_logprobs: int = _opt(
        "SPECSERVE_MAX_LOGPROBS",
        _API.max_logprobs,
        "most alternatives logprobs and prompt_logprobs may ask for (vLLM's --max-logprobs)",
    )
    max_total_logprobs: int = _opt(
        "SPECSERVE_MAX_TOTAL_LOGPROBS",
        _API.max_total_logprobs,
        "most n x max(logprobs, prompt_logprobs) one request may ask for; more is a 400 naming n",
    )
    max_backlog: int = _opt(
        "SPECSERVE_MAX_BACKLOG", 0, "requests waiting for a worker, all tenants; more get 429 (0: no cap)"
    )
    tenant_max_queued: int = _opt(
        "SPECSERVE_TENANT_MAX_QUEUED", 0, "requests one API key may have waiting; more get 429 (0: no cap)"
    )
    tenant_tokens_per_minute: int = _opt(
        "SPECSERVE_TENANT_TOKENS_PER_MINUTE",
        0,
        "tokens (max_tokens asked) one API key may ask for a minute; more get 429 (0: no cap)",
    )
    default_tenant: str = _opt(
        "SPECSERVE_DEFAULT_TENANT",
        Limits.default_tenant,
        "the tenant whose limits (waiting cap, tokens per minute) a raw XADD naming no tenant counts "
        "against; '~' (no API key's tenant can be named so) gives such entries a quota of their own; "
        "empty: none",
    )
    fair_share_quantum: int = _opt(
        "SPECSERVE_FAIR_SHARE_QUANTUM",
        _WORKER.fair_share.quantum,
        "tokens of credit a tenant gains each round of the ready queue's round robin (queue/ready.py)",
    )
    oldest_every: int = _opt(
        "SPECSERVE_OLDEST_EVERY",
        _WORKER.fair_share.oldest_every,
        "every Nth admission takes the longest-waiting request, whatever its priority: the starvation "
        "bound (0: off)",
    )
    reply_maxlen: int = _opt(
        "SPECSERVE_REPLY_MAXLEN",
        _WORKER.reply_maxlen,
        "entries a reply stream keeps (about; oldest first out)",
    )
    prefix_routing: bool = _opt(
        "SPECSERVE_PREFIX_ROUTING",
        _WORKER.routing.enabled,
        "pass a request to a worker that holds its prompt's prefix (queue/routing.py)",
        kind=bool,
    )
    prefix_routing_wait_ms: int = _opt(
        "SPECSERVE_PREFIX_ROUTING_WAIT_MS",
        _WORKER.routing.wait_ms,
        "how long a passed request waits for the warm worker before the passer runs it",
        kind=int,
    )
    suffix_fleet: bool = _opt(
        "SPECSERVE_SUFFIX_FLEET",
        _WORKER.suffix_fleet,
        "with --speculative-method suffix: share finished outputs with the other workers of the model "
        "through Redis, and draft from theirs (service/suffix_fleet.py)",
        kind=bool,
    )
    worker_name: str | None = _opt("SPECSERVE_WORKER_NAME", None, "consumer name (default host-pid)")
    access_log: bool = _opt(
        "SPECSERVE_ACCESS_LOG",
        False,
        "log a line per request that ends: id, tenant, status, tokens, latency (logger specserve.access)",
    )
    log_stats_interval: float = _opt(
        "SPECSERVE_LOG_STATS_INTERVAL",
        10.0,
        "seconds between engine lines: throughput, running/waiting, KV use, draft acceptance (0: off)",
    )

    def __post_init__(self) -> None:
        for method in ("draft_model", "eagle3"):
            if method in self.speculative_method.split(",") and not self.speculative_model:
                raise ValueError(f"--speculative-method {method} needs --speculative-model")
        limits = ("max_connections", "header_timeout", "body_timeout", "keepalive_timeout")
        checked = ("dead_letter_maxlen", "dead_letter_ttl", "reply_maxlen", "max_file_bytes")
        for name in (*limits, *checked, "prepare_workers", "prepare_timeout", "queue_shards"):
            if not getattr(self, name) > 0:  # also false for NaN
                raise ValueError(f"{_env_of(name)}: must be positive")
        if self.max_logprobs < 0:
            raise ValueError(f"{_env_of('max_logprobs')}: must be 0 or positive")
        if self.max_total_logprobs < 0:
            raise ValueError(f"{_env_of('max_total_logprobs')}: must be 0 or positive")
        if not self.fair_share_quantum > 0:
            raise ValueError(f"{_env_of('fair_share_quantum')}: must be positive")
        limits = ("max_backlog", "tenant_max_queued", "tenant_tokens_per_minute", "oldest_every")
        for name in (*limits, "log_stats_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_env_of(name)}: must be 0 (no limit) or positive")
        # the engine's own checks come after the model has loaded: these fail before it starts to
        for name in (*_ENGINE_KNOBS, "prompt_lookup_max", "num_speculative_tokens"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"{_env_of(name)}: must be positive")

    @property
    def consumer_name(self) -> str:
        return self.worker_name or f"{socket.gethostname()}-{os.getpid()}"

    def engine_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "model": self.model,  # None: the engine serves the demo SmolLM2-135M-Instruct
            "dtype": self.dtype,
            "device": self.device,
            "speculative_config": self.speculative_config(),
        }
        for name in _ENGINE_KNOBS:
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw

    def seed_nodes(self) -> list[str]:
        return (self.redis_seed_nodes or "").replace(",", " ").split()

    def served_model_names(self) -> list[str]:
        """The names the model is served under, primary first: --served-model-name, else --model."""
        names = (self.served_model_name or "").replace(",", " ").split()
        return names or ([self.model] if self.model else [])

    def queue_keys(self, cluster: bool = False) -> Keys:
        """The names of the fleet's keys (queue/keys.py); `server_keys` tags them once the server is known."""
        return Keys(self.prefix, cluster=cluster, shards=self.queue_shards)

    def keys_list(self) -> list[str]:
        keys = [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]
        if self.api_keys_file:
            text = Path(self.api_keys_file).read_text()
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        return keys

    def api_settings(self, served_models: list[str]) -> ApiSettings:
        return ApiSettings(
            max_body_bytes=self.max_body_bytes,
            max_prompt_chars=self.max_prompt_chars,
            api_keys=self.keys_list(),
            key_priority_floor=self.key_priority_floor,
            served_models=served_models,
            max_file_bytes=self.max_file_bytes,
            tool_call_parser=self.tool_call_parser,
            prepare_workers=self.prepare_workers,
            prepare_timeout_s=self.prepare_timeout,
            max_logprobs=self.max_logprobs,
            max_total_logprobs=self.max_total_logprobs,
        )

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            ttl_s=self.result_ttl,
            claim_timeout_s=self.claim_timeout,
            max_deliveries=self.max_deliveries,
            # Raw XADDs skip the API, so the worker holds them to the API's configured limits.
            max_body_chars=self.max_body_bytes,
            max_prompt_chars=self.max_prompt_chars,
            dead_letter_maxlen=self.dead_letter_maxlen,
            dead_letter_ttl_s=self.dead_letter_ttl,
            reply_maxlen=self.reply_maxlen,
            access_log=self.access_log,
            suffix_fleet=self.suffix_fleet,
            routing=RoutingConfig(enabled=self.prefix_routing, wait_ms=self.prefix_routing_wait_ms),
            fair_share=FairShare(quantum=self.fair_share_quantum, oldest_every=self.oldest_every),
            limits=self.limits(),
            served_model_names=tuple(self.served_model_names()),
            prepare_workers=self.prepare_workers,
            prepare_timeout_s=self.prepare_timeout,
            max_logprobs=self.max_logprobs,
        )

    def durability(self) -> Durability:
        return Durability(self.durable_enqueue, int(self.durable_enqueue_timeout * 1000))

    def limits(self) -> Limits:
        return Limits(
            self.max_backlog, self.tenant_max_queued, self.tenant_tokens_per_minute, self.default_tenant
        )

    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            max_connections=self.max_connections,
            header_timeout_s=self.header_timeout,
            body_timeout_s=self.body_timeout,
            keepalive_timeout_s=self.keepalive_timeout,
        )

    def speculative_config(self) -> dict[str, Any] | None:
        if self.speculative_method == "none":
            return None
        spec: dict[str, Any] = {"method": self.speculative_method}
        if self.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = self.num_speculative_tokens
        if self.speculative_model:
            spec["model"] = self.speculative_model
        if self.prompt_lookup_max is not None:
            spec["prompt_lookup_max"] = self.prompt_lookup_max
        if self.speculative_token_tree:
            spec["speculative_token_tree"] = self.speculative_token_tree
        return spec


def _env_of(name: str) -> str:
    return next(f.metadata["env"] for f in fields(ServiceConfig) if f.name == name)


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _bool(text: str) -> bool:
    if text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    raise ValueError(text)


def _flag(name: str, meta: dict[str, Any]) -> str:
    return meta.get("flag") or "--" + name.replace("_", "-")


_ENGINE_KNOBS = (
    "revision",
    "max_num_seqs",
    "kv_cache_bytes",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "block_size",
    "max_model_len",
    "enable_chunked_prefill",
    "prefill_tokens_beside_decode",
    "enable_prefix_caching",
    "attention_backend",
    "kv_cache_dtype",
    "quantization",
    "batch_invariant",
    "enforce_eager",
    "adaptive_threads",
    "tensor_parallel_size",
    "chat_template",
    "scheduling_policy",
    "background_tokens",
)


# Who reads what: `serve` reads every setting; `worker` and `api` only theirs, and their --help lists only
# those. The rest (the connection, bind address, limits both enforce, the model's names) both read.
WORKER_ONLY = {
    *_ENGINE_KNOBS,
    "dtype",
    "device",
    "speculative_method",
    "speculative_model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "health_port",
    "drain_timeout",
    "claim_timeout",
    "max_deliveries",
    "embedded_maxmemory",
    "dead_letter_maxlen",
    "dead_letter_ttl",
    "fair_share_quantum",
    "oldest_every",
    "reply_maxlen",
    "prefix_routing",
    "prefix_routing_wait_ms",
    "suffix_fleet",
    "worker_name",
    "access_log",
    "log_stats_interval",
    "metrics_prefix",  # an API alone exports no vLLM-named series
}
API_ONLY = {
    "port",
    "api_keys",
    "api_keys_file",
    "allow_unauthenticated",
    "max_file_bytes",
    "tool_call_parser",
}


def read_by(command: str) -> set[str]:
    """The settings `command` (serve, worker or api) reads."""
    names = {f.name for f in fields(ServiceConfig)}
    if command == "worker":
        return names - API_ONLY
    if command == "api":
        return names - WORKER_ONLY
    return names


def _kind(f) -> type:
    return f.metadata.get("kind") or type(f.default)


def add_arguments(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """Add the config flags (all, or `only` those) with defaults from the environment."""
    for f in fields(ServiceConfig):
        if only is not None and f.name not in only:
            continue
        meta = dict(f.metadata)
        env = meta.get("env")
        kind = _kind(f)
        default = _default_text(f)
        where = f"env {env}" if default == "unset" else f"env {env}; default {default}"
        kw: dict[str, Any] = {
            "dest": f.name,
            "default": None,
            "help": f"{meta['help']} [{where}]".replace("%", "%%"),
        }
        if kind is bool:  # --x / --no-x: either way from the default (unset: the engine's)
            kw["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float):
            kw["type"] = kind
        if "choices" in meta:
            kw["choices"] = [c for c in meta["choices"] if c is not None]
        if "nargs" in meta:
            kw["nargs"] = meta["nargs"]
        parser.add_argument(_flag(f.name, meta), **kw)


def from_args(ns: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> ServiceConfig:
    """Flag, else environment variable, else default."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServiceConfig):
        given = getattr(ns, f.name, None) if ns is not None else None
        env = f.metadata.get("env")
        if given is not None:
            values[f.name] = " ".join(given) if isinstance(given, list) else given
        elif env and environ.get(env):
            kind = _kind(f)
            try:
                if kind is bool:
                    values[f.name] = _bool(environ[env])
                else:
                    values[f.name] = kind(environ[env]) if kind in (int, float) else environ[env]
            except ValueError:
                raise ValueError(f"{env}={environ[env]!r} is not a valid {f.name}") from None
    cfg = ServiceConfig(**values)
    for f in fields(ServiceConfig):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ValueError(f"{f.metadata['env']}: {getattr(cfg, f.name)!r} is not one of {choices}")
    return cfg


def _default_text(f) -> str:
    if f.default is None:  # the engine's knobs defer to engine/config.py; the rest say in their help
        return "engine's" if f.name in (*_ENGINE_KNOBS, "prompt_lookup_max") else "unset"
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if isinstance(f.default, float) and f.default.is_integer():
        return str(int(f.default))
    return str(f.default)


def markdown() -> str:
    """docs/configuration.md, from the fields above: the one place settings are defined."""
    rows = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m specserve.service.config --markdown > docs/configuration.md`"
        " from specserve/service/config.py (ServiceConfig); tests/test_config_docs.py checks it is current."
        " Edit the fields there, not this file. -->",
        "",
        "Every setting is a flag of `specserve serve` and an environment variable (the Helm chart sets the"
        " variables); `specserve worker` and `specserve api` take the flags they read (`read by`, and their"
        " `--help`). A flag wins over its variable, the"
        " variable over the default. `enqueue` and `status` take only the connection settings (REDIS_URL,"
        " SPECSERVE_PREFIX, SPECSERVE_DATA_DIR, SPECSERVE_RESULT_TTL). Boolean variables take"
        " 1/true/yes/on or 0/false/no/off. `--log-level` (DEBUG, INFO, ...) is a flag of `specserve` itself.",
        "",
        "| flag | environment variable | default | meaning | read by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in fields(ServiceConfig):
        meta = f.metadata
        flag = _flag(f.name, meta)
        if _kind(f) is bool and f.default is None:
            flag += f" / --no-{flag[2:]}"
        meaning = meta["help"].replace("|", "\\|")
        choices = [c for c in meta.get("choices", []) if c is not None]
        if choices:
            meaning += " (one of " + ", ".join(f"`{c}`" for c in choices) + ")"
        readers = "api" if f.name in API_ONLY else "worker" if f.name in WORKER_ONLY else "worker, api"
        rows.append(f"| `{flag}` | `{meta['env']}` | `{_default_text(f)}` | {meaning} | {readers} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m specserve.service.config --markdown > docs/configuration.md")
    sys.stdout.write(markdown())
