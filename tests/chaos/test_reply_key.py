"""A producer's reply stream key holding another type: the red team's `reply_to` pointing at a string looped
forever (FINISH wrote the output entry, failed on the reply stream, and every redelivery wrote another final).
Replayed with real processes: a worker, raw entries in one MULTI beside valid ones replying to a real
stream, and time for several claim timeouts afterwards."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from valkey_helpers import wait_for

from .conftest import (
    KEYS,
    assert_no_problems,
    dead_letters,
    failed_once_problems,
    finished_once_problems,
    group_state,
    outcomes,
    raw_redis,
    reference,
    run_bounded,
    unfinished_requests,
    wait_terminal,
    xadd_multi,
)

pytestmark = pytest.mark.chaos

PROMPTS = ["Reply number one:", "Reply number two:", "Reply number three:"]
PARAMS = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
CLAIM_TIMEOUT_S = 2


def test_a_reply_key_of_another_type_fails_its_request_once_and_its_neighbours_run(cluster, tiny_model_dir):
    worker = cluster.worker("w", SPECSERVE_CLAIM_TIMEOUT=str(CLAIM_TIMEOUT_S))
    refs = dict(zip(PROMPTS, reference(tiny_model_dir, PROMPTS, **PARAMS)))

    def entry(rid: str, prompt: str, reply_to: str | None, stream: bool = False) -> dict[bytes, bytes]:
        body = {"prompt": prompt, **PARAMS}
        if reply_to is not None:
            body |= {"reply_to": reply_to, "reply_stream": stream}
        return {b"id": rid.encode(), b"body": orjson.dumps(body)}

    async def main():
        r = raw_redis(cluster.valkey)
        try:
            await worker.ready()
            await r.set(KEYS.reply("taken"), b"a string")
            await r.hset(KEYS.reply("hashed"), mapping={b"k": b"v"})
            entries = [
                entry("good-0", PROMPTS[0], "mine", stream=True),
                entry("bad-string", PROMPTS[1], "taken"),
                entry("good-1", PROMPTS[1], None),
                entry("bad-hash", PROMPTS[2], "hashed", stream=True),
                entry("good-2", PROMPTS[2], "mine"),
            ]
            await xadd_multi(r, entries)
            good, bad = ["good-0", "good-1", "good-2"], ["bad-string", "bad-hash"]
            await wait_terminal(r, good + bad, timeout=120, cluster=cluster)

            async def no_pending() -> bool:
                g = await group_state(r)
                return g["pending"] == 0 and g["lag"] == 0

            await wait_for(no_pending, timeout=30, what="nothing pending")
            # several claim timeouts: a request that failed on its reply key must not run again
            await asyncio.sleep(3 * CLAIM_TIMEOUT_S)
            got = await outcomes(r, good + bad)
            problems = {
                rid: finished_once_problems(got[rid], *refs[PROMPTS[i]]) for i, rid in enumerate(good)
            }
            problems |= {rid: failed_once_problems(got[rid], "reply_to") for rid in bad}
            assert_no_problems(problems, "requests", cluster)
            mine = await r.xrange(KEYS.reply("mine"))
            return {
                "dead": await dead_letters(r),
                "unfinished": await unfinished_requests(r),
                "taken": await r.get(KEYS.reply("taken")),
                "hashed": await r.hgetall(KEYS.reply("hashed")),
                "mine": len(mine),
                "finals": {rid: len(got[rid].finals) for rid in good + bad},
            }
        finally:
            await r.aclose()

    got = run_bounded(main(), timeout=240)
    print("reply key:", {k: v for k, v in got.items() if k != "dead"}, "dead letters:", len(got["dead"]))
    assert got["dead"] == {} and got["unfinished"] == {}
    assert got["taken"] == b"a string" and got["hashed"] == {b"k": b"v"}  # left as they were
    assert got["mine"] > 0  # the good neighbours' replies went to their stream
    assert worker.alive()
