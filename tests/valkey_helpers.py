"""Helpers for the queue and service tests: running coroutines, an in-process worker stack on a shared tiny
engine, real `specserve` processes. The fixtures are in valkey_fixtures.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from specserve.queue.client import QueueClient
from specserve.queue.connection import open_redis
from specserve.queue.keys import Keys

T = TypeVar("T")
REPO = Path(__file__).resolve().parent.parent
TINY_ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": 256, "max_num_seqs": 32}


def run(coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
    """Run a test coroutine on a fresh loop, bounded so a hang fails instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class TinyEngines:
    """One loaded tiny model per test process, re-wrapped in a fresh AsyncLLMEngine for each event loop."""

    def __init__(self) -> None:
        self._engines: dict[str, Any] = {}
        self._llms: dict[str, Any] = {}

    def llm_engine(self, model_dir: Path, **extra: Any):
        from specserve.engine.config import EngineConfig
        from specserve.engine.llm_engine import LLMEngine

        key = repr((str(model_dir), sorted(extra.items())))
        if key not in self._engines:
            self._engines[key] = LLMEngine(
                EngineConfig(model=str(model_dir), **{**TINY_ENGINE_ARGS, **extra})
            )
        return self._engines[key]

    def llm(self, model_dir: Path):
        """An LLM for reference outputs (LLM.generate), separate from the engine the workers use."""
        from specserve import LLM

        key = str(model_dir)
        if key not in self._llms:
            self._llms[key] = LLM(key, **TINY_ENGINE_ARGS)
        return self._llms[key]


TINY = TinyEngines()


@contextlib.asynccontextmanager
async def service_stack(
    url: str,
    model_dir: Path,
    prefix: str = "specserve",
    name: str = "w-test",
    start_worker: bool = True,
    telemetry: Any = None,
    engine_args: dict[str, Any] | None = None,
    shards: int = 1,
    **worker_cfg: Any,
) -> AsyncIterator[tuple[Any, QueueClient]]:
    """An in-process worker (on the shared tiny engine) and a queue client, both on `url`; with `shards`
    > 1 the worker serves every shard (a ShardedWorker)."""
    from specserve.engine.async_engine import AsyncLLMEngine
    from specserve.service.telemetry import Telemetry
    from specserve.service.worker import ShardedWorker, Worker, WorkerConfig

    llm_engine = TINY.llm_engine(model_dir, **(engine_args or {}))
    engine = AsyncLLMEngine(llm_engine)
    await engine.start()
    keys = Keys(prefix, shards=shards)
    worker_redis = await open_redis(url)  # a cluster's client where `url` names a cluster node
    kind = Worker if shards == 1 else ShardedWorker
    worker = kind(engine, worker_redis, keys, name, WorkerConfig(**worker_cfg), telemetry or Telemetry())
    client = QueueClient(await open_redis(url), keys)
    if start_worker:
        await worker.start()
    try:
        yield worker, client
    finally:
        await worker.drain(timeout=0)
        await worker.close()
        await engine.shutdown()
        await client.aclose()
        await worker_redis.aclose()
        # Leave the shared engine empty for the next test.
        for rid in list(llm_engine._requests):
            llm_engine.abort(rid)
        while llm_engine.has_unfinished():
            llm_engine.step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_cli(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start `specserve <args>` as a real process (output to `log`)."""
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "specserve.service.cli", *args],
            env=full_env,
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


async def wait_for(predicate, timeout: float = 60.0, what: str = "condition", interval: float = 0.05):
    """Poll an async predicate until true (used to wait for processes; never to assert speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def api_stack(
    url: str,
    model_dir: Path,
    api_keys: list[str] | None = None,
    shards: int = 1,
    start_worker: bool = True,
    worker_cfg: dict[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[str, Any, QueueClient]]:
    """service_stack plus the HTTP API on a free loopback port; yields (base URL, worker, client)."""
    from aiohttp import web

    from specserve.service.api import Api, ApiSettings

    stack = service_stack(url, model_dir, shards=shards, start_worker=start_worker, **(worker_cfg or {}))
    async with stack as (worker, client):
        cfg = ApiSettings(api_keys=api_keys or [], **settings)
        api = Api(client, worker.telemetry, cfg, model_ready=lambda: worker.ready)
        runner = web.AppRunner(api.app(refresh_queue_stats=False), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield f"http://127.0.0.1:{port}", worker, client
        finally:
            await runner.cleanup()


# A tiny `specserve serve`: fp32 on the CPU, a small KV cache, its own embedded valkey.
TINY_SERVE_ENV = {
    "SPECSERVE_DTYPE": "float32",
    "SPECSERVE_KV_CACHE_BYTES": str(4 << 20),
    "SPECSERVE_DEVICE": "cpu",
}


async def http_ready(url: str) -> bool:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


@contextlib.contextmanager
def serve_process(model_dir: Path, tmp: Path, **env: str):
    """`specserve serve` on `model_dir` (embedded valkey, one worker; `env` adds settings) until the block
    ends; yields its base URL once it is ready."""
    import signal

    port = free_port()
    full = {**TINY_SERVE_ENV, "SPECSERVE_MODEL": str(model_dir), "SPECSERVE_PORT": str(port), "REDIS_URL": ""}
    proc = spawn_cli(["serve", "--data-dir", str(tmp / "data")], {**full, **env}, tmp / "serve.log")
    base = f"http://127.0.0.1:{port}"
    try:
        run(wait_for(lambda: http_ready(f"{base}/readyz"), timeout=180, what="serve ready"), timeout=200)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
