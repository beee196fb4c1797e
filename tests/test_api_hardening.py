"""The API under hostile or careless clients: bounded `timeout`s and a numeric fuzz over every
route, tenants that cannot read, cancel or squat each other's requests, client disconnects that are not
errors, slow clients and connection floods cut off, OpenAI-shaped errors for expired and bad fields, and a
full Redis answered with a 503. Real valkey-server, real HTTP, real sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis
from redis.exceptions import OutOfMemoryError
from valkey_helpers import api_stack, free_port, run, service_stack, spawn_cli, wait_for

from specserve.queue.client import QueueClient
from specserve.queue.connection import connect
from specserve.queue.keys import Keys
from specserve.service.api import Api, ApiSettings
from specserve.service.gateway import MAX_TIMEOUT_S
from specserve.service.http import HttpLimits, parse_api_keys, serve
from specserve.service.telemetry import Telemetry

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
FINAL = ("finished", "failed", "cancelled", "expired")
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=60)  # a hang fails the test instead of stalling it


@contextlib.asynccontextmanager
async def guarded_stack(
    url: str,
    model_dir: Path | None,
    limits: HttpLimits | None = None,
    start_worker: bool = True,
    **settings: Any,
) -> AsyncIterator[tuple[str, Any, QueueClient]]:
    """The API as `specserve api` runs it (http.serve: connection guard, read timeouts), with an in-process
    worker on the tiny engine (model_dir) or none at all (model_dir None)."""
    async with contextlib.AsyncExitStack() as stack:
        if model_dir is not None:
            worker, client = await stack.enter_async_context(
                service_stack(url, model_dir, start_worker=start_worker)
            )
            telemetry = worker.telemetry
        else:
            worker, client, telemetry = None, QueueClient(connect(url), KEYS), Telemetry()
            stack.push_async_callback(client.aclose)
            stack.callback(telemetry.shutdown)
        api = Api(client, telemetry, ApiSettings(**settings))
        port = free_port()
        runner = await serve(api.app(refresh_queue_stats=False), "127.0.0.1", port, limits or HttpLimits())
        stack.push_async_callback(runner.cleanup)
        yield f"http://127.0.0.1:{port}", worker, client


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _final(http: aiohttp.ClientSession, base: str, rid: str, headers: dict[str, str] | None = None):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        async with http.get(f"{base}/v1/requests/{rid}", headers=headers) as r:
            assert r.status == 200, (r.status, await r.text())
            body = await r.json()
        if body["status"] in FINAL:
            return body
        await asyncio.sleep(0.02)
    raise AssertionError(f"request {rid} never finished")


def _http_codes(metrics: str) -> dict[str, int]:
    """specserve_http_requests_total by code, from the Prometheus text."""
    codes: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith("specserve_http_requests_total{"):
            code = re.search(r'code="(\d+)"', line)
            assert code is not None, line
            codes[code[1]] = codes.get(code[1], 0) + int(float(line.rsplit(" ", 1)[1]))
    return codes


# ---- F2: timeout, and a numeric fuzz over both routes ---------------------------------------------------

BAD_TIMEOUTS: list[tuple[str, str]] = [
    ("1e308", "1e308"),
    ("huge int", str(2**64)),
    ("over 30 days", str(MAX_TIMEOUT_S + 1)),
    ("negative", "-1"),
    ("zero", "0"),
    ("minus zero", "-0"),
    ("true", "true"),
    ("string", '"10"'),
    ("NaN", "NaN"),
    ("Infinity", "Infinity"),
    ("-Infinity", "-Infinity"),
    ("1e999", "1e999"),
]


def test_timeout_must_be_a_finite_positive_bounded_number(valkey, tiny_model_dir):
    model = str(tiny_model_dir)
    msgs = '[{"role": "user", "content": "x"}]'
    routes = [  # bodies as text, so that NaN, Infinity and 1e999 go out as the raw JSON a client could send
        ("/v1/requests", '{"prompt": "x", "max_tokens": 1, "timeout": RAW}'),
        ("/v1/completions", f'{{"model": "{model}", "prompt": "x", "max_tokens": 1, "timeout": RAW}}'),
        (
            "/v1/chat/completions",
            f'{{"model": "{model}", "messages": {msgs}, "max_tokens": 1, "timeout": RAW}}',
        ),
    ]

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            for path, template in routes:
                for what, raw in BAD_TIMEOUTS:
                    headers = {"Content-Type": "application/json"}
                    async with http.post(
                        base + path, data=template.replace("RAW", raw), headers=headers
                    ) as r:
                        body = await r.json()
                        assert (r.status, body["error"]["param"]) == (400, "timeout"), (path, what, body)
            assert await client.r.xlen(KEYS.requests) == 0  # nothing got through
            # The bound itself is fine, and so is a fraction of a second.
            for timeout in (MAX_TIMEOUT_S, 0.001):
                async with http.post(
                    f"{base}/v1/requests", json={"prompt": "x", "max_tokens": 1, "timeout": timeout}
                ) as r:
                    assert r.status == 202, await r.text()

    run(main())


def test_the_clis_timeout_follows_the_same_rule(valkey, tmp_path):
    for i, bad in enumerate(("nan", "inf", "0", "-3", "1e308")):
        log = tmp_path / f"enqueue-{i}.log"
        proc = spawn_cli(["enqueue", "hi", "--id", f"t{i}", "--timeout", bad], {"REDIS_URL": valkey.url}, log)
        assert proc.wait(60) != 0
        assert "error: --timeout: must be a number of seconds" in log.read_text(), bad
    with redis.Redis.from_url(valkey.url) as r:
        assert r.keys("specserve:req:*") == []  # nothing was enqueued


NUMERIC_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "timeout", "deadline", "speculation"]
# OpenAI's numeric fields we accept only at their neutral value (or not at all on one of the routes), and
# stop_token_ids, whose numbers sit in a list.
NUMERIC_FIELDS += ["n", "best_of", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs"]
NUMERIC_FIELDS += ["max_completion_tokens", "stop_token_ids", "repetition_penalty", "min_p", "min_tokens"]
FUZZ_VALUES = ["NaN", "Infinity", "-Infinity", "1e999", "1e308", "-1e308", "-0", str(2**64), "-1", "0.5"]


def _fuzz_body(path: str, model: str, field: str, raw: str) -> str:
    base: dict[str, Any] = {"max_tokens": 2, "ignore_eos": True}
    if path == "/v1/chat/completions":
        base |= {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    elif path == "/v1/completions":
        base |= {"model": model, "prompt": "hi"}
    else:
        base["prompt"] = "hi"
    base.pop(field, None)
    value = f"[{raw}]" if field == "stop_token_ids" else raw
    return orjson.dumps(base).decode()[:-1] + f', "{field}": {value}}}'


def test_numeric_fuzz_is_a_4xx_naming_the_field_or_a_request_that_finishes(valkey, tiny_model_dir):
    """Every numeric field of both routes, with values that broke things: never a 5xx, never a hang."""
    model = str(tiny_model_dir)
    paths = ["/v1/requests", "/v1/completions", "/v1/chat/completions"]

    async def main():
        outcomes: dict[str, int] = {}
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            for path in paths:
                for field in NUMERIC_FIELDS:
                    for raw in FUZZ_VALUES:
                        case = (path, field, raw)
                        data = _fuzz_body(path, model, field, raw)
                        headers = {"Content-Type": "application/json"}
                        async with http.post(base + path, data=data, headers=headers) as r:
                            status = r.status
                            body = await r.json()
                        assert status < 500, (case, status, body)
                        if 400 <= status < 500:
                            assert body["error"]["param"] == field and body["error"]["message"], (case, body)
                            outcomes["4xx"] = outcomes.get("4xx", 0) + 1
                            continue
                        assert status in (200, 202), (case, status, body)
                        outcomes["2xx"] = outcomes.get("2xx", 0) + 1
                        if path == "/v1/requests":
                            done = await _final(http, base, body["id"])
                            assert done["status"] in FINAL, (case, done)
                        else:
                            assert body["choices"][0]["finish_reason"], (case, body)
        return outcomes

    outcomes = run(main(), timeout=600)
    assert outcomes["4xx"] and outcomes["2xx"]  # both kinds of answer were exercised


# ---- F4: tenants -------------------------------------------------------------------------------------------

BOB_TOKEN = "bob-secret-token-5f1e0c"


def test_a_request_belongs_to_the_key_that_made_it(valkey, tiny_model_dir):
    alice, bob = _auth("alice-token-a1b2c3"), _auth(BOB_TOKEN)
    keys = ["alice:alice-token-a1b2c3", BOB_TOKEN]
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir, api_keys=keys) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            async with http.post(
                f"{base}/v1/requests",
                json={"id": "shared", "prompt": "Alice's secret", **body},
                headers=alice,
            ) as r:
                assert r.status == 202 and (await r.json())["id"] == "shared"
            mine = await _final(http, base, "shared", alice)
            assert mine["id"] == "shared" and mine["status"] == "finished"
            # Bob sees nothing of it: not its result, not its stream, and he cannot cancel it.
            async with http.get(f"{base}/v1/requests/shared", headers=bob) as r:
                assert r.status == 404 and (await r.json())["error"]["param"] == "id"
            async with http.get(f"{base}/v1/requests/shared/stream", headers=bob) as r:
                assert r.status == 404
            async with http.delete(f"{base}/v1/requests/shared", headers=bob) as r:
                assert r.status == 404
            # The same id is Bob's own request, not a window on Alice's result.
            async with http.post(
                f"{base}/v1/requests", json={"id": "shared", "prompt": "Bob's question", **body}, headers=bob
            ) as r:
                assert r.status == 202 and (await r.json())["created"] is True
            his = await _final(http, base, "shared", bob)
            assert his["status"] == "finished" and his["token_ids"] != mine["token_ids"]
            assert (await _final(http, base, "shared", alice))["text"] == mine["text"]
            async with http.get(f"{base}/v1/requests/shared/stream", headers=alice) as r:
                assert r.status == 200 and b"event: done" in await r.read()
            # A long one of Alice's: Bob's DELETE is a 404 and changes nothing, hers cancels it.
            long = {"id": "long", "prompt": "go", "max_tokens": 1900, "ignore_eos": True}
            async with http.post(f"{base}/v1/requests", json=long, headers=alice) as r:
                assert r.status == 202
            async with http.delete(f"{base}/v1/requests/long", headers=bob) as r:
                assert r.status == 404
            assert await client.r.hget(KEYS.req("alice:long"), "cancel") is None
            async with http.delete(f"{base}/v1/requests/long", headers=alice) as r:
                assert r.status in (200, 202) and (await r.json())["cancelled"] is True
            assert (await _final(http, base, "long", alice))["status"] == "cancelled"
            # OpenAI routes record the tenant too.
            async with http.post(
                f"{base}/v1/completions",
                json={"model": str(tiny_model_dir), "prompt": "hi", "max_tokens": 2},
                headers=bob,
            ) as r:
                assert r.status == 200
                cmpl = (await r.json())["id"]
            bob_tenant = parse_api_keys([BOB_TOKEN])[0].tenant
            assert await client.r.hget(KEYS.req(cmpl), "tenant") == bob_tenant
            assert await client.r.hget(KEYS.req("alice:shared"), "tenant") == "alice"
            assert await client.r.hget(KEYS.req(f"{bob_tenant}:shared"), "tenant") == bob_tenant
            # Redis holds tenant names, never a token.
            dump = []
            for key in await client.r.keys("*"):
                kind = await client.r.type(key)
                if kind == "hash":
                    dump.append(orjson.dumps(await client.r.hgetall(key)).decode())
                elif kind == "stream":
                    dump.append(orjson.dumps(await client.r.xrange(key)).decode())
                dump.append(key)
            assert "alice-token" not in "".join(dump) and BOB_TOKEN not in "".join(dump)

    run(main())


def test_a_tenant_id_too_long_with_its_prefix_is_refused_naming_id(valkey, tiny_model_dir):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir, api_keys=["acme:tok-1"]) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            for rid, status in (("x" * 195, 202), ("x" * 196, 400)):
                async with http.post(
                    f"{base}/v1/requests",
                    json={"id": rid, "prompt": "x", "max_tokens": 1},
                    headers=_auth("tok-1"),
                ) as r:
                    body = await r.json()
                    assert r.status == status, body
                    if status == 400:
                        assert body["error"]["param"] == "id" and "195" in body["error"]["message"]

    run(main())


def test_api_key_entries_name_their_tenant_and_bad_entries_are_refused():
    keys = parse_api_keys(["acme:tok-1", "acme:tok-2", "bare-token"])
    assert [k.tenant for k in keys[:2]] == ["acme", "acme"]  # two keys, one tenant (rotation)
    derived = keys[2].tenant
    assert derived.startswith("key-") and "bare-token" not in derived
    assert parse_api_keys(["bare-token"])[0].tenant == derived  # stable across restarts and replicas
    for bad in (["a b:tok"], ["acme:"], ["t1", "t1"], ["x:t", "y:t"]):
        with pytest.raises(ValueError) as e:
            parse_api_keys(bad)
        assert "tok" not in str(e.value).replace("token", "")  # the error never echoes the token


# ---- F5: a client that leaves mid-body -----------------------------------------------------------------


def test_a_client_leaving_mid_body_is_no_error(valkey, tiny_model_dir, caplog: pytest.LogCaptureFixture):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            port = int(base.rsplit(":", 1)[1])
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/requests HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 1000\r\n\r\n{"prompt": "half a bo'
                )
                await writer.drain()
                await asyncio.sleep(0.1)
                writer.close()
                await writer.wait_closed()

            async def counted() -> bool:
                async with http.get(f"{base}/metrics") as r:
                    codes = _http_codes(await r.text())
                return sum(n for code, n in codes.items() if code not in ("200",)) >= 3

            await wait_for(counted, timeout=20, what="the three requests to be counted")
            async with http.get(f"{base}/metrics") as r:
                return _http_codes(await r.text())

    with caplog.at_level(logging.DEBUG):
        codes = run(main())
    assert not [c for c in codes if c.startswith("5")], codes
    assert codes.get("499") == 3, codes
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


# ---- F6: slow clients, connection floods ---------------------------------------------------------------


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Read until the server closes the connection (fails if it is still open after `seconds`)."""
    data = b""
    async with asyncio.timeout(seconds):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk


