"""The worker's intake against what anyone with access to Redis can XADD: bytes that are not UTF-8 in ids,
field names and bodies, numbers out of range, entries far over the size limits, a duplicate id. One bad
entry ends alone (failed with the field, or dead-lettered with a reason); its batch-mates run exactly once.

Each case replays a red-team finding (F1, F2, F3, F7 in docs/hardening.md) that lost or stalled
requests before."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json

import orjson
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from valkey_helpers import run, service_stack, wait_for

from specserve import SamplingParams
from specserve.queue.keys import Keys

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _body(prompt: str, **extra) -> bytes:
    return json.dumps({"prompt": prompt, **GREEDY, **extra}).encode()  # json: ints past 64 bits too


def _reference(tiny_engines, model_dir, prompts):
    return {
        p: o.token_ids
        for p, o in zip(prompts, tiny_engines.llm(model_dir).generate(prompts, SamplingParams(**GREEDY)))
    }


async def _xadd_all(raw, entries: list[dict[bytes, bytes]]) -> None:
    """Every entry in one MULTI, so a worker reads them in one batch."""
    pipe = raw.pipeline(transaction=True)
    for fields in entries:
        pipe.xadd(KEYS.requests, fields)
    await pipe.execute()


async def _finals(raw, rid: str) -> int:
    return sum(1 for _, f in await raw.xrange(KEYS.out(rid)) if b"finish_reason" in f)


async def _dead(raw) -> list[dict[bytes, bytes]]:
    return [f for _, f in await raw.xrange(KEYS.dead)]


VALID = ["def fibonacci(n):", "The quick brown fox", "Hello"]


def test_bytes_that_are_not_utf8_fail_their_own_entry_and_every_neighbour_runs(
    valkey, tiny_model_dir, tiny_engines
):
    """F1: the red team's repro (a body with \\xff first in a MULTI, valid entries after it), plus a
    non-UTF-8 id and a non-UTF-8 field name in the same batch."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)
    bad_body = b'{"prompt":"\xff"}'

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await _xadd_all(
                    raw,
                    [
                        {b"id": b"junk1", b"body": bad_body},
                        {b"id": b"ok-0", b"body": _body(VALID[0])},
                        {b"id": b"\xff\xfe-id", b"body": _body("no usable id")},
                        {b"id": b"ok-1", b"body": _body(VALID[1]), b"\xff": b"\xfe"},  # extra junk field
                        {b"id": b"ok-2", b"body": _body(VALID[2])},
                    ],
                )
                results = {rid: await client.wait(rid) for rid in ("junk1", "ok-0", "ok-1", "ok-2")}
                finals = {rid: await _finals(raw, rid) for rid in results}
                return results, finals, await _dead(raw)
            finally:
                await raw.aclose()

    results, finals, dead = run(main())
    for i, prompt in enumerate(VALID):
        got = results[f"ok-{i}"]
        assert got.status == "finished" and got.token_ids == ref[prompt], got
    assert results["junk1"].status == "failed" and results["junk1"].error_field == "body"
    assert "UTF-8" in results["junk1"].error
    assert finals == {"junk1": 1, "ok-0": 1, "ok-1": 1, "ok-2": 1}
    (letter,) = dead  # the entry with no usable id, its bytes kept as they came
    assert letter[b"reason"] == b"entry has no valid id" and letter[b"body"] == _body("no usable id")


