"""The service on a real Valkey Cluster (3 masters, 3 replicas on loopback): the same REDIS_URL finds the
cluster by itself, every script's keys share one slot, the service's results equal LLM.generate, and a master
killed with SIGKILL under load loses no accepted request: each finishes exactly once and every stream reader
gets every token once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.cluster import key_slot
from valkey_cluster import ValkeyCluster
from valkey_helpers import api_stack, free_port, run, service_stack, spawn_cli, wait_for

from specserve import SamplingParams
from specserve.queue import scripts
from specserve.queue.client import Durability, Limits, QueueClient
from specserve.queue.connection import Connections, NotReplicated, is_cluster, open_redis
from specserve.queue.consumer import ConsumerConfig, StreamConsumer
from specserve.queue.keys import Keys
from specserve.queue.ready import Admission, FairShare, ReadyQueue
from specserve.queue.resp import RespClient
from specserve.queue.wire import decode_body

pytest_plugins = ("valkey_fixtures",)
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Hello"]


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    cluster = ValkeyCluster(tmp_path / "cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _every_key(keys: Keys) -> list[str]:
    """Every name keys.py builds, one of each kind."""
    names = [keys.requests, keys.group, keys.dead, keys.models, keys.keyed, keys.quota, keys.load, keys.ready]
    return [
        *names, keys.req("r-1"), keys.out("r-1"), keys.reply("producer"), keys.warm("k"), keys.passes("w"),
        keys.wake("x"), keys.batch("file", "f-1"),
    ]  # fmt: skip


def test_single_instance_names_are_unchanged_and_cluster_names_share_one_slot() -> None:
    plain = Keys("specserve")
    assert plain.requests == "specserve:requests" and plain.req("a") == "specserve:req:a"
    assert plain.ready == "specserve:ready:"
    tagged = Keys("specserve", cluster=True)
    assert tagged.requests == "{specserve}:requests" and tagged.out("a") == "{specserve}:out:a"
    # scripts build the quota and ready-queue keys from these prefixes: they must hash with the rest
    slots = {
        key_slot(k.encode()) for k in _every_key(tagged) + [tagged.quota + "queued:t", tagged.ready + "age"]
    }
    assert len(slots) == 1


def test_the_same_url_opens_a_cluster_client_only_on_a_cluster(valkey, valkey_cluster) -> None:
    async def main():
        single, clustered = await open_redis(valkey.url), await open_redis(valkey_cluster.nodes[4].url)
        try:
            a, b = QueueClient(single), QueueClient(clustered)
            return type(single), type(clustered), a.keys.requests, b.keys.requests
        finally:
            await single.aclose()
            await clustered.aclose()

    single_type, cluster_type, single_key, cluster_key = run(main())
    assert single_type is Redis and issubclass(cluster_type, RedisCluster)
    assert (single_key, cluster_key) == ("specserve:requests", "{specserve}:requests")


def test_a_burst_past_the_cluster_pool_waits_for_a_connection_instead_of_failing(valkey_cluster) -> None:
    """redis-py's cluster pool raises MaxConnectionsError when a burst outnumbers it; ours waits, as the
    single instance's blocking pool does: 200 first enqueues at once over 4 connections all land."""

    async def main():
        r = await open_redis(valkey_cluster.nodes[0].url, max_connections=4)
        try:
            client = QueueClient(r)
            body = {"prompt": "x", "max_tokens": 1}
            accepted = await asyncio.gather(*(client.enqueue(body, f"burst-{i}") for i in range(200)))
            return len({a.id for a in accepted}), await r.xlen(client.keys.requests)
        finally:
            await r.aclose()

    assert run(main()) == (200, 200)


def test_a_user_without_info_still_finds_out_whether_it_is_on_a_cluster(valkey, valkey_cluster) -> None:
    def limited(node) -> str:
        with redis.Redis(port=node.port, password=node.password) as admin:
            admin.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-info")
        return f"redis://limited:pw@127.0.0.1:{node.port}/0"

    async def main():
        kinds = []
        for url in (limited(valkey), *(limited(n) for n in valkey_cluster.nodes)):
            kinds.append(await is_cluster(url))
        return kinds

    single, *nodes = run(main())
    assert single is False and all(nodes)