def test_slow_headers_and_slow_bodies_are_cut_off(valkey):
    limits = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, keepalive_timeout_s=30)

    async def main():
        async with guarded_stack(valkey.url, None, limits) as (base, _w, _c):
            port = int(base.rsplit(":", 1)[1])
            # Connects and says nothing.
            silent = await asyncio.open_connection("127.0.0.1", port)
            # Slowloris: a header line every 0.2 s, never the blank line.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/requests HTTP/1.1\r\nHost: t\r\n")
            started = time.monotonic()

            async def trickle() -> None:
                with contextlib.suppress(ConnectionError):
                    for i in range(100):
                        await asyncio.sleep(0.2)
                        writer.write(b"X-Slow-%d: y\r\n" % i)
                        await writer.drain()

            feeder = asyncio.create_task(trickle())
            await _closed_within(reader, 5)
            assert time.monotonic() - started < 4
            feeder.cancel()
            await _closed_within(silent[0], 5)
            # A body that never completes: 408 naming the body, then the connection closes.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/requests HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b'Content-Length: 500\r\n\r\n{"prompt": '
            )
            answer = await _closed_within(reader, 8)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), answer
            assert orjson.loads(payload)["error"]["param"] == "body"
            # A kept-alive client that pauses between requests longer than the header timeout is fine.
            async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
                for _ in range(2):
                    async with http.get(f"{base}/healthz") as r:
                        assert r.status == 200
                    await asyncio.sleep(1.5)

    run(main())


