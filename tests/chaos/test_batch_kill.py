"""A Batch API job whose worker is SIGKILLed mid-batch: its lines are ordinary queued
requests, some running on the victim, some waiting in the ready queue under `~ready`, some not yet read; a
rescuer worker takes them all over and the batch's output is what it would have been without the crash."""

from __future__ import annotations

import asyncio
import io
import signal

import openai
import orjson
from valkey_helpers import TINY

from specserve import SamplingParams
from specserve.queue.client import QueueClient
from specserve.queue.connection import connect

from .conftest import KEYS, raw_redis, run_bounded, unfinished_requests, wait_settled

CLAIM = {"SPECSERVE_CLAIM_TIMEOUT": "1.5", "SPECSERVE_MAX_NUM_SEQS": "4"}
PROMPTS = [f"Line {i} of the batch:" for i in range(19)]
MAX_TOKENS = 48


def _jsonl(model: str) -> bytes:
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": model,
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i, p in enumerate(PROMPTS)
    ]
    rows.insert(5, {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": "x", "max_tokens": -1}})  # fmt: skip
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def test_a_worker_killed_mid_batch_changes_nothing_in_its_result(cluster, tiny_model_dir):
    ref = TINY.llm(tiny_model_dir).generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    victim = cluster.worker("victim", **CLAIM)
    api = cluster.api()

    async def main():
        r = raw_redis(cluster.valkey)
        client = QueueClient(connect(cluster.valkey.url), KEYS)
        oai = openai.AsyncOpenAI(base_url=f"{api.base}/v1", api_key="none", max_retries=0)
        try:
            await victim.ready()
            await api.ready()
            f = await oai.files.create(
                file=("in.jsonl", io.BytesIO(_jsonl(str(tiny_model_dir)))), purpose="batch"
            )
            batch = await oai.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
            # kill it once some lines are done, some run and the rest wait
            for _ in range(600):
                batch = await oai.batches.retrieve(batch.id)
                if batch.request_counts.completed >= 3:
                    break
                await asyncio.sleep(0.05)
            held = {
                c["name"]: c["pending"] for c in await client.r.xinfo_consumers(KEYS.requests, KEYS.group)
            }
            victim.signal(signal.SIGKILL)
            await victim.wait_exit(30)
            rescuer = cluster.worker("rescuer", **CLAIM)
            await rescuer.ready()
            for _ in range(1200):
                batch = await oai.batches.retrieve(batch.id)
                if batch.status not in ("validating", "in_progress", "finalizing"):
                    break
                await asyncio.sleep(0.1)
            output = (await oai.files.content(batch.output_file_id)).content
            errors = (await oai.files.content(batch.error_file_id)).content
            await wait_settled(r)
            return batch, held, output, errors, await unfinished_requests(r)
        finally:
            await oai.close()
            await client.aclose()
            await r.aclose()

    batch, held, output, errors, unfinished = run_bounded(main(), timeout=400)
    assert held.get("victim", 0) >= 1, held  # the victim held lines when it died
    assert batch.status == "completed" and batch.request_counts.total == 20
    assert (batch.request_counts.completed, batch.request_counts.failed) == (19, 1)
    lines = {row["custom_id"]: row for row in map(orjson.loads, output.splitlines())}
    assert set(lines) == {f"req-{i}" for i in range(19)}  # one line each: none lost, none twice
    for i, want in enumerate(ref):
        body = lines[f"req-{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == want.text, i
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    (bad,) = map(orjson.loads, errors.splitlines())
    assert bad["custom_id"] == "bad"
    assert unfinished == {}
