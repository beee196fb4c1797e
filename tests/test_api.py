"""The HTTP API end to end (aiohttp server -> valkey -> worker -> engine): native routes with resumable SSE,
the official openai client, bad input, auth, health and metrics, and many concurrent producers."""

from __future__ import annotations

import asyncio
import logging
import random

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from valkey_helpers import api_stack, free_port, run, wait_for

from specserve import SamplingParams
from specserve.queue.client import QueueClient
from specserve.queue.connection import connect
from specserve.queue.keys import Keys
from specserve.service.api import Api
from specserve.service.telemetry import Telemetry

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


async def _sse(resp: aiohttp.ClientResponse) -> list[dict]:
    """Parse a Server-Sent Events body into [{"id", "event", "data"}] (data JSON-decoded unless [DONE])."""
    events, current = [], {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if current:
                events.append(current)
            current = {}
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(": ")
            current[key] = value if key != "data" or value == "[DONE]" else orjson.loads(value)
    return events


async def _wait_status(http, base, rid, statuses=("finished", "failed", "cancelled", "expired")) -> dict:
    while True:
        async with http.get(f"{base}/v1/requests/{rid}") as r:
            body = await r.json()
        if body["status"] in statuses:
            return body
        await asyncio.sleep(0.02)


def test_native_routes_enqueue_poll_stream_resume_cancel(valkey, tiny_model_dir, tiny_engines):
    prompt = "The capital of France is"
    ref = tiny_engines.llm(tiny_model_dir).generate(prompt, SamplingParams(**GREEDY))[0]

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _worker, _client),
            aiohttp.ClientSession() as http,
        ):
            async with http.post(f"{base}/v1/requests", json={"id": "n1", "prompt": prompt, **GREEDY}) as r:
                assert r.status == 202 and await r.json() == {"id": "n1", "status": "queued", "created": True}
            async with http.post(f"{base}/v1/requests", json={"id": "n1", "prompt": "other"}) as r:
                assert r.status == 200 and (await r.json())["created"] is False
            done = await _wait_status(http, base, "n1")
            assert done["token_ids"] == ref.token_ids and done["text"] == ref.text
            assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 12
            assert done["error"] is None
            async with http.get(f"{base}/v1/requests/n1/stream") as r:
                assert r.headers["Content-Type"] == "text/event-stream"
                events = await _sse(r)
            tokens = [t for e in events if e["event"] == "token" for t in e["data"]["token_ids"]]
            assert tokens == ref.token_ids and events[-1]["event"] == "done"
            assert events[-1]["data"]["status"] == "finished" and events[-1]["data"]["usage"]["prompt_tokens"]
            # Resume after the first event: only what came after it.
            first = events[0]
            async with http.get(f"{base}/v1/requests/n1/stream", headers={"Last-Event-ID": first["id"]}) as r:
                rest = await _sse(r)
            resumed = first["data"]["token_ids"] + [
                t for e in rest if e["event"] == "token" for t in e["data"]["token_ids"]
            ]
            assert resumed == ref.token_ids
            assert (
                first["data"]["text"] + "".join(e["data"]["text"] for e in rest if e["event"] == "token")
                == ref.text
            )
            async with http.get(f"{base}/v1/requests/nope") as r:
                assert r.status == 404 and (await r.json())["error"]["param"] == "id"
            # Cancel a long one while it runs.
            long = {"id": "long", "prompt": prompt, "max_tokens": 1900, "ignore_eos": True}
            async with http.post(f"{base}/v1/requests", json=long) as r:
                assert r.status == 202
            async with http.get(f"{base}/v1/requests/long/stream") as r:
                async for raw in r.content:
                    if raw.startswith(b"event: token"):
                        break
            async with http.delete(f"{base}/v1/requests/long") as r:
                assert r.status == 202 and (await r.json())["status"] == "running"
            cancelled = await _wait_status(http, base, "long")
            assert cancelled["status"] == "cancelled" and len(cancelled["token_ids"]) < 1900
            async with http.delete(f"{base}/v1/requests/long") as r:
                assert r.status == 200 and (await r.json())["cancelled"] is False

    run(main())


