"""The fleet-wide suffix tree: the builder's chunked inserts equal whole ones, a proposal never waits for the
builder's lock, the wire form of an output and what counts as junk, and two workers on one valkey where the
second drafts an answer only the first has given (greedy outputs still HF's)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MAX_TOKENS, PROMPTS
from test_suffix import _seq, _shape
from valkey_helpers import TINY_ENGINE_ARGS, run, wait_for

from specserve.engine.sequence import SeqStatus
from specserve.queue.connection import open_redis
from specserve.queue.keys import Keys
from specserve.service.suffix_fleet import MAX_OUTPUT_TOKENS, decode_tokens, encode_tokens
from specserve.spec.suffix import FLEET_REFRESH, FleetTree, GlobalTree, SuffixProposer

pytest_plugins = ("valkey_fixtures",)

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def _wait_built(tree: FleetTree, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while tree.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not tree.pending, "the builder did not finish"


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_a_chunked_add_leaves_the_tree_an_add_at_once_does(chunk: int) -> None:
    outputs = [[1, 2, 3, 1, 2, 4], [5, 1, 2, 3], [2, 3, 2, 3, 2]]
    whole, steps = GlobalTree(4, 2), GlobalTree(4, 2)
    versions = []
    for key, tokens in enumerate(outputs):
        whole.add(key, tokens)
        for _ in steps.add_steps(key, tokens, chunk):
            versions.append(steps.version)
    assert _shape(steps.tree) == _shape(whole.tree)
    assert list(steps.outputs) == [1, 2]  # the oldest evicted whole, as add does
    assert steps.num_nodes == whole.num_nodes
    assert versions == sorted(versions)  # a reader sees every change as a new version


def test_the_fleets_outputs_are_drafted_and_a_held_lock_skips_them_without_waiting() -> None:
    proposer = SuffixProposer(4, max_tree_depth=8)
    fleet = proposer.fleet_tree()
    assert fleet is not None and proposer.fleet_tree() is fleet
    seq = _seq(1, [7, 8, 9])
    assert proposer.propose([(seq, 4)])[1].token_ids == []  # nothing seen yet
    assert fleet.offer(("fleet", "1-0"), [7, 8, 9, 10, 11, 12, 13])
    _wait_built(fleet)
    assert proposer.propose([(seq, 4)])[1].token_ids == [10, 11, 12]  # match of 3: a draft of 3 at most
    with fleet.lock:  # the builder mid-chunk: the step drafts from the other trees alone, at once
        started = time.perf_counter()
        assert proposer.propose([(seq, 4)])[1].token_ids == []
        assert time.perf_counter() - started < 5.0  # it returned while the lock was held: no wait
    assert proposer.propose([(seq, 4)])[1].token_ids == [10, 11, 12]  # followed again from its last tokens
    fleet.close()


def test_a_drafting_sequence_sees_a_new_fleet_output_within_the_refresh_bound() -> None:
    proposer = SuffixProposer(4, max_tree_depth=8)
    fleet = proposer.fleet_tree()
    assert fleet is not None
    fleet.offer(("fleet", "1-0"), [7, 8, 9, 10])
    _wait_built(fleet)
    seq = _seq(1, [1, 2])
    assert proposer.propose([(seq, 4)])[1].token_ids == []  # its place found, in a tree without [1, 2]
    fleet.offer(("fleet", "2-0"), [1, 2, 3, 4, 5])
    _wait_built(fleet)
    drafts = [proposer.propose([(seq, 4)])[1].token_ids for _ in range(FLEET_REFRESH + 1)]
    assert drafts == [[]] * FLEET_REFRESH + [[3, 4]]  # a match of 2: a draft of 2 at most


def test_finished_outputs_are_shared_once_and_aborted_ones_not() -> None:
    proposer = SuffixProposer(4)
    fleet = proposer.fleet_tree()
    assert fleet is not None
    for seq_id, reason in ((1, "stop"), (2, "abort"), (3, "length")):
        seq = _seq(seq_id, [1, 2])
        seq.token_ids.extend([seq_id, 9])
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        proposer.forget(seq)
    assert fleet.outgoing() == [[1, 9], [3, 9]]
    assert fleet.outgoing() == []
    fleet.close()


def test_full_queues_drop_without_blocking() -> None:
    fleet = FleetTree(4, 10, max_pending=2)
    with fleet.lock:  # the builder stuck on its first output: the queue fills behind it
        results = [fleet.offer(("k", i), [1, 2, 3]) for i in range(6)]
        for i in range(5):
            fleet.share([i])
    assert results[:2] == [True, True] and results[-1] is False and fleet.num_dropped >= 3
    assert fleet.outgoing() == [[3], [4]] and fleet.num_unsent == 3
    fleet.close()


def test_no_fleet_tree_without_a_shared_tree() -> None:
    assert SuffixProposer(4, max_cached_requests=0).fleet_tree() is None


@pytest.mark.parametrize(
    "value",
    [
        None,
        7,
        b"",
        b"\x01\x00\x00",  # not whole uint32s
        (1000).to_bytes(4, "little"),  # outside a vocabulary of 1000
        b"\x00" * (4 * MAX_OUTPUT_TOKENS + 4),  # too long
        ["1", "2"],
    ],
)
def test_junk_is_not_an_output(value: Any) -> None:
    assert decode_tokens(value, 1000) is None


def test_outputs_cross_the_wire_as_they_are() -> None:
    tokens = [0, 1, 999, 65535, 70000]
    assert decode_tokens(encode_tokens(tokens), 70001) == tokens
    # the lean client hands non-UTF-8 bytes out as surrogate-escaped text
    escaped = encode_tokens(tokens).decode("utf-8", "surrogateescape")
    assert decode_tokens(escaped, 70001) == tokens
    assert sys.byteorder == "big" or encode_tokens([1]) == b"\x01\x00\x00\x00"


# ---- two workers on one valkey -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _worker(url: str, model_dir: Path, name: str, prefix: str, **cfg: Any) -> AsyncIterator[Any]:
    """A worker on an engine of its own (each worker's suffix trees are its own, as in separate processes)."""
    from specserve.engine.async_engine import AsyncLLMEngine
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.service.telemetry import Telemetry
    from specserve.service.worker import Worker, WorkerConfig

    config = EngineConfig(model=str(model_dir), **TINY_ENGINE_ARGS, speculative_config=SUFFIX)
    engine = AsyncLLMEngine(await asyncio.to_thread(LLMEngine, config))
    await engine.start()
    redis = await open_redis(url)
    worker = Worker(engine, redis, Keys(prefix), name, WorkerConfig(**cfg), Telemetry())
    await worker.start()
    try:
        yield worker
    finally:
        await worker.drain(timeout=0)
        await worker.close()
        await engine.shutdown()
        await redis.aclose()


def _two_workers(url: str, model_dir: Path, fleet: bool, prefix: str) -> tuple[list[Any], list[Any], Any]:
    """Worker A answers every prompt; then worker B (A gone) answers the same ones."""
    from specserve.queue.client import QueueClient

    body = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "speculation": 4}

    async def answer(client: QueueClient) -> list[Any]:
        out = []
        for prompt in PROMPTS:
            handle = await client.enqueue({"prompt": prompt, **body})
            out.append(await client.wait(handle.id))
        return out

    async def main() -> tuple[list[Any], list[Any], Any]:
        client = QueueClient(await open_redis(url), Keys(prefix))
        try:
            async with _worker(url, model_dir, "a", prefix, suffix_fleet=fleet) as a:
                first = await answer(client)
                if fleet:

                    async def sent() -> bool:
                        return a.suffix_fleet.counters.sent == len(PROMPTS)

                    await wait_for(sent, timeout=30, what="A's outputs sent")
            async with _worker(url, model_dir, "b", prefix, suffix_fleet=fleet) as b:
                if fleet:

                    async def learnt() -> bool:
                        tree = b.suffix_fleet.tree
                        return b.suffix_fleet.counters.received == len(PROMPTS) and not tree.pending

                    await wait_for(learnt, timeout=30, what="B learnt A's outputs")
                second = await answer(client)
                counters = b.suffix_fleet.counters if fleet else None
                if fleet:
                    await b._refresh_stats()
                    metrics = b.telemetry.metrics_text().decode().splitlines()
                    assert f"specserve_suffix_fleet_received_total {float(len(PROMPTS))}" in metrics
                    assert "specserve_suffix_fleet_junk_total 0.0" in metrics
            return first, second, counters
        finally:
            await client.aclose()

    return run(main(), timeout=300)


