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


def _replica_of(cluster: ValkeyCluster, master) -> list:
    found = []
    for node in cluster.nodes:
        if node is master or not node.running():
            continue
        with cluster.client(node) as c:
            role = c.execute_command("ROLE")
            if role[0] == "slave" and int(role[2]) == master.port:
                found.append(node)
    return found


@pytest.mark.slow
def test_a_shard_whose_master_is_down_leaves_the_others_serving(valkey_cluster, tiny_model_dir):
    """The master of shard 1's slot stops (SIGSTOP; its replica told not to take over, the cluster told to
    serve the slots it still covers) while traffic runs: requests on the shards of live masters keep
    finishing within bounded latency, requests to the stopped shard are answered within seconds, 503 with
    Retry-After (or accepted), and once the master is back every request finishes exactly once, those a
    producer sent again after a 503 included."""
    import signal
    import time

    down = valkey_cluster.master_of(KEYS.of_shard(1).requests)
    alive = [k for k in range(SHARDS) if valkey_cluster.master_of(KEYS.of_shard(k).requests) is not down]
    assert alive and valkey_cluster.master_of(KEYS.config) is not down
    for node in valkey_cluster.nodes:
        with valkey_cluster.client(node) as c:
            c.config_set("cluster-require-full-coverage", "no")
    for node in _replica_of(valkey_cluster, down):
        with valkey_cluster.client(node) as c:
            c.config_set("cluster-replica-no-failover", "yes")
    stem_alive = [f"live{i}" for i in range(200) if shard_of(f"live{i}", SHARDS) in alive][:8]
    stem_dead = [f"dead{i}" for i in range(200) if shard_of(f"dead{i}", SHARDS) == 1][:3]
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    async def main():
        stack = api_stack(valkey_cluster.url, tiny_model_dir, shards=SHARDS)
        async with stack as (base, _worker, client), aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as http:

            async def post(rid: str) -> tuple[int, str | None, float]:
                t0 = time.monotonic()
                async with http.post(f"{base}/v1/requests", json={**body, "id": rid}) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After"), time.monotonic() - t0

            async def served(rid: str) -> float:
                t0 = time.monotonic()
                status, _, _ = await post(rid)
                assert status == 202, (rid, status)
                result = await asyncio.wait_for(client.wait(rid), 30)
                assert result.status == "finished", rid
                return time.monotonic() - t0

            assert await served("warm-up") < 30
            down.proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(2.5)  # past the node timeout: the others mark it failed
                dead_answers = await asyncio.gather(*(post(rid) for rid in stem_dead))
                alive_latency = await asyncio.gather(*(served(rid) for rid in stem_alive))
            finally:
                down.proc.send_signal(signal.SIGCONT)
            await asyncio.to_thread(valkey_cluster.wait_ok)
            # A 503 got no answer from the stopped master: the request may have landed. The producer's retry
            # with the same id adds nothing twice either way.
            retried = [
                (await post(rid))[0] for rid, (status, _, _) in zip(stem_dead, dead_answers) if status != 202
            ]
            results = [await asyncio.wait_for(client.wait(rid), 60) for rid in stem_dead]
            infos = {rid: await client.info(rid) for rid in (*stem_alive, *stem_dead)}
            # entries-added, not XLEN: workers trim the request streams up to the oldest pending entry
            entries = {
                k: int((await client.r.xinfo_stream(KEYS.of_shard(k).requests))["entries-added"])
                for k in range(SHARDS)
            }
            return dead_answers, alive_latency, retried, results, infos, entries

    dead_answers, alive_latency, retried, results, infos, entries = run(main(), timeout=300)
    # the live shards never waited on the stopped one (bounds with room for a loaded machine)
    assert max(alive_latency) < 30, alive_latency
    for status, retry_after, took in dead_answers:
        assert status in (202, 503), status
        assert status == 202 or (retry_after is not None and int(retry_after) >= 1)
        assert took < 40, took  # answered within the retry window and a socket timeout or two, not hung
    assert all(status in (200, 202) for status in retried), retried
    assert [r.status for r in results] == ["finished"] * len(stem_dead)
    assert all(i["status"] == "finished" and i["run"] == "1" for i in infos.values()), infos
    assert sum(entries.values()) == 1 + len(stem_alive) + len(stem_dead)  # none added twice


@pytest.mark.parametrize("server", ["single", "cluster"])
def test_a_batch_spreads_over_shards_and_every_line_runs_once(request, server, tiny_model_dir):
    """The Batch API with three shards, on one instance and on the cluster, under a tenant cap of 4 queued
    (lines over it wait for room): every good line runs exactly once, on the shard its id hashes to, and
    the batch's counts and files are right."""
    import io

    import openai
    import orjson

    target = request.getfixturevalue("valkey" if server == "single" else "valkey_cluster")
    model = str(tiny_model_dir)
    greedy = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    rows = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": f"line {i}", **greedy}}
        for i in range(12)
    ]  # fmt: skip
    rows.insert(5, {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": "x", "top_p": 5}})  # fmt: skip
    data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
    keys = Keys("specserve", cluster=server == "cluster", shards=SHARDS)

    async def main():
        stack = api_stack(target.url, tiny_model_dir, api_keys=["a:tok-a"], shards=SHARDS)
        async with stack as (base, _worker, client):
            client.limits = Limits(tenant_max_queued=4)
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            f = await oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await oai.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
            for _ in range(1200):
                batch = await oai.batches.retrieve(batch.id)
                if batch.status not in ("validating", "in_progress", "finalizing"):
                    break
                await asyncio.sleep(0.1)
            output = (await oai.files.content(batch.output_file_id)).content
            entries = {k.shard: await client.r.xrange(k.requests) for k in keys.every_shard()}
            infos = {f["id"]: await client.info(f["id"]) for items in entries.values() for _, f in items}
            return batch, output, entries, infos

    batch, output, entries, infos = run(main(), timeout=300)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        13,
        12,
        1,
    )
    lines = {row["custom_id"]: row for row in map(orjson.loads, output.splitlines())}
    assert set(lines) == {f"l{i}" for i in range(12)}
    assert all(row["response"]["status_code"] == 200 for row in lines.values())
    assert sum(len(items) for items in entries.values()) == 12  # one entry a line, none twice
    assert sum(1 for items in entries.values() if items) >= 2
    for shard, items in entries.items():
        assert all(keys.of_request(f["id"]).shard == shard for _, f in items)
    assert all(i["status"] == "finished" and i["run"] == "1" for i in infos.values())
