"""Batches under the tenant's limits: lines a limit holds back go in as capacity frees (none is lost), lines
count against tokens per minute like any request, and a read of the batch costs a bounded number of Redis
reads whatever the batch's size."""

from __future__ import annotations

import asyncio
import io
import time

import openai
import orjson
from test_quotas import KEYS, _limited
from valkey_helpers import run

from specserve.queue.client import Limits
from specserve.service.batch import ADVANCE_LINES

pytest_plugins = ("valkey_fixtures",)
DONE = ("completed", "failed", "cancelled", "expired")


def _jsonl(model: str, n: int, max_tokens: int = 4) -> bytes:
    rows = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": f"Item {i}:", "max_tokens": max_tokens, "ignore_eos": True},
        }
        for i in range(n)
    ]
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


async def _batch(oai: openai.AsyncOpenAI, data: bytes):
    f = await oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return await oai.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")


def test_a_batch_larger_than_the_waiting_cap_finishes_every_line(valkey, tiny_model_dir):
    """10 lines under a cap of 6 waiting requests: 6 go in, 4 wait in the batch and go in as the first
    finish. Every line completes; none is failed for the cap."""

    async def main():
        async with _limited(valkey, tiny_model_dir, Limits(tenant_max_queued=6), start_worker=False) as (
            base,
            worker,
            client,
        ):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            batch = await _batch(oai, _jsonl(str(tiny_model_dir), 10))
            queued_at_first = await client.r.xlen(KEYS.requests)
            await worker.start()
            for _ in range(1200):
                batch = await oai.batches.retrieve(batch.id)
                if batch.status in DONE:
                    break
                await asyncio.sleep(0.1)
            output = (await oai.files.content(batch.output_file_id)).content
            return batch, queued_at_first, output

    batch, queued_at_first, output = run(main(), timeout=600)
    assert queued_at_first == 6
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        10,
        10,
        0,
    )
    assert {orjson.loads(row)["custom_id"] for row in output.splitlines()} == {f"line-{i}" for i in range(10)}


def test_batch_lines_count_against_tokens_per_minute(valkey):
    """5 lines of 1,000 tokens with 3,000 a minute: 3 go in (the minute's counter shows them), 2 wait; a
    line asking more than a minute allows is refused at once, naming the limit."""

    async def main():
        async with _limited(valkey, None, Limits(tenant_tokens_per_minute=3000), served_models=["m"]) as (
            base,
            _w,
            client,
        ):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            data = _jsonl("m", 5, max_tokens=1000) + _jsonl("m", 1, max_tokens=4000).replace(
                b"line-0", b"huge"
            )
            batch = await _batch(oai, data)
            minute = int(time.time() // 60)
            used = [await client.r.get(f"{KEYS.quota}tpm:team-a:{m}") for m in (minute - 1, minute)]
            return batch, await client.r.xlen(KEYS.requests), used

    batch, queued, used = run(main())
    assert queued == 3
    assert 3000 in [int(u) for u in used if u is not None]
    assert (batch.request_counts.total, batch.request_counts.failed) == (6, 1)
    assert batch.status == "in_progress"


def test_reading_a_batch_costs_a_bounded_number_of_redis_reads(valkey):
    """A poll reads the batch's counters and advances it by at most ADVANCE_LINES lines queued and as many
    statuses read (ENQUEUE's own HGET counts among them): with 2,500 lines it never reads every line's
    status, and the batch's own key stays small (its lines live apart and are not rewritten)."""
    lines = 2500

    async def main():
        async with _limited(valkey, None, Limits(), served_models=["m"]) as (base, _w, client):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            batch = await _batch(oai, _jsonl("m", lines))

            async def stats() -> dict[str, int]:
                info = await client.r.info("commandstats")
                return {k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items()}

            before = await stats()
            polled = await oai.batches.retrieve(batch.id)
            after = await stats()
            size = await client.r.memory_usage(f"{KEYS.prefix}:batch:{batch.id}")
            return polled, {k: after.get(k, 0) - before.get(k, 0) for k in after}, size

    polled, calls, size = run(main())
    assert polled.status == "in_progress" and polled.request_counts.total == lines
    assert calls.get("hget", 0) <= 2 * ADVANCE_LINES + 5, calls
    assert calls.get("rpush", 0) <= 2 and calls.get("lrange", 0) <= 3, calls
    assert size < 8192  # the batch object and its counters; the lines live apart


def test_held_back_lines_go_in_as_capacity_frees_without_a_poll(valkey, tiny_model_dir):
    """10 lines under a cap of 6 waiting requests, and nobody reads the batch after creating it: the 4 held
    back still go in as the first 6 finish (the API's background fill), and every line's request finishes."""

    async def main():
        async with _limited(valkey, tiny_model_dir, Limits(tenant_max_queued=6), start_worker=False) as (
            base,
            worker,
            client,
        ):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            batch = await _batch(oai, _jsonl(str(tiny_model_dir), 10))
            queued_at_first = await client.r.xlen(KEYS.requests)
            await worker.start()
            rids = [f"team-a:{batch.id}-{n}" for n in range(1, 11)]
            statuses: list = []
            for _ in range(1200):
                statuses = [await client.r.hget(KEYS.req(rid), "status") for rid in rids]
                if all(s == "finished" for s in statuses):
                    break
                await asyncio.sleep(0.1)
            return queued_at_first, statuses

    queued_at_first, statuses = run(main(), timeout=600)
    assert queued_at_first == 6
    assert statuses == ["finished"] * 10
