"""QUEUE BENCHMARK (no model): the queue path alone, one Redis instance against a Valkey Cluster.

    python bench/queue_cluster.py [--requests 2000] [--tokens 64] [--concurrency 256] [--step-ms 0]
                                  [--shards 3]

The worker's engine is replaced by a token generator that costs nothing: each claimed request gets one token a
step (every in-flight request in the same step, as a batch does), and the real queue code carries everything
else: QueueClient.enqueue (the ENQUEUE script), StreamConsumer.read_new and claim, Publisher (APPEND and
FINISH scripts, pipelined per step), and QueueClient.wait (the output reader's blocking XREAD). So the figures
are what the queue can carry, not what a model serves.

Targets, each started here on loopback: a single valkey-server (append-only file on, as the embedded server
runs) and a cluster of 3 masters + 3 replicas (tests/valkey_cluster.py). With one shard all of the service's
keys share one hash slot on a cluster (queue/keys.py), so that figure is one master's plus the cluster's
redirection handling; with --shards N (SPECSERVE_QUEUE_SHARDS) each shard's keys hash to a slot of their own,
and the token worker serves every shard as the service's worker does (a consumer and a publisher per shard).

Printed per target (the cluster with one shard, with SPECSERVE_DURABLE_ENQUEUE=1's WAIT for a replica, and
with --shards shards):
the enqueue's latency (p50), requests/s and tokens/s end to end; on the worker's output path, Redis round
trips (pipelined writes) and bytes sent per generated token; and the servers' CPU seconds per 1,000 tokens
(INFO cpu, masters summed), which says where a single instance saturates. Every figure is printed with the
CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hiredis
from common import REPO, cpu_line

sys.path[:0] = [str(REPO), str(REPO / "tests")]

from valkey_cluster import ValkeyCluster  # noqa: E402

from specserve.queue.client import Durability, QueueClient  # noqa: E402
from specserve.queue.connection import Connections, open_redis, server_keys  # noqa: E402
from specserve.queue.consumer import ClaimVerdict, StreamConsumer  # noqa: E402
from specserve.queue.embedded import EmbeddedValkey  # noqa: E402
from specserve.queue.keys import Keys  # noqa: E402
from specserve.queue.publisher import Publisher  # noqa: E402
from specserve.queue.wire import OutputEntry  # noqa: E402


@dataclass
class Wire:
    """What the worker's output path sent: pipelined writes and their bytes."""

    writes: int = 0
    bytes: int = 0


def count_writes(publisher: Publisher, wire: Wire) -> None:
    fast = publisher._fast
    inner = fast.pipeline

    async def pipeline(commands: Any, raise_on_error: bool = True) -> list[Any]:
        wire.writes += 1
        wire.bytes += sum(len(hiredis.pack_command(tuple(c))) for c in commands)
        return await inner(commands, raise_on_error=raise_on_error)

    fast.pipeline = pipeline  # type: ignore[method-assign]


async def token_worker(
    redis: Any, keys: Keys, tokens: int, step_ms: float, wire: Wire, stop: asyncio.Event
) -> None:
    """Claims the requests of `keys`' shard and gives each `tokens` tokens, one per step, at no cost."""
    conns = Connections(redis, route=keys.requests)
    consumer = StreamConsumer(conns, keys, "bench-worker")
    publisher = Publisher(conns, keys, "bench-worker", ttl_ms=600_000)
    count_writes(publisher, wire)
    await consumer.ensure_group()
    flushing = asyncio.create_task(publisher.run())
    running: dict[str, tuple[str, int]] = {}  # request id -> (entry id, tokens given)
    try:
        while not stop.is_set():
            entries = await consumer.read_new(256, wait=not running)
            claims = await consumer.claim([(e, None) for e in entries]) if entries else []
            for e, c in zip(entries, claims):
                if not isinstance(c, Exception) and c.verdict is ClaimVerdict.RUN:
                    running[e.request_id] = (e.entry_id, 0)
            for rid, (eid, given) in list(running.items()):
                entry = OutputEntry(1, given, given, [given % 1000], "x")
                if given + 1 < tokens:
                    publisher.push(rid, entry)
                    running[rid] = (eid, given + 1)
                else:
                    entry.finish_reason, entry.status = "length", "finished"
                    entry.usage = {
                        "prompt_tokens": 1,
                        "completion_tokens": tokens,
                        "total_tokens": tokens + 1,
                    }
                    publisher.finish(rid, eid, entry, {"finish_reason": "length"})
                    del running[rid]
            await asyncio.sleep(step_ms / 1000)
    finally:
        publisher.stop()
        await asyncio.wait([flushing], timeout=5)
        await conns.aclose()