def test_connections_over_the_cap_are_refused_and_room_comes_back(valkey, caplog: pytest.LogCaptureFixture):
    cap = 30
    limits = HttpLimits(max_connections=cap, header_timeout_s=30)

    async def main():
        async with guarded_stack(valkey.url, None, limits) as (base, _w, _c):
            port = int(base.rsplit(":", 1)[1])
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
            await asyncio.sleep(0.2)
            extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2 * cap)]
            for reader, _writer in extra:
                answer = await _closed_within(reader, 5)
                head, _, payload = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503"), answer
                assert orjson.loads(payload)["error"]["code"] == "too_many_connections"
            for reader, _writer in held[:5]:  # still open: nothing came back yet
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await reader.read(1)
            for _reader, writer in [*held, *extra]:
                writer.close()
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
                async with http.get(f"{base}/healthz") as r:
                    assert r.status == 200

    with caplog.at_level(logging.WARNING, logger="specserve.service.http"):
        run(main())
    (warning,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]  # one, not 60
    assert "30 open" in warning and "SPECSERVE_MAX_CONNECTIONS" in warning


# ---- F9: OpenAI shapes, field types, Last-Event-ID -----------------------------------------------------


def test_an_expired_request_is_a_408_with_openais_error_shape(valkey, tiny_model_dir):
    model = str(tiny_model_dir)

    async def main():
        async with (
            guarded_stack(valkey.url, tiny_model_dir, start_worker=False) as (base, worker, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            body = {"model": model, "prompt": "x", "max_tokens": 2, "timeout": 0.05}

            async def ask(stream: bool) -> tuple[int, dict[str, Any]]:
                async with http.post(f"{base}/v1/completions", json={**body, "stream": stream}) as r:
                    return r.status, await r.json()

            asking = [asyncio.create_task(ask(False)), asyncio.create_task(ask(True))]

            async def both_queued() -> bool:
                return await client.fast.execute("XLEN", client.keys.requests) == 2

            # both are queued and both deadlines pass while no worker runs (on a loaded machine a request
            # can reach the API later than any fixed sleep; one a worker took in time would rightly stream)
            await wait_for(both_queued, what="both requests queued")
            await asyncio.sleep(0.2)
            await worker.start()
            return await asyncio.gather(*asking)

    for status, body in run(main()):
        assert status == 408, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["param"], err["code"]) == ("timeout", "deadline_expired") and err["message"]


def test_a_stream_that_outlives_its_timeout_ends_with_the_same_408_error(valkey, tiny_model_dir):
    body = {"model": str(tiny_model_dir), "prompt": "Go on", "max_tokens": 1900, "ignore_eos": True}

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            async with http.post(
                f"{base}/v1/completions", json={**body, "stream": True, "timeout": 1.0}
            ) as r:
                assert r.status == 200
                return [line[6:] for line in (await r.read()).split(b"\n") if line.startswith(b"data: ")]

    events = run(main())
    assert events[-1] == b"[DONE]" and len(events) > 3  # it did stream before the deadline stopped it
    err = orjson.loads(events[-2])["error"]
    assert (err["type"], err["code"], err["param"]) == ("timeout", "deadline_expired", "timeout")


def test_user_must_be_a_string(valkey, tiny_model_dir):
    model = str(tiny_model_dir)
    msgs = [{"role": "user", "content": "x"}]

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            for path, body in (
                ("/v1/chat/completions", {"model": model, "messages": msgs, "user": 123}),
                ("/v1/completions", {"model": model, "prompt": "x", "user": ["a"]}),
            ):
                async with http.post(base + path, json=body) as r:
                    assert (r.status, (await r.json())["error"]["param"]) == (400, "user")
            ok = {"model": model, "messages": msgs, "user": "u-1", "max_tokens": 1}
            async with http.post(f"{base}/v1/chat/completions", json=ok) as r:
                assert r.status == 200

    run(main())


def test_last_event_id_must_be_two_non_negative_integers(valkey, tiny_model_dir):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            async with http.post(
                f"{base}/v1/requests", json={"id": "e1", "prompt": "x", "max_tokens": 2}
            ) as r:
                assert r.status == 202
            await _final(http, base, "e1")
            for bad in ("-5.-5", "1.-1", "5", "1.2.3", "a.b", "1e3.0", "1.2 3", "9" * 40 + ".0"):
                async with http.get(f"{base}/v1/requests/e1/stream", headers={"Last-Event-ID": bad}) as r:
                    assert (r.status, (await r.json())["error"]["param"]) == (400, "Last-Event-ID"), bad
            async with http.get(f"{base}/v1/requests/e1/stream", headers={"Last-Event-ID": "0.0"}) as r:
                assert r.status == 200

    run(main())


def test_get_of_a_failed_request_names_the_field(valkey, tiny_model_dir):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            # Token ids beyond the vocabulary: only the worker's engine knows, so it fails there.
            async with http.post(f"{base}/v1/requests", json={"id": "bad", "prompt": [10**9]}) as r:
                assert r.status == 202
            return await _final(http, base, "bad")

    done = run(main())
    assert done["status"] == "failed" and done["error"]
    assert done["error_field"] == "prompt"


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("9 " * 4000, id="tokenized-on-the-loop"),  # under the worker's long-prompt threshold
        pytest.param("word " * 3000, id="tokenized-in-a-thread"),
    ],
)
def test_a_chat_over_the_context_names_messages(valkey, tiny_model_dir, content: str):
    model = str(tiny_model_dir)

    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, _w, _c),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            long = {"role": "user", "content": content}
            async with http.post(
                f"{base}/v1/chat/completions", json={"model": model, "messages": [long], "max_tokens": 1}
            ) as r:
                return r.status, await r.json()

    status, body = run(main())
    assert status == 400 and body["error"]["param"] == "messages", body


