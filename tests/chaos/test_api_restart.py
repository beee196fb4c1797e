"""The API process goes away while clients read SSE streams, twice (SIGTERM, then SIGKILL); each client
reconnects to the restarted API with Last-Event-ID. The worker is frozen across each restart, so every stream
is cut and resumed mid-generation. The concatenated tokens must equal the reference run: no gap, no
duplicate."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from .conftest import (
    KEYS,
    SseClient,
    Timeline,
    free_port,
    raw_redis,
    reference,
    run_bounded,
    wait_for,
)

pytestmark = pytest.mark.chaos

PARAMS = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["First stream:", "Second stream, a longer prompt than the first:", "Third"]


def test_sse_clients_resume_across_api_restarts(cluster, tiny_model_dir):
    t = Timeline("api-restart")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    worker = cluster.worker("w")
    api = cluster.api("api", port=port)
    refs = reference(tiny_model_dir, PROMPTS, **PARAMS)

    async def main():
        nonlocal api
        r = raw_redis(cluster.valkey)
        try:
            await worker.ready()
            await api.ready()
            t.mark("worker and API ready")
            ids = [f"sse-{i}" for i in range(len(PROMPTS))]
            async with aiohttp.ClientSession() as http:
                for rid, prompt in zip(ids, PROMPTS):
                    async with http.post(
                        f"{base}/v1/requests", json={"id": rid, "prompt": prompt, **PARAMS}
                    ) as p:
                        assert p.status == 202, await p.text()
            clients = [SseClient(rid) for rid in ids]
            cut_at = []
            exits, stop_s = [], []
            for round_no, (tokens, sig) in enumerate(((8, signal.SIGTERM), (60, signal.SIGKILL))):
                # Each client reads some tokens; then the worker is frozen (generation stops mid-way) and the
                # API is stopped under the open streams: gracefully (SIGTERM) the first time, killed the next.
                await asyncio.gather(*(c.read(base, until_tokens=tokens) for c in clients))
                await worker.freeze()
                statuses = [(await r.hget(KEYS.req(rid), "status")).decode() for rid in ids]
                assert statuses == ["running"] * len(ids), statuses
                streams = [asyncio.create_task(c.read(base)) for c in clients]  # reconnected, still open
                opened = 2 * round_no + 2

                async def reopened(n=opened) -> bool:
                    return all(c.connections >= n for c in clients)

                await wait_for(reopened, timeout=30, what="streams reopened")
                await asyncio.sleep(0.2)  # the reopened streams are inside the API, waiting on Redis
                stopping = time.monotonic()
                api.signal(sig)
                exits.append(await api.wait_exit(30))
                stop_s.append(round(time.monotonic() - stopping, 2))  # a figure, not asserted
                await asyncio.wait_for(asyncio.gather(*streams), 30)
                cut_at.append([len(c.token_ids) for c in clients])
                t.mark(f"API stopped ({sig.name}, rc {exits[-1]}); clients cut at {cut_at[-1]} tokens")
                api = cluster.api("api", port=port)  # same port: clients come back to the same address
                await api.ready()
                t.mark("API restarted")
                worker.thaw()
            await asyncio.wait_for(asyncio.gather(*(c.read(base) for c in clients)), 120)
            t.mark("every stream done")
        finally:
            worker.thaw()
            await r.aclose()
        return clients, cut_at, exits, stop_s

    clients, cut_at, exits, stop_s = run_bounded(main(), timeout=200)
    assert exits == [0, -signal.SIGKILL], cluster.logs()  # SIGTERM: a clean exit with streams open
    for c, (want_ids, want_text) in zip(clients, refs):
        assert c.done is not None and c.done["status"] == "finished", c.done
        assert c.token_ids == want_ids, f"{c.rid}: {len(c.token_ids)} tokens, reference {len(want_ids)}"
        assert c.text == want_text
        assert c.last_id == f"{len(want_ids)}.{len(want_text)}"
        assert c.connections >= 5  # first read, reopened twice under a dying API, resumed twice
    figures = {"streams": len(clients), "cut_at": cut_at, "tokens": len(refs[0][0]), "api_exit_s": stop_s}
    print("SSE across an API SIGTERM and an API SIGKILL:", figures)