def test_a_worker_drafts_what_only_another_worker_said(valkey, tiny_model_dir, hf_reference) -> None:
    refs = hf_reference("llama_gqa_tied")
    first, second, counters = _two_workers(valkey.url, tiny_model_dir, fleet=True, prefix="on")
    assert [r.token_ids for r in first] == refs
    assert [r.token_ids for r in second] == refs
    # A's outputs reached B's tree; B's own, read back as they are sent, were skipped
    assert counters.junk == 0 and counters.received == len(PROMPTS)
    on = sum(r.usage["draft_accepted"] for r in second)
    proposed = sum(r.usage["draft_proposed"] for r in second)
    _first, alone, _ = _two_workers(valkey.url, tiny_model_dir, fleet=False, prefix="off")
    assert [r.token_ids for r in alone] == refs
    off = sum(r.usage["draft_accepted"] for r in alone)
    assert on > off, (on, off)
    assert on >= 0.8 * proposed > 0  # A's answers, drafted whole from the first token B emits


def test_the_fleet_setting_reaches_the_worker_and_only_it() -> None:
    from specserve.service.config import ServiceConfig, read_by

    assert ServiceConfig().worker_config().suffix_fleet is True
    assert ServiceConfig(suffix_fleet=False).worker_config().suffix_fleet is False
    assert "suffix_fleet" in read_by("worker") and "suffix_fleet" not in read_by("api")