# ---- Redis full: a clear 503, nothing silently dropped ---------------------------------------------------


def test_a_full_redis_is_a_503_naming_the_cause_and_nothing_is_queued(valkey, tiny_model_dir):
    model = str(tiny_model_dir)

    async def main():
        async with (
            guarded_stack(valkey.url, None, served_models=[model]) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            async with http.post(f"{base}/v1/requests", json={"id": "before", "prompt": "x"}) as r:
                assert r.status == 202
            used = int((await client.r.info("memory"))["used_memory"])
            await client.r.config_set("maxmemory", str(used + 512 * 1024))
            assert (await client.r.config_get("maxmemory-policy"))["maxmemory-policy"] == "noeviction"
            with pytest.raises(OutOfMemoryError):
                for i in range(10_000):
                    await client.r.set(f"filler:{i}", "x" * 8192)
            entries = await client.r.xlen(KEYS.requests)
            answers = []
            for path, body in (
                ("/v1/requests", {"id": "after", "prompt": "x"}),
                ("/v1/requests", {"prompt": "no id"}),
                ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1}),
                ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}]}),
            ):
                async with http.post(base + path, json=body) as r:
                    answers.append((r.status, await r.json(), r.headers.get("Retry-After")))
            # Reads still work, and what was queued before is intact (noeviction).
            async with http.get(f"{base}/v1/requests/before") as r:
                assert r.status == 200 and (await r.json())["status"] == "queued"
            async with http.get(f"{base}/v1/requests/after") as r:
                assert r.status == 404
            assert await client.r.xlen(KEYS.requests) == entries
            async with http.get(f"{base}/metrics") as r:
                codes = _http_codes(await r.text())
            # Room again before the stack stops (its output reader's last wake-up is a write).
            await client.r.config_set("maxmemory", "0")
            return answers, codes

    answers, codes = run(main())
    for status, body, retry in answers:
        assert status == 503, body
        assert body["error"]["code"] == "redis_out_of_memory" and "memory" in body["error"]["message"]
        assert body["error"]["type"] == "server_error" and retry
    assert "500" not in codes


