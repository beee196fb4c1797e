"""The API process dies (SIGKILL) while clients read SSE streams, twice; each client reconnects to the
restarted API with Last-Event-ID. The worker is frozen across each restart, so every stream is cut and
resumed mid-generation. The concatenated tokens must equal the reference run: no gap, no duplicate."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import orjson
import pytest

from .conftest import (
    KEYS,
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


class SseClient:
    """Reads /v1/requests/{id}/stream as a browser's EventSource would: an event counts once its blank line
    has arrived (a connection cut mid-event drops the partial one), and Last-Event-ID is the id of the last
    event dispatched."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.token_ids: list[int] = []
        self.text = ""
        self.last_id: str | None = None
        self.done: dict | None = None
        self.connections = 0
        self.seen_offsets: list[int] = []

    async def read(self, base: str, until_tokens: int | None = None) -> None:
        """Read until the `done` event, `until_tokens` tokens in all, or the connection breaks."""
        headers = {"Last-Event-ID": self.last_id} if self.last_id else {}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
        event: dict[str, str] = {}
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as http,
                http.get(f"{base}/v1/requests/{self.rid}/stream", headers=headers) as resp,
            ):
                assert resp.status == 200, await resp.text()
                self.connections += 1
                async for raw in resp.content:
                    line = raw.decode().rstrip("\r\n")
                    if line:
                        if not line.startswith(":"):
                            name, _, value = line.partition(":")
                            event[name] = value[1:] if value.startswith(" ") else value
                        continue
                    if event:
                        self._dispatch(event)
                        event = {}
                    if self.done is not None or (
                        until_tokens is not None and len(self.token_ids) >= until_tokens
                    ):
                        return
        except aiohttp.ClientError:
            return  # the API went away; resume later from last_id

    def _dispatch(self, event: dict[str, str]) -> None:
        data = orjson.loads(event.get("data", "{}"))
        if "id" in event:
            self.last_id = event["id"]
        if event.get("event") == "token":
            self.seen_offsets.append(data["offset"])
            self.token_ids += data["token_ids"]
            self.text += data["text"]
        elif event.get("event") == "done":
            self.done = data


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
            for round_no, tokens in enumerate((8, 60)):
                # Each client reads some tokens; then the worker is frozen (generation stops mid-way) and the
                # API is killed under the open streams.
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
                api.signal(signal.SIGKILL)
                await api.wait_exit(30)
                await asyncio.wait_for(asyncio.gather(*streams), 30)
                cut_at.append([len(c.token_ids) for c in clients])
                t.mark(f"API killed; clients cut at {cut_at[-1]} tokens")
                api = cluster.api("api", port=port)  # same port: clients come back to the same address
                await api.ready()
                t.mark("API restarted")
                worker.thaw()
            await asyncio.wait_for(asyncio.gather(*(c.read(base) for c in clients)), 120)
            t.mark("every stream done")
        finally:
            worker.thaw()
            await r.aclose()
        return clients, cut_at

    clients, cut_at = run_bounded(main(), timeout=200)
    for c, (want_ids, want_text) in zip(clients, refs):
        assert c.done is not None and c.done["status"] == "finished", c.done
        assert c.token_ids == want_ids, f"{c.rid}: {len(c.token_ids)} tokens, reference {len(want_ids)}"
        assert c.text == want_text
        assert c.last_id == f"{len(want_ids)}.{len(want_text)}"
        assert c.connections >= 5  # first read, reopened twice under a dying API, resumed twice
    print("SSE across 2 API kills:", {"streams": len(clients), "cut_at": cut_at, "tokens": len(refs[0][0])})
