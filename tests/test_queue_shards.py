"""The request stream split into shards (--queue-shards) on a single instance: the names of each shard, a
request found on the shard its id hashes to by every producer and reader, a worker serving every shard with
results equal to LLM.generate, and a fleet that refuses a process given another shard count."""

from __future__ import annotations

import asyncio
import zlib

import orjson
import pytest
from redis.cluster import key_slot
from valkey_helpers import run, service_stack

from specserve import SamplingParams
from specserve.queue.client import Limits, QueueClient, QuotaExceeded, ShardMismatch, shard_limits
from specserve.queue.connection import open_redis
from specserve.queue.keys import Keys, shard_of
from specserve.service.config import ServiceConfig

pytest_plugins = ("valkey_fixtures",)
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_one_shard_keeps_every_name_and_more_shards_tag_each_with_its_own_slot() -> None:
    assert Keys("specserve", shards=1).requests == "specserve:requests"
    assert Keys("specserve", cluster=True, shards=1).req("a") == "{specserve}:req:a"
    keys = Keys("specserve", cluster=True, shards=3)
    # the rule producers are given: CRC-32 of the id's UTF-8 bytes, modulo the shard count
    assert shard_of("req-42", 3) == zlib.crc32(b"req-42") % 3
    mine = keys.of_request("req-42")
    assert mine.shard == shard_of("req-42", 3)
    assert mine.requests == f"{{specserve:s{mine.shard}}}:requests"
    assert mine.req("req-42") == f"{{specserve:s{mine.shard}}}:req:req-42"
    # every key one shard's scripts touch shares that shard's slot
    scripted = [mine.requests, mine.req("x"), mine.out("x"), mine.ready + "age"]
    scripted += [mine.reply("p"), mine.warm("k"), mine.load, mine.passes("w"), mine.dead]
    assert len({key_slot(k.encode()) for k in scripted}) == 1
    assert len({key_slot(k.requests.encode()) for k in keys.every_shard()}) == 3
    # the fleet's own keys keep the shard-less names
    assert {mine.models, mine.keyed, mine.config} == {
        "{specserve}:models",
        "{specserve}:keyed",
        "{specserve}:config",
    }
    assert mine.batch("file", "f") == "{specserve}:file:f"
    # on a single instance a tenant's limits are counted once for the fleet, whatever the shard
    assert Keys("specserve", shards=3).of_shard(2).quota == "specserve:quota:"


def test_shard_count_is_a_setting_and_tenant_counters_of_a_sharded_cluster_get_slots_of_their_own() -> None:
    assert ServiceConfig(queue_shards=4).queue_keys().shards == 4
    with pytest.raises(ValueError, match="SPECSERVE_QUEUE_SHARDS"):
        ServiceConfig(queue_shards=0)
    sharded = Keys("specserve", cluster=True, shards=2)
    # the shards' scripts count no tenant limit there: each tenant's counters share a slot of their own
    assert sharded.split_quota and sharded.of_shard(1).quota == ""
    assert sharded.tenant_quota("acme") == "{specserve:t:acme}:quota:"
    mine = shard_limits(Limits(max_backlog=10, tenant_max_queued=3, tenant_tokens_per_minute=99), sharded)
    assert mine == Limits(max_backlog=5)  # the backlog counted per shard, each holding its share
    one = Keys("specserve", shards=2)  # one instance: the fleet's keys count every shard's requests
    assert not one.split_quota and one.tenant_quota("acme") == one.quota == "specserve:quota:"
    assert shard_limits(Limits(tenant_max_queued=3), one) == Limits(tenant_max_queued=3)


