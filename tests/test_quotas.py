"""Admission limits for a queue many teams share: a global backlog cap and per-tenant
caps on queued requests and tokens per minute, checked atomically in Redis as a request is enqueued. Over a
limit, HTTP answers 429 with Retry-After and an OpenAI-shaped error naming the limit; nothing is queued, and
nobody else's requests are touched."""

from __future__ import annotations

import aiohttp
from test_api_hardening import HTTP_TIMEOUT, _auth, _final, guarded_stack
from valkey_helpers import run

from specserve.queue.client import Limits, QueueClient, QuotaExceeded
from specserve.queue.connection import connect
from specserve.queue.keys import Keys

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
KEYS_AB = ["team-a:tok-a", "team-b:tok-b"]


def _limited(valkey, model_dir, limits: Limits, **kw):
    stack = guarded_stack(valkey.url, model_dir, api_keys=KEYS_AB, **kw)

    class _Limited:
        async def __aenter__(self):
            base, worker, client = await stack.__aenter__()
            client.limits = limits
            return base, worker, client

        async def __aexit__(self, *exc):
            return await stack.__aexit__(*exc)

    return _Limited()


def test_a_tenant_over_its_queued_cap_gets_429_and_others_are_untouched(valkey):
    """No worker runs, so requests stay queued: A's third is refused, B's go in, and a cancel makes room."""

    async def main():
        async with (
            _limited(valkey, None, Limits(tenant_max_queued=2), served_models=["m"]) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            codes = []
            for i in range(3):
                async with http.post(
                    f"{base}/v1/requests", json={"id": f"a{i}", "prompt": "x"}, headers=_auth("tok-a")
                ) as r:
                    codes.append((r.status, r.headers.get("Retry-After"), await r.json()))
            async with http.post(
                f"{base}/v1/requests", json={"id": "b0", "prompt": "x"}, headers=_auth("tok-b")
            ) as r:
                b_status = r.status
            async with http.delete(f"{base}/v1/requests/a0", headers=_auth("tok-a")) as r:
                assert r.status == 200
            async with http.post(
                f"{base}/v1/requests", json={"id": "a3", "prompt": "x"}, headers=_auth("tok-a")
            ) as r:
                after_cancel = r.status
            queued = await client.r.xlen(KEYS.requests)
            return codes, b_status, after_cancel, queued, await client.r.exists(KEYS.req("team-a:a2"))

    codes, b_status, after_cancel, queued, refused_exists = run(main())
    assert [c[0] for c in codes] == [202, 202, 429]
    _, retry_after, err = codes[2]
    assert retry_after is not None and int(retry_after) >= 1
    assert err["error"]["param"] == "tenant_max_queued" and err["error"]["code"] == "rate_limit_exceeded"
    assert b_status == 202 and after_cancel == 202
    assert queued == 4 and not refused_exists  # a0 a1 b0 a3: the refused one was never added


def test_tokens_per_minute_and_the_backlog_cap(valkey):
    async def main():
        r = connect(valkey.url)
        async with QueueClient(r, KEYS, limits=Limits(max_backlog=3, tenant_tokens_per_minute=100)) as c:
            await c.ensure_group()
            outcomes = []
            for rid, tenant, tokens in [
                ("t0", "a", 101),  # more than a minute allows, even as the minute's first request
                ("t1", "a", 60),
                ("t2", "a", 60),
                ("t3", "b", 60),
                ("t4", None, 0),
                ("t5", None, 0),
            ]:
                try:
                    await c.enqueue(
                        {"prompt": "x", "max_tokens": tokens or 16}, rid, tenant=tenant, tokens=tokens
                    )
                    outcomes.append((rid, "queued", None))
                except QuotaExceeded as e:
                    outcomes.append((rid, e.limit, e.retry_after))
            return outcomes, await c.r.xlen(KEYS.requests)

    outcomes, queued = run(main())
    assert outcomes[0][:2] == ("t0", "tenant_tokens_per_minute")
    outcomes = outcomes[1:]
    assert outcomes[0][:2] == ("t1", "queued")
    assert outcomes[1][:2] == ("t2", "tenant_tokens_per_minute") and 1 <= outcomes[1][2] <= 60
    assert outcomes[2][:2] == ("t3", "queued")  # another tenant's minute is its own
    assert outcomes[3][:2] == ("t4", "queued")
    assert outcomes[4][:2] == ("t5", "max_backlog")  # three waiting: the cap
    assert queued == 3


def test_requests_a_worker_takes_leave_their_tenants_queue(valkey, tiny_model_dir):
    """The cap counts waiting requests: once a worker has run them, the tenant may queue more."""

    async def main():
        async with (
            _limited(valkey, tiny_model_dir, Limits(tenant_max_queued=2)) as (base, _w, _client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            statuses = []
            for i in range(5):
                body = {"id": f"r{i}", "prompt": "hello", "max_tokens": 2}
                async with http.post(f"{base}/v1/requests", json=body, headers=_auth("tok-a")) as r:
                    statuses.append(r.status)
                await _final(http, base, f"r{i}", _auth("tok-a"))
            return statuses

    assert run(main()) == [202] * 5


def test_n_choices_over_a_quota_are_refused_whole_and_none_is_queued(valkey):
    """n > 1 is all or nothing: 3 choices against a cap of 2 queued are one 429 and no entry, where the
    first two used to be queued and run on with nobody reading them; 2 choices go in together."""

    async def main():
        async with (
            _limited(valkey, None, Limits(tenant_max_queued=2), served_models=["m"]) as (base, _w, client),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True}
            async with http.post(
                f"{base}/v1/completions", json={**body, "n": 3}, headers=_auth("tok-a")
            ) as r:
                refused = (r.status, (await r.json())["error"]["param"])
            queued_after_refusal = await client.r.xlen(KEYS.requests)
            http_timeout = aiohttp.ClientTimeout(
                total=2
            )  # no worker: the stream waits, only its start counts
            try:
                async with http.post(
                    f"{base}/v1/completions",
                    json={**body, "n": 2},
                    headers=_auth("tok-a"),
                    timeout=http_timeout,
                ) as r:
                    await r.content.read(1)
            except TimeoutError:
                pass
            return refused, queued_after_refusal, await client.r.xlen(KEYS.requests)

    refused, queued_after_refusal, queued = run(main())
    assert refused == (429, "tenant_max_queued")
    assert queued_after_refusal == 0
    assert queued == 2  # both choices of the n = 2 call, together


def test_enqueue_all_adds_none_when_one_would_pass_a_limit(valkey):
    async def main():
        async with QueueClient(connect(valkey.url), KEYS, limits=Limits(max_backlog=3)) as c:
            await c.ensure_group()
            await c.enqueue({"prompt": "x"}, "first")
            try:
                await c.enqueue_all([({"prompt": "x"}, f"c{i}") for i in range(3)])
            except QuotaExceeded as e:
                refused = e.limit
            fitted = await c.enqueue_all(
                [({"prompt": "x"}, f"d{i}") for i in range(2)] + [({"prompt": "y"}, "first")]
            )
            return refused, [(e.id, e.created) for e in fitted], await c.r.xlen(KEYS.requests)

    refused, fitted, queued = run(main())
    assert refused == "max_backlog"
    assert fitted == [("d0", True), ("d1", True), ("first", False)]  # a known id is left as it is
    assert queued == 3


def test_a_keys_priority_floor_holds_on_every_route(valkey):
    """A key may not put its requests ahead of everyone's: `tenant@N:token` (or the floor for every key)
    bounds how urgent a priority its requests may ask for; within it, anything goes."""

    async def main():
        keys = ["team-a@0:tok-a", "team-b:tok-b", "team-c@-50:tok-c"]
        async with (
            guarded_stack(valkey.url, None, api_keys=keys, key_priority_floor=-10, served_models=["m"]) as (
                base,
                _w,
                client,
            ),
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http,
        ):
            answers = {}
            for token, priority in (
                ("tok-a", -1),
                ("tok-a", 0),
                ("tok-b", -11),
                ("tok-b", -10),
                ("tok-c", -50),
            ):
                body = {"id": f"{token}{priority}", "prompt": "x", "priority": priority}
                async with http.post(f"{base}/v1/requests", json=body, headers=_auth(token)) as r:
                    answers[(token, priority)] = (r.status, (await r.json()).get("error", {}).get("param"))
            chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": -3}
            async with http.post(f"{base}/v1/chat/completions", json=chat, headers=_auth("tok-a")) as r:
                answers["chat"] = (r.status, (await r.json())["error"]["param"])
            return answers, await client.r.xlen(KEYS.requests)

    answers, queued = run(main())
    assert answers[("tok-a", -1)] == (400, "priority") and answers[("tok-a", 0)][0] == 202
    assert answers[("tok-b", -11)] == (400, "priority") and answers[("tok-b", -10)][0] == 202
    assert answers[("tok-c", -50)][0] == 202 and answers["chat"] == (400, "priority")
    assert queued == 3