def _cluster(redis: Any) -> bool:
    return type(redis).__name__ == "RedisCluster"


async def server_cpu(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        r = await open_redis(url)
        try:
            info = await (r.info("cpu", target_nodes=r.PRIMARIES) if _cluster(r) else r.info("cpu"))
            rows = info.values() if _cluster(r) else [info]
            total += sum(float(i["used_cpu_sys"]) + float(i["used_cpu_user"]) for i in rows)
        finally:
            await r.aclose()
        if _cluster(r):
            break
    return total


async def measure(
    url: str,
    requests: int,
    tokens: int,
    concurrency: int,
    step_ms: float,
    durable: int = 0,
    shards: int = 1,
) -> dict[str, float]:
    producer_redis = await open_redis(url)
    keys = server_keys(producer_redis, Keys("specserve", shards=shards))
    await producer_redis.delete(keys.config)  # each target its own shard count: a fresh fleet
    producer = QueueClient(producer_redis, keys, durable=Durability(replicas=durable))
    worker_redis = await open_redis(url)
    wire, stop = Wire(), asyncio.Event()
    workers = [
        asyncio.create_task(token_worker(worker_redis, k, tokens, step_ms, wire, stop))
        for k in keys.every_shard()
    ]
    gate = asyncio.Semaphore(concurrency)
    cpu0 = await server_cpu([url])

    enqueue_ms: list[float] = []
    run = uuid.uuid4().hex[:8]  # each measurement its own ids: a known id is not enqueued again

    async def one(i: int) -> int:
        async with gate:
            t = time.perf_counter()
            rid = (await producer.enqueue({"prompt": "x", "max_tokens": tokens}, f"{run}-{i}")).id
            enqueue_ms.append(1000 * (time.perf_counter() - t))
            return len((await producer.wait(rid)).token_ids)

    start = time.perf_counter()
    got = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - start
    cpu = await server_cpu([url]) - cpu0
    stop.set()
    await asyncio.gather(*workers)
    await producer.aclose()
    await worker_redis.aclose()
    generated = sum(got)
    assert generated == requests * tokens, "a request lost or gained tokens"
    return {
        "enqueue p50 ms": statistics.median(enqueue_ms),
        "requests/s": requests / wall,
        "tokens/s": generated / wall,
        "round trips/token": wire.writes / generated,
        "bytes/token": wire.bytes / generated,
        "server cpu s/1k tokens": 1000 * cpu / generated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=0.0, help="pause between token steps (0: none)")
    ap.add_argument("--shards", type=int, default=3, help="shards of the last cluster target")
    args = ap.parse_args()
    print(f"QUEUE BENCHMARK (no model, zero-cost tokens) on {cpu_line()}")
    with tempfile.TemporaryDirectory() as tmp:
        single = EmbeddedValkey(Path(tmp) / "single").start()
        cluster = ValkeyCluster(Path(tmp) / "cluster").start()
        try:
            targets = [
                ("single instance", single.url, 0, 1),
                ("cluster 3+3, one slot", cluster.url, 0, 1),
                ("cluster, durable enqueue", cluster.url, 1, 1),
                (f"cluster, {args.shards} shards", cluster.url, 0, args.shards),
            ]
            for name, url, durable, shards in targets:
                figures = asyncio.run(
                    measure(url, args.requests, args.tokens, args.concurrency, args.step_ms, durable, shards)
                )
                print(f"{name:26s} " + "  ".join(f"{k} {v:,.2f}" for k, v in figures.items()))
        finally:
            single.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