# ---- exposure: no keys on a public address -------------------------------------------------------------


async def _api_starts(env: dict[str, str], port: int, log: Path) -> None:
    """`specserve api` with `env` comes up (its health route answers), then is stopped."""
    proc = spawn_cli(["api"], env, log)
    try:

        async def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as r:
                    return r.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await wait_for(up, timeout=60, what="the API to start")
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_api_without_keys_on_a_public_address_refuses_to_start_unless_allowed(valkey, tmp_path):
    port = free_port()
    env = {"REDIS_URL": valkey.url, "SPECSERVE_HOST": "0.0.0.0", "SPECSERVE_PORT": str(port)}
    env |= {"SPECSERVE_API_KEYS": "", "SPECSERVE_API_KEYS_FILE": "", "SPECSERVE_ALLOW_UNAUTHENTICATED": ""}
    refused = spawn_cli(["api"], env, tmp_path / "refused.log")
    assert refused.wait(60) != 0
    assert "refusing to serve the API on '0.0.0.0' with no API keys" in (tmp_path / "refused.log").read_text()

    run(_api_starts({**env, "SPECSERVE_ALLOW_UNAUTHENTICATED": "1"}, port, tmp_path / "allowed.log"))
    assert "has no API keys: anyone who reaches it" in (tmp_path / "allowed.log").read_text()
    run(_api_starts({**env, "SPECSERVE_API_KEYS": "ops:tok-9"}, port, tmp_path / "keyed.log"))
    assert "no API keys" not in (tmp_path / "keyed.log").read_text()