def test_two_shards_on_one_instance_serve_every_producer(valkey, tiny_model_dir, tiny_engines) -> None:
    prompts = [f"The quick brown fox {i}" for i in range(8)]
    ref = tiny_engines.llm(tiny_model_dir).generate(prompts, SamplingParams(**GREEDY))
    ids = [f"two-{i}" for i in range(len(prompts))]
    assert {shard_of(i, 2) for i in ids} == {0, 1}

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, shards=2) as (worker, client):
            for rid, prompt in zip(ids[:-1], prompts[:-1]):
                await client.enqueue({"prompt": prompt, **GREEDY}, rid)
            # A producer in any language: XADD to the stream of the shard its id hashes to.
            raw = ids[-1]
            await client.r.xadd(
                client.keys_of(raw).requests,
                {"id": raw, "body": orjson.dumps({"prompt": prompts[-1], **GREEDY})},
            )
            again = await client.enqueue({"prompt": prompts[0], **GREEDY}, ids[0])
            # One XADDed to the other shard: the worker sends it on to its own, where readers find it.
            wrong = client.keys.of_shard(1 - shard_of("misrouted", 2)).requests
            await client.r.xadd(
                wrong, {"id": "misrouted", "body": orjson.dumps({"prompt": prompts[1], **GREEDY})}
            )
            misrouted = await client.wait("misrouted")
            results = await asyncio.gather(*(client.wait(i) for i in ids))
            infos = [await client.info(i) for i in ids]
            lengths = [await client.r.xlen(k.requests) for k in client.keys.every_shard()]
            on_shard = [await client.r.exists(client.keys.of_shard(shard_of(i, 2)).req(i)) for i in ids]
            pending = [await client.r.xpending(k.requests, k.group) for k in client.keys.every_shard()]
            return again, results, infos, lengths, on_shard, worker.ready, misrouted, pending

    again, results, infos, lengths, on_shard, ready, misrouted, pending = run(main())
    assert ready and not again.created  # idempotent by id across shards too
    assert misrouted.status == "finished" and misrouted.token_ids == ref[1].token_ids
    assert all(p["pending"] == 0 for p in pending)  # the misrouted entry was acknowledged where it landed
    for got, want in zip(results, ref):
        assert got.status == "finished" and got.token_ids == want.token_ids
    assert all(info["run"] == "1" and info["status"] == "finished" for info in infos)  # each exactly once
    assert sum(lengths) == len(ids) + 2 and all(lengths) and all(on_shard)  # misrouted: on both


def test_a_process_with_another_shard_count_is_refused_naming_the_setting(valkey) -> None:
    async def main():
        first = QueueClient(await open_redis(valkey.url), Keys("specserve", shards=2))
        other = QueueClient(await open_redis(valkey.url), Keys("specserve", shards=3))
        try:
            await first.enqueue({"prompt": "hi"}, "one")
            with pytest.raises(ShardMismatch, match=r"SPECSERVE_QUEUE_SHARDS.* is 3 here.* uses 2"):
                await other.enqueue({"prompt": "hi"}, "two")
            return await first.r.exists(other.keys_of("two").req("two"))
        finally:
            await first.aclose()
            await other.aclose()

    assert run(main()) == 0  # nothing was enqueued by the refused one


def test_serve_refuses_to_start_on_a_fleet_with_another_shard_count(valkey) -> None:
    from specserve.service.launch import check_shards

    async def main():
        r = await open_redis(valkey.url)
        try:
            await check_shards(r, Keys("specserve", shards=3), ServiceConfig(queue_shards=3))  # records 3
            with pytest.raises(SystemExit, match=r"error: SPECSERVE_QUEUE_SHARDS .* is 1 here.* uses 3"):
                await check_shards(r, Keys("specserve"), ServiceConfig())
            return await r.hget(Keys("specserve").config, "queue_shards")
        finally:
            await r.aclose()

    assert run(main()) == "3"


def test_choices_over_two_shards_are_all_or_none_under_a_tenant_limit(valkey) -> None:
    first, second = (
        "pick-0",
        next(f"pick-{i}" for i in range(1, 50) if shard_of(f"pick-{i}", 2) != shard_of("pick-0", 2)),
    )

    async def main():
        client = QueueClient(
            await open_redis(valkey.url), Keys("specserve", shards=2), limits=Limits(tenant_max_queued=1)
        )
        try:
            with pytest.raises(QuotaExceeded, match="tenant_max_queued"):
                await client.enqueue_all([({"prompt": "a"}, first), ({"prompt": "b"}, second)], tenant="t")
            return await client.info(first), await client.info(second)
        finally:
            await client.aclose()

    taken, refused = run(main())
    assert taken["status"] == "cancelled" and refused == {}  # the shard that took one gave it up at once
