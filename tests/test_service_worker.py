"""The worker against a real valkey-server and the real (tiny) engine: results equal LLM.generate, bad input
fails with a reason, cancellation, deadlines, dead letters, draining, a Redis restart, traces, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import aclosing

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from valkey_helpers import run, service_stack, wait_for

from specserve import SamplingParams
from specserve.queue.consumer import ConsumerConfig, StreamConsumer
from specserve.queue.keys import Keys
from specserve.queue.wire import RequestEntry
from specserve.service.telemetry import Telemetry

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Hello"]
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _reference(tiny_engines, model_dir, prompts, **params):
    return tiny_engines.llm(model_dir).generate(prompts, SamplingParams(**params))


def test_results_equal_llm_generate_through_client_and_raw_xadd(valkey, tiny_model_dir, tiny_engines):
    chat = [{"role": "user", "content": "What is 2+2?"}]
    sampled = {"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    llm = tiny_engines.llm(tiny_model_dir)
    ref = _reference(tiny_engines, tiny_model_dir, PROMPTS, **GREEDY)
    ref_chat = llm.generate([llm.engine.encode_chat(chat)], SamplingParams(**GREEDY))[0]
    ref_sampled = _reference(tiny_engines, tiny_model_dir, [PROMPTS[0]], **sampled)[0]

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            ids = [(await client.enqueue({"prompt": p, **GREEDY})).id for p in PROMPTS]
            # A producer in any language: XADD with the documented fields.
            await client.r.xadd(
                KEYS.requests, {"id": "raw-chat", "body": orjson.dumps({"messages": chat, **GREEDY})}
            )
            await client.r.xadd(
                KEYS.requests,
                # final-only: one output entry carries every token
                {
                    "id": "raw-ids",
                    "body": orjson.dumps({"prompt": ref[1].prompt_token_ids, **GREEDY, "stream": False}),
                },
            )
            await client.enqueue({"prompt": PROMPTS[0], **sampled}, "sampled")
            results = await asyncio.gather(
                *(client.wait(i) for i in [*ids, "raw-chat", "raw-ids", "sampled"])
            )
            lengths = [await client.r.xlen(KEYS.out(i)) for i in (ids[1], "raw-ids")]
            return results, await client.result(ids[0]), lengths

    results, stored, lengths = run(main())
    assert lengths[1] == 1 < lengths[0]  # the publisher may merge steps, but a streamed request gets several
    for got, want in zip(results, [*ref, ref_chat, ref[1], ref_sampled]):
        assert got.status == "finished" and got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.usage["prompt_tokens"] == want.usage.prompt_tokens
        assert got.usage["completion_tokens"] == want.usage.completion_tokens
    assert (
        stored.token_ids == ref[0].token_ids
        and stored.info["worker"] == "w-test"
        and stored.info["run"] == "1"
    )
    # the engine's share of the latency, for telling it from what the queue and transport add
    created, finished = int(stored.info["created"]), int(stored.info["finished"])
    assert 0 < float(stored.info["engine_ms"]) <= finished - created + 1


def test_a_long_prompt_is_tokenised_off_the_loop_with_the_same_result(valkey, tiny_model_dir, tiny_engines):
    prompt = "=" * 9000 + " and then"  # past the length where the worker tokenises in a thread
    ref = _reference(tiny_engines, tiny_model_dir, [prompt], **GREEDY)[0]

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            return await client.wait((await client.enqueue({"prompt": prompt, **GREEDY})).id)

    got = run(main())
    assert got.token_ids == ref.token_ids and got.usage["prompt_tokens"] == len(ref.prompt_token_ids)


def test_bad_requests_fail_with_a_reason_and_the_worker_goes_on(valkey, tiny_model_dir):
    bad = {
        "json": (b"{not json", "body"),
        "unknown-field": (orjson.dumps({"prompt": "x", "temperture": 1}), "temperture"),
        "negative-max": (orjson.dumps({"prompt": "x", "max_tokens": -1}), "max_tokens"),
        "huge-max": (orjson.dumps({"prompt": "x", "max_tokens": 10**9}), "max_tokens"),
        "too-long": (orjson.dumps({"prompt": [5] * 5000}), "prompt"),
        "wrong-type": (orjson.dumps({"prompt": "x", "top_p": "high"}), "top_p"),
        "bad-model": (orjson.dumps({"prompt": "x", "model": "gpt-9"}), "model"),
        "no-prompt": (orjson.dumps({"max_tokens": 3}), "prompt"),
    }

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            for rid, (body, _) in bad.items():
                await client.r.xadd(KEYS.requests, {"id": rid, "body": body})
            await client.r.xadd(KEYS.requests, {"body": b'{"prompt": "no id"}'})
            ok = await client.enqueue({"prompt": "still here", "max_tokens": 3})
            results = {rid: await client.wait(rid) for rid in bad}
            good = await client.wait(ok.id)
            dead = await client.r.xrange(KEYS.dead)
            infos = {rid: await client.info(rid) for rid in bad}
            return results, good, dead, infos

    results, good, dead, infos = run(main())
    for rid, (_, field) in bad.items():
        r = results[rid]
        assert r.status == "failed" and r.finish_reason == "error" and r.error, rid
        assert r.error_field == field and infos[rid]["error_field"] == field, (rid, r.error)
    assert "temperture" in results["unknown-field"].error and "unknown" in results["unknown-field"].error
    assert good.status == "finished" and len(good.token_ids) >= 1
    assert len(dead) == 1 and dead[0][1]["reason"] == "entry has no valid id"


def test_cancellation_stops_within_a_step_and_frees_kv_blocks(valkey, tiny_model_dir):
    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            rid = (
                await client.enqueue({"prompt": "Tell me a story", "max_tokens": 1900, "ignore_eos": True})
            ).id
            async with aclosing(client.stream(rid)) as deltas:
                async for d in deltas:
                    if d.token_ids:
                        break
            assert worker.engine.stats().kv_blocks_used > 0
            assert (await client.cancel(rid))[0] == "cancelling"
            result = await client.wait(rid)
            await wait_for(lambda: _true(worker.engine.stats().kv_blocks_used == 0), what="blocks freed")
            return result

    result = run(main())
    assert result.status == "cancelled" and result.finish_reason == "abort"
    assert 0 < result.usage["completion_tokens"] < 1900


async def _true(value: bool) -> bool:
    return value


def test_an_expired_deadline_never_starts(valkey, tiny_model_dir):
    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            steps = worker.engine.stats().steps
            late = await client.enqueue({"prompt": "too late", "max_tokens": 5, "deadline": 1.0})
            result = await client.wait(late.id)
            return result, await client.info(late.id), worker.engine.stats().steps - steps

    result, info, steps = run(main())
    assert result.status == "expired" and result.token_ids == [] and result.error_field == "deadline"
    assert "run" not in info and "started" not in info and steps == 0


def test_requests_started_before_their_claim_stop_when_it_says_no(valkey, tiny_model_dir, tiny_engines):
    """Fresh entries reach the engine while their claim is in flight; one cancelled while it waits in the
    ready queue is aborted when the claim answers, the second entry of a duplicated id never reaches the
    engine (its sort-in sees the id taken), and nothing is left behind."""
    ref = _reference(tiny_engines, tiny_model_dir, [PROMPTS[1]], **GREEDY)[0]

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, start_worker=False) as (worker, client):
            await client.enqueue({"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True}, "gone")
            await worker.consumer.ensure_group()
            await worker._sort_new(wait=False)  # into the ready queue; cancelled while it waits there
            assert (await client.cancel("gone"))[0] == "cancelled"
            body = orjson.dumps({"prompt": PROMPTS[1], **GREEDY})
            for _ in range(2):  # a producer's retry: the same id twice, read in one batch
                await client.r.xadd(KEYS.requests, {"id": "twice", "body": body})
            seq_ids = worker.engine.engine._seq_ids  # one id per request the engine was handed
            before = next(seq_ids)
            await worker.start()
            gone, twice = await client.wait("gone"), await client.wait("twice")
            await wait_for(lambda: _true(worker.engine.num_unfinished() == 0 and not worker.inflight))
            handed = next(seq_ids) - before - 1
            return gone, twice, worker.engine.stats(), handed, await client.info("twice")

    gone, twice, stats, handed, info = run(main())
    assert handed == 2  # "gone" went to the engine before its claim said cancel; "twice" once
    assert gone.status == "cancelled" and gone.token_ids == []
    assert twice.status == "finished" and twice.token_ids == ref.token_ids and info["run"] == "1"
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0


def test_an_entry_delivered_again_while_its_claim_is_retried_runs_once(valkey, tiny_model_dir, tiny_engines):
    """A failover to a replica that missed the read delivers the same entry again while this worker's claim of
    it is still being retried: the second delivery waits on that claim instead of starting the request twice
    (the engine refused the second start, and the request failed)."""
    ref = _reference(tiny_engines, tiny_model_dir, [PROMPTS[2]], **GREEDY)[0]

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            claim, claiming, again = worker.consumer.claim, asyncio.Event(), asyncio.Event()

            async def slow_claim(pairs):  # the first claim waits out a failover (or the second delivery)
                if claiming.is_set():
                    again.set()
                else:
                    claiming.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(again.wait(), timeout=1.0)
                return await claim(pairs)

            worker.consumer.claim = slow_claim
            await client.enqueue({"prompt": PROMPTS[2], **GREEDY}, "again")
            await asyncio.wait_for(claiming.wait(), timeout=30)
            (entry_id, fields), *_ = await client.r.xrange(KEYS.requests)
            await worker._admit([RequestEntry.from_fields(entry_id, fields)], fresh=True)
            result = await client.wait("again")
            await wait_for(lambda: _true(not worker.inflight))
            return result, await client.info("again")

    result, info = run(main())
    assert result.status == "finished" and result.token_ids == ref.token_ids
    assert info["run"] == "1"  # claimed once


def test_a_poison_request_goes_to_the_dead_letter_stream(valkey, tiny_model_dir):
    async def main():
        async with service_stack(
            valkey.url, tiny_model_dir, start_worker=False, claim_timeout_s=0.2, max_deliveries=2
        ) as (worker, client):
            await client.enqueue({"prompt": "crashes every worker", "max_tokens": 3}, "poison")
            # Two workers took it and died without acknowledging it: real consumers that never come back.
            for ghost in ("ghost1", "ghost2"):
                c = StreamConsumer(client.conns, KEYS, ghost, ConsumerConfig(claim_timeout_ms=0))
                await c.ensure_group()
                assert await c.read_new(1, wait=False) or await c.reclaim(1)
            await worker.start()
            result = await client.wait("poison")
            return result, await client.r.xrange(KEYS.dead)

    result, dead = run(main())
    assert result.status == "failed" and "delivered 3 times" in result.error
    assert [f["id"] for _, f in dead] == ["poison"] and dead[0][1]["deliveries"] == "3"


def test_drain_hands_in_flight_work_to_another_worker(valkey, tiny_model_dir, tiny_engines):
    params = {"max_tokens": 150, "temperature": 0.0, "ignore_eos": True}
    ref = _reference(tiny_engines, tiny_model_dir, PROMPTS, **params)

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, name="first", claim_timeout_s=0.5) as (
            w1,
            client,
        ):
            ids = [(await client.enqueue({"prompt": p, **params})).id for p in PROMPTS]
            await wait_for(lambda: _all_started(client, ids), what="all running")
            await w1.drain(timeout=0)  # SIGTERM with no grace left: everything goes back
            infos = [await client.info(i) for i in ids]
        async with service_stack(valkey.url, tiny_model_dir, name="second", claim_timeout_s=0.5) as (_w2, c2):
            results = [await c2.wait(i) for i in ids]
            return infos, results, [await c2.info(i) for i in ids]

    handed, results, infos = run(main())
    back = [i["status"] == "queued" for i in handed]
    assert any(back), handed
    for got, want, info, was_back, before in zip(results, ref, infos, back, handed):
        assert got.status == "finished" and got.token_ids == want.token_ids and got.text == want.text
        if was_back:
            assert before["handoffs"] == "1" and info["worker"] == "second" and info["run"] == "2"
        else:
            assert before["status"] == "finished" and info["worker"] == "first"


async def _all_started(client, ids) -> bool:
    for rid in ids:
        if not await client.r.exists(KEYS.out(rid)):
            return False
    return True


def test_requests_complete_across_a_redis_restart(valkey, tiny_model_dir, tiny_engines):
    params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    # Three times what the engine admits at once, so that two waves still wait in Redis when the first
    # tokens arrive, however fast the first wave runs.
    prompts = [f"Request number {i}:" for i in range(12)]
    ref = _reference(tiny_engines, tiny_model_dir, prompts, **params)

    async def main():
        async with service_stack(
            valkey.url, tiny_model_dir, engine_args={"max_num_seqs": 4}, claim_timeout_s=5
        ) as (_worker, client):
            ids = [(await client.enqueue({"prompt": p, **params})).id for p in prompts]

            async def collect(rid):
                ids_seen, text = [], ""
                async with aclosing(client.stream(rid)) as deltas:
                    async for d in deltas:
                        ids_seen += d.token_ids
                        text += d.text
                return ids_seen, text

            streams = [asyncio.create_task(collect(i)) for i in ids]
            await wait_for(lambda: client.r.exists(KEYS.out(ids[0])), what="first tokens")
            queued = sum([(await client.info(i))["status"] == "queued" for i in ids])
            await asyncio.to_thread(valkey.restart)
            streamed = await asyncio.gather(*streams)
            results = [await client.result(i) for i in ids]
            return queued, streamed, results

    queued, streamed, results = run(main(), timeout=240)
    assert queued > 0  # some were still waiting in Redis when it went down
    for (ids_seen, text), got, want in zip(streamed, results, ref):
        assert got.status == "finished" and got.token_ids == want.token_ids
        assert ids_seen == want.token_ids and text == want.text  # every token once, none lost


def test_traces_continue_the_producers_trace(valkey, tiny_model_dir):
    exporter = InMemorySpanExporter()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"

    async def main():
        telemetry = Telemetry(span_exporter=exporter)
        async with service_stack(valkey.url, tiny_model_dir, telemetry=telemetry) as (_worker, client):
            added = await client.enqueue({"prompt": "trace me", "max_tokens": 4}, traceparent=traceparent)
            await client.wait(added.id)
            await wait_for(lambda: _true(len(exporter.get_finished_spans()) >= 5), what="spans")
            return telemetry

    telemetry = run(main())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"specserve.request", "queue_wait", "prefill", "decode", "finish"} <= set(spans)
    root = spans["specserve.request"]
    assert format(root.context.trace_id, "032x") == trace_id
    assert format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    for name in ("queue_wait", "prefill", "decode", "finish"):
        assert spans[name].parent.span_id == root.context.span_id
    text = telemetry.metrics_text().decode()
    for metric in (
        "specserve_time_to_first_token_seconds_count 1.0",
        "specserve_e2e_latency_seconds_count 1.0",
        "specserve_time_per_output_token_seconds_count 1.0",
        'specserve_requests_total{status="finished"} 1.0',
    ):
        assert metric in text, metric


def test_with_speculation_on_results_are_unchanged_and_drafts_are_counted(
    valkey, tiny_model_dir, tiny_engines
):
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    prompts = ["one two three one two three one two three", "abc abc abc abc"]
    ref = _reference(tiny_engines, tiny_model_dir, prompts, **params)
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, engine_args=spec) as (worker, client):
            ids = [(await client.enqueue({"prompt": p, **params})).id for p in prompts]
            off = await client.enqueue({"prompt": prompts[0], **params, "speculation": "off"})
            results = [await client.wait(i) for i in [*ids, off.id]]
            await worker._refresh_stats()
            return results, worker.telemetry.metrics_text().decode()

    results, metrics = run(main())
    for got, want in zip(results, [*ref, ref[0]]):
        assert got.status == "finished" and got.token_ids == want.token_ids and got.text == want.text
    assert results[-1].usage["draft_proposed"] == 0  # that request asked for no speculation
    proposed = sum(r.usage["draft_proposed"] for r in results)
    assert proposed > 0 and sum(r.usage["draft_accepted"] for r in results) <= proposed
    assert f"specserve_draft_tokens_proposed_total {float(proposed)}" in metrics
