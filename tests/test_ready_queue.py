"""The ready queue (queue/ready.py) on a real valkey-server: priority bands, deficit
round robin by tokens between a band's tenants, the oldest-every-Nth starvation bound, raw XADDs' limits, and
the consumer group's pending list as the one record of who holds an entry (nothing lost in a crash)."""

from __future__ import annotations

import orjson
from valkey_helpers import run

from specserve.queue import scripts
from specserve.queue.client import Limits, QueueClient
from specserve.queue.connection import Connections, connect
from specserve.queue.consumer import ConsumerConfig, StreamConsumer
from specserve.queue.keys import Keys
from specserve.queue.ready import FairShare, ReadyQueue, cost_of
from specserve.queue.wire import RequestBody, decode_body

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
TTL_MS = 600_000


class Queue:
    """A producer (raw XADDs, as any service may send) and one worker's view: read new, sort in, take."""

    def __init__(self, url: str, fair: FairShare, limits: Limits, name: str = "w1") -> None:
        self.r = connect(url)
        self.conns = Connections(self.r)
        self.consumer = StreamConsumer(self.conns, KEYS, name, ConsumerConfig(block_ms=50))
        self.ready = ReadyQueue(self.conns.fast, KEYS, name, fair, limits, TTL_MS)

    async def xadd(self, rid: str, **body) -> None:
        await self.r.xadd(KEYS.requests, {"id": rid, "body": orjson.dumps({"prompt": "hello", **body})})

    async def sort_all(self) -> list[str]:
        entries = await self.consumer.read_new(1000, wait=False)
        items: list[tuple] = []
        for e in entries:
            body = decode_body(e.raw_body)
            assert isinstance(body, RequestBody)
            items.append((e, body))
        verdicts = await self.ready.sort_in(items)
        return [v.verdict if not isinstance(v, Exception) else repr(v) for v in verdicts]

    async def take_ids(self, n: int, better_than: int | None = None) -> list[str]:
        taken = await self.ready.take(n, better_than)
        return [e.request_id or "" for e in taken.entries]

    async def aclose(self) -> None:
        await self.conns.aclose(close_redis=True)


async def _queue(url: str, fair: FairShare | None = None, limits: Limits | None = None) -> Queue:
    q = Queue(url, fair or FairShare(oldest_every=0), limits or Limits())
    await q.consumer.ensure_group()
    return q


def test_the_best_band_goes_first_and_arrival_order_holds_within_a_band(valkey):
    async def main():
        q = await _queue(valkey.url)
        for i in range(3):
            await q.xadd(f"low{i}", priority=5)
        await q.xadd("urgent", priority=-1)
        for i in range(3):
            await q.xadd(f"norm{i}")
        verdicts = await q.sort_all()
        order = [*await q.take_ids(2), *await q.take_ids(10)]
        await q.aclose()
        return verdicts, order

    verdicts, order = run(main())
    assert verdicts == ["ready"] * 7
    assert order == ["urgent", "norm0", "norm1", "norm2", "low0", "low1", "low2"]


def test_tenants_share_a_band_by_tokens_not_by_requests(valkey):
    """Deficit round robin by tokens: A queued 40 first, then B 4; B's requests are admitted long before A's
    20th. And a tenant asking for long generations gets fewer requests through than one asking short ones."""

    async def main():
        q = await _queue(valkey.url, FairShare(quantum=256, oldest_every=0))
        for i in range(40):
            await q.xadd(f"a{i}", tenant="A", max_tokens=60)
        for i in range(4):
            await q.xadd(f"b{i}", tenant="B", max_tokens=60)
        await q.sort_all()
        first = await q.take_ids(44)
        # long vs short: 20 each, C asks 240 tokens a request and D 12
        for i in range(20):
            await q.xadd(f"c{i}", tenant="C", max_tokens=240)
            await q.xadd(f"d{i}", tenant="D", max_tokens=12)
        await q.sort_all()
        second = await q.take_ids(12)
        await q.aclose()
        return first, second

    first, second = run(main())
    assert sorted(first) == sorted([f"a{i}" for i in range(40)] + [f"b{i}" for i in range(4)])
    last_b = max(first.index(f"b{i}") for i in range(4))
    assert last_b < first.index("a19"), first
    assert [x for x in first if x.startswith("a")] == [f"a{i}" for i in range(40)]  # FIFO per tenant
    # per round of the ring each tenant gets a quantum (256 tokens): ~1 of C's, ~20 of D's
    assert sum(x.startswith("d") for x in second) >= 3 * sum(x.startswith("c") for x in second), second


def test_every_nth_admission_takes_the_oldest_request_whatever_its_band(valkey):
    """The starvation bound: with oldest_every=3, a low-priority request queued before a flood of better ones
    is admitted within three admissions, and at most every third admission breaks band order."""

    async def main():
        q = await _queue(valkey.url, FairShare(oldest_every=3))
        await q.r.delete(f"{KEYS.prefix}:ready:turn")
        await q.xadd("old-low", priority=9)
        for i in range(10):
            await q.xadd(f"hi{i}", priority=0)
        await q.sort_all()
        order = []
        for _ in range(11):
            order += await q.take_ids(1)
        await q.aclose()
        return order

    order = run(main())
    assert order.index("old-low") < 3, order
    assert [x for x in order if x != "old-low"] == [f"hi{i}" for i in range(10)]


