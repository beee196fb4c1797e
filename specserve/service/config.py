"""Service configuration: every setting is an environment variable and a CLI flag (Helm's names)."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specserve.queue.keys import DEFAULT_PREFIX


@dataclass(frozen=True)
class HttpLimits:
    """What the API's and the health server's HTTP listeners put up with (service/http.py `serve`)."""

    max_connections: int = 1000  # open client connections; more are answered 503 and closed at once
    header_timeout_s: float = 15.0  # connect (or a kept-alive connection's next first byte) to full headers
    body_timeout_s: float = 60.0  # to read a whole request body
    keepalive_timeout_s: float = 75.0  # an idle kept-alive connection; above common proxies' 60 s reuse


_LIMITS = HttpLimits()


def _opt(env: str | None, default: Any, help: str, flag: str | None = None, **kw: Any) -> Any:
    return field(default=default, metadata={"env": env, "help": help, "flag": flag, **kw})


@dataclass
class ServiceConfig:
    redis_url: str | None = _opt(
        "REDIS_URL", None, "Redis/Valkey URL (redis:// or rediss://); none: embedded"
    )
    prefix: str = _opt("SPECSERVE_PREFIX", DEFAULT_PREFIX, "prefix of every Redis key")
    model: str | None = _opt(
        "SPECSERVE_MODEL", None, "HF model dir or GGUF file (default: demo SmolLM2-135M)"
    )
    dtype: str = _opt(
        "SPECSERVE_DTYPE",
        "auto",
        "weights/activations dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    device: str = _opt("SPECSERVE_DEVICE", "auto", "where the model runs", choices=["auto", "cpu", "cuda"])
    speculative_method: str = _opt(
        "SPECSERVE_SPEC_METHOD", "none", "speculative decoding", choices=["none", "ngram", "draft_model"]
    )
    speculative_model: str | None = _opt("SPECSERVE_SPEC_MODEL", None, "draft model (method draft_model)")
    num_speculative_tokens: int = _opt("SPECSERVE_NUM_SPEC_TOKENS", 4, "draft tokens per step (upper bound)")
    max_num_seqs: int | None = _opt("SPECSERVE_MAX_NUM_SEQS", None, "most sequences in a batch")
    kv_cache_bytes: int | None = _opt("SPECSERVE_KV_CACHE_BYTES", None, "KV cache size in bytes")
    host: str = _opt("SPECSERVE_HOST", "127.0.0.1", "API bind address (0.0.0.0 in containers)")
    port: int = _opt("SPECSERVE_PORT", 8000, "API port")
    health_port: int = _opt("SPECSERVE_HEALTH_PORT", 8001, "worker's /healthz /readyz /metrics port (0: off)")
    api_keys: str | None = _opt(
        "SPECSERVE_API_KEYS", None, "comma-separated bearer tokens, `tenant:token` or bare (none: no auth)"
    )
    api_keys_file: str | None = _opt(
        "SPECSERVE_API_KEYS_FILE", None, "file with one bearer token a line (`tenant:token` or a bare token)"
    )
    allow_unauthenticated: bool = _opt(
        "SPECSERVE_ALLOW_UNAUTHENTICATED",
        False,
        "let the API run with no keys on a non-loopback address (it refuses to otherwise)",
    )
    drain_timeout: float = _opt(
        "SPECSERVE_DRAIN_TIMEOUT", 30.0, "seconds to finish in-flight work on SIGTERM"
    )
    otlp_endpoint: str | None = _opt("OTEL_EXPORTER_OTLP_ENDPOINT", None, "OTLP/HTTP endpoint for traces")
    # Beyond the chart's surface: tuning with sane defaults.
    data_dir: str = _opt("SPECSERVE_DATA_DIR", ".specserve/valkey", "embedded server's data folder")
    result_ttl: float = _opt("SPECSERVE_RESULT_TTL", 86400.0, "seconds every per-request key lives")
    claim_timeout: float = _opt(
        "SPECSERVE_CLAIM_TIMEOUT", 30.0, "idle seconds before a dead worker's work is taken"
    )
    max_deliveries: int = _opt("SPECSERVE_MAX_DELIVERIES", 3, "deliveries before the dead-letter stream")
    max_body_bytes: int = _opt("SPECSERVE_MAX_BODY_BYTES", 1 << 20, "largest request body")
    max_prompt_chars: int = _opt("SPECSERVE_MAX_PROMPT_CHARS", 200_000, "longest prompt the API accepts")
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
        "SPECSERVE_DEAD_LETTER_MAXLEN", 100_000, "dead letters kept at most (oldest trimmed first)"
    )
    dead_letter_ttl: float = _opt("SPECSERVE_DEAD_LETTER_TTL", 7 * 86400.0, "seconds a dead letter is kept")
    worker_name: str | None = _opt("SPECSERVE_WORKER_NAME", None, "consumer name (default host-pid)")

    def __post_init__(self) -> None:
        if self.speculative_method in ("draft_model",) and not self.speculative_model:
            raise ValueError("--speculative-method draft_model needs --speculative-model")
        limits = ("max_connections", "header_timeout", "body_timeout", "keepalive_timeout")
        for name in (*limits, "dead_letter_maxlen", "dead_letter_ttl"):
            if not getattr(self, name) > 0:  # also false for NaN
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
        if self.max_num_seqs:
            kw["max_num_seqs"] = self.max_num_seqs
        if self.kv_cache_bytes:
            kw["kv_cache_bytes"] = self.kv_cache_bytes
        return kw

    def keys_list(self) -> list[str]:
        keys = [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]
        if self.api_keys_file:
            text = Path(self.api_keys_file).read_text()
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        return keys

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
        spec: dict[str, Any] = {
            "method": self.speculative_method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.speculative_model:
            spec["model"] = self.speculative_model
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


def _kind(f) -> type:
    return int if f.name in ("max_num_seqs", "kv_cache_bytes") else type(f.default)


def add_arguments(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """Add the config flags (all, or `only` those) with defaults from the environment."""
    for f in fields(ServiceConfig):
        if only is not None and f.name not in only:
            continue
        meta = dict(f.metadata)
        env = meta.get("env")
        kind = _kind(f)
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": f"{meta['help']} [env {env}]"}
        if kind is bool:
            kw.update(action="store_const", const=True)
        elif kind in (int, float):
            kw["type"] = kind
        if "choices" in meta:
            kw["choices"] = meta["choices"]
        parser.add_argument(_flag(f.name, meta), **kw)


def from_args(ns: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> ServiceConfig:
    """Flag, else environment variable, else default."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServiceConfig):
        given = getattr(ns, f.name, None) if ns is not None else None
        env = f.metadata.get("env")
        if given is not None:
            values[f.name] = given
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
