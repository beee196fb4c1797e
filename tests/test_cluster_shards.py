"""Three shards on a real 3-master Valkey Cluster: a tenant's limits hold across the shards (its counters in a
slot of their own, queue/tenants.py) and no crash leaks a count; a shard whose master is down while the others
serve; the Batch API's lines spread over the shards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from valkey_cluster import ValkeyCluster
from valkey_helpers import api_stack, run

from specserve.queue import scripts
from specserve.queue.client import Limits, QueueClient, QuotaExceeded
from specserve.queue.connection import open_redis
from specserve.queue.keys import Keys, shard_of

pytest_plugins = ("valkey_fixtures",)
SHARDS = 3
KEYS = Keys("specserve", cluster=True, shards=SHARDS)
TOK = {"Authorization": "Bearer tok-a"}
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=60)


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    cluster = ValkeyCluster(tmp_path / "cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def one_per_shard(stem: str, qualify: str = "") -> list[str]:
    """An id for each shard, first shard first (`qualify`: the tenant prefix the API puts before ids)."""
    found: dict[int, str] = {}
    for i in range(1000):
        rid = f"{stem}{i}"
        found.setdefault(shard_of(qualify + rid, SHARDS), rid)
        if len(found) == SHARDS:
            return [found[k] for k in range(SHARDS)]
    raise AssertionError("ids over every shard not found")


async def _final(http: aiohttp.ClientSession, base: str, rid: str) -> dict:
    for _ in range(3000):
        async with http.get(f"{base}/v1/requests/{rid}", headers=TOK) as r:
            body = await r.json()
        if body.get("status") in ("finished", "failed", "cancelled", "expired"):
            return body
        await asyncio.sleep(0.02)
    raise AssertionError(f"{rid} never ended")


def test_a_tenants_cap_holds_across_shards_and_frees_on_cancel_and_on_run(valkey_cluster, tiny_model_dir):
    """No worker runs at first, so requests stay queued: one on each of the three shards fill the tenant's cap
    of 3, the fourth (on any shard) is 429 naming the limit, a cancel lets one in, and once a worker has
    run them the tenant may queue three more."""
    ids = one_per_shard("a", "team-a:")
    more = one_per_shard("b", "team-a:")
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0.0}

    async def main():
        stack = api_stack(
            valkey_cluster.url, tiny_model_dir, api_keys=["team-a:tok-a"], shards=SHARDS, start_worker=False
        )
        async with stack as (base, worker, client), aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:
            assert client.keys.split_quota
            client.limits = Limits(tenant_max_queued=3)

            async def post(rid: str) -> tuple[int, str | None, dict]:
                async with http.post(f"{base}/v1/requests", json={**body, "id": rid}, headers=TOK) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            filled = [await post(rid) for rid in ids]
            refused = [await post(rid) for rid in more]  # every shard refuses: the count is the tenant's
            async with http.delete(f"{base}/v1/requests/{ids[0]}", headers=TOK) as r:
                assert r.status == 200
            after_cancel = await post(more[0])
            still_full = await post(more[1])
            await worker.start()
            finals = [await _final(http, base, rid) for rid in (*ids[1:], more[0])]
            again = [await post(rid) for rid in (more[1], more[2])]
            return filled, refused, after_cancel, still_full, finals, again

    filled, refused, after_cancel, still_full, finals, again = run(main(), timeout=240)
    assert [f[0] for f in filled] == [202] * 3
    for status, retry_after, err in refused:
        assert status == 429 and retry_after is not None
        assert err["error"]["param"] == "tenant_max_queued"
    assert after_cancel[0] == 202 and still_full[0] == 429
    assert [f["status"] for f in finals] == ["finished"] * 3
    assert [a[0] for a in again] == [202, 202]


def test_no_crash_leaks_a_tenants_count(valkey_cluster, tiny_model_dir):
    """A worker killed between its claim and its release (the entry stays pending with a dead consumer), and
    a producer killed between its reservation and its enqueue, leave members in the tenant's set that are
    not queued: the next admission that would be refused reconciles them away, and the orphaned request is
    reclaimed and run exactly once."""
    dead, *fill = one_per_shard("d")
    fill.append("d-extra")
    phantom = "never-enqueued"

    async def main():
        stack = api_stack(
            valkey_cluster.url, tiny_model_dir, shards=SHARDS, start_worker=False,
            worker_cfg={"claim_timeout_s": 1.0},
        )  # fmt: skip
        async with stack as (_base, worker, client):
            client.limits = Limits(tenant_max_queued=3)
            assert client.tenants is not None
            client.tenants.grace_ms = 0  # the phantom's producer is known dead: no enqueue is under way
            await client.enqueue({"prompt": "hello", "max_tokens": 3}, dead, tenant="t")
            # A worker that read and claimed it, then died before releasing its tenant's count.
            keys = KEYS.of_request(dead)
            r = client.r
            await r.xreadgroup(keys.group, "dead-worker", {keys.requests: ">"}, count=1)
            ((entry_id, _),) = await r.xrange(keys.requests)
            claim = await r.eval(
                scripts.CLAIM, 2, keys.req(dead), keys.requests, entry_id, keys.group, "dead-worker",
                60_000, 3, "", entry_id.split("-")[0], keys.quota, dead,
            )  # fmt: skip
            assert claim[0] == "run"
            # A producer that reserved and died before its enqueue.
            reserved = await client.tenants.reserve("t", [phantom], 0, 3, 0)
            assert not isinstance(reserved, tuple)
            counted_before = await r.zcard(client.tenants.queued_key("t"))
            for rid in fill:  # the tenant holds nothing queued: its cap of 3 lets three in
                await client.enqueue({"prompt": "hi", "max_tokens": 2}, rid, tenant="t")
            with pytest.raises(QuotaExceeded, match="tenant_max_queued"):
                await client.enqueue({"prompt": "hi"}, "one-too-many", tenant="t")
            await worker.start()
            results = [await asyncio.wait_for(client.wait(rid), 60) for rid in (dead, *fill)]
            info = await client.info(dead)
            return counted_before, results, info

    counted_before, results, info = run(main(), timeout=240)
    assert counted_before == 2  # the orphan and the phantom
    assert [res.status for res in results] == ["finished"] * 4
    assert info["run"] == "2" and info["worker"] != "dead-worker"  # reclaimed, and finished by one run


def test_the_cluster_client_opens_on_the_same_url_without_a_tenant_refusal(valkey_cluster) -> None:
    """The limits that a sharded cluster refused at start are accepted now, and a client's counters name
    the tenant's own slot."""

    async def main():
        client = QueueClient(
            await open_redis(valkey_cluster.url),
            Keys("specserve", shards=SHARDS),
            limits=Limits(tenant_max_queued=3, tenant_tokens_per_minute=100),
        )
        try:
            await client.ensure_group()
            await client.enqueue({"prompt": "x", "max_tokens": 40}, "x1", tenant="acme", tokens=40)
            await client.enqueue({"prompt": "x", "max_tokens": 40}, "x2", tenant="acme", tokens=40)
            with pytest.raises(QuotaExceeded, match="tenant_tokens_per_minute"):
                await client.enqueue({"prompt": "x", "max_tokens": 40}, "x3", tenant="acme", tokens=40)
            # a retried enqueue of a known id counts nothing twice
            await client.enqueue({"prompt": "x", "max_tokens": 40}, "x1", tenant="acme", tokens=0)
            assert client.tenants is not None
            return await client.r.zrange(client.tenants.queued_key("acme"), 0, -1)
        finally:
            await client.aclose()

    assert sorted(run(main())) == ["x1", "x2"]