def test_better_than_takes_only_from_better_bands(valkey):
    """A full worker running band 5 work may take band-0 work for the engine to preempt for, nothing else."""

    async def main():
        q = await _queue(valkey.url, FairShare(oldest_every=1))  # even the oldest turn is skipped here
        await q.xadd("same", priority=5)
        await q.xadd("worse", priority=7)
        await q.xadd("better", priority=0)
        await q.sort_all()
        got = await q.take_ids(3, better_than=5)
        left = (await q.ready.take(0)).waiting
        await q.aclose()
        return got, left

    got, left = run(main())
    assert got == ["better"] and left == 2


def test_a_raw_xadd_over_its_tenants_limit_is_refused_as_it_is_sorted_in(valkey):
    """Requests the API did not admit (raw XADDs) meet the same limits when a worker sorts them in."""

    async def main():
        q = await _queue(valkey.url, limits=Limits(tenant_max_queued=2, max_backlog=100))
        for i in range(3):
            await q.xadd(f"t{i}", tenant="T")
        await q.xadd("u0", tenant="U")
        verdicts = await q.sort_all()
        status = await q.r.hget(KEYS.req("t0"), "status")
        await q.aclose()
        return verdicts, status

    verdicts, status = run(main())
    assert verdicts == ["ready", "ready", "refused", "ready"]
    assert status == "queued"  # the hash a raw XADD never wrote is created as it is admitted


def test_sorted_in_entries_are_held_by_the_ready_queue_and_never_reclaimed_as_stuck(valkey):
    """While an entry waits it is pending with the pseudo-consumer `~ready`, so reclaim (which takes entries
    of dead workers) leaves it; once taken, a worker that dies leaves it pending with that worker, and another
    worker reclaims it after the claim timeout. At no point is an entry pending with nobody."""

    async def main():
        q = await _queue(valkey.url)
        for i in range(3):
            await q.xadd(f"r{i}")
        await q.sort_all()
        other = Queue(valkey.url, FairShare(), Limits(), name="w2")
        reclaimed_waiting = await other.consumer.reclaim(10)  # idle 0 ms: anything not ~ready would go
        held = {c["name"]: c["pending"] for c in await q.r.xinfo_consumers(KEYS.requests, KEYS.group)}
        taken = await q.take_ids(1)  # then w1 "dies" holding it
        other.consumer.cfg = ConsumerConfig(claim_timeout_ms=0)
        reclaimed = await other.consumer.reclaim(10)
        pending = await q.r.xpending(KEYS.requests, KEYS.group)
        await other.aclose()
        await q.aclose()
        return reclaimed_waiting, held, taken, [e.request_id for e in reclaimed], pending["pending"]

    reclaimed_waiting, held, taken, reclaimed, pending = run(main())
    assert reclaimed_waiting == []
    assert held.get(scripts.READY_CONSUMER) == 3
    assert taken == ["r0"] and reclaimed == ["r0"]
    assert pending == 3  # r0 with w2, r1 and r2 still waiting in the ready queue


def test_queue_stats_count_what_waits_in_the_ready_queue(valkey):
    async def main():
        q = await _queue(valkey.url)
        await q.xadd("a", tenant="A", priority=2)
        await q.xadd("b")
        await q.sort_all()
        await q.xadd("c")  # not yet sorted in: the group's lag
        stats = await q.consumer.stats()
        await q.aclose()
        return stats

    stats = run(main())
    assert stats.depth == 3 and stats.pending == 0
    assert stats.waiting == {(2, "A"): 1, (0, ""): 1}


def test_cost_counts_prompt_and_max_tokens_and_is_capped():
    body = decode_body(orjson.dumps({"prompt": "x" * 400, "max_tokens": 50}).decode())
    assert isinstance(body, RequestBody)
    assert cost_of(body, 16) == 150
    huge = decode_body(orjson.dumps({"prompt": list(range(100_000)), "max_tokens": 5}).decode())
    assert isinstance(huge, RequestBody) and cost_of(huge, 16) == 32_768


def test_enqueue_through_the_client_marks_the_request_admitted(valkey):
    """The API's enqueue checks the limits itself, so the worker does not count it twice."""

    async def main():
        r = connect(valkey.url)
        async with QueueClient(r, KEYS, limits=Limits(tenant_max_queued=1)) as c:
            await c.enqueue({"prompt": "x", "tenant": "T"}, "x1")
            admitted = await r.hget(KEYS.req("x1"), "admitted")
            tenant = await r.hget(KEYS.req("x1"), "tenant")
        q = await _queue(valkey.url, limits=Limits(tenant_max_queued=1))
        verdicts = await q.sort_all()
        await q.aclose()
        return admitted, tenant, verdicts

    admitted, tenant, verdicts = run(main())
    assert admitted == "1" and tenant == "T"
    assert verdicts == ["ready"]  # not refused for holding its own place in T's queue