def test_an_api_without_keys_refuses_a_redis_that_keyed_apis_served(valkey, tmp_path):
    """Tenants' requests are private to their keys: an API without keys, on the same Redis, would hand them
    to anyone who reaches it. It refuses to start there unless told something else guards it."""
    port = free_port()
    env = {"REDIS_URL": valkey.url, "SPECSERVE_HOST": "127.0.0.1", "SPECSERVE_PORT": str(port)}
    env |= {"SPECSERVE_API_KEYS_FILE": "", "SPECSERVE_ALLOW_UNAUTHENTICATED": ""}

    run(_api_starts({**env, "SPECSERVE_API_KEYS": ""}, port, tmp_path / "before.log"))  # nothing keyed yet
    run(_api_starts({**env, "SPECSERVE_API_KEYS": "team-a:tok-a"}, port, tmp_path / "keyed.log"))
    refused = spawn_cli(["api"], {**env, "SPECSERVE_API_KEYS": ""}, tmp_path / "refused.log")
    assert refused.wait(60) != 0
    assert "holds requests made with API keys" in (tmp_path / "refused.log").read_text()
    allowed = {**env, "SPECSERVE_API_KEYS": "", "SPECSERVE_ALLOW_UNAUTHENTICATED": "1"}
    run(_api_starts(allowed, port, tmp_path / "allowed.log"))


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_json_nested_past_the_limit_is_a_400_naming_the_field_on_every_route(valkey):
    """One nesting limit for every JSON field, checked where a body is parsed: a template argument 300 deep
    was a 500 (the wire's serializer stops at 255), and a schema 250-300 deep held the event loop for
    seconds while it was validated."""
    from specserve.queue.wire import MAX_JSON_DEPTH

    deep = _nested(300)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(MAX_JSON_DEPTH + 5)}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}

    async def main():
        async with guarded_stack(valkey.url, None) as (base, _w, client):
            answers = []
            async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
                for path, body in (
                    ("/v1/chat/completions", {**chat, "chat_template_kwargs": deep}),
                    ("/v1/chat/completions", {**chat, "response_format": schema}),
                    ("/v1/completions", {"model": "m", "prompt": "x", "extra": [deep]}),
                    ("/v1/requests", {"id": "deep", "prompt": "x", "structured_outputs": {"json": deep}}),
                ):
                    started = time.monotonic()
                    async with http.post(base + path, json=body) as r:
                        answers.append((r.status, (await r.json())["error"], time.monotonic() - started))
                # A body just within the limit is not refused for its depth.
                within = {"id": "within", "prompt": "x", "structured_outputs": {"json": _nested(10)}}
                within["structured_outputs"]["json"] = {"type": "object", "properties": _nested(20)}
                async with http.post(base + "/v1/requests", json=within) as r:
                    within_error = (await r.json()).get("error", {})
            return answers, within_error, await client.r.exists(KEYS.req("deep"))

    answers, within_error, queued = run(main())
    fields = [error["param"] for _, error, _ in answers]
    assert fields == ["chat_template_kwargs", "response_format", "extra", "structured_outputs"], answers
    assert all(status == 400 and "nested deeper than" in e["message"] for status, e, _ in answers)
    assert max(seconds for _, _, seconds in answers) < 5.0  # refused before anything walks it
    assert "nested" not in str(within_error.get("message", ""))
    assert queued == 0