@pytest.mark.parametrize("full", [False, True])
def test_the_builder_thread_ends_on_close(full: bool) -> None:
    fleet = FleetTree(4, 10, max_pending=2)
    if full:  # no room for the wake-up: it stops after the output it is building
        with fleet.lock:
            while fleet.offer(("k", 0), [1, 2, 3]):
                pass
            fleet.close()
    else:
        fleet.close()
    fleet._thread.join(timeout=5)
    assert not fleet._thread.is_alive()


def test_a_starting_feed_takes_the_newest_outputs_its_builder_has_room_for(valkey) -> None:
    from specserve.queue.connection import Connections
    from specserve.service.suffix_fleet import SuffixFleet

    async def main() -> tuple[dict[Any, list[int]], Any, list[str]]:
        redis = await open_redis(valkey.url)
        conns = Connections(redis)
        tree = FleetTree(4, 100, max_pending=8)
        ids = []
        for i in range(20):
            ids.append(await redis.xadd("fleet", {"w": "other", "t": encode_tokens([i, i + 1])}))
        fleet = SuffixFleet(conns, "fleet", "me", tree, 1000, block_ms=100)
        await fleet.read_once()
        await asyncio.to_thread(_wait_built, tree)
        await conns.aclose(close_redis=True)
        tree.close()
        return (
            dict(tree.cache.outputs),
            fleet.counters,
            [i.decode() if isinstance(i, bytes) else i for i in ids],
        )

    built, counters, ids = run(main())
    assert built == {("fleet", ids[i]): [i, i + 1] for i in range(16, 20)}  # the newest half of its room
    assert counters.received == 4 and counters.dropped == 0