def test_reclaim_moves_past_an_entry_that_is_not_utf8(valkey, tiny_model_dir, tiny_engines):
    """F1: a worker died holding a batch with a non-UTF-8 entry; the survivor reclaims every entry of it."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, start_worker=False, claim_timeout_s=0.2) as (
            worker,
            client,
        ):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await client.ensure_group()
                await _xadd_all(
                    raw,
                    [{b"id": b"\xffghost", b"body": b"\xff\xff"}]
                    + [{b"id": f"r-{i}".encode(), b"body": _body(p)} for i, p in enumerate(VALID)],
                )
                # a worker that read the batch and was SIGKILLed: a real consumer that never comes back
                got = await raw.xreadgroup(KEYS.group, "ghost", {KEYS.requests: ">"}, count=10)
                assert len(got[0][1]) == 4
                await worker.start()
                results = [await client.wait(f"r-{i}") for i in range(len(VALID))]
                await wait_for(lambda: _no_pending(raw), what="nothing left pending")
                runs = [(await client.info(f"r-{i}"))["run"] for i in range(len(VALID))]
                return results, runs, await _dead(raw)
            finally:
                await raw.aclose()

    results, runs, dead = run(main())
    assert [r.token_ids for r in results] == [ref[p] for p in VALID]
    assert all(r.status == "finished" for r in results) and runs == ["1"] * len(VALID)
    assert [d[b"body"] for d in dead] == [b"\xff\xff"]


async def _no_pending(raw) -> bool:
    return (await raw.xpending(KEYS.requests, KEYS.group))["pending"] == 0


def test_a_drain_with_an_undecodable_entry_pending_hands_back_the_rest(valkey, tiny_model_dir, tiny_engines):
    """F1: SIGTERM while entries read but not started include one that is not UTF-8: the drain completes,
    the poison is dead-lettered, the rest run on the next worker."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)

    async def main():
        raw = aioredis.Redis.from_url(valkey.url)
        try:
            async with service_stack(valkey.url, tiny_model_dir, name="first", start_worker=False) as (
                w1,
                c1,
            ):
                await c1.ensure_group()
                await _xadd_all(
                    raw,
                    [{b"id": f"h-{i}".encode(), b"body": _body(p)} for i, p in enumerate(VALID)]
                    + [{b"\xff": b"\xff", b"body": b'{"prompt": "x"}'}],
                )
                # read as the drain began: pending on this worker, never started
                await raw.xreadgroup(KEYS.group, "first", {KEYS.requests: ">"}, count=10)
                await w1.drain(timeout=0)
            async with service_stack(valkey.url, tiny_model_dir, name="second", claim_timeout_s=0.5) as (
                _,
                c2,
            ):
                results = [await c2.wait(f"h-{i}") for i in range(len(VALID))]
                workers = [(await c2.info(f"h-{i}"))["worker"] for i in range(len(VALID))]
                return results, workers, await _dead(raw)
        finally:
            await raw.aclose()

    results, workers, dead = run(main())
    assert [r.token_ids for r in results] == [ref[p] for p in VALID]
    assert all(r.status == "finished" for r in results) and workers == ["second"] * len(VALID)
    assert [d[b"reason"] for d in dead] == [b"entry has no valid id"]


