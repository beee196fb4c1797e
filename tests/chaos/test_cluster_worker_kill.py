"""A worker process SIGKILLed mid-stream on a real 3-master Valkey Cluster with three shards: its requests,
one or more on each shard, are reclaimed by another worker process and resumed exactly, and every SSE reader
that followed them through an API process across the kill gets every token once, in order.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from valkey_cluster import ValkeyCluster

from specserve.queue.client import QueueClient
from specserve.queue.connection import open_redis
from specserve.queue.keys import Keys, shard_of

from .conftest import (
    Cluster,
    SseClient,
    assert_no_problems,
    finished_once_problems,
    outcomes,
    reference,
    run_bounded,
    wait_for,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SHARDS = 3
KEYS = Keys("specserve", cluster=True, shards=SHARDS)
# Long enough to be mid-stream when the worker dies (the tiny model makes a token in a few ms), short enough
# for the rerun to stay quick on a loaded machine.
LONG = {"max_tokens": 600, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [f"Long story {i}:" for i in range(6)]
ENV = {"SPECSERVE_CLAIM_TIMEOUT": "1.5", "SPECSERVE_QUEUE_SHARDS": str(SHARDS)}


@pytest.fixture
def valkey_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    cluster = ValkeyCluster(tmp_path / "valkey-cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_worker_killed_mid_stream_on_a_sharded_cluster_resumes_exactly(
    valkey_cluster, tiny_model_dir, tmp_path
):
    refs = reference(tiny_model_dir, PROMPTS, **LONG)
    procs = Cluster(valkey_cluster, tiny_model_dir, tmp_path)  # type: ignore[arg-type]  # it only needs .url
    ids = [f"story-{i}" for i in range(len(PROMPTS))]
    assert len({shard_of(rid, SHARDS) for rid in ids}) == SHARDS  # every shard holds some

    async def main():
        victim = procs.worker("victim", **ENV)
        api = procs.api(**ENV)
        r = await open_redis(valkey_cluster.url)
        client = QueueClient(r, Keys("specserve", shards=SHARDS))
        try:
            await victim.ready()
            await api.ready()
            for rid, prompt in zip(ids, PROMPTS):
                await client.enqueue({"prompt": prompt, **LONG}, rid)
            followers = [asyncio.create_task(SseClient(rid).follow(api.base, 240)) for rid in ids]

            async def all_streaming() -> bool:
                return all([await r.exists(KEYS.of_request(rid).out(rid)) for rid in ids])

            await wait_for(all_streaming, timeout=60, what="tokens of every request")
            victim.signal(signal.SIGKILL)
            await victim.wait_exit(30)
            rescuer = procs.worker("rescuer", **ENV)
            await rescuer.ready()
            streams = await asyncio.wait_for(asyncio.gather(*followers), 240)
            got = await outcomes(r, ids, KEYS)
            return streams, got
        finally:
            await client.aclose()
            procs.close()

    streams, got = run_bounded(main(), timeout=400)
    problems = {rid: finished_once_problems(got[rid], *ref) for rid, ref in zip(ids, refs)}
    for rid, ref, sse in zip(ids, refs, streams):
        problems[rid] += sse.problems(*ref)
    assert_no_problems(problems, "requests on the sharded cluster", procs)
    assert any(int(got[rid].info["run"]) >= 2 for rid in ids)  # the kill caught some mid-stream: rerun
