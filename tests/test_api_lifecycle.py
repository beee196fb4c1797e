"""The request lifecycle at the API's edges, as clients written against OpenAI and vLLM expect it: streams
they can parse strictly, a non-streaming request that stops when its client leaves, an answer at the
deadline when no worker is there, vLLM's neutral sampling extras, and a CLI whose exit code says how a
request ended."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import orjson
import pytest
from test_api_hardening import HTTP_TIMEOUT, guarded_stack
from valkey_helpers import REPO, run, wait_for

from specserve.queue.keys import Keys
from specserve.service import gateway

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")


def _strict_vllm_sse(raw_reads: list[bytes]) -> list[dict]:
    """How vLLM 0.32's bench client reads a stream: each network read stripped, then split on a blank line;
    every message must be `data: <json>` or `data: [DONE]`. A comment line would swallow the message glued
    after it in the same read."""
    messages = []
    for chunk in raw_reads:
        for part in chunk.strip().split(b"\n\n"):
            if not part:
                continue
            assert part.startswith(b"data: "), part
            payload = part[len(b"data: ") :]
            if payload != b"[DONE]":
                messages.append(orjson.loads(payload))
    return messages


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_streams_parse_with_a_strict_vllm_reader(valkey, tiny_model_dir, monkeypatch, path):
    """OpenAI and vLLM send no SSE comments; ours were `: keep-alive`, which vLLM's client turned into lost
    tokens. With keep-alives due every millisecond, the stream still carries only data messages."""
    monkeypatch.setattr(gateway, "KEEPALIVE_S", 0.001)
    model = str(tiny_model_dir)
    n = 40
    body = {"model": model, "max_tokens": n, "ignore_eos": True, "temperature": 0, "stream": True}
    body |= {"messages": [{"role": "user", "content": "Count:"}]} if "chat" in path else {"prompt": "Count:"}

    async def main():
        async with (
            guarded_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
            http.post(base + path, json=body) as r,
        ):
            assert r.status == 200
            return [chunk async for chunk in r.content.iter_any()]

    reads = run(main())
    assert not any(line.startswith(b":") for chunk in reads for line in chunk.split(b"\n"))
    messages = _strict_vllm_sse(reads)
    key = "delta" if "chat" in path else "text"
    text = "".join(
        (c["delta"].get("content") or "") if key == "delta" else c["text"]
        for m in messages
        for c in m["choices"]
    )
    assert text and messages[-1]["choices"][0]["finish_reason"] == "length"


def test_a_non_streaming_request_stops_when_its_client_leaves(valkey, tiny_model_dir):
    model = str(tiny_model_dir)

    async def main():
        async with guarded_stack(valkey.url, tiny_model_dir) as (base, worker, client):
            body = {"model": model, "prompt": "Tell me everything.", "max_tokens": 1900, "ignore_eos": True}
            async with aiohttp.ClientSession() as http:
                post = asyncio.create_task(http.post(f"{base}/v1/completions", json=body))
                await wait_for(lambda: _running(worker), what="the request running")
                post.cancel()  # the client goes away before the answer
            await wait_for(lambda: _none_running(worker), timeout=20, what="the request stopped")
            (key,) = [k async for k in client.r.scan_iter(match=KEYS.req("cmpl-*"))]
            return await client.r.hgetall(key)

    info = run(main())
    assert info["status"] == "cancelled" and int(info["completion_tokens"]) < 1900


async def _running(worker) -> bool:
    return bool(worker.inflight)


async def _none_running(worker) -> bool:
    return not worker.inflight and worker.engine.num_unfinished() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_with_no_worker_the_deadline_is_answered_and_the_request_ends(valkey, stream):
    """No worker is up: the API answers at the deadline (408, OpenAI's shape) instead of holding the client
    until it gives up, and the request does not linger queued."""

    async def main():
        async with (
            guarded_stack(valkey.url, None, served_models=["m"]) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            body = {"model": "m", "prompt": "hello", "timeout": 0.5, "stream": stream}
            start = time.monotonic()
            async with http.post(f"{base}/v1/completions", json=body) as r:
                status, error = r.status, (await r.json())["error"]
            waited = time.monotonic() - start
            (key,) = [k async for k in client.r.scan_iter(match=KEYS.req("cmpl-*"))]
            return status, error, waited, await client.r.hget(key, "status")

    status, error, waited, final_status = run(main())
    assert status == 408 and error["code"] == "deadline_expired" and error["param"] == "timeout"
    assert waited < HTTP_TIMEOUT.total  # answered by the API, not by the client giving up
    assert final_status == "cancelled"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_sampling_extras_are_accepted(valkey, tiny_model_dir, path):
    """`vllm bench serve` sends repetition_penalty 1.0 and min_p 0; other values work too (they are applied
    by engine/penalties.py), and a value out of range is refused naming the field."""
    model = str(tiny_model_dir)
    base_body = {"model": model, "max_tokens": 2}
    base_body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}

    async def main():
        async with (
            guarded_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            out = []
            for extra in (
                {"repetition_penalty": 1.0, "min_p": 0.0},
                {"repetition_penalty": 1.3, "min_p": 0.1, "presence_penalty": 0.5, "logit_bias": {"11": 5}},
                {"repetition_penalty": 0},
            ):
                async with http.post(base + path, json=base_body | extra) as r:
                    out.append((r.status, await r.json()))
            return out

    (ok_status, _), (adjusted_status, _), (bad_status, bad) = run(main())
    assert ok_status == 200 and adjusted_status == 200
    assert bad_status == 400 and bad["error"]["param"] == "repetition_penalty"


def test_the_cli_exits_non_zero_when_a_waited_request_fails(valkey, tiny_model_dir):
    """`specserve enqueue --wait` printed a failed result and exited 0."""
    from valkey_helpers import service_stack

    async def main():
        async with service_stack(valkey.url, tiny_model_dir):
            env = {"REDIS_URL": valkey.url, "PYTHONUNBUFFERED": "1"}
            cmd = [sys.executable, "-m", "specserve.service.cli", "enqueue", "--wait"]
            good = await asyncio.to_thread(
                subprocess.run, [*cmd, "hello", "--max-tokens", "2"], cwd=REPO, env=env, capture_output=True
            )
            bad = await asyncio.to_thread(
                subprocess.run,
                [*cmd, "--body", '{"prompt": [999999999]}'],
                cwd=REPO,
                env=env,
                capture_output=True,
            )
            return good, bad

    good, bad = run(main())
    assert good.returncode == 0 and orjson.loads(good.stdout)["status"] == "finished"
    assert bad.returncode == 1 and orjson.loads(bad.stdout)["status"] == "failed"


def test_an_api_shutting_down_ends_open_streams_cleanly(valkey):
    """SIGTERM with an SSE stream open: the stream ends at once with a clean end of response (the client
    resumes with Last-Event-ID), instead of being cut mid-chunk after aiohttp's shutdown timeout."""
    from valkey_helpers import free_port

    from specserve.queue.client import QueueClient
    from specserve.queue.connection import connect
    from specserve.service.api import Api, ApiSettings
    from specserve.service.http import HttpLimits, serve
    from specserve.service.telemetry import Telemetry

    async def main():
        client = QueueClient(connect(valkey.url), KEYS)
        api = Api(client, Telemetry(), ApiSettings(served_models=["m"]))
        port = free_port()
        runner = await serve(api.app(refresh_queue_stats=False), "127.0.0.1", port, HttpLimits())
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
                async with http.post(f"{base}/v1/requests", json={"id": "s", "prompt": "x"}) as r:
                    assert r.status == 202  # no worker: it waits, and so does its stream
                async with http.get(f"{base}/v1/requests/s/stream") as r:
                    assert r.status == 200
                    closing = asyncio.create_task(runner.cleanup())
                    body = await r.read()  # raises ClientPayloadError if the response is cut off
                    await closing
                return body
        finally:
            await client.aclose()

    assert run(main()) == b""  # nothing was generated; the stream simply ended
