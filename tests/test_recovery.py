"""Token-preserving recovery: a request taken over from a dead worker continues from the tokens its readers
were already shown (prompt + shown tokens, the budget less them, output numbered after them), so a reader
sees one sequence with nothing replayed, equal to a run with no crash."""

from __future__ import annotations

import asyncio
import signal
from contextlib import aclosing

import orjson
from test_service_process import TINY_ENV, _ready
from valkey_helpers import free_port, run, service_stack, spawn_cli, wait_for

from specserve import SamplingParams
from specserve.queue.client import QueueClient
from specserve.queue.connection import connect
from specserve.queue.keys import Keys
from specserve.service.running import resume_point

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")


def test_a_killed_workers_requests_continue_where_their_readers_are(
    valkey, tiny_model_dir, tiny_engines, tmp_path
):
    params = {"max_tokens": 160, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"Chapter {i}:" for i in range(4)]
    ref = tiny_engines.llm(tiny_model_dir).generate(prompts, SamplingParams(**params))
    health = free_port()
    env = {
        **TINY_ENV,
        "REDIS_URL": valkey.url,
        "SPECSERVE_MODEL": str(tiny_model_dir),
        "SPECSERVE_CLAIM_TIMEOUT": "1.5",
        "SPECSERVE_HEALTH_PORT": str(health),
        "SPECSERVE_WORKER_NAME": "victim",
    }
    victim = spawn_cli(["worker"], env, tmp_path / "victim.log")

    async def main():
        client = QueueClient(connect(valkey.url), KEYS)
        try:
            await wait_for(lambda: _ready(f"http://127.0.0.1:{health}/readyz"), timeout=180, what="worker")
            ids = [(await client.enqueue({"prompt": p, **params})).id for p in prompts]

            async def collect(rid):
                seen, text = [], ""
                async with aclosing(client.stream(rid)) as deltas:
                    async for d in deltas:
                        seen += d.token_ids
                        text += d.text
                return seen, text

            streams = [asyncio.create_task(collect(rid)) for rid in ids]
            await wait_for(lambda: _some_output(client, ids, 20), timeout=60, what="tokens from the victim")
            victim.send_signal(signal.SIGKILL)
            await asyncio.to_thread(victim.wait)
            async with service_stack(valkey.url, tiny_model_dir, name="rescuer", claim_timeout_s=1.5):
                streamed = await asyncio.gather(*streams)
                results = [await client.result(rid) for rid in ids]
                entries = [[f for _, f in await client.r.xrange(KEYS.out(rid))] for rid in ids]
            return streamed, results, entries
        finally:
            await client.aclose()

    try:
        streamed, results, entries = run(main(), timeout=300)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    resumed = 0
    for (seen, text), res, want, stream in zip(streamed, results, ref, entries):
        assert res.status == "finished" and res.token_ids == want.token_ids and res.text == want.text
        assert seen == want.token_ids and text == want.text  # the streaming reader: every token once
        assert res.usage["completion_tokens"] == params["max_tokens"]
        assert res.usage["prompt_tokens"] == len(want.prompt_token_ids)
        # nothing generated twice: the entries' tokens add up to the output, each run after the last
        assert sum(len(orjson.loads(f["ids"])) for f in stream) == params["max_tokens"]
        runs = [int(f["run"]) for f in stream]
        assert runs == sorted(runs)
        if runs[-1] == 2 and runs[0] == 1:
            resumed += 1
            first_of_rerun = next(f for f in stream if f["run"] == "2")
            shown_before = sum(len(orjson.loads(f["ids"])) for f in stream if f["run"] == "1")
            assert int(first_of_rerun["offset"]) == shown_before > 0
    assert resumed, "no request was interrupted mid-generation"


async def _some_output(client, ids, tokens: int) -> bool:
    for rid in ids:
        shown = sum(len(orjson.loads(f["ids"])) for _, f in await client.r.xrange(KEYS.out(rid)))
        if shown < tokens:
            return False
    return True


def test_resume_point_takes_the_tokens_whose_text_was_shown(demo_tokenizer):
    tok = demo_tokenizer
    prompt = tok.encode("Say it:")
    ids = tok.encode(" héllo wörld, ok")
    full = tok.decode(ids)
    assert resume_point(tok, prompt, ids, full) == (len(ids), len(full))
    # the reader saw the ids but not all their text (held back: it could still become a stop string)
    n, chars = resume_point(tok, prompt, ids, full[:-4])
    assert n < len(ids) and full[:chars] == tok.decode(ids[:n]) and chars <= len(full) - 4
    # half a UTF-8 character: a token that is only the first byte of "é" has no text of its own yet
    e_bytes = [t for t in tok.encode("é") if tok.decode([t]) == "\ufffd"]
    if e_bytes:
        ids2 = tok.encode(" caf") + e_bytes[:1]
        shown = tok.decode(ids2[:-1])
        assert resume_point(tok, prompt, ids2, shown) == (len(ids2) - 1, len(shown))
    assert resume_point(tok, prompt, [], "") == (0, 0)