def test_numbers_out_of_range_fail_their_own_request_naming_the_field(valkey, tiny_model_dir, tiny_engines):
    """F2: a deadline of 1e308 overflowed the claim and stalled its whole batch; a seed past 64 bits raised
    on the engine's step thread. Each now fails alone, naming its field."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)
    bad = {
        "deadline-huge": ({"deadline": 1e308}, "deadline"),
        "deadline-negative": ({"deadline": -1}, "deadline"),
        "seed-huge": ({"seed": 10**20, "temperature": 0.5}, "seed"),
        "temperature-huge": ({"temperature": 1e308}, "temperature"),
        "max-tokens-float": ({"max_tokens": 2**64}, "max_tokens"),  # orjson reads it as a float
        "top-k-huge": ({"top_k": 10**18}, None),  # fine: more than the vocabulary means all of it
    }

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                entries = [{b"id": rid.encode(), b"body": _body("x", **f)} for rid, (f, _) in bad.items()]
                entries += [{b"id": f"n-{i}".encode(), b"body": _body(p)} for i, p in enumerate(VALID)]
                entries.append({b"id": b"nan-text", b"body": b'{"prompt": "x", "temperature": NaN}'})
                await _xadd_all(raw, entries)
                results = {rid: await client.wait(rid) for rid in [*bad, "nan-text"]}
                good = [await client.wait(f"n-{i}") for i in range(len(VALID))]
                return results, good, worker.engine.error
            finally:
                await raw.aclose()

    results, good, engine_error = run(main())
    assert engine_error is None
    for rid, (_, field) in bad.items():
        if field is None:
            assert results[rid].status == "finished", results[rid]
        else:
            assert results[rid].status == "failed" and results[rid].error_field == field, (rid, results[rid])
    assert results["nan-text"].status == "failed" and results["nan-text"].error_field == "body"
    assert [r.token_ids for r in good] == [ref[p] for p in VALID]


def test_raw_entries_over_the_limits_fail_before_they_are_parsed_or_tokenized(
    valkey, tiny_model_dir, tiny_engines
):
    """F3: a raw XADD skips the API's limits; a 5 MB prompt was tokenized in full before it was refused,
    with the pull loop stalled meanwhile. The worker now applies the API's limits first."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)
    long_ok = "=" * 9000  # past the length tokenized in a thread, under every limit (142 tokens)

    async def main():
        async with service_stack(
            valkey.url, tiny_model_dir, max_body_chars=1 << 20, max_prompt_chars=200_000
        ) as (
            _worker,
            client,
        ):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await _xadd_all(
                    raw,
                    [
                        {b"id": b"huge-body", b"body": _body("x" * (5 << 20))},
                        {b"id": b"long-prompt", b"body": _body("y" * 300_000)},
                        {
                            b"id": b"long-chat",
                            b"body": orjson.dumps({"messages": [{"role": "user", "content": "z" * 300_000}]}),
                        },
                        {b"id": b"long-ok", b"body": _body(long_ok, max_tokens=2)},
                    ]
                    + [{b"id": f"c-{i}".encode(), b"body": _body(p)} for i, p in enumerate(VALID)],
                )
                ids = ["huge-body", "long-prompt", "long-chat", "long-ok"] + [f"c-{i}" for i in range(3)]
                return {rid: await client.wait(rid) for rid in ids}
            finally:
                await raw.aclose()

    results = run(main())
    huge = results["huge-body"]
    assert huge.status == "failed" and huge.error_field == "body" and "too large" in huge.error
    assert results["long-prompt"].error_field == "prompt" and "too long" in results["long-prompt"].error
    assert results["long-chat"].error_field == "messages"
    assert results["long-ok"].status == "finished" and len(results["long-ok"].token_ids) == 2
    assert [results[f"c-{i}"].token_ids for i in range(3)] == [ref[p] for p in VALID]


def test_chat_over_the_context_names_messages(valkey, tiny_model_dir):
    """F9: the prompt a chat request becomes is the worker's doing; the client sent messages. Both where
    the worker tokenizes on its loop and where a long chat is tokenized in a thread."""
    # over the tiny model's 2048-token context: one token per character of "1 2 3 ..."
    words = "1 2 3 " * 1500  # 9,000 characters: past the length tokenized in a thread

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            short = await client.enqueue(
                {"messages": [{"role": "user", "content": words[:3900]}], "max_tokens": 2}
            )
            longer = await client.enqueue({"messages": [{"role": "user", "content": words}], "max_tokens": 2})
            return await client.wait(short.id), await client.wait(longer.id)

    short, longer = run(main())
    assert short.status == "failed" and short.error_field == "messages" and "tokens" in short.error
    assert longer.status == "failed" and longer.error_field == "messages" and "tokens" in longer.error


