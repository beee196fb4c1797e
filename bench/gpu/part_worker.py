"""The worker on the device: `specserve worker` and `specserve api` as real processes over the embedded
valkey-server, 50 chat requests through the openai client, the worker killed (SIGKILL) mid-run and a new one
started; every request must finish exactly once (the chaos suite's audit: one final entry, one finished
status, no gap and no duplicate in its output stream) and every client must get its answer."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.gpu.common import Context, Part, table

TESTS = Path(__file__).resolve().parents[2] / "tests"
NAME = "smollm2"


async def _scenario(ctx: Context, data: dict) -> list[list[object]]:
    sys.path.insert(0, str(TESTS))
    from chaos.conftest import KEYS, Cluster, _s, finished_once_problems, outcomes, raw_redis
    from openai import AsyncOpenAI
    from valkey_helpers import free_port

    from specserve.queue.embedded import EmbeddedValkey

    n, max_tokens = (50, 96) if not ctx.smoke else (6, 8)
    workdir = Path(tempfile.mkdtemp(prefix="gpu-worker-"))
    valkey = EmbeddedValkey(workdir / "valkey").start()
    cluster = Cluster(valkey, ctx.model, workdir)
    env = {
        "SPECSERVE_DEVICE": str(ctx.device),
        "SPECSERVE_DTYPE": "bfloat16" if ctx.cuda else "float32",
        "SPECSERVE_QUANTIZATION": "none" if ctx.cuda else "auto",
        "SPECSERVE_CLAIM_TIMEOUT": "2",
        "SPECSERVE_SERVED_MODEL_NAME": NAME,
        "SPECSERVE_KV_CACHE_BYTES": str(1 << 30 if ctx.cuda else 64 << 20),
    }
    rows: list[list[object]] = []
    data["logs"] = ""
    try:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        first = cluster.worker("worker-1", **env)
        api = cluster.api("api", port=port, SPECSERVE_SERVED_MODEL_NAME=NAME)
        await first.ready(timeout=max(30.0, ctx.left() - 30))
        await api.ready(timeout=60)
        data["start_s"] = time.monotonic() - t0
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=ctx.left())
        topics = ["the sea", "a city at night", "learning to cook", "a long train journey", "an old library"]

        async def one(i: int):
            return await client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": f"Write a short story ({i}) about {topics[i % 5]}."}],
                max_tokens=max_tokens,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )

        t1 = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        # kill the worker once a few answers are back, so others are mid-generation and some not begun
        kill_after = max(1, n // 10)
        while sum(t.done() for t in tasks) < kill_after and time.monotonic() - t1 < ctx.left() / 3:
            await asyncio.sleep(0.05)
        done_before = sum(t.done() for t in tasks)
        first.kill()
        data["finished_before_kill"] = done_before
        second = cluster.worker("worker-2", **env)
        await second.ready(timeout=max(30.0, ctx.left() - 20))
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), ctx.left() - 5)
        data["scenario_s"] = time.monotonic() - t1
        errors = [repr(r)[:300] for r in results if isinstance(r, BaseException)]
        answered = n - len(errors)
        r = raw_redis(valkey)
        ids = []
        async for key in r.scan_iter(match=KEYS.req("*").encode(), count=1000):
            ids.append(_s(key)[len(KEYS.req("")) :])
        found = await outcomes(r, ids)
        problems = {}
        texts = {}
        for rid, o in found.items():
            # the request's own assembled output is the reference: a kill mid-run must leave it one
            # continuous completion with a single final entry
            p = finished_once_problems(o, o.token_ids, o.text)
            if len(o.token_ids) != max_tokens:
                p.append(f"{len(o.token_ids)} tokens, asked for {max_tokens}")
            if p:
                problems[rid] = p
            texts[o.text] = rid
        client_texts = [r.choices[0].message.content for r in results if not isinstance(r, BaseException)]
        mismatched = sum(t not in texts for t in client_texts)
        runs = sum(int(o.info.get("run", "0") or 0) > 1 for o in found.values())
        await r.aclose()
        ok = not errors and not problems and len(found) == n and mismatched == 0
        data.update(
            requests=n,
            answered=answered,
            status_hashes=len(found),
            resumed_runs=runs,
            problems=problems,
            client_errors=errors[:5],
            answers_not_on_server=mismatched,
        )
        rows.append(
            [
                f"{n} chat requests, worker SIGKILLed after {done_before} answers, a new worker started",
                f"{answered}/{n} answered; {len(found)} on the server, {len(problems)} with problems; "
                f"{runs} resumed in a second run; {mismatched} answers not what the server holds",
                "all answered, each finished exactly once",
                "ok" if ok else "FAILED",
            ]
        )
        return rows
    finally:
        data["logs"] = cluster.logs()[-8000:]
        cluster.close()
        valkey.stop()


def run(ctx: Context) -> Part:
    if ctx.model is None:
        return Part("worker", False, "skipped: the demo GGUF did not travel")
    data: dict = {}
    try:
        rows = asyncio.run(asyncio.wait_for(_scenario(ctx, data), max(10.0, ctx.left())))
        ok = all(r[-1] == "ok" for r in rows)
        md = table(["scenario", "result", "goal", "verdict"], rows)
    except Exception:  # noqa: BLE001 - the report says what broke
        ok = False
        data["error"] = traceback.format_exc()[-4000:]
        md = f"FAILED:\n\n```\n{data['error']}\n```"
    if not ok and data.get("logs"):
        md += f"\n\n<details><summary>process logs</summary>\n\n```\n{data['logs']}\n```\n</details>"
    return Part("worker", ok, md, data)