def test_the_openai_client_streaming_and_not(valkey, tiny_model_dir, tiny_engines):
    llm = tiny_engines.llm(tiny_model_dir)
    prompt = "Once upon a time"
    chat = [{"role": "user", "content": "Say something."}]
    ref = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))[0]
    ref_chat = llm.generate([llm.engine.encode_chat(chat)], SamplingParams(max_tokens=8, temperature=0.0))[0]
    model = str(tiny_model_dir)

    async def main():
        async with api_stack(valkey.url, tiny_model_dir, api_keys=["sk-test"]) as (base, _w, queue):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sk-test", max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == [model]
            c = await client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
            assert c.choices[0].text == ref.text and c.choices[0].finish_reason == ref.finish_reason
            # Answered once at the end, so the worker wrote one output entry, not one per step.
            assert await queue.r.xlen(f"specserve:out:{c.id}") == 1
            assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (
                len(ref.prompt_token_ids),
                len(ref.token_ids),
            )
            stream = await client.completions.create(
                model=tiny_model_dir.name, prompt=prompt, max_tokens=10, temperature=0, stream=True
            )
            assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == ref.text
            cc = await client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0)
            assert (
                cc.choices[0].message.content == ref_chat.text and cc.choices[0].message.role == "assistant"
            )
            assert cc.usage.prompt_tokens == len(ref_chat.prompt_token_ids)
            chunks = [
                ch
                async for ch in await client.chat.completions.create(
                    model=model,
                    messages=chat,
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == ref_chat.text and chunks[-1].usage.completion_tokens == len(ref_chat.token_ids)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref_chat.finish_reason
            await client.close()
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as bad:
                try:
                    await bad.models.list()
                    raise AssertionError("a wrong key was accepted")
                except openai.AuthenticationError as e:
                    assert e.status_code == 401

    run(main())


def test_bad_input_is_a_4xx_naming_the_field_and_the_service_stays_up(valkey, tiny_model_dir):
    model = str(tiny_model_dir)
    cases = [
        ("/v1/requests", b"{nope", 400, "body"),
        ("/v1/requests", b"[1, 2]", 400, "body"),
        ("/v1/requests", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/requests", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
        ("/v1/requests", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
        ("/v1/requests", {"prompt": "x", "colour": "red"}, 400, "colour"),
        ("/v1/requests", {"prompt": "x" * 5000}, 400, "prompt"),
        ("/v1/requests", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/requests", {"prompt": "x", "id": "spaces are bad"}, 400, "id"),
        ("/v1/completions", {"prompt": "x"}, 400, "model"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": model, "prompt": "x", "n": 17}, 400, "n"),  # above MAX_CHOICES
        ("/v1/completions", {"model": model, "prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"model": model, "prompt": list(range(3000))}, 400, "prompt"),  # > context
        (
            "/v1/completions",
            {"model": model, "prompt": "x", "stream": True, "max_tokens": 10**6},
            400,
            "max_tokens",
        ),
        ("/v1/chat/completions", {"model": model, "messages": "hi"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            400,
            "tools[0].type",
        ),
    ]

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir, max_prompt_chars=4000, max_body_bytes=64_000) as (
                base,
                _w,
                _c,
            ),
            aiohttp.ClientSession() as http,
        ):
            for path, body, status, field in cases:
                kw = {"data": body} if isinstance(body, bytes) else {"json": body}
                async with http.post(base + path, **kw) as r:
                    err = (await r.json())["error"]
                    assert (r.status, err["param"]) == (status, field), (path, body, r.status, err)
                    assert err["message"] and err["type"]
            async with http.post(f"{base}/v1/requests", data=b"x" * 70_000) as r:
                assert r.status == 413 and (await r.json())["error"]["param"] == "body"
            async with http.get(f"{base}/v1/nowhere") as r:
                assert r.status == 404 and "error" in await r.json()
            async with http.post(
                f"{base}/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 2}
            ) as r:
                assert r.status == 200 and len((await r.json())["choices"]) == 1

    run(main())


def test_auth_covers_everything_but_health_and_metrics(valkey, tiny_model_dir):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir, api_keys=["k1", "k2"]) as (base, _w, _c),
            aiohttp.ClientSession() as http,
        ):
            for method, path in [("POST", "/v1/requests"), ("GET", "/v1/requests/x"), ("GET", "/v1/models")]:
                async with http.request(method, base + path, json={"prompt": "x"}) as r:
                    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                async with http.request(method, base + path, headers={"Authorization": "Bearer nope"}) as r:
                    assert r.status == 401
            async with http.get(f"{base}/v1/models", headers={"Authorization": "Bearer k2"}) as r:
                assert r.status == 200
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200
            async with http.get(f"{base}/readyz") as r:
                assert r.status == 200 and await r.json() == {"ready": True, "redis": True, "model": True}
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
                assert (
                    r.status == 200
                    and "specserve_queue_depth" in text
                    and "specserve_kv_blocks_total" in text
                )

    run(main())


def test_many_concurrent_producers_lose_and_duplicate_nothing(valkey, tiny_model_dir):
    producers, per_producer = 50, 10

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, client),
            aiohttp.ClientSession() as http,
        ):

            async def producer(p: int) -> list[str]:
                ids = []
                for i in range(per_producer):
                    rid = f"load-{p}-{i}"
                    body = {
                        "id": rid,
                        "prompt": f"producer {p} item {i}",
                        "max_tokens": 2,
                        "ignore_eos": True,
                    }
                    for _ in range(1 + (random.random() < 0.2)):  # some producers retry: idempotent
                        async with http.post(f"{base}/v1/requests", json=body) as r:
                            assert r.status in (200, 202)
                    ids.append(rid)
                return ids

            ids = [
                rid
                for batch in await asyncio.gather(*(producer(p) for p in range(producers)))
                for rid in batch
            ]
            results = await asyncio.gather(*(client.wait(rid) for rid in ids))
            entries = await client.r.xlen(KEYS.requests)
            runs = [await client.r.hget(KEYS.req(rid), "run") for rid in ids]
            finals = [
                sum("finish_reason" in f for _, f in await client.r.xrange(KEYS.out(rid)))
                for rid in ids[::25]
            ]
            return ids, results, entries, runs, finals

    ids, results, entries, runs, finals = run(main(), timeout=300)
    assert len(set(ids)) == producers * per_producer == len(results)
    assert all(r.status == "finished" and len(r.token_ids) == 2 for r in results)
    assert entries <= len(ids) and set(runs) == {"1"} and set(finals) == {1}


def test_a_streaming_client_that_leaves_cancels_its_request(valkey, tiny_model_dir):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, worker, client),
            aiohttp.ClientSession() as http,
        ):
            body = {
                "model": str(tiny_model_dir),
                "prompt": "Go on and on",
                "max_tokens": 1900,
                "stream": True,
            }
            body["ignore_eos"] = True
            async with http.post(f"{base}/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        rid = orjson.loads(line[6:])["id"]
                        break
            # Leaving the block closed the connection mid-stream.
            result = await asyncio.wait_for(client.wait(rid), timeout=60)
            return result

    result = run(main())
    assert result.status == "cancelled" and result.usage["completion_tokens"] < 1900


def test_readiness_follows_redis(valkey, tiny_model_dir):
    async def main():
        async with api_stack(valkey.url, tiny_model_dir) as (base, _w, _c), aiohttp.ClientSession() as http:
            async with http.get(f"{base}/readyz") as r:
                assert r.status == 200
            await asyncio.to_thread(valkey.stop)
            async with http.get(f"{base}/readyz") as r:
                assert r.status == 503 and (await r.json())["redis"] is False
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200  # alive all the same: nothing to restart
            await asyncio.to_thread(valkey.start)

            async def ready() -> bool:
                async with http.get(f"{base}/readyz") as r:
                    return r.status == 200

            # The worker is ready again at its next Redis call that succeeds (its load is published every
            # 200 ms), not necessarily at the very moment the server is back.
            await wait_for(ready, timeout=10, what="ready again")

    run(main())


async def _start_api_alone(url: str) -> tuple[web.AppRunner, QueueClient, Telemetry]:
    """The API app with no worker anywhere; AppRunner.setup() runs its startup hooks."""
    client = QueueClient(connect(url), KEYS)
    telemetry = Telemetry()
    runner = web.AppRunner(Api(client, telemetry).app(refresh_queue_stats=False))
    await runner.setup()
    return runner, client, telemetry


def test_api_startup_creates_the_workers_group(valkey):
    # Before any request and any worker: a KEDA redis-streams trigger needs the group to read its lag.
    async def main():
        runner, client, telemetry = await _start_api_alone(valkey.url)
        try:
            (group,) = await client.r.xinfo_groups(KEYS.requests)
            assert group["name"] == KEYS.group
            assert (group["lag"], group["pending"], group["consumers"]) == (0, 0, 0)
            await client.enqueue({"prompt": "waits for a worker"}, "w1")
            (group,) = await client.r.xinfo_groups(KEYS.requests)
            assert group["lag"] == 1
        finally:
            await runner.cleanup()
            await client.aclose()
            telemetry.shutdown()

    run(main())


def test_api_starts_while_redis_is_down(caplog: pytest.LogCaptureFixture):
    async def main():
        runner, client, telemetry = await _start_api_alone(f"redis://127.0.0.1:{free_port()}/0")
        await runner.cleanup()
        await client.aclose()
        telemetry.shutdown()

    with caplog.at_level(logging.WARNING, logger="specserve.service.api"):
        run(main(), timeout=30)
    assert "consumer group not created at startup" in caplog.text