def test_a_duplicate_id_arriving_while_the_original_runs_here_is_acknowledged_at_once(valkey, tiny_model_dir):
    """F7: the second entry of a running id was skipped as "ours" and stayed pending until a reclaim, 30 s
    later, acknowledged it."""

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            await client.enqueue({"prompt": "a long one", "max_tokens": 400, "ignore_eos": True}, "dup")
            await wait_for(lambda: _running(worker, "dup"), what="the original running")
            await client.r.xadd(KEYS.requests, {"id": "dup", "body": _body("the producer's retry")})
            # well inside the 30 s claim timeout after which a reclaim would have acknowledged it
            await wait_for(lambda: _pending_is(client.r, 1), timeout=10, what="the duplicate acknowledged")
            still_running = "dup" in worker.inflight
            result = await client.wait("dup")
            return still_running, result, await client.info("dup")

    still_running, result, info = run(main())
    assert still_running and result.status == "finished" and info["run"] == "1"
    assert len(result.token_ids) == 400


async def _running(worker, rid: str) -> bool:
    return rid in worker.inflight


async def _pending_is(r, n: int) -> bool:
    return (await r.xpending(KEYS.requests, KEYS.group))["pending"] == n


# ---- fuzz: random bytes in mixed batches ---------------------------------------------------------------

_junk = st.binary(min_size=0, max_size=40)
_bad_entry = st.one_of(
    st.dictionaries(_junk.filter(bool), _junk, min_size=1, max_size=4),  # anything at all
    st.builds(lambda i, b: {b"id": i, b"body": b}, _junk.filter(bool), _junk),  # a bad id
    st.builds(lambda b: {b"id": b"fuzz-bad", b"body": b}, _junk),  # a usable id, a bad body
    st.builds(
        lambda k, v: {b"id": b"fuzz-bad2", k: v, b"body": b'{"prompt": "x"}'}, _junk.filter(bool), _junk
    ),
)


def test_fuzz_random_bytes_in_mixed_batches_never_cost_a_valid_neighbour(valkey, tiny_model_dir):
    """Hypothesis throws random bytes at ids, field names and bodies, mixed with valid entries in one
    MULTI; every valid entry finishes exactly once, and nothing is left pending."""
    counter = itertools.count()
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    _worker, client = loop.run_until_complete(
        stack.enter_async_context(service_stack(valkey.url, tiny_model_dir))
    )
    raw = aioredis.Redis.from_url(valkey.url)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bad=st.lists(_bad_entry, min_size=1, max_size=4), n_valid=st.integers(1, 3), data=st.data())
    def one_batch(bad, n_valid, data):
        k = next(counter)
        valid = [{b"id": f"v{k}-{i}".encode(), b"body": _body("Hello")} for i in range(n_valid)]
        entries = list(valid)
        for b in bad:
            entries.insert(data.draw(st.integers(0, len(entries))), b)

        async def check():
            await raw.delete(
                KEYS.req("fuzz-bad"), KEYS.out("fuzz-bad"), KEYS.req("fuzz-bad2"), KEYS.out("fuzz-bad2")
            )
            await _xadd_all(raw, entries)
            for v in valid:
                rid = v[b"id"].decode()
                result = await asyncio.wait_for(client.wait(rid), 30)
                assert result.status == "finished" and len(result.token_ids) == GREEDY["max_tokens"], result
                assert await _finals(raw, rid) == 1
            await wait_for(lambda: _no_pending(raw), timeout=30, what="every entry acknowledged")

        loop.run_until_complete(check())

    try:
        one_batch()
    finally:
        loop.run_until_complete(raw.aclose())
        loop.run_until_complete(stack.aclose())
        loop.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"deadline": float("inf")},
        {"deadline": 1e308},
        {"deadline": -0.0},
        {"deadline": 2**70},
        {"temperature": float("nan")},
        {"top_p": float("inf")},
        {"seed": 2**64},
        {"seed": -(2**63) - 1},
        {"max_tokens": 2**70},
        {"top_k": -(2**70)},
        {"speculation": 2**70},
        {"stop_token_ids": [-1]},
    ],
)
def test_every_number_is_bounded_before_it_is_used(fields):
    """Non-finite, huge and negative values of every numeric field are refused at the wire or by
    SamplingParams, naming the field (the worker and the API both call these)."""
    from specserve.engine.errors import InvalidParameter
    from specserve.queue.wire import WireError, parse_body

    (name,) = fields
    try:
        body = parse_body({"prompt": "x", **fields})
        SamplingParams.from_dict(body.sampling)
    except (WireError, InvalidParameter) as e:
        assert e.field == name
    else:
        assert name == "deadline" and fields[name] == 0.0  # -0.0 is the epoch: valid, and long past