def test_seed_nodes_find_the_cluster_when_the_urls_node_is_down(valkey_cluster) -> None:
    # a replica: the masters go on serving every slot
    down = next(
        n for n in valkey_cluster.nodes if valkey_cluster.client(n).execute_command("ROLE")[0] == "slave"
    )
    down.kill()
    seeds = [f"127.0.0.1:{n.port}" for n in valkey_cluster.nodes if n is not down]

    async def main():
        r = await open_redis(down.url, seeds)
        try:
            await r.set(Keys("specserve", cluster=True).keyed, "1")
            return type(r)
        finally:
            await r.aclose()

    assert issubclass(run(main()), RedisCluster)


def test_service_on_a_cluster_equals_llm_generate(valkey_cluster, tiny_model_dir, tiny_engines) -> None:
    ref = tiny_engines.llm(tiny_model_dir).generate(PROMPTS, SamplingParams(**GREEDY))

    async def main():
        async with service_stack(valkey_cluster.url, tiny_model_dir) as (_worker, client):
            ids = [(await client.enqueue({"prompt": p, **GREEDY})).id for p in PROMPTS[:2]]
            # A producer in any language: XADD with the documented fields, to the tagged stream.
            await client.r.xadd(
                client.keys.requests, {"id": "raw", "body": orjson.dumps({"prompt": PROMPTS[2], **GREEDY})}
            )
            again = await client.enqueue({"prompt": PROMPTS[0], **GREEDY}, ids[0])
            results = await asyncio.gather(*(client.wait(i) for i in [*ids, "raw"]))
            stored = await client.result(ids[0])
            return results, again, stored

    results, again, stored = run(main())
    assert not again.created  # enqueue stays idempotent by id on a cluster
    for got, want in zip(results, ref):
        assert got.status == "finished" and got.token_ids == want.token_ids and got.text == want.text
    assert stored is not None and stored.token_ids == ref[0].token_ids and stored.info["run"] == "1"


async def _enqueue_until_accepted(client: QueueClient, body: dict, request_id: str) -> None:
    """A producer's loop: the same id again after an error, so a retry never adds a request twice."""
    for _ in range(200):
        try:
            await client.enqueue(body, request_id)
            return
        except Exception:  # the master away mid-failover: 503 over HTTP, an error here; try again
            await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} was never accepted")


