"""Putting the parts together: Redis (given or embedded), engine, worker, API, health server, signals."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from specserve.queue.client import QueueClient, agree_on_shards
from specserve.queue.connection import TRANSIENT_ERRORS, connect, open_redis, server_keys
from specserve.queue.embedded import EmbeddedValkey
from specserve.queue.keys import Keys
from specserve.service.api import Api, add_health_routes
from specserve.service.config import ServiceConfig
from specserve.service.http import parse_api_keys, serve
from specserve.service.telemetry import Telemetry, log_stats_every

log = logging.getLogger("specserve")
URL_FILE = "url"  # in the embedded server's data dir: how `enqueue`, `status` and `api` find it


def _embedded_url(cfg: ServiceConfig) -> str | None:
    path = Path(cfg.data_dir) / URL_FILE
    return path.read_text().strip() if path.exists() else None


async def _reachable(url: str) -> bool:
    r = connect(url, max_connections=2)
    try:
        return bool(await asyncio.wait_for(r.ping(), timeout=2))
    except (asyncio.TimeoutError, *TRANSIENT_ERRORS):
        return False
    finally:
        await r.aclose()


async def resolve_redis(cfg: ServiceConfig, start_embedded: bool) -> tuple[str, EmbeddedValkey | None]:
    """REDIS_URL if given; else a running embedded server of this data dir; else (if allowed) start one."""
    if cfg.redis_url:
        return cfg.redis_url, None
    url = _embedded_url(cfg)
    if url and await _reachable(url):
        return url, None
    if not start_embedded:
        # The data dir is relative: run elsewhere, a `serve` that is up looks absent; say where we looked.
        where = (Path(cfg.data_dir) / URL_FILE).resolve()
        found = f"the embedded server in {where} does not answer" if url else f"there is no {where}"
        raise SystemExit(
            f"error: no server found: REDIS_URL is unset and {found}. Pass --redis-url (REDIS_URL), or "
            "--data-dir (SPECSERVE_DATA_DIR) naming the data dir of a running `specserve serve` (it is "
            "relative to the directory that serve was started in), or start one with `specserve serve`"
        )
    server = EmbeddedValkey(cfg.data_dir, maxmemory=cfg.embedded_maxmemory)
    await asyncio.to_thread(server.start)
    path = Path(cfg.data_dir) / URL_FILE
    path.touch(mode=0o600)
    path.write_text(server.url + "\n")
    log.info("started the embedded valkey-server (append-only file in %s)", server.data_dir)
    return server.url, server


async def load_engine(cfg: ServiceConfig):
    """Load the model in a thread, showing progress, so signals and HTTP probes are served meanwhile."""
    from specserve.engine.async_engine import AsyncLLMEngine

    name = cfg.model or "the demo SmolLM2-135M-Instruct"
    task = asyncio.create_task(AsyncLLMEngine.load(**cfg.engine_kwargs()))
    start = time.monotonic()
    tty = sys.stderr.isatty()
    spinner = "|/-\\"
    i = 0
    while not task.done():
        await asyncio.wait({task}, timeout=0.25 if tty else 5.0)
        elapsed = time.monotonic() - start
        if tty:
            sys.stderr.write(f"\r{spinner[i % 4]} loading {name} ... {elapsed:.1f}s")
            sys.stderr.flush()
            i += 1
        elif not task.done():
            log.info("loading %s ... %.0fs", name, elapsed)
    if tty:
        sys.stderr.write("\r" + " " * 70 + "\r")
    engine = task.result()
    log.info(
        "loaded %s in %.1fs (context %d tokens)",
        engine.model_name,
        time.monotonic() - start,
        engine.max_model_len,
    )
    return engine


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or "" for every address): it may well be reachable from outside


def check_api_exposure(cfg: ServiceConfig) -> None:
    """An API with no keys serves anyone who can reach it: fine on loopback, refused on any other address
    unless asked for (--allow-unauthenticated), and warned about even then. Bad key entries stop us here."""
    try:
        keys = parse_api_keys(cfg.keys_list())
    except ValueError as e:
        raise SystemExit(f"error: SPECSERVE_API_KEYS / SPECSERVE_API_KEYS_FILE: {e}") from None
    if keys or is_loopback(cfg.host):
        return
    if not cfg.allow_unauthenticated:
        raise SystemExit(
            f"error: refusing to serve the API on {cfg.host!r} with no API keys: anyone who reaches it could "
            "read and cancel every request. Set SPECSERVE_API_KEYS (or SPECSERVE_API_KEYS_FILE), bind "
            "127.0.0.1, or pass --allow-unauthenticated (SPECSERVE_ALLOW_UNAUTHENTICATED=1) if something "
            "in front of it authenticates clients."
        )
    log.warning(
        "the API on %s has no API keys: anyone who reaches it can read and cancel every request", cfg.host
    )


async def guard_tenant_data(redis: Any, keys: Keys, cfg: ServiceConfig) -> None:
    """An API with keys marks its Redis; one without keys refuses a marked Redis (it would hand every
    tenant's requests to whoever reaches it) unless --allow-unauthenticated says something else guards it."""
    try:
        if cfg.keys_list():
            await redis.set(keys.keyed, "1")
        elif await redis.exists(keys.keyed) and not cfg.allow_unauthenticated:
            raise SystemExit(
                f"error: this Redis holds requests made with API keys ({keys.keyed} is set): an API without "
                "keys would serve them to anyone who reaches it. Set SPECSERVE_API_KEYS (or "
                "SPECSERVE_API_KEYS_FILE), or pass --allow-unauthenticated "
                "(SPECSERVE_ALLOW_UNAUTHENTICATED=1) if something in front of it authenticates clients."
            )
    except RedisError as e:  # Redis away at start: routes answer 503 until it is back; checked next start
        log.warning("could not check %s (%s)", keys.keyed, e)


async def check_shards(redis: Any, keys: Keys, cfg: ServiceConfig) -> None:
    """Refuse, before serving, a shard count the fleet on this Redis does not use."""
    try:
        await agree_on_shards(redis, keys)
    except ValueError as e:  # ShardMismatch
        raise SystemExit(f"error: {e}") from None
    except RedisError as e:  # Redis away at start: the worker and the first enqueue check it again
        log.warning("could not check %s (%s)", keys.config, e)


async def run(cfg: ServiceConfig, with_api: bool, with_worker: bool) -> None:
    """serve = both; `api` and `worker` one each. Returns after a drained shutdown on SIGTERM/SIGINT."""
    if with_api:
        check_api_exposure(cfg)
    stop = _stop_event()
    url, server = await resolve_redis(cfg, start_embedded=with_worker)
    redis = await open_redis(
        url, cfg.seed_nodes()
    )  # a cluster's client when the server at `url` is a cluster node
    keys = server_keys(redis, cfg.queue_keys())
    await check_shards(redis, keys, cfg)
    # An API-only process has no engine: it exports no engine series rather than ones stuck at 0.
    telemetry = Telemetry(
        "specserve",
        cfg.otlp_endpoint,
        engine_metrics=with_worker,
        metrics_prefix=cfg.metrics_prefix,
        tenant_names=cfg.metrics_tenant_names,
    )
    stats_task: asyncio.Task[None] | None = None
    worker = None
    runners: list[web.AppRunner] = []
    client = QueueClient(
        redis, keys, ttl_ms=int(cfg.result_ttl * 1000), limits=cfg.limits(), durable=cfg.durability()
    )
    try:
        if with_api:
            await guard_tenant_data(redis, keys, cfg)
            served = cfg.served_model_names()
            ready = (lambda: worker is not None and worker.ready) if with_worker else None
            api = Api(client, telemetry, cfg.api_settings(served), model_ready=ready)
            app = api.app(refresh_queue_stats=not with_worker)
            runners.append(await serve(app, cfg.host, cfg.port, cfg.http_limits()))
            log.info("API on http://%s:%d", cfg.host, cfg.port)
        elif with_worker and cfg.health_port:
            health = web.Application()
            probe = Api(client, telemetry, model_ready=lambda: worker is not None and worker.ready)
            add_health_routes(health, telemetry, probe.readiness)
            runners.append(await serve(health, cfg.host, cfg.health_port, cfg.http_limits()))
            log.info("worker health on http://%s:%d", cfg.host, cfg.health_port)
        if with_worker:
            # imports the engine: only where a worker runs
            from specserve.service.worker import ShardedWorker

            engine = await load_engine(cfg)
            await engine.start()
            worker = ShardedWorker(engine, redis, keys, cfg.consumer_name, cfg.worker_config(), telemetry)
            await worker.start()
            if cfg.log_stats_interval > 0:
                stats_task = asyncio.create_task(log_stats_every(telemetry, cfg.log_stats_interval))
        await stop.wait()
        log.info("stopping")
        if worker is not None:
            await worker.drain(cfg.drain_timeout)
            await worker.close()
            await worker.engine.shutdown()
    finally:
        if stats_task is not None:
            stats_task.cancel()
        for runner in runners:
            await runner.cleanup()
        await client.aclose()
        telemetry.shutdown()
        if server is not None:
            with contextlib.suppress(Exception):  # a server that fails to stop must not block the exit
                await asyncio.to_thread(server.stop)