def test_a_grammar_checker_that_does_not_start_is_a_503_with_retry_after(valkey, monkeypatch):
    """A grammar child that is not ready in time (a node too loaded to run its imports) is no fault of the
    request: a retryable 503 naming the cause, nothing queued, never a 500; the next request gets a fresh
    child and is checked as usual."""
    from specserve.engine import prepare

    body = {"id": "g1", "prompt": "x", "structured_outputs": {"regex": "[a-z]+"}}

    async def main():
        async with guarded_stack(valkey.url, None) as (base, _w, client):
            async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
                monkeypatch.setattr(prepare, "READY_TIMEOUT_S", 0.001)
                async with http.post(base + "/v1/requests", json=body) as r:
                    first = (r.status, r.headers.get("Retry-After"), (await r.json())["error"]["code"])
                queued = await client.r.exists(KEYS.req("g1"))
                monkeypatch.setattr(prepare, "READY_TIMEOUT_S", 120.0)
                bad = {**body, "id": "g2", "structured_outputs": {"regex": "[a-z"}}
                async with http.post(base + "/v1/requests", json=bad) as r:
                    second = (r.status, (await r.json())["error"]["param"])
            return first, queued, second

    first, queued, second = run(main())
    assert first[0] == 503 and first[1] and first[2] == "grammar_unavailable", first
    assert queued == 0
    assert second == (400, "structured_outputs.regex")


