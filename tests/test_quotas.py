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
