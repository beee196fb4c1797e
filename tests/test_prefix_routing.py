"""Prefix-aware claiming against a real valkey-server: the routing key, the PASS and
TAKEBACK scripts case by case, and two in-process workers on the tiny engine: requests behind a prompt one
worker has run go to that worker (results unchanged), and come back to the reader within the wait when that
worker does not claim them."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from valkey_helpers import run, service_stack, wait_for

from specserve import SamplingParams
from specserve.queue.connection import BLOCK_MS, Connections, connect
from specserve.queue.consumer import StreamConsumer
from specserve.queue.keys import Keys
from specserve.queue.routing import ROUTE_MIN_CHARS, Router, RoutingConfig, prefix_key
from specserve.queue.wire import RequestBody

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
SYSTEM = "You are a careful assistant. " * 60  # ~1.7k characters, the same for every request below
OTHER_ENGINE = {"enable_prefix_caching": True}  # a second tiny engine (the first is shared) for a 2nd worker
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_the_key_follows_the_shared_start_of_a_prompt():
    a = prefix_key(RequestBody(prompt=None, messages=_chat("What is 2+2?")))
    b = prefix_key(RequestBody(prompt=None, messages=_chat("Name a colour.")))
    other = prefix_key(RequestBody(prompt=None, messages=_chat("What is 2+2?", "Be terse. " * 200)))
    assert a is not None and a == b and a != other
    assert prefix_key(RequestBody(prompt=None, messages=_chat("x"), model="m2")) != a  # other model
    kwargs = RequestBody(prompt=None, messages=_chat("x"), chat_template_kwargs={"enable_thinking": False})
    assert prefix_key(kwargs) != a  # the template may render another start
    assert prefix_key(RequestBody(prompt="short", messages=None)) is None
    assert prefix_key(RequestBody(prompt="y" * ROUTE_MIN_CHARS, messages=None)) is not None
    assert prefix_key(RequestBody(prompt=list(range(300)), messages=None)) == prefix_key(
        RequestBody(prompt=[*range(256), 7, 7], messages=None)
    )
    assert prefix_key(RequestBody(prompt=list(range(100)), messages=None)) is None


async def _router(url: str, name: str, **cfg) -> tuple[Router, StreamConsumer, Connections]:
    conns = Connections(connect(url))
    consumer = StreamConsumer(conns, KEYS, name)
    await consumer.ensure_group()
    return (
        Router(conns.fast, conns.blocking(200), 200, KEYS, name, RoutingConfig(enabled=True, **cfg)),
        consumer,
        conns,
    )


def test_pass_goes_only_to_a_live_warm_worker_with_room_and_not_much_busier(valkey):
    async def main():
        from specserve.queue.client import QueueClient

        client = QueueClient(connect(valkey.url), KEYS)
        a, ca, conns_a = await _router(valkey.url, "a", slack=2)
        b, cb, conns_b = await _router(valkey.url, "b", slack=2)
        body = {"messages": _chat("hi"), **GREEDY}
        key = prefix_key(RequestBody(prompt=None, messages=body["messages"]))
        assert key is not None
        verdicts = []

        async def offer(setup) -> str:
            rid = (await client.enqueue(body)).id
            (entry,) = await cb.read_new(1, wait=False)
            assert entry.request_id == rid
            await setup()
            got = await b.offer([(entry, key)], ttl_ms=60_000)
            verdicts.append(got.get(entry.entry_id, ""))
            return entry

        async def nothing():
            pass

        assert await a.passed_to_me() == []  # a reads its passes from now on
        await offer(nothing)  # nobody is warm
        await a.advertise([key])
        await offer(nothing)  # a is warm but has published no load: it may be dead
        await a.publish_load(0, 0)
        await offer(nothing)  # no room
        await a.publish_load(5, 3)
        await b.publish_load(2, 3)
        await offer(nothing)  # 5 in flight against 2: more than the slack
        await a.publish_load(4, 3)
        passed = await offer(nothing)  # within the slack: passed
        assert (await client.r.hget(KEYS.load, "a")).startswith("5 2 ")  # the pass counts in a's load at once
        await offer(nothing)  # so the next one stays: 5 against 2 again
        await b.advertise([key])
        await offer(nothing)  # b is warm itself: it keeps it
        assert verdicts == ["", "", "", "", "a", "", ""]

        # The passed entry is a's pending entry now, not a new delivery, and a hears of it.
        pending = await client.r.xpending_range(
            KEYS.requests, KEYS.group, passed.entry_id, passed.entry_id, 1
        )
        assert pending[0]["consumer"] == "a" and pending[0]["times_delivered"] == 1
        assert await a.passed_to_me() == [passed.entry_id]
        assert await b.offer([(passed, key)], ttl_ms=60_000) == {}  # never passed twice

        # Taking back works while a has not claimed it, and only then.
        assert await b.take_back(passed, "a") is passed
        pending = await client.r.xpending_range(
            KEYS.requests, KEYS.group, passed.entry_id, passed.entry_id, 1
        )
        assert pending[0]["consumer"] == "b" and pending[0]["times_delivered"] == 1
        assert await b.take_back(passed, "a") is None  # not a's any more

        # A raw XADD (no status hash until its first claim) is passed too, and its hash expires.
        await client.r.xadd(KEYS.requests, {"id": "raw-1", "body": orjson.dumps(body).decode()})
        (raw,) = await cb.read_new(1, wait=False)
        await a.publish_load(0, 3)
        await a.advertise(["other-prompt"])  # b is warm for `key` by now: another key a alone holds
        assert await b.offer([(raw, "other-prompt")], ttl_ms=60_000) == {raw.entry_id: "a"}
        assert await client.r.hget(KEYS.req("raw-1"), "passed") == "a"
        assert 0 < await client.r.pttl(KEYS.req("raw-1")) <= 60_000
        for c in (conns_a, conns_b):
            await c.aclose(close_redis=True)
        await client.aclose()

    run(main())


@contextlib.asynccontextmanager
async def _warm_then_cold(url: str, model_dir, wait_ms: int, hears_passes: bool):
    """A worker warm for SYSTEM (it ran one request behind it) that no longer reads the group, and a cold
    one beside it; both publish their loads. `hears_passes`: whether the warm one still reads its passes."""
    routing = {"routing": RoutingConfig(enabled=True, wait_ms=wait_ms)}
    async with service_stack(url, model_dir, name="warm", **routing) as (warm, client):
        first = (await client.enqueue({"messages": _chat("Hi."), **GREEDY})).id
        assert (await client.wait(first)).status == "finished"
        await warm._stop(warm._pulling[:2] if hears_passes else warm._pulling)
        await _blocked_read_ends()
        async with service_stack(url, model_dir, name="cold", engine_args=OTHER_ENGINE, **routing) as (
            cold,
            _,
        ):
            await wait_for(lambda: _loaded(client, ("warm", "cold")), what="both loads published")
            yield warm, cold, client


def test_requests_go_to_the_worker_that_ran_their_prefix(valkey, tiny_model_dir, tiny_engines):
    questions = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to three."]
    ref = _reference(tiny_engines, tiny_model_dir, questions)

    async def main():
        async with _warm_then_cold(valkey.url, tiny_model_dir, 5000, hears_passes=True) as (
            warm,
            cold,
            client,
        ):
            ids = [(await client.enqueue({"messages": _chat(q), **GREEDY})).id for q in questions]
            results = [await client.wait(i) for i in ids]
            infos = [await client.info(i) for i in ids]
            await cold._refresh_stats()
            metrics = cold.telemetry.metrics_text().decode()
            assert f"specserve_prefix_routing_passed_total {float(len(ids))}" in metrics.splitlines()
            return results, infos, cold.routing.passed, warm.routing.received

    results, infos, passed, received = run(main())
    assert [r.token_ids for r in results] == [r.token_ids for r in ref]
    assert all(i["worker"] == "warm" and i["passed"] == "warm" and i["run"] == "1" for i in infos), [
        (i["worker"], i.get("passed"), i["run"], i["cached_tokens"]) for i in infos
    ]
    assert passed == received == len(results)


def test_a_passed_request_comes_back_when_the_warm_one_does_not_claim_it(
    valkey, tiny_model_dir, tiny_engines
):
    ref = _reference(tiny_engines, tiny_model_dir, ["Say hello."])

    async def main():
        async with _warm_then_cold(valkey.url, tiny_model_dir, 50, hears_passes=False) as (_, cold, client):
            rid = (await client.enqueue({"messages": _chat("Say hello."), **GREEDY})).id
            result = await asyncio.wait_for(client.wait(rid), 60)
            return result, await client.info(rid), cold.routing.taken_back

    result, info, taken_back = run(main())
    assert result.token_ids == ref[0].token_ids
    assert info["worker"] == "cold" and info["passed"] == "warm" and info["run"] == "1" and taken_back == 1


async def _pending(client, entry_id: str) -> list[dict]:
    return await client.r.xpending_range(KEYS.requests, KEYS.group, entry_id, entry_id, 1)


async def _blocked_read_ends() -> None:
    """A cancelled XREADGROUP ... BLOCK stays blocked on the server, which would still hand it the next entry
    (then pending there until the claim timeout): let it time out first."""
    await asyncio.sleep(BLOCK_MS / 1000 + 0.5)


def _reference(tiny_engines, model_dir, questions):
    llm = tiny_engines.llm(model_dir)
    return llm.generate([llm.engine.encode_chat(_chat(q)) for q in questions], SamplingParams(**GREEDY))


async def _loaded(client, names) -> bool:
    load = await client.r.hgetall(KEYS.load)
    return all(n in load for n in names)
