"""QUEUE BENCHMARK (no model): the queue path alone, one Redis instance against a Valkey Cluster.

    python bench/queue_cluster.py [--requests 2000] [--tokens 64] [--concurrency 256] [--step-ms 0]
                                  [--shards 3] [--processes 1] [--only single|cluster|durable|sharded]

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
trips (pipelined writes) and bytes sent per generated token; the servers' CPU seconds per 1,000 tokens
(INFO cpu, masters summed); and each server's CPU over the run (its used_cpu_sys + used_cpu_user delta over
the wall time: the busiest one, and the sum), beside the bench processes' own. Redis runs commands on one
thread, so a server at 100 % is saturated; while the bench's processes are at 100 % each, they are the limit
instead: raise --processes until the single instance's figure reaches 100 % (where it saturates) and
compare the 3-shard cluster's tokens/s at the same --processes. Every figure is printed with the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """Count the pipelined writes of the publisher's lean client and the bytes that went on its connection
    (as sent: a script by EVALSHA once the connection has it, queue/resp.py)."""
    fast = publisher._fast
    inner, ready = fast.pipeline, fast._ready

    async def pipeline(commands: Any, raise_on_error: bool = True) -> list[Any]:
        wire.writes += 1
        return await inner(commands, raise_on_error=raise_on_error)

    async def counted_ready() -> Any:
        proto = await ready()
        if not getattr(proto, "bench_counted", False):
            send = proto.send

            def counted(data: bytes, replies: int) -> Any:
                wire.bytes += len(data)
                return send(data, replies)

            proto.send = counted  # type: ignore[method-assign]
            proto.bench_counted = True  # type: ignore[attr-defined]
        return proto

    fast.pipeline = pipeline  # type: ignore[method-assign]
    fast._ready = counted_ready  # type: ignore[method-assign]


async def token_worker(
    redis: Any, keys: Keys, tokens: int, step_ms: float, wire: Wire, stop: asyncio.Event, name: str = "p0"
) -> None:
    """Claims the requests of `keys`' shard and gives each `tokens` tokens, one per step, at no cost."""
    conns = Connections(redis, route=keys.requests)
    consumer = StreamConsumer(conns, keys, f"bench-worker-{name}")
    publisher = Publisher(conns, keys, f"bench-worker-{name}", ttl_ms=600_000)
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


async def server_cpu(url: str) -> dict[str, float]:
    """CPU seconds (used_cpu_sys + used_cpu_user, INFO cpu) of each server: the one at `url`, or every master
    of its cluster, by address."""
    r = await open_redis(url)
    try:
        if _cluster(r):
            info = await r.info("cpu", target_nodes=r.PRIMARIES)
            rows = dict(info)
        else:
            rows = {url.rsplit("@", 1)[-1]: await r.info("cpu")}
        return {k: float(i["used_cpu_sys"]) + float(i["used_cpu_user"]) for k, i in rows.items()}
    finally:
        await r.aclose()


@dataclass
class Part:
    """What one producer-and-worker process did."""

    enqueue_ms: list[float]
    generated: int
    writes: int
    bytes: int
    process_cpu_s: float


async def part(
    url: str,
    requests: int,
    tokens: int,
    concurrency: int,
    step_ms: float,
    durable: int,
    shards: int,
    name: str,
    go: Any,
    producers_done: Any,
) -> Part:
    """Producers for `requests` requests and a token worker per shard, in this process. `go`: an async
    callable awaited once the workers are set up, before the first enqueue (where the clock starts);
    `producers_done`: one awaited once this process's requests all finished, before its workers stop (with
    several processes, a worker may hold another process's requests until every producer is done)."""
    producer_redis = await open_redis(url)
    keys = server_keys(producer_redis, Keys("specserve", shards=shards))
    producer = QueueClient(producer_redis, keys, durable=Durability(replicas=durable))
    worker_redis = await open_redis(url)
    wire, stop = Wire(), asyncio.Event()
    workers = [
        asyncio.create_task(token_worker(worker_redis, k, tokens, step_ms, wire, stop, name))
        for k in keys.every_shard()
    ]
    gate = asyncio.Semaphore(concurrency)
    enqueue_ms: list[float] = []
    run = f"{name}-{uuid.uuid4().hex[:8]}"  # each measurement its own ids: a known id is not enqueued again

    async def one(i: int) -> int:
        async with gate:
            t = time.perf_counter()
            rid = (await producer.enqueue({"prompt": "x", "max_tokens": tokens}, f"{run}-{i}")).id
            enqueue_ms.append(1000 * (time.perf_counter() - t))
            return len((await producer.wait(rid)).token_ids)

    await go()
    cpu0 = time.process_time()
    got = await asyncio.gather(*(one(i) for i in range(requests)))
    used = time.process_time() - cpu0
    await producers_done()
    stop.set()
    await asyncio.gather(*workers)
    await producer.aclose()
    await worker_redis.aclose()
    generated = sum(got)
    assert generated == requests * tokens, "a request lost or gained tokens"
    return Part(enqueue_ms, generated, wire.writes, wire.bytes, used)


async def _until(event: Any) -> None:
    while not event.is_set():
        await asyncio.sleep(0.005)