def test_dead_letters_are_capped_trimmed_by_age_and_expire(valkey):
    """Data at rest: a flood of bad entries cannot fill Redis through the dead-letter stream."""
    from specserve.queue.connection import Connections, connect
    from specserve.queue.consumer import ConsumerConfig, StreamConsumer
    from specserve.queue.wire import RequestEntry

    async def main():
        r = connect(valkey.url)
        conns = Connections(r)
        c = StreamConsumer(
            conns, KEYS, "w", ConsumerConfig(dead_maxlen=3, dead_ttl_ms=60_000, dead_body_chars=10)
        )
        try:
            await c.ensure_group()
            old = "1000-0"  # an entry id from 1970: older than any TTL
            await r.xadd(KEYS.dead, {"entry": old}, id=old)
            await c.dead_letter(RequestEntry("1-0", None, "x"), "no id")
            after_one = await r.xlen(KEYS.dead)  # the old letter trimmed by age, not by the cap
            for i in range(1, 5):
                await c.dead_letter(RequestEntry(f"{i + 1}-0", None, "\udcff" + "b" * 20), "no id")
            letters = await aioredis.Redis.from_url(valkey.url).xrange(KEYS.dead)
            return after_one, letters, await r.pttl(KEYS.dead)
        finally:
            await conns.aclose(close_redis=True)

    after_one, letters, ttl = run(main())
    assert after_one == 1
    assert [f[b"entry"] for _, f in letters] == [b"3-0", b"4-0", b"5-0"]
    assert letters[0][1][b"body"] == b"\xff" + b"b" * 9 and b"cut to 10" in letters[0][1][b"reason"]
    assert 0 < ttl <= 60_000


def test_an_unreadable_output_entry_is_skipped_and_the_reader_serves_everyone_else(valkey):
    from specserve.queue.client import QueueClient
    from specserve.queue.connection import connect
    from specserve.queue.wire import OutputEntry

    async def main():
        async with QueueClient(connect(valkey.url), KEYS) as c:
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await raw.xadd(KEYS.out("bad"), {b"ids": b"\xff", b"text": b"x"})
                await raw.xadd(
                    KEYS.out("bad"), OutputEntry(1, 0, 0, [5], "a", "stop", "finished").to_fields()
                )
                await raw.xadd(
                    KEYS.out("good"), OutputEntry(1, 0, 0, [7], "b", "stop", "finished").to_fields()
                )
                return await asyncio.gather(c.wait("bad"), c.wait("good"))
            finally:
                await raw.aclose()

    bad, good = run(main(), timeout=20)
    assert bad.token_ids == [5] and good.token_ids == [7] and good.status == "finished"


