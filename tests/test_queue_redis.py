"""The queue layer against a real valkey-server: idempotent enqueue, claims, heartbeats, reclaim, dead
letters, safe trimming, cancellation, batched output, the multiplexed output reader, restarts."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import orjson
import pytest
from redis.exceptions import NoPermissionError
from valkey_helpers import run

from specserve.queue.client import QueueClient
from specserve.queue.connection import Connections, connect, stop_tasks
from specserve.queue.consumer import ConsumerConfig, StreamConsumer
from specserve.queue.embedded import EmbeddedValkey
from specserve.queue.keys import Keys
from specserve.queue.outputs import OutputReader
from specserve.queue.publisher import Publisher
from specserve.queue.wire import OutputEntry

pytest_plugins = ("valkey_fixtures",)  # the valkey fixture
KEYS = Keys("t")


def _consumer(r, name: str, **cfg) -> StreamConsumer:
    return StreamConsumer(Connections(r), KEYS, name, ConsumerConfig(**cfg))


def test_enqueue_is_idempotent_by_id(valkey):
    async def main():
        async with QueueClient(connect(valkey.url), KEYS, ttl_ms=60_000) as c:
            first = await c.enqueue({"prompt": "hi", "max_tokens": 3}, "req-1")
            again = await c.enqueue({"prompt": "something else"}, "req-1")
            assert first.created and first.entry_id and not again.created and again.status == "queued"
            assert await c.r.xlen(KEYS.requests) == 1
            info = await c.info("req-1")
            assert info["status"] == "queued" and info["entry"] == first.entry_id
            assert 0 < await c.r.pttl(KEYS.req("req-1")) <= 60_000
            ((eid, fields),) = await c.r.xrange(KEYS.requests)
            assert fields["id"] == "req-1" and orjson.loads(fields["body"]) == {
                "prompt": "hi",
                "max_tokens": 3,
            }

    run(main())


async def _workers_group(r) -> dict:
    (group,) = await r.xinfo_groups(KEYS.requests)
    assert group["name"] == KEYS.group
    return group


async def _xgroup_create_calls(r) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_xgroup|create", {}).get("calls", 0))


def test_enqueue_creates_the_workers_group_before_any_worker_exists(valkey):
    # A KEDA redis-streams trigger scales workers from zero on the group's lag: it must exist, and count
    # what waits, while no worker has ever run.
    async def main():
        async with QueueClient(connect(valkey.url), KEYS) as c:
            assert not await c.r.exists(KEYS.requests)
            await c.enqueue({"prompt": "first"}, "g1")
            group = await _workers_group(c.r)
            assert (group["lag"], group["pending"], group["consumers"]) == (1, 0, 0)
            assert group["last-delivered-id"] == "0-0"
            for i in range(3):
                await c.enqueue({"prompt": "more"}, f"g{i + 2}")
            assert (await _workers_group(c.r))["lag"] == 4
            assert await _xgroup_create_calls(c.r) == 1  # once per client, not once per enqueue
            # From id 0, as the worker creates it: the first worker gets everything that waited.
            w = _consumer(c.r, "w")
            await w.ensure_group()
            assert [e.request_id for e in await w.read_new(10, wait=False)] == ["g1", "g2", "g3", "g4"]

    run(main())


def test_enqueue_recreates_the_group_after_a_restart_that_lost_the_data(tmp_path):
    server = EmbeddedValkey(tmp_path / "data", appendonly=False).start()  # no AOF, no RDB: nothing survives
    try:

        async def main():
            async with QueueClient(connect(server.url), KEYS) as c:
                await c.enqueue({"prompt": "lost"}, "before")
                await asyncio.to_thread(server.restart)
                assert not await c.r.exists(KEYS.requests)
                await c.enqueue({"prompt": "after"}, "after")  # the same client: it has cached the group
                group = await _workers_group(c.r)
                assert (group["lag"], group["pending"], group["consumers"]) == (1, 0, 0)
                w = _consumer(c.r, "w")
                assert [e.request_id for e in await w.read_new(5, wait=False)] == ["after"]

        run(main())
    finally:
        server.stop()


def test_raw_xadd_duplicates_are_recognised_by_the_worker(valkey):
    async def main():
        r = connect(valkey.url)
        w = _consumer(r, "w1")
        await w.ensure_group()
        for _ in range(2):  # a producer in another language retrying its XADD
            await r.xadd(KEYS.requests, {"id": "dup", "body": '{"prompt": "x"}'})
        entries = await w.read_new(10, wait=False)
        claims = await w.claim([(e, None) for e in entries])
        assert [c.verdict.value for c in claims] == ["run", "duplicate"]
        info = await r.hgetall(KEYS.req("dup"))
        assert info["status"] == "running" and info["entry"] == entries[0].entry_id and info["run"] == "1"
        await r.aclose()

    run(main())


def test_claim_verdicts(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        w = _consumer(r, "w1")
        await w.ensure_group()
        await c.enqueue({"prompt": "a"}, "cancelled-before")
        await r.hset(KEYS.req("cancelled-before"), "cancel", "1")  # the documented cancel field
        await c.enqueue({"prompt": "b"}, "late")
        await c.enqueue({"prompt": "c"}, "already-done")
        await r.hset(KEYS.req("already-done"), "status", "finished")
        await c.enqueue({"prompt": "d"}, "fine")
        entries = await w.read_new(10, wait=False)
        deadlines = {"late": 1.0}  # 1970: long gone
        claims = await w.claim([(e, deadlines.get(e.request_id)) for e in entries])
        assert {e.request_id: cl.verdict.value for e, cl in zip(entries, claims)} == {
            "cancelled-before": "cancel",
            "late": "expire",
            "already-done": "done",
            "fine": "run",
        }
        other = _consumer(r, "w2")
        assert [cl.verdict.value for cl in await other.claim([(entries[-1], None)])] == ["notmine"]
        await r.aclose()

    run(main())


def test_entries_redelivered_too_often_are_declared_dead(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        await c.enqueue({"prompt": "poison"}, "p1")
        # Two workers took it and died without acknowledging (what a request that crashes workers does).
        ghost1, ghost2 = (
            _consumer(r, "ghost1", claim_timeout_ms=0),
            _consumer(r, "ghost2", claim_timeout_ms=0),
        )
        await ghost1.ensure_group()
        assert len(await ghost1.read_new(1, wait=False)) == 1
        assert len(await ghost2.reclaim(1)) == 1
        live = _consumer(r, "live", claim_timeout_ms=0, max_deliveries=2)
        (entry,) = await live.reclaim(1)
        (claim,) = await live.claim([(entry, None)])
        assert claim.verdict.value == "dead" and claim.detail == "3"
        await live.dead_letter(entry, "delivered 3 times", 3)
        ((_, dead),) = await r.xrange(KEYS.dead)
        assert dead["id"] == "p1" and dead["deliveries"] == "3" and dead["entry"] == entry.entry_id
        await r.aclose()

    run(main())


def test_heartbeat_keeps_long_work_from_being_stolen(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        await c.enqueue({"prompt": "long"}, "long")
        a = _consumer(r, "a", claim_timeout_ms=300)
        b = _consumer(r, "b", claim_timeout_ms=300)
        await a.ensure_group()
        (entry,) = await a.read_new(1, wait=False)
        for _ in range(4):  # 0.6 s in all, twice the claim timeout, but refreshed every 0.15 s
            await asyncio.sleep(0.15)
            assert await a.heartbeat([entry.entry_id]) == []
            assert await b.reclaim(10) == []
        await asyncio.sleep(0.4)  # a stops heartbeating (it died): b takes over
        assert [e.entry_id for e in await b.reclaim(10)] == [entry.entry_id]
        assert await a.heartbeat([entry.entry_id]) == [entry.entry_id]  # a learns it lost it
        await r.aclose()

    run(main())


def test_trim_never_drops_pending_or_undelivered_entries(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        w = _consumer(r, "w")
        await w.ensure_group()
        for i in range(6):
            await c.enqueue({"prompt": f"p{i}"}, f"r{i}")
        read = await w.read_new(4, wait=False)
        await w.ack(read[0].entry_id)
        await w.ack(read[2].entry_id)
        await w.trim()
        left = [eid for eid, _ in await r.xrange(KEYS.requests)]
        # r0 is gone (acknowledged, older than anything pending); r1 (pending) and everything after stay.
        assert left == [e.entry_id for e in read[1:]] + [eid for eid in left[3:]] and len(left) == 5
        for e in read[1:]:
            await w.ack(e.entry_id)
        await w.trim()
        assert await r.xlen(KEYS.requests) == 3  # the last delivered one and the two never delivered
        await r.aclose()

    run(main())


def test_cancel_queued_running_finished_and_unknown(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        await c.enqueue({"prompt": "q"}, "queued")
        assert await c.cancel("queued") == ("cancelled", "cancelled")
        res = await c.result("queued")
        assert res.status == "cancelled" and res.finish_reason == "abort"
        await c.enqueue({"prompt": "r"}, "running")
        await r.hset(KEYS.req("running"), "status", "running")
        assert await c.cancel("running") == ("cancelling", "running")
        assert await r.hget(KEYS.req("running"), "cancel") == "1"
        assert await c.cancel("queued") == ("terminal", "cancelled")
        assert await c.cancel("nope") == ("missing", "")
        await r.aclose()

    run(main())


def test_publisher_batches_deltas_and_finishes_only_what_it_owns(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        w = _consumer(r, "w")
        await w.ensure_group()
        await c.enqueue({"prompt": "x"}, "mine")
        await c.enqueue({"prompt": "y"}, "theirs")
        mine, theirs = await w.read_new(2, wait=False)
        await w.claim([(mine, None), (theirs, None)])  # run 1 of each: outputs are written for their run
        pub = Publisher(Connections(r), KEYS, "w", ttl_ms=60_000)
        task = asyncio.create_task(pub.run())
        for i in range(3):  # pushed within one loop turn: one entry
            pub.push("mine", OutputEntry(1, i, i, [i], chr(65 + i)))
        await pub.wait_idle()
        assert [f["ids"] for _, f in await r.xrange(KEYS.out("mine"))] == ["[0,1,2]"]
        pub.push("mine", OutputEntry(2, 3, 3, [9], "Z"))  # a run that does not own the request: dropped
        await pub.wait_idle()
        final = OutputEntry(1, 3, 3, [3], "D", "length", "finished", {"completion_tokens": 4})
        assert await pub.finish("mine", mine.entry_id, final, {"finish_reason": "length"})
        other = Publisher(Connections(r), KEYS, "someone-else", ttl_ms=60_000)
        other_task = asyncio.create_task(other.run())
        assert not await other.finish("theirs", theirs.entry_id, final, {})
        res = await c.result("mine")
        assert res.status == "finished" and res.token_ids == [0, 1, 2, 3] and res.text == "ABCD"
        pending = await r.xpending(KEYS.requests, KEYS.group)
        assert pending["pending"] == 1  # "mine" acknowledged with its final entry; "theirs" untouched
        assert await r.exists(KEYS.out("theirs")) == 0 and 0 < await r.pttl(KEYS.out("mine")) <= 60_000
        for t in (task, other_task):
            t.cancel()
        await r.aclose()

    run(main())


def test_output_reader_follows_many_streams_on_one_connection(valkey):
    async def main():
        r = connect(valkey.url)
        # A block far longer than this test's bound: a subscriber that failed to wake the reader would hang.
        conns = Connections(r)
        reader = OutputReader(conns, KEYS, block_ms=600_000)
        task = asyncio.create_task(reader.run())

        async def follow(rid: str) -> list[int]:
            got = []
            async with aclosing(reader.follow(rid)) as entries:
                async for _, e in entries:
                    got += e.token_ids
            return got

        async def produce(rid: str, n: int) -> None:
            for i in range(n):
                await asyncio.sleep(0.01)
                last = i == n - 1
                e = OutputEntry(1, i, i, [i], "x", "stop" if last else None, "finished" if last else None)
                await r.xadd(KEYS.out(rid), e.to_fields())

        followers = [asyncio.create_task(follow(f"r{i}")) for i in range(20)]
        await asyncio.gather(*(produce(f"r{i}", 5) for i in range(20)))
        results = await asyncio.wait_for(asyncio.gather(*followers), timeout=30)
        assert results == [[0, 1, 2, 3, 4]] * 20
        late = await asyncio.wait_for(follow("r3"), timeout=30)  # a stream that already ended
        assert late == [0, 1, 2, 3, 4]
        await reader.close(task)
        await conns.aclose()
        await r.aclose()

    run(main())


def test_a_reader_that_starts_while_the_server_is_away_gets_its_output_once_it_is_back(tmp_path):
    server = EmbeddedValkey(tmp_path / "data").start()
    try:

        async def main():
            r = connect(server.url)
            conns = Connections(r)
            reader = OutputReader(conns, KEYS, block_ms=200)
            task = asyncio.create_task(reader.run())
            await asyncio.to_thread(server.stop)  # a master killed, or a failover under way

            async def follow() -> list[int]:
                got = []
                async with aclosing(reader.follow("away")) as entries:
                    async for _, e in entries:
                        got += e.token_ids
                return got

            follower = asyncio.create_task(follow())
            await asyncio.sleep(0.3)  # its wake-up found no server
            assert not follower.done()
            await asyncio.to_thread(server.start)
            await r.xadd(KEYS.out("away"), OutputEntry(1, 0, 0, [7], "x", "stop", "finished").to_fields())
            assert await asyncio.wait_for(follower, timeout=30) == [7]
            await reader.close(task)
            await conns.aclose()
            await r.aclose()

        run(main())
    finally:
        server.stop()


def test_queue_stats_report_depth_pending_and_lag(valkey):
    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        w = _consumer(r, "w")
        await w.ensure_group()
        for i in range(5):
            await c.enqueue({"prompt": "x"}, f"s{i}")
        await asyncio.sleep(0.05)
        await w.read_new(2, wait=False)
        s = await w.stats()
        assert (s.depth, s.pending, s.consumers) == (3, 2, 1) and s.lag_seconds > 0
        await r.aclose()

    run(main())


def test_append_only_file_keeps_the_queue_across_a_restart(tmp_path):
    server = EmbeddedValkey(tmp_path / "data").start()
    try:

        async def before():
            async with QueueClient(connect(server.url), KEYS) as c:
                w = _consumer(c.r, "w")
                await w.ensure_group()
                await c.enqueue({"prompt": "in flight"}, "inflight")
                await c.enqueue({"prompt": "survive"}, "waiting")
                assert [e.request_id for e in await w.read_new(1, wait=False)] == ["inflight"]

        run(before())
        server.restart()  # SIGTERM: the server fsyncs its append-only file on the way out

        async def after():
            async with QueueClient(connect(server.url), KEYS) as c:
                assert (await c.info("waiting"))["status"] == "queued"
                pending = await c.r.xpending(KEYS.requests, KEYS.group)
                assert pending["pending"] == 1 and pending["consumers"][0]["name"] == "w"
                w = _consumer(c.r, "w")
                assert [e.request_id for e in await w.read_new(5, wait=False)] == ["waiting"]

        run(after())
    finally:
        server.stop()


def test_clients_reconnect_after_the_server_restarts(valkey):
    async def main():
        async with QueueClient(connect(valkey.url), KEYS) as c:
            await c.enqueue({"prompt": "one"}, "one")
            await asyncio.to_thread(valkey.restart)
            await c.enqueue({"prompt": "two"}, "two")  # the stale pooled connection is replaced
            assert await c.r.xlen(KEYS.requests) == 2

    run(main())


def test_acl_user_limited_to_the_prefix_can_run_the_queue(valkey):
    async def main():
        admin = connect(valkey.url)
        await admin.acl_setuser("svc", enabled=True, passwords=["+s3cret"], keys=["t:*"], commands=["+@all"])
        url = f"redis://svc:s3cret@{valkey.host}:{valkey.port}/0"
        async with QueueClient(connect(url), KEYS) as c:
            w = _consumer(c.r, "w")
            await w.ensure_group()
            await c.enqueue({"prompt": "x"}, "acl")
            (entry,) = await w.read_new(1, wait=False)
            assert [cl.verdict.value for cl in await w.claim([(entry, None)])] == ["run"]
            with pytest.raises(NoPermissionError):
                await c.r.set("other:key", "1")
        await admin.aclose()

    run(main())


def test_a_run_that_lost_its_request_writes_no_more_output(valkey):
    """A worker that lost its request to a reclaim keeps producing tokens until its next heartbeat; they
    must not land among the new run's (the rerun's tokens may differ from the lost run's: in bf16 its
    differently shaped steps can move a logit, and with it a draw)."""

    async def main():
        r = connect(valkey.url)
        c = QueueClient(r, KEYS)
        old, new = _consumer(r, "old", claim_timeout_ms=0), _consumer(r, "new", claim_timeout_ms=0)
        await old.ensure_group()
        await c.enqueue({"prompt": "x"}, "req")
        (entry,) = await old.read_new(1, wait=False)
        assert (await old.claim([(entry, None)]))[0].run == 1
        old_pub = Publisher(Connections(r), KEYS, "old", ttl_ms=60_000)
        new_pub = Publisher(Connections(r), KEYS, "new", ttl_ms=60_000)
        tasks = [asyncio.create_task(p.run()) for p in (old_pub, new_pub)]
        old_pub.push("req", OutputEntry(1, 0, 0, [1, 2], "ab"))
        await old_pub.wait_idle()
        (taken,) = await new.reclaim(1)  # the old worker looked dead: its entry is taken over
        assert (await new.claim([(taken, None)]))[0].run == 2
        new_pub.push("req", OutputEntry(2, 2, 2, [30], "X"))
        await new_pub.wait_idle()
        old_pub.push("req", OutputEntry(1, 2, 2, [3], "c"))  # the lost run's next step, too late
        await old_pub.wait_idle()
        entries = [f for _, f in await r.xrange(KEYS.out("req"))]
        for t in tasks:
            t.cancel()
        await r.aclose()
        return entries

    entries = run(main())
    assert [(e["run"], e["ids"]) for e in entries] == [("1", "[1,2]"), ("2", "[30]")]


def test_stop_tasks_ends_a_loop_that_swallowed_its_cancel() -> None:
    """A loop whose cancel was swallowed (on Python 3.11, one racing a Redis reply inside asyncio.wait_for)
    goes on: stop_tasks cancels it again until it has ended, and a loop that never ends is given up on."""

    async def swallows_once() -> None:
        swallowed = False
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True

    let_go = asyncio.Event()

    async def never_ends() -> None:  # until the test lets it go
        while not let_go.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    async def main():
        loop = asyncio.get_running_loop()
        swallowing = asyncio.create_task(swallows_once())
        await asyncio.sleep(0)
        started = loop.time()
        await stop_tasks([swallowing])
        stopped_in = loop.time() - started
        stubborn = asyncio.create_task(never_ends())
        await asyncio.sleep(0)
        await stop_tasks([stubborn], timeout=0.3)
        given_up_in = loop.time() - started - stopped_in
        left_running = not stubborn.done()
        let_go.set()
        stubborn.cancel()
        await asyncio.wait({stubborn})
        return swallowing.cancelled(), stopped_in, left_running, given_up_in

    cancelled, stopped_in, left_running, given_up_in = asyncio.run(main())
    assert cancelled and stopped_in < 1.0
    assert left_running and given_up_in < 1.0
