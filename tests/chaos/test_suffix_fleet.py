"""A worker that drafts from the other workers' outputs (service/suffix_fleet.py) while its feed is abused:
junk entries on the suffix stream, the stream trimmed to nothing, the key replaced by a string, the server
frozen (SIGSTOP) and then restarted from its append-only file. Each time the feed counts what it skipped and
takes the next good output; and while the server is frozen, with the feed's read stuck on it and the fleet
tree's lock held by someone else, the worker's engine still completes a speculating request: no step waits
on the feed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from specserve import SamplingParams
from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.queue.connection import open_redis
from specserve.service.suffix_fleet import MAX_OUTPUT_TOKENS, encode_tokens
from specserve.service.telemetry import Telemetry
from specserve.service.worker import Worker, WorkerConfig

from .conftest import KEYS, raw_redis, run_bounded, wait_for

pytestmark = pytest.mark.chaos

GOOD = [5, 6, 7, 8, 9, 10, 11, 12]


def test_the_feed_survives_junk_trims_restarts_and_holds_no_step(chaos_valkey, tiny_model_dir) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=256,
        speculative_config={"method": "suffix", "num_speculative_tokens": 4},
    )

    async def main() -> None:
        engine = AsyncLLMEngine(await asyncio.to_thread(LLMEngine, config))
        await engine.start()
        redis = await open_redis(chaos_valkey.url)
        worker = Worker(engine, redis, KEYS, "feeding", WorkerConfig(), Telemetry())
        await worker.start()
        fleet = worker.suffix_fleet
        assert fleet is not None
        c = fleet.counters
        raw = raw_redis(chaos_valkey)
        key = KEYS.suffix_outputs(engine.model_name)

        async def good(n: int) -> None:
            await raw.xadd(key, {b"w": b"other", b"t": encode_tokens(GOOD)})

            async def received() -> bool:
                return c.received == n

            await wait_for(received, timeout=30, what=f"good output {n} received")

        async def stepping(what: str) -> None:
            """A request on the engine runs to its end (speculating) while the feed is stuck."""
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, speculation=4)
            deltas = [d async for d in engine.add_request(what, GOOD * 2, params, stream=False)]
            assert deltas[-1].finished and len(deltas[-1].token_ids) == 12

        try:
            await good(1)
            junk: list[dict[bytes, Any]] = [
                {b"t": encode_tokens(GOOD)},  # no worker
                {b"w": b"other"},  # no tokens
                {b"w": b"other", b"t": b"\x01\x02\x03"},  # not whole ids
                {b"w": b"other", b"t": encode_tokens([engine.vocab_size])},  # outside the vocabulary
                {b"w": b"other", b"t": b"\x00" * (4 * MAX_OUTPUT_TOKENS + 4)},  # too long
                {b"w": b"\xff\xfe", b"t": b"\xff"},  # not UTF-8, and not ids
            ]
            for fields in junk:
                await raw.xadd(key, fields)
            await good(2)
            assert c.junk == len(junk)

            await raw.xtrim(key, maxlen=0)
            await good(3)

            await raw.delete(key)
            await raw.set(key, "not a stream")  # every XREAD now fails with WRONGTYPE

            async def failing() -> bool:
                return c.errors >= 2

            await wait_for(failing, timeout=30, what="the feed's reads failing")
            await raw.delete(key)
            await good(4)

            # the server frozen: the feed's XREAD waits on it; the builder's lock held by this thread
            assert chaos_valkey.proc is not None
            os.kill(chaos_valkey.proc.pid, signal.SIGSTOP)
            try:
                with fleet.tree.lock:
                    await asyncio.wait_for(stepping("while-frozen"), timeout=120)
            finally:
                os.kill(chaos_valkey.proc.pid, signal.SIGCONT)

            errors = c.errors
            await asyncio.to_thread(chaos_valkey.restart)
            await raw.aclose()
            raw = raw_redis(chaos_valkey)
            await stepping("while-restarting")
            await good(5)
            assert c.errors > errors  # the restart cut the read, and the feed came back by itself
            assert c.junk == len(junk) and c.dropped == 0
        finally:
            await worker.drain(timeout=0)
            await worker.close()
            await engine.shutdown()
            await redis.aclose()
            await raw.aclose()

    run_bounded(main(), timeout=300)