def test_an_entry_whose_status_key_is_unusable_is_dead_lettered_once(valkey, tiny_model_dir, tiny_engines):
    """The claim script fails for one entry (its status key holds a string): that entry alone is
    dead-lettered and acknowledged, so no later reclaim dead-letters it again; its neighbours run."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, claim_timeout_s=0.3) as (_worker, client):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await raw.set(KEYS.req("wrongtype"), b"not a hash")
                await _xadd_all(
                    raw,
                    [{b"id": b"wrongtype", b"body": _body("x")}]
                    + [{b"id": f"w-{i}".encode(), b"body": _body(p)} for i, p in enumerate(VALID)],
                )
                good = [await client.wait(f"w-{i}") for i in range(len(VALID))]
                await wait_for(lambda: _no_pending(raw), timeout=10, what="the bad entry acknowledged")
                await asyncio.sleep(1.0)  # a few reclaim periods: nothing comes back to be dead-lettered
                return good, await _dead(raw)
            finally:
                await raw.aclose()

    good, dead = run(main())
    assert [r.token_ids for r in good] == [ref[p] for p in VALID]
    assert [d[b"id"] for d in dead] == [b"wrongtype"] and b"WRONGTYPE" in dead[0][b"reason"]


def test_a_full_redis_holds_outputs_and_claims_until_there_is_room(valkey, tiny_model_dir, tiny_engines):
    """maxmemory with noeviction refuses writes (OOM): the worker's outputs, finals and claims wait for room
    instead of being dropped or dead-lettered, and every request then finishes exactly once."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)
    long = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}  # still running when polled
    ref_long = tiny_engines.llm(tiny_model_dir).generate([VALID[0]], SamplingParams(**long))[0].token_ids

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await client.enqueue({"prompt": VALID[0], **long}, "running")
                await wait_for(lambda: _running(worker, "running"), what="running")
                # fill it up: the server refuses every write from now on
                used = (await raw.info("memory"))["used_memory"]
                await raw.config_set("maxmemory", used)
                await raw.config_set("maxmemory-policy", "noeviction")
                # queued behind the wall (a raw XADD over the limit would be refused too: add them first
                # with room, then fill)
                await raw.config_set("maxmemory", 0)
                await _xadd_all(
                    raw, [{b"id": f"q-{i}".encode(), b"body": _body(p)} for i, p in enumerate(VALID)]
                )
                used = (await raw.info("memory"))["used_memory"]
                await raw.config_set("maxmemory", used)
                await asyncio.sleep(1.5)  # outputs, finals and claims are refused meanwhile
                refused = (await raw.info("stats")).get("total_error_replies", 0)
                await raw.config_set("maxmemory", 0)
                results = {rid: await client.wait(rid) for rid in ["running", "q-0", "q-1", "q-2"]}
                finals = {rid: await _finals(raw, rid) for rid in results}
                runs = {(await client.info(rid))["run"] for rid in results}
                return results, finals, refused, await _dead(raw), runs
            finally:
                await raw.aclose()

    results, finals, refused, dead, runs = run(main())
    assert runs == {"1"}  # nothing had to be rerun: no write was dropped
    assert refused > 0  # the server did refuse writes while full
    assert results["running"].status == "finished" and results["running"].token_ids == ref_long
    for i, p in enumerate(VALID):
        assert results[f"q-{i}"].status == "finished" and results[f"q-{i}"].token_ids == ref[p]
    assert set(finals.values()) == {1} and dead == []


