"""Priority bands and tenant fair share through a worker: requests are XADDed to the one
stream, the worker sorts them into the ready queue and admits the best band first, rotating between tenants;
finishing order is read off a producer's reply stream, where each final result lands as it is written."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from valkey_helpers import TINY, run, service_stack, wait_for

from specserve.queue.client import Limits
from specserve.queue.keys import Keys
from specserve.queue.ready import FairShare
from specserve.service import worker as worker_module

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def _finish_order(client, want: int, stream: str = "order") -> list[dict]:
    got: list[dict] = []
    last = "0-0"
    while len(got) < want:
        for _, items in await client.r.xread({KEYS.reply(stream): last}, block=5000) or []:
            for eid, f in items:
                last = eid
                got.append(f)
    return got


def test_a_tenants_burst_does_not_starve_anothers_few(valkey, tiny_model_dir):
    """Tenant A enqueues 40, then tenant B 4, with 4 sequence slots: B's 4 finish before A's 20th."""

    async def main():
        async with service_stack(
            valkey.url,
            tiny_model_dir,
            start_worker=False,
            engine_args={"max_num_seqs": 4},
            fair_share=FairShare(quantum=256),
        ) as (worker, client):
            for tenant, n in (("A", 40), ("B", 4)):
                for i in range(n):
                    body = {"prompt": f"tenant {tenant} asks {i}", "max_tokens": 24, **GREEDY}
                    await client.enqueue({**body, "tenant": tenant, "reply_to": "order"}, f"{tenant}{i}")
            await worker.start()
            return [f["id"] for f in await _finish_order(client, 44)]

    order = run(main(), timeout=300)
    assert sorted(order) == sorted([f"A{i}" for i in range(40)] + [f"B{i}" for i in range(4)])
    a_done = [x for x in order if x.startswith("A")]
    assert max(order.index(f"B{i}") for i in range(4)) < order.index(a_done[19]), order


def test_high_priority_work_overtakes_a_full_pool_of_low_priority_work(valkey, tiny_model_dir):
    """The pool is full of long low-priority requests when short high-priority ones arrive: with the engine's
    priority policy they preempt, and finish before most of the long ones (4 slots, 12 long, 4 short). The
    starvation bound holds too: every long request finishes."""

    async def main():
        async with service_stack(
            valkey.url,
            tiny_model_dir,
            engine_args={"max_num_seqs": 4, "scheduling_policy": "priority"},
            fair_share=FairShare(oldest_every=8),
        ) as (worker, client):
            for i in range(12):
                body = {"prompt": f"long job {i}", "max_tokens": 160, "priority": 10, **GREEDY}
                await client.enqueue({**body, "reply_to": "order"}, f"long{i}")
            # wait until the pool is full of long work
            while len(worker.inflight) < 4:
                await client.r.xlen(KEYS.requests)
                await _sleep()
            for i in range(4):
                body = {"prompt": f"short job {i}", "max_tokens": 8, **GREEDY}
                await client.enqueue({**body, "reply_to": "order"}, f"short{i}")
            finals = await _finish_order(client, 16)
            engine = TINY.llm_engine(tiny_model_dir, max_num_seqs=4, scheduling_policy="priority")
            return finals, engine.scheduler.num_preemptions

    finals, preemptions = run(main(), timeout=300)
    order = [f["id"] for f in finals]
    assert all(f["status"] == "finished" for f in finals)
    last_short = max(order.index(f"short{i}") for i in range(4))
    longs_before = sum(x.startswith("long") for x in order[:last_short])
    assert longs_before <= 4, order  # at most the ones already near their end
    assert preemptions >= 1
    for f in finals:  # preempted and recomputed, the long ones still produce all their tokens
        want = 160 if f["id"].startswith("long") else 8
        assert len(orjson.loads(f["ids"])) == want


async def _sleep() -> None:
    await asyncio.sleep(0.05)


def test_a_full_workers_wait_ends_when_an_entry_arrives_and_takes_nothing(
    valkey, tiny_model_dir, monkeypatch
):
    """A full worker that may overbook waits for new entries with a plain XREAD, not a sleep: the wait ends
    when an entry is added (here its cap is a minute, so only the entry can end it), and it delivers
    nothing: the entry is still new to the consumer group, for whichever worker reads it."""
    monkeypatch.setattr(worker_module, "ARRIVAL_WAIT_MS", 60_000)

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, start_worker=False) as (worker, client):
            await worker.consumer.ensure_group()
            watch = asyncio.ensure_future(worker._next_arrival())

            async def blocked() -> bool:
                clients = await client.r.execute_command("CLIENT", "LIST")
                lines = (clients if isinstance(clients, str) else clients.decode()).splitlines()
                return any("cmd=xread" in line and "flags=b" in line for line in lines)

            await wait_for(blocked, what="the XREAD to block")
            assert not watch.done()
            await client.enqueue({"prompt": "wake up", "max_tokens": 2}, "arrival")
            await asyncio.wait_for(watch, timeout=30)
            return [e.request_id for e in await worker.consumer.read_new(10, wait=False)]

    assert run(main(), timeout=120) == ["arrival"]


def test_a_raw_xadd_over_its_tenants_cap_fails_naming_the_limit(valkey, tiny_model_dir):
    """A producer that XADDs past its tenant's cap of queued requests gets `failed` with the limit as
    error_field; its other requests and everyone else's run."""

    async def main():
        async with service_stack(
            valkey.url,
            tiny_model_dir,
            start_worker=False,
            limits=Limits(tenant_max_queued=3),
        ) as (worker, client):
            for i in range(5):
                body = {"prompt": f"raw {i}", "max_tokens": 4, "tenant": "T", "reply_to": "order", **GREEDY}
                await client.r.xadd(KEYS.requests, {"id": f"t{i}", "body": orjson.dumps(body)})
            body = {"prompt": "other", "max_tokens": 4, "tenant": "U", "reply_to": "order", **GREEDY}
            await client.r.xadd(KEYS.requests, {"id": "u0", "body": orjson.dumps(body)})
            await worker.start()
            return {f["id"]: f for f in await _finish_order(client, 6)}

    finals = run(main(), timeout=300)
    statuses = {rid: f["status"] for rid, f in finals.items()}
    assert statuses == {
        "t0": "finished",
        "t1": "finished",
        "t2": "finished",
        "t3": "failed",
        "t4": "failed",
        "u0": "finished",
    }
    assert finals["t3"]["error_field"] == "tenant_max_queued"


