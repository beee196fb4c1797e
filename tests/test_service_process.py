"""Real `specserve` processes: a worker SIGKILLed mid-generation loses nothing, and `specserve serve` runs the
whole service on its embedded valkey-server with one command, then drains and stops it on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import aiohttp
import orjson
import psutil
from valkey_helpers import REPO, free_port, run, service_stack, spawn_cli, wait_for

from specserve import SamplingParams
from specserve.queue.client import QueueClient
from specserve.queue.connection import connect
from specserve.queue.keys import Keys

pytest_plugins = ("valkey_fixtures",)
KEYS = Keys("specserve")
TINY_ENV = {"SPECSERVE_DTYPE": "float32", "SPECSERVE_KV_CACHE_BYTES": str(4 << 20), "SPECSERVE_DEVICE": "cpu"}


async def _ready(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


def _log(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def test_a_worker_killed_mid_generation_loses_nothing(valkey, tiny_model_dir, tiny_engines, tmp_path):
    """... and its requests continue where their readers are (token-preserving recovery): the rescuer
    numbers its output after what the victim wrote, and no token is generated twice."""
    params = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    prompts = [f"Story {i} begins:" for i in range(6)]
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
    log = tmp_path / "victim.log"
    victim = spawn_cli(["worker"], env, log)
    api_port = free_port()
    api_env = {"REDIS_URL": valkey.url, "SPECSERVE_PORT": str(api_port)}
    api = spawn_cli(["api"], api_env, tmp_path / "api.log")
    base = f"http://127.0.0.1:{api_port}"

    async def main():
        client = QueueClient(connect(valkey.url), KEYS)
        try:
            await wait_for(
                lambda: _ready(f"http://127.0.0.1:{health}/readyz"), timeout=180, what="worker ready"
            )
            await wait_for(lambda: _ready(f"{base}/readyz"), timeout=180, what="api ready")
            ids = [(await client.enqueue({"prompt": p, **params})).id for p in prompts]

            async def collect(rid):
                seen, text = [], ""
                async with aclosing(client.stream(rid)) as deltas:
                    async for d in deltas:
                        seen += d.token_ids
                        text += d.text
                return seen, text

            async def collect_sse(rid):  # through the API process, as Server-Sent Events
                seen, text = [], ""
                async with aiohttp.ClientSession() as http, http.get(f"{base}/v1/requests/{rid}/stream") as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            data = orjson.loads(line[6:])
                            seen += data.get("token_ids", [])
                            text += data.get("text", "")
                return seen, text

            streams = [asyncio.create_task((collect_sse if i % 2 else collect)(r)) for i, r in enumerate(ids)]
            await wait_for(lambda: _all_have_output(client, ids), timeout=60, what="tokens from the victim")
            victim.send_signal(signal.SIGKILL)
            await asyncio.to_thread(victim.wait)
            before = [await client.info(i) for i in ids]
            async with service_stack(valkey.url, tiny_model_dir, name="rescuer", claim_timeout_s=1.5):
                streamed = await asyncio.gather(*streams)
                after = [await client.result(i) for i in ids]
                entries = [[f for _, f in await client.r.xrange(KEYS.out(i))] for i in ids]
            return before, streamed, after, entries
        finally:
            await client.aclose()

    try:
        before, streamed, after, entries = run(main(), timeout=300)
    finally:
        for proc in (victim, api):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # Killed mid-generation: requests the victim had not finished are rerun by the rescuer.
    interrupted = [b["status"] == "running" and b["worker"] == "victim" for b in before]
    assert any(interrupted), _log(log)
    resumed = 0
    for (seen, text), res, want, was_running, stream in zip(streamed, after, ref, interrupted, entries):
        assert res.status == "finished" and res.token_ids == want.token_ids and res.text == want.text
        if was_running:
            assert res.info["worker"] == "rescuer" and res.info["run"] == "2"
        assert seen == want.token_ids and text == want.text  # the streaming reader saw every token once
        assert res.usage["completion_tokens"] == params["max_tokens"]
        assert res.usage["prompt_tokens"] == len(want.prompt_token_ids)
        # Nothing generated twice but what the reading rule allows (docs/wire-format.md): each entry's text
        # starts where the entries before it stopped, and its tokens where they stopped too, except a rerun's
        # first entry, which goes back over the last tokens whose text had been held back (half a UTF-8
        # character, or a possible stop string) and makes the same tokens again, each run after the last.
        runs = [int(f["run"]) for f in stream]
        assert runs == sorted(runs)
        written = chars = again = 0
        for i, f in enumerate(stream):
            ids, offset, text_offset = orjson.loads(f["ids"]), int(f["offset"]), int(f["text_offset"])
            assert text_offset == chars, (i, text_offset, chars)
            if i == 0 or runs[i] == runs[i - 1]:
                assert offset == written, (i, offset, written)
            else:
                assert offset <= written
                earlier = [t for g in stream[:i] for t in orjson.loads(g["ids"])]
                assert ids[: written - offset] == earlier[offset:written]  # greedy: the same tokens
                again += written - offset
            written, chars = offset + len(ids), text_offset + len(f["text"])
        assert written == params["max_tokens"]
        assert sum(len(orjson.loads(f["ids"])) for f in stream) == params["max_tokens"] + again
        if runs[0] == 1 and runs[-1] == 2:
            resumed += 1
            # the rescuer continued after the victim's tokens, going back at most over the bytes of one
            # unfinished UTF-8 character (no stop strings here)
            written_by_victim = sum(len(orjson.loads(f["ids"])) for f in stream if f["run"] == "1")
            first = int(next(f for f in stream if f["run"] == "2")["offset"])
            assert written_by_victim - 3 <= first <= written_by_victim
    assert resumed, "no request was interrupted after the victim wrote some of its tokens"


async def _all_have_output(client, ids) -> bool:
    for rid in ids:
        if not await client.r.exists(KEYS.out(rid)):
            return False
    return True


def test_serve_runs_everything_with_one_command_and_stops_cleanly(tiny_model_dir, tmp_path):
    port = free_port()
    data = tmp_path / "data"
    env = {**TINY_ENV, "SPECSERVE_MODEL": str(tiny_model_dir), "SPECSERVE_PORT": str(port), "REDIS_URL": ""}
    log = tmp_path / "serve.log"
    proc = spawn_cli(["serve", "--data-dir", str(data)], env, log)
    base = f"http://127.0.0.1:{port}"

    def cli(*args: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "specserve.service.cli", *args, "--data-dir", str(data)],
            cwd=REPO,
            env={**env, "PYTHONUNBUFFERED": "1"},
            capture_output=True,
            timeout=120,
            check=True,
        )
        return orjson.loads(out.stdout)

    async def main():
        await wait_for(lambda: _ready(f"{base}/readyz"), timeout=180, what="serve ready")
        async with aiohttp.ClientSession() as http:
            body = {"model": tiny_model_dir.name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
            async with http.post(f"{base}/v1/completions", json=body) as r:
                assert r.status == 200
                return (await r.json())["choices"][0]["text"]

    try:
        text = run(main(), timeout=300)
        waited = cli("enqueue", "Hello", "--max-tokens", "4", "--temperature", "0", "--wait")
        status = cli("status", waited["id"])
        children = psutil.Process(proc.pid).children(recursive=True)  # the embedded valkey-server
        names = [c.name() for c in children]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, _log(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert waited["status"] == "finished" and waited["text"] == text
    assert status == waited
    assert (data / "appendonlydir").is_dir()  # the embedded server kept an append-only file in the data dir
    assert names == ["valkey-server"] and not any(c.is_running() for c in children)  # stopped with us