def test_a_producer_reads_every_result_once_from_its_reply_stream(valkey, tiny_model_dir, tiny_engines):
    """reply_to: the worker also writes each final result, whole, to {prefix}:reply:<name> in the same
    atomic step as the request's final entry; with reply_stream, each delta too. A producer reads its results
    with one XREAD loop instead of one wait per id."""
    ref = _reference(tiny_engines, tiny_model_dir, VALID)

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            for i, p in enumerate(VALID):
                await client.enqueue({"prompt": p, **GREEDY, "reply_to": "prod-a"}, f"a-{i}")
            await client.enqueue(
                {"prompt": VALID[0], **GREEDY, "reply_to": "prod-a", "reply_stream": True}, "a-s"
            )
            raw = aioredis.Redis.from_url(valkey.url)
            try:  # a raw producer, and one whose body is refused for another field: it still hears back
                await raw.xadd(KEYS.requests, {"id": "a-raw", "body": _body(VALID[1], reply_to="prod-a")})
                await raw.xadd(KEYS.requests, {"id": "a-bad", "body": _body("x", top_p=7, reply_to="prod-a")})
                await client.enqueue({"prompt": VALID[2], **GREEDY, "reply_to": "someone-else"}, "b-0")
                want = {f"a-{i}" for i in range(len(VALID))} | {"a-s", "a-raw", "a-bad"}
                finals: dict[str, list[dict]] = {}
                deltas: list[dict] = []
                last = "0-0"
                while set(finals) != want:
                    for _, items in await raw.xread({KEYS.reply("prod-a"): last}, block=5000) or []:
                        for eid, f in items:
                            last = eid
                            f = {k.decode(): v.decode() for k, v in f.items()}
                            (finals.setdefault(f["id"], []) if "status" in f else deltas).append(f)
                await asyncio.sleep(0.5)  # anything written twice would have arrived by now
                for _, items in await raw.xread({KEYS.reply("prod-a"): last}, block=100) or []:
                    for _, f in items:
                        finals.setdefault(f[b"id"].decode(), []).append(f)
                return finals, deltas, await raw.xlen(KEYS.reply("someone-else"))
            finally:
                await raw.aclose()

    finals, deltas, other = run(main())
    assert all(len(v) == 1 for v in finals.values()), finals  # every result exactly once
    for i, p in enumerate(VALID):
        f = finals[f"a-{i}"][0]
        assert f["status"] == "finished" and orjson.loads(f["ids"]) == ref[p]
        assert orjson.loads(f["usage"])["completion_tokens"] == len(ref[p])
    assert orjson.loads(finals["a-raw"][0]["ids"]) == ref[VALID[1]]
    bad = finals["a-bad"][0]
    assert bad["status"] == "failed" and bad["error_field"] == "top_p" and bad["ids"] == "[]"
    streamed = [d for d in deltas if d["id"] == "a-s"]
    assert {d["id"] for d in deltas} == {"a-s"} and streamed
    whole = finals["a-s"][0]
    assert (
        sum((orjson.loads(d["ids"]) for d in streamed), [])
        == orjson.loads(whole["ids"])[: sum(len(orjson.loads(d["ids"])) for d in streamed)]
    )
    assert "".join(d["text"] for d in streamed) == whole["text"][: len("".join(d["text"] for d in streamed))]
    assert other == 1  # another producer's stream got its own result only


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"reply_to": "a b"}, "reply_to"),
        ({"reply_to": "x" * 201}, "reply_to"),
        ({"reply_to": 5}, "reply_to"),
        ({"reply_to": "ok", "reply_stream": "yes"}, "reply_stream"),
        ({"reply_stream": True}, "reply_stream"),
    ],
)
def test_a_reply_stream_is_named_like_an_id(fields, field):
    """A reply stream is a key under the prefix, never one the body picks: no spaces, globs or length."""
    from specserve.queue.wire import WireError, parse_body

    with pytest.raises(WireError) as e:
        parse_body({"prompt": "x", **fields})
    assert e.value.field == field


@pytest.mark.parametrize("reply_stream", [False, True])
def test_a_reply_key_of_another_type_fails_the_request_once_naming_reply_to(
    valkey, tiny_model_dir, reply_stream
):
    """The reply stream's key holds a string: the final is written once, `failed` with error_field
    reply_to, the entry is acknowledged, nothing is dead-lettered, and the key is left as it was. (The
    finish script used to write the output entry, fail on the reply stream, and leave the entry pending for
    another delivery, forever.)"""

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, claim_timeout_s=0.3) as (_worker, client):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                await raw.set(KEYS.reply("taken"), b"a string")
                body = {"prompt": VALID[0], **GREEDY, "reply_to": "taken", "reply_stream": reply_stream}
                await client.enqueue(body, "rt-0")
                result = await client.wait("rt-0")
                await wait_for(lambda: _no_pending(raw), timeout=10, what="the entry acknowledged")
                await asyncio.sleep(1.0)  # a few reclaim periods: nothing runs it again
                kept = await raw.get(KEYS.reply("taken"))
                return result, await _finals(raw, "rt-0"), await _dead(raw), kept
            finally:
                await raw.aclose()

    result, finals, dead, kept = run(main())
    assert result.status == "failed" and result.error_field == "reply_to", result
    assert finals == 1 and dead == [] and kept == b"a string"