def test_raw_xadds_naming_no_tenant_count_under_the_default_tenant(valkey, tiny_model_dir):
    """Raw entries without a tenant skipped every per-tenant cap; they now count under the default tenant
    (`~` unless configured): past its cap of 2 they fail naming the limit, and can still be read by anyone
    (no owner is recorded)."""

    async def main():
        async with service_stack(
            valkey.url, tiny_model_dir, start_worker=False, limits=Limits(tenant_max_queued=2)
        ) as (worker, client):
            for i in range(4):
                body = {"prompt": f"raw {i}", "max_tokens": 4, "reply_to": "order", **GREEDY}
                await client.r.xadd(KEYS.requests, {"id": f"n{i}", "body": orjson.dumps(body)})
            await worker.start()
            finals = {f["id"]: f for f in await _finish_order(client, 4)}
            return finals, await client.r.hgetall(KEYS.req("n0"))

    finals, status = run(main(), timeout=300)
    assert {rid: f["status"] for rid, f in finals.items()} == {
        "n0": "finished",
        "n1": "finished",
        "n2": "failed",
        "n3": "failed",
    }
    assert finals["n2"]["error_field"] == "tenant_max_queued"
    assert status.get("quota") == "~" and "tenant" not in status


def test_priority_and_tenant_over_http(valkey, tiny_model_dir):
    """`priority` (vLLM's extra field) and `tenant` reach the queue from the native and OpenAI routes; with
    API keys the key decides the tenant, and a body naming another is a 400 naming `tenant`."""
    import aiohttp
    from test_api_hardening import HTTP_TIMEOUT, _auth, _final, guarded_stack

    async def main():
        async with (
            guarded_stack(valkey.url, tiny_model_dir, api_keys=["team-a:tok-a"]) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            body = {"id": "n1", "prompt": "hello", "max_tokens": 2, "priority": 3}
            async with http.post(f"{base}/v1/requests", json=body, headers=_auth("tok-a")) as r:
                native = r.status
            done = await _final(http, base, "n1", _auth("tok-a"))
            stored = orjson.loads((await client.r.xrange(KEYS.requests))[0][1]["body"])
            chat = {
                "model": tiny_model_dir.name,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "priority": -2,
                "tenant": "team-a",
            }
            async with http.post(f"{base}/v1/chat/completions", json=chat, headers=_auth("tok-a")) as r:
                openai_status = r.status
            async with http.post(
                f"{base}/v1/chat/completions", json={**chat, "tenant": "team-b"}, headers=_auth("tok-a")
            ) as r:
                other = (r.status, await r.json())
            async with http.post(
                f"{base}/v1/chat/completions", json={**chat, "priority": 1.5}, headers=_auth("tok-a")
            ) as r:
                bad = (r.status, await r.json())
            return native, done, stored, openai_status, other, bad

    native, done, stored, openai_status, other, bad = run(main(), timeout=300)
    assert native == 202 and done["status"] == "finished"
    assert stored["priority"] == 3 and stored["tenant"] == "team-a"
    assert openai_status == 200
    assert other[0] == 400 and other[1]["error"]["param"] == "tenant"
    assert bad[0] == 400 and bad[1]["error"]["param"] == "priority"


def _raw(tenant: str, i: int) -> dict[str, bytes]:
    body = {"prompt": f"tenant {tenant} asks {i}", "max_tokens": 24, **GREEDY, "tenant": tenant}
    return {"id": f"{tenant}{i}".encode(), "body": orjson.dumps({**body, "reply_to": "order"})}


@pytest.mark.parametrize("small_first", [False, True])
def test_the_fair_share_holds_however_fast_entries_arrive(valkey, tiny_model_dir, small_first):
    """A running worker with 2 slots; one pipeline lands a tenant's burst of 40 and another tenant's 4 (in
    either order) at once. The order of arrival within the pipeline must not decide who runs: the small
    tenant's 4 finish before the burst's 12th."""

    async def main():
        async with service_stack(
            valkey.url, tiny_model_dir, engine_args={"max_num_seqs": 2}, fair_share=FairShare(quantum=256)
        ) as (_worker, client):
            groups = [("A", 40), ("B", 4)]
            pipe = client.r.pipeline(transaction=False)
            for tenant, n in reversed(groups) if small_first else groups:
                for i in range(n):
                    pipe.xadd(KEYS.requests, _raw(tenant, i))
            await pipe.execute()
            return [f["id"] for f in await _finish_order(client, 44)]

    order = run(main(), timeout=300)
    assert sorted(order) == sorted([f"A{i}" for i in range(40)] + [f"B{i}" for i in range(4)])
    a_done = [x for x in order if x.startswith("A")]
    assert max(order.index(f"B{i}") for i in range(4)) < order.index(a_done[11]), order


def test_a_small_tenant_arriving_after_a_running_burst_is_served_next(valkey, tiny_model_dir):
    """Tenant A's burst of 40 is already running (a few finished) when tenant B's 4 arrive: B's 4 are
    admitted next, not after A's credit and one more quantum of A's are spent. With 2 slots, B's last
    finishes before 6 more of A's have."""

    async def main():
        async with service_stack(
            valkey.url, tiny_model_dir, engine_args={"max_num_seqs": 2}, fair_share=FairShare(quantum=256)
        ) as (_worker, client):
            pipe = client.r.pipeline(transaction=False)
            for i in range(40):
                pipe.xadd(KEYS.requests, _raw("A", i))
            await pipe.execute()
            first = await _finish_order(client, 3)
            pipe = client.r.pipeline(transaction=False)
            for i in range(4):
                pipe.xadd(KEYS.requests, _raw("B", i))
            await pipe.execute()
            return [f["id"] for f in await _finish_order(client, 44)], len(first)

    order, _ = run(main(), timeout=300)
    assert sorted(order) == sorted([f"A{i}" for i in range(40)] + [f"B{i}" for i in range(4)])
    b_last = max(order.index(f"B{i}") for i in range(4))
    # the A's finished before B's arrived are the first 3 read, at least; B was sent right after
    arrived_after = len([x for x in order[:b_last] if x.startswith("A")])
    assert arrived_after <= 3 + 2 + 6, order