def _child(args: tuple[Any, ...], index: int, signals: tuple[Any, ...], out: Any) -> None:
    """One of several producer-and-worker processes: set up, wait for the start, report when its producers are
    done, wait until every process's are, then stop its workers and send back what it did."""
    ready, start, finished, release = signals

    async def go() -> None:
        ready.put(index)
        await _until(start)

    async def producers_done() -> None:
        finished.put(index)
        await _until(release)

    out.put(asyncio.run(part(*args, name=f"p{index}", go=go, producers_done=producers_done)))


def _in_processes(args: tuple[Any, ...], processes: int) -> tuple[list[Part], dict[str, float], float]:
    """Run the parts in `processes` processes started together; also returns each server's CPU seconds and
    the wall time between the start and the last producer done."""
    url = args[0]
    ctx = multiprocessing.get_context("spawn")
    ready, finished, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    start, release = ctx.Event(), ctx.Event()
    signals = (ready, start, finished, release)
    procs = [ctx.Process(target=_child, args=(args, i, signals, out)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    cpu0 = asyncio.run(server_cpu(url))
    t0 = time.perf_counter()
    start.set()
    for _ in procs:
        finished.get(timeout=3600)
    wall = time.perf_counter() - t0
    cpu1 = asyncio.run(server_cpu(url))
    release.set()
    parts = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return parts, {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}, wall


async def _in_this_process(args: tuple[Any, ...]) -> tuple[list[Part], dict[str, float], float]:
    url, marks = args[0], {}

    async def go() -> None:
        marks["cpu0"], marks["t0"] = await server_cpu(url), time.perf_counter()

    async def producers_done() -> None:
        marks["wall"] = time.perf_counter() - marks["t0"]
        marks["cpu1"] = await server_cpu(url)

    got = await part(*args, name="p0", go=go, producers_done=producers_done)
    cpu0, cpu1 = marks["cpu0"], marks["cpu1"]
    return [got], {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}, marks["wall"]


async def _fresh_fleet(url: str, shards: int) -> None:
    r = await open_redis(url)
    try:
        await r.delete(server_keys(r, Keys("specserve", shards=shards)).config)  # each target its own count
    finally:
        await r.aclose()


def measure(
    url: str,
    requests: int,
    tokens: int,
    concurrency: int,
    step_ms: float,
    durable: int = 0,
    shards: int = 1,
    processes: int = 1,
) -> dict[str, float]:
    """One target: `processes` producer-and-worker processes, each with `requests` requests and
    `concurrency` of them in flight, against the server(s) at `url`."""
    asyncio.run(_fresh_fleet(url, shards))
    args = (url, requests, tokens, concurrency, step_ms, durable, shards)
    if processes == 1:
        parts, cpu, wall = asyncio.run(_in_this_process(args))
    else:
        parts, cpu, wall = _in_processes(args, processes)
    busy = [100 * used / wall for used in cpu.values()]
    generated = sum(p.generated for p in parts)
    return {
        "enqueue p50 ms": statistics.median([ms for p in parts for ms in p.enqueue_ms]),
        "requests/s": requests * processes / wall,
        "tokens/s": generated / wall,
        "round trips/token": sum(p.writes for p in parts) / generated,
        "bytes/token": sum(p.bytes for p in parts) / generated,
        "server cpu s/1k tokens": 1000 * sum(cpu.values()) / generated,
        # each server's CPU over the run (100 = one core saturated: Redis runs commands on one thread)
        "busiest server cpu %": max(busy),
        "servers cpu % (sum)": sum(busy),
        # the bench's own processes: near 100 x processes, they and not Redis are what saturated
        "bench cpu %": 100 * sum(p.process_cpu_s for p in parts) / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per process")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight per process")
    ap.add_argument("--step-ms", type=float, default=0.0, help="pause between token steps (0: none)")
    ap.add_argument("--shards", type=int, default=3, help="shards of the sharded cluster target")
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="producer-and-worker processes per target (one Python process saturates before a Redis does: "
        "give the single instance enough of them to reach 100 %% CPU)",
    )
    ap.add_argument("--only", choices=["single", "cluster", "durable", "sharded"], action="append")
    args = ap.parse_args()
    print(
        f"QUEUE BENCHMARK (no model, zero-cost tokens) on {cpu_line()}, {args.processes} process(es) a target"
    )
    with tempfile.TemporaryDirectory() as tmp:
        single = EmbeddedValkey(Path(tmp) / "single").start()
        cluster = ValkeyCluster(Path(tmp) / "cluster").start()
        try:
            targets = [
                ("single", "single instance", single.url, 0, 1),
                ("cluster", "cluster 3+3, one slot", cluster.url, 0, 1),
                ("durable", "cluster, durable enqueue", cluster.url, 1, 1),
                ("sharded", f"cluster, {args.shards} shards", cluster.url, 0, args.shards),
            ]
            for key, name, url, durable, shards in targets:
                if args.only and key not in args.only:
                    continue
                figures = measure(
                    url, args.requests, args.tokens, args.concurrency, args.step_ms, durable, shards,
                    args.processes,
                )  # fmt: skip
                print(f"{name:26s} " + "  ".join(f"{k} {v:,.2f}" for k, v in figures.items()), flush=True)
        finally:
            single.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