def test_a_raw_entry_nested_past_the_limit_fails_naming_the_field(valkey, tiny_model_dir):
    from specserve.queue.wire import WireError, decode_body

    chat = [{"role": "user", "content": "x"}]
    raw = json.dumps({"messages": chat, "max_tokens": 2, "chat_template_kwargs": _nested(300)})
    with pytest.raises(WireError) as e:
        decode_body(raw)
    assert e.value.field == "chat_template_kwargs"

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            await client.r.xadd(KEYS.requests, {"id": "deep-raw", "body": raw})
            return await client.wait("deep-raw")

    result = run(main())
    assert result.status == "failed" and result.error_field == "chat_template_kwargs"


def test_redis_down_is_a_503_with_retry_after_on_every_route(tmp_path):
    """Redis unreachable: every route that needs it answers a retryable 503 naming the cause, never a 500
    with a traceback."""
    from specserve.queue.embedded import EmbeddedValkey

    server = EmbeddedValkey(tmp_path / "valkey").start()
    routes = [
        ("POST", "/v1/requests", {"id": "r1", "prompt": "x"}),
        ("GET", "/v1/requests/r1", None),
        ("DELETE", "/v1/requests/r1", None),
        ("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        ("GET", "/v1/models", None),
        ("GET", "/v1/batches", None),
    ]

    async def main():
        try:
            async with guarded_stack(server.url, None) as (base, _w, _client):
                async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
                    async with http.get(base + "/v1/models") as r:
                        assert r.status == 200
                    server.stop()
                    answers = []
                    for method, path, body in routes:
                        async with http.request(method, base + path, json=body) as r:
                            error = (await r.json())["error"]
                            answers.append((path, r.status, r.headers.get("Retry-After"), error["code"]))
                    return answers
        finally:
            if server.running:
                server.stop()

    for path, status, retry_after, code in run(main()):
        assert (status, code) == (503, "redis_unavailable") and retry_after, path
