"""The server itself misbehaves mid-load, twice in one run: frozen (SIGSTOP) for twice the claim timeout,
then resumed; later killed with SIGKILL and restarted from its append-only file (same port, data dir and
password).

Two worker processes and an API process serve concurrent producers; every fourth request is also followed
as it is produced, by a QueueClient stream and by an SSE client of the API (which resumes with Last-Event-ID
when the API loses Redis).
Every request whose enqueue was acknowledged before the fault finishes exactly once with the reference
tokens; one whose enqueue failed is retried by its producer with the same id (enqueue is idempotent by id)
and then finishes exactly once too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import aclosing
from typing import Any

import pytest

from specserve.queue.client import QueueClient
from specserve.queue.connection import TRANSIENT_ERRORS, connect

from .conftest import (
    KEYS,
    Cluster,
    SseClient,
    Timeline,
    assert_no_problems,
    finished_once_problems,
    group_state,
    outcomes,
    raw_redis,
    reference,
    run_bounded,
    unfinished_requests,
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.chaos

PARAMS = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [f"Item {i} of the load:" for i in range(8)]
PRODUCERS, PER_PRODUCER = 4, 24
# Shorter than the freeze below: when the server wakes up, every in-flight entry looks abandoned, and each
# worker's reclaim may take the other's. That must still end in exactly one finished run per request.
CLAIM = {"SPECSERVE_CLAIM_TIMEOUT": "2"}


class Load:
    """Producers that enqueue through QueueClient (the Lua ENQUEUE, idempotent by id), retrying a failed or
    unanswered enqueue with the same id, and streaming readers for every fourth request."""

    def __init__(self, url: str, api_base: str) -> None:
        self.url = url
        self.api = api_base
        self.plan = [
            [(f"p{p}-r{i}", PROMPTS[(p * PER_PRODUCER + i) % len(PROMPTS)]) for i in range(PER_PRODUCER)]
            for p in range(PRODUCERS)
        ]
        self.prompt_of = {rid: prompt for batch in self.plan for rid, prompt in batch}
        self.acked: dict[str, float] = {}
        self.retries = 0
        self.streamed: dict[str, tuple[list[int], str]] = {}
        self.sse: dict[str, SseClient] = {}
        self._readers: list[asyncio.Task[Any]] = []
        self._clients: list[QueueClient] = []

    @property
    def ids(self) -> list[str]:
        return list(self.prompt_of)

    async def _produce(self, batch: list[tuple[str, str]]) -> None:
        client = QueueClient(connect(self.url), KEYS)
        self._clients.append(client)
        for i, (rid, prompt) in enumerate(batch):
            while True:
                try:
                    await asyncio.wait_for(client.enqueue({"prompt": prompt, **PARAMS}, rid), 15)
                    self.acked[rid] = time.monotonic()
                    break
                except (asyncio.TimeoutError, *TRANSIENT_ERRORS):
                    self.retries += 1
                    await asyncio.sleep(0.2)
            if i % 4 == 0:  # followed as it is produced: through the client, and as SSE through the API
                self._readers.append(asyncio.create_task(self._read(client, rid)))
                self.sse[rid] = SseClient(rid)
                self._readers.append(asyncio.create_task(self.sse[rid].follow(self.api, 150)))
            await asyncio.sleep(0.1)

    async def _read(self, client: QueueClient, rid: str) -> None:
        ids, text = [], ""
        async with aclosing(client.stream(rid)) as deltas:
            async for d in deltas:
                ids += d.token_ids
                text += d.text
        self.streamed[rid] = (ids, text)

    async def run(self) -> None:
        await asyncio.gather(*(self._produce(batch) for batch in self.plan))

    async def readers_done(self, timeout: float) -> None:
        done, pending = await asyncio.wait(self._readers, timeout=timeout)
        for t in pending:
            t.cancel()
        for t in done:
            t.result()
        assert not pending, f"{len(pending)} streaming readers never saw their final entry"

    async def aclose(self) -> None:
        for t in self._readers:
            t.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for c in self._clients:
            await c.aclose()


async def _load_through(cluster: Cluster, model_dir, faults) -> dict:
    """Run the load; when `fraction` of its enqueues are acknowledged, run each (name, fraction, fault)."""
    t = Timeline("valkey")
    workers = [cluster.worker(f"w{i}", **CLAIM) for i in range(2)]
    api = cluster.api()
    load = Load(cluster.valkey.url, api.base)
    refs_task = asyncio.ensure_future(asyncio.to_thread(reference, model_dir, PROMPTS, **PARAMS))  # meanwhile
    figures: dict = {"requests": len(load.ids)}
    try:
        for proc in (*workers, api):
            await proc.ready()
        t.mark("workers and API ready")
        producing = asyncio.create_task(load.run())
        for name, fraction, fault in faults:

            async def far_enough(fraction=fraction) -> bool:
                return len(load.acked) >= len(load.ids) * fraction

            await wait_for(far_enough, timeout=60, what=f"{fraction:.0%} of the load enqueued")
            r = raw_redis(cluster.valkey)
            try:
                running = await _running(r, load.ids)
            finally:
                await r.aclose()
            figures[name] = {"acked_before": len(load.acked), "running_at": running}
            t.mark(f"{name}: {len(load.acked)} enqueues acknowledged, {running} requests running")
            await fault()
            t.mark(f"{name} over")
        await asyncio.wait_for(producing, 120)
        t.mark(f"every enqueue acknowledged ({load.retries} retried)")
        r = raw_redis(cluster.valkey)
        try:
            await wait_terminal(r, load.ids, timeout=120, cluster=cluster)
            t.mark("every request ended")
            await load.readers_done(timeout=30)
            refs = dict(zip(PROMPTS, await refs_task))
            got = await outcomes(r, load.ids)
            problems = {rid: finished_once_problems(got[rid], *refs[load.prompt_of[rid]]) for rid in load.ids}
            for rid, seen in load.streamed.items():
                if seen != refs[load.prompt_of[rid]]:
                    problems[rid].append(f"streaming reader saw {seen}")
            for rid, sse in load.sse.items():
                problems[rid] += sse.problems(*refs[load.prompt_of[rid]])
            assert_no_problems(problems, "requests", cluster)
            assert await unfinished_requests(r) == {}
            g = await group_state(r)
            assert (g["pending"], g["lag"]) == (0, 0), g
            figures.update(
                finished_once=len(load.ids),
                enqueue_retries=load.retries,
                reruns=sum(int(o.info["run"]) > 1 for o in got.values()),
                streamed=len(load.streamed),
                sse_exact=len(load.sse),
                sse_reconnects=sum(c.connections + c.refused - 1 for c in load.sse.values()),
            )
            return figures
        finally:
            await r.aclose()
    finally:
        await load.aclose()
        await asyncio.wait({refs_task})


async def _running(r, ids: list[str]) -> int:
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(KEYS.req(rid), "status")
    return sum(s == b"running" for s in await pipe.execute())


def test_valkey_frozen_past_the_claim_timeout_then_killed_and_restarted_from_its_aof(cluster, tiny_model_dir):
    server = cluster.valkey
    port, password, data = server.port, server.password, server.data_dir

    async def freeze():
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(4.0)  # twice the claim timeout
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)

    async def crash():
        server.kill()  # SIGKILL: no shutdown, no final fsync
        await asyncio.sleep(1.0)
        await asyncio.to_thread(server.start)
        assert (server.port, server.password, server.data_dir) == (port, password, data)

    faults = [("SIGSTOP 4 s", 0.25, freeze), ("kill -9 + restart", 0.6, crash)]
    figures = run_bounded(_load_through(cluster, tiny_model_dir, faults), timeout=220)
    print("valkey faults:", figures)