def _audit_under_load(
    cluster: ValkeyCluster, model_dir: Path, engines, disrupt: Callable[[str], object], shards: int = 1
) -> str:
    """Requests running and waiting, stream readers following each, then `disrupt(a slot key)` (in a
    thread, returning once the cluster serves again: the slot of the first request's shard) while producers go
    on enqueueing, retrying with the same id. Audit: every accepted request finished exactly once with the
    greedy reference's tokens, every reader got every token once, and no retry added a request twice.
    Returns the disrupted key."""
    body = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    ref = {
        f"load-{i}": r.token_ids
        for i, r in enumerate(engines.llm(model_dir).generate(prompts, SamplingParams(**body)))
    }
    keys = Keys("specserve", cluster=True, shards=shards)
    tag = keys.of_request("load-0").requests

    async def read(client: QueueClient, rid: str) -> list[int]:
        got: list[int] = []
        async for delta in client.stream(rid):
            got.extend(delta.token_ids)
        return got

    async def main():
        # a request whose claim the promoted replica missed waits for a reclaim: keep that wait short
        async with service_stack(cluster.url, model_dir, shards=shards, claim_timeout_s=3.0) as (
            worker,
            client,
        ):
            ids = list(ref)
            first, later = ids[: len(ids) // 2], ids[len(ids) // 2 :]
            # Accepted before the disruption means held by a replica too (WAIT): without it a failover may
            # promote a replica that never saw the stream, and the request is gone with it (Durability's
            # contract). The later ones are enqueued while the promoted master has no replica to wait for.
            durable = QueueClient(await open_redis(cluster.url), keys, durable=Durability(replicas=1))
            try:
                for rid in first:
                    await durable.enqueue({"prompt": prompts[ids.index(rid)], **body}, rid)
            finally:
                await durable.aclose()
            readers = {rid: asyncio.create_task(read(client, rid)) for rid in ids}
            while not worker.inflight:
                await asyncio.sleep(0.01)
            disrupting = asyncio.ensure_future(asyncio.to_thread(disrupt, tag))
            producers = [
                asyncio.create_task(
                    _enqueue_until_accepted(client, {"prompt": prompts[ids.index(r)], **body}, r)
                )
                for r in later
            ]
            await disrupting
            await asyncio.gather(*producers)
            streamed = dict(zip(readers, await asyncio.gather(*readers.values())))
            results = {rid: await client.result(rid) for rid in ids}
            entries = sum([await client.r.xlen(k.requests) for k in keys.every_shard()])
            return streamed, results, entries

    streamed, results, entries = run(main(), timeout=240)
    for rid, want in ref.items():
        result = results[rid]
        assert result is not None and result.status == "finished", rid
        assert result.token_ids == want, rid
        assert streamed[rid] == want, rid  # every token once, in order, to the reader that followed it
    assert entries <= len(ref)  # a producer's retry never added a request twice
    return tag


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_a_master_killed_under_load_loses_no_request_and_no_token(
    valkey_cluster, tiny_model_dir, tiny_engines, shards
) -> None:
    def kill_master(tag: str) -> None:
        master = valkey_cluster.master_of(tag)
        master.kill()
        valkey_cluster.failover_done(tag, master)

    _audit_under_load(valkey_cluster, tiny_model_dir, tiny_engines, kill_master, shards=shards)


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_the_slot_moved_to_another_master_under_load_loses_no_request_and_no_token(
    valkey_cluster, tiny_model_dir, tiny_engines, shards
) -> None:
    moved_to = []

    def move(tag: str) -> None:
        moved_to.append(valkey_cluster.migrate_slot(tag))

    tag = _audit_under_load(valkey_cluster, tiny_model_dir, tiny_engines, move, shards=shards)
    assert valkey_cluster.master_of(tag) is moved_to[0]
    if shards == 1:  # one slot holds the whole queue: the request stream moved with it
        assert valkey_cluster.master_of(Keys("specserve", cluster=True).requests) is moved_to[0]


def test_a_durable_enqueue_is_on_a_replica_before_it_is_accepted(valkey_cluster) -> None:
    tag = Keys("specserve", cluster=True).requests

    async def main():
        client = QueueClient(await open_redis(valkey_cluster.url), durable=Durability(replicas=1))
        try:
            await client.enqueue({"prompt": "hi"}, "durable-1")
        finally:
            await client.aclose()

    run(main())
    master = valkey_cluster.master_of(tag)
    with valkey_cluster.client(master) as c:
        replica_port = int(c.execute_command("ROLE")[2][0][1])
    replica = next(n for n in valkey_cluster.nodes if n.port == replica_port)
    with valkey_cluster.client(replica) as c:
        c.execute_command("READONLY")  # a replica answers reads of its master's slots
        assert c.hget(Keys("specserve", cluster=True).req("durable-1"), "status") == "queued"


def test_a_durable_enqueue_with_no_replica_is_refused_and_a_retry_adds_nothing(valkey) -> None:
    async def main():
        client = QueueClient(await open_redis(valkey.url), durable=Durability(replicas=1, timeout_ms=50))
        errors = []
        try:
            for _ in range(2):  # a producer retrying with the same id
                try:
                    await client.enqueue({"prompt": "hi"}, "lonely")
                except NotReplicated as e:
                    errors.append(e)
            return errors, await client.r.xlen(client.keys.requests), await client.info("lonely")
        finally:
            await client.aclose()

    errors, length, info = run(main())
    assert len(errors) == 2 and "0 of 1 replicas" in str(errors[0])
    assert length == 1 and info["status"] == "queued"  # held by the master, once


def test_finish_run_again_answers_written_and_writes_nothing_twice(valkey) -> None:
    keys = Keys("t")

    async def main():
        r = await open_redis(valkey.url)
        try:
            await r.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
            eid = await r.xadd(keys.requests, {"id": "f1", "body": "{}"})
            await r.xreadgroup(keys.group, "w1", {keys.requests: ">"})
            await r.hset(
                keys.req("f1"), mapping={"status": "running", "entry": eid, "worker": "w1", "run": 1}
            )
            args = [
                3, keys.out("f1"), keys.req("f1"), keys.requests, keys.group, "w1", eid, 60_000, "finished",
                1, "status", "finished", 0, 100,
            ]  # fmt: skip
            first, again = await r.eval(scripts.FINISH, *args), await r.eval(scripts.FINISH, *args)
            other = await r.eval(scripts.FINISH, *[a if a != "w1" else "w2" for a in args])
            return (
                first,
                again,
                other,
                await r.xlen(keys.out("f1")),
                await r.xpending(keys.requests, keys.group),
            )
        finally:
            await r.aclose()

    first, again, other, outputs, pending = run(main())
    assert (first, again, other) == (1, 1, 0)  # another worker's finish is still refused
    assert outputs == 1 and pending["pending"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_specserve_api_and_worker_processes_serve_from_a_cluster_url(
    valkey_cluster, tiny_model_dir, tiny_engines, tmp_path, shards
) -> None:
    """The CLI's path: REDIS_URL names one cluster node, nothing else says it is a cluster (with three shards
    too: both processes given SPECSERVE_QUEUE_SHARDS)."""
    ref = tiny_engines.llm(tiny_model_dir).generate(["Hello"], SamplingParams(**GREEDY))[0]
    health, api_port = free_port(), free_port()
    env = {
        "SPECSERVE_DTYPE": "float32", "SPECSERVE_KV_CACHE_BYTES": str(4 << 20), "SPECSERVE_DEVICE": "cpu",
        "REDIS_URL": valkey_cluster.nodes[2].url, "SPECSERVE_MODEL": str(tiny_model_dir),
        "SPECSERVE_HEALTH_PORT": str(health), "SPECSERVE_QUEUE_SHARDS": str(shards),
    }  # fmt: skip
    worker = spawn_cli(["worker"], env, tmp_path / "worker.log")
    api_env = {
        "REDIS_URL": env["REDIS_URL"],
        "SPECSERVE_PORT": str(api_port),
        "SPECSERVE_QUEUE_SHARDS": str(shards),
    }
    api = spawn_cli(["api"], api_env, tmp_path / "api.log")
    base = f"http://127.0.0.1:{api_port}"

    async def ready(url: str) -> bool:
        try:
            async with aiohttp.ClientSession() as http, http.get(url) as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    async def main():
        await wait_for(lambda: ready(f"http://127.0.0.1:{health}/readyz"), timeout=180, what="worker ready")
        await wait_for(lambda: ready(f"{base}/readyz"), timeout=180, what="api ready")
        body = {"model": str(tiny_model_dir), "prompt": "Hello", **GREEDY}
        async with aiohttp.ClientSession() as http, http.post(f"{base}/v1/completions", json=body) as r:
            return r.status, await r.json()

    try:
        status, answer = run(main(), timeout=300)
    finally:
        for proc in (worker, api):
            proc.terminate()
        for proc in (worker, api):
            proc.wait(timeout=60)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == ref.text
    with valkey_cluster.cluster_client() as c:
        keys = Keys("specserve", cluster=True, shards=shards)
        assert sum(c.xlen(k.requests) for k in keys.every_shard()) == 1  # on its id's shard, once


@pytest.mark.slow
def test_the_batch_api_e2e_runs_unchanged_on_a_cluster(valkey_cluster, tiny_model_dir, tiny_engines) -> None:
    """The Files and Batch APIs' own end-to-end test (tests/test_batch_api.py), given the cluster: the batch's
    hash, lists and lock, the files and the lines' requests all on the cluster."""
    from test_batch_api import test_a_batch_through_the_openai_client

    test_a_batch_through_the_openai_client(valkey_cluster, tiny_model_dir, tiny_engines)


def test_shards_spread_over_the_masters_and_serve_50_http_requests_once_each(
    valkey_cluster, tiny_model_dir, tiny_engines
) -> None:
    """Three shards on the 3-master cluster, through the HTTP API: every request answered and run exactly
    once, the requests spread over the shards, and the shards over more than one master."""
    body = {"model": str(tiny_model_dir), "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(50)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = tiny_engines.llm(tiny_model_dir).generate(prompts, params)
    keys = Keys("specserve", cluster=True, shards=3)

    async def main():
        async with api_stack(valkey_cluster.url, tiny_model_dir, shards=3) as (base, _worker, client):
            async with aiohttp.ClientSession() as http:

                async def complete(prompt: str) -> tuple[int, dict]:
                    async with http.post(f"{base}/v1/completions", json={**body, "prompt": prompt}) as r:
                        return r.status, await r.json()

                answers = await asyncio.gather(*(complete(p) for p in prompts))
            entries = {k.shard: await client.r.xrange(k.requests) for k in keys.every_shard()}
            infos = {f["id"]: await client.info(f["id"]) for items in entries.values() for _, f in items}
            return answers, entries, infos

    answers, entries, infos = run(main(), timeout=300)
    for (status, answer), want in zip(answers, ref):
        assert status == 200, answer
        assert answer["choices"][0]["text"] == want.text
    assert sum(len(items) for items in entries.values()) == 50  # one entry per request, none twice
    assert sum(1 for items in entries.values() if items) >= 2
    assert len(infos) == 50
    assert all(i["status"] == "finished" and i["run"] == "1" for i in infos.values())  # each run once
    masters = {valkey_cluster.master_of(k.requests).port for k in keys.every_shard()}
    assert len(masters) >= 2


def test_the_lean_client_follows_ask_to_a_slot_half_migrated(valkey_cluster) -> None:
    """A key already moved to the target while its slot is still the source's: the source answers ASK, and
    the lean client asks the target (ASKING first) instead of waiting for the migration to end."""
    key = Keys("specserve", cluster=True, shards=3).of_shard(1).req("moved")
    slot = key_slot(key.encode())
    source = valkey_cluster.master_of(key)
    target = next(
        n
        for n in valkey_cluster.nodes
        if n is not source and valkey_cluster.client(n).execute_command("ROLE")[0] == "master"
    )
    with valkey_cluster.client(source) as src, valkey_cluster.client(target) as dst:
        src.hset(key, "status", "queued")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.cluster("myid"))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.cluster("myid"))
        src.execute_command(
            "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "AUTH", valkey_cluster.password, "KEYS", key
        )

    async def main():
        r = await open_redis(valkey_cluster.url)
        fast = RespClient(r, route=key)
        try:
            one = await fast.execute("HGET", key, "status")
            piped = await fast.pipeline([("HGET", key, "status"), ("HSET", key, "status", "running")])
            return one, piped, await fast.execute("HGET", key, "status")
        finally:
            await fast.aclose()
            await r.aclose()

    one, piped, after = run(main())
    assert one == "queued" and piped == ["queued", 0] and after == "running"
    with valkey_cluster.client(target) as dst:
        dst.execute_command("ASKING")
        assert dst.hget(key, "status") == "running"  # written once, on the node that holds the key


# what is on the target already when the script runs: (keys moved first, the oldest-request turn)
HALF_MOVED = {
    "sort_in": (["bands", "age"], 0),  # sorting in stops after its list writes
    "take": (["age"], 0),  # a take stops before its pop
    "take_emptying": ([], 0),  # nothing moved yet: a take empties a list after a move and stops at it
    "take_stream_moved": (["/requests"], 2),  # every declared key moved: an ASK, which a script waits out
}


@pytest.mark.parametrize("during", list(HALF_MOVED))
def test_the_ready_queue_half_moved_loses_no_entry(valkey_cluster, during: str) -> None:
    """Some of the queue's keys already on the target: a script gets past Valkey's check of its declared keys
    and reaches a key that is not on the source midway, where Valkey stops it after its first writes. It runs
    again until the slot has moved, and every entry is taken once: none is left held by `~ready` outside the
    queue, and none is moved to the worker without being handed to it. A script all of whose declared keys
    have moved is not run on the target (an ASK): there its writes would make keys the migration then
    refuses to move (BUSYKEY)."""
    keys = Keys("specserve", cluster=True)
    body = {"prompt": "hello", "max_tokens": 4}
    half_moved = threading.Event()
    moved_first, oldest_every = HALF_MOVED[during]
    moved = [keys.requests if k == "/requests" else keys.ready + k for k in moved_first]

    async def main():
        r = await open_redis(valkey_cluster.url)
        conns = Connections(r, route=keys.requests)
        consumer = StreamConsumer(conns, keys, "w1", ConsumerConfig(block_ms=50))
        client = QueueClient(r, keys)
        fair = FairShare(oldest_every=oldest_every)
        ready = ReadyQueue(conns.fast, keys, "w1", fair, Limits(), 600_000)

        async def sort_new() -> list[Admission]:
            entries = await consumer.read_new(10, wait=False)
            verdicts = await ready.sort_in([(e, decode_body(e.raw_body)) for e in entries])
            return [v.verdict for v in verdicts]

        async def take(n: int = 10) -> list[str]:
            return [e.request_id or "" for e in (await ready.take(n)).entries]

        try:
            await consumer.ensure_group()
            for rid in ("before", "waiting"):
                await client.enqueue(body, rid)
            verdicts = await sort_new()  # the band's list, its ring, `bands` and `age` now exist
            taken = await take(1)  # and the band's credit and grant
            await client.enqueue(body, "arriving")
            if during != "sort_in":
                verdicts += await sort_new()
            moving = asyncio.ensure_future(
                asyncio.to_thread(
                    valkey_cluster.migrate_slot,
                    keys.requests,
                    first=moved,
                    half_moved=half_moved,
                    pause_s=1.0,
                )
            )
            await asyncio.to_thread(half_moved.wait, 10)
            if during == "sort_in":
                verdicts += await sort_new()
            else:
                taken += await take()
            await moving
            taken += await take()
            pending = await conns.fast.execute("XPENDING", keys.requests, keys.group, "-", "+", 10)
            return verdicts, taken, pending
        finally:
            await conns.aclose(close_redis=True)

    verdicts, taken, pending = run(main())
    assert verdicts == [Admission.READY] * 3
    assert taken == ["before", "waiting", "arriving"]
    assert {p[1] for p in pending} == {"w1"}  # all with the worker that took them, none left with ~ready


def test_redis_pys_client_runs_a_script_again_that_a_half_moved_slot_stopped(valkey_cluster) -> None:
    """The scripts sent through redis-py (cancel, hand-back, tenants' limits) stop the same way at a key the
    migration already moved; the cluster client runs them again until the slot has moved."""
    keys = Keys("specserve", cluster=True)
    counted, moved = keys.req("counted"), keys.req("moved")
    half_moved = threading.Event()
    # stops at GET on the moved key, after its first write; ran again from the start, its INCR counts twice
    script = "redis.call('INCR', KEYS[1]) return redis.call('GET', ARGV[1])"

    async def main():
        r = await open_redis(valkey_cluster.url)
        try:
            await r.set(counted, 0)
            await r.set(moved, "here")
            moving = asyncio.ensure_future(
                asyncio.to_thread(
                    valkey_cluster.migrate_slot, counted, first=[moved], half_moved=half_moved, pause_s=1.0
                )
            )
            await asyncio.to_thread(half_moved.wait, 10)
            got = await r.eval(script, 1, counted, moved)
            await moving
            return got, int(await r.get(counted))
        finally:
            await r.aclose()

    got, runs = run(main())
    assert got == "here" and runs >= 2
