"""The chaos suite's shared parts: a valkey-server with a password and an append-only file, real `specserve
worker` / `specserve api` processes that are always killed at the end, raw Redis access that survives
non-UTF-8 bytes, and the exactly-once audit every scenario ends with.

tests/conftest.py's fixtures (tiny_model_dir) apply here too; valkey_fixtures.py is not loaded (a non-root
conftest cannot declare pytest_plugins), so the server fixture is this file's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from valkey_helpers import TINY, free_port, spawn_cli, wait_for

from specserve import SamplingParams
from specserve.queue.embedded import EmbeddedValkey
from specserve.queue.keys import Keys
from specserve.queue.wire import TERMINAL, OutputEntry, assemble

KEYS = Keys("specserve")
# What the worker processes load: the tiny random model, float32 on the CPU, a small KV cache.
TINY_ENV = {"SPECSERVE_DTYPE": "float32", "SPECSERVE_KV_CACHE_BYTES": str(4 << 20), "SPECSERVE_DEVICE": "cpu"}


# ---- processes ------------------------------------------------------------------------------------------


@dataclass
class Proc:
    """One `specserve` process; `base` is where its /readyz answers (the API, or the worker's health port)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    base: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def tail(self, n: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} (pid {self.pid}, rc {self.popen.poll()}) ---\n{text[-n:]}"

    async def ready(self, timeout: float = 120.0) -> None:
        async def up() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited before it was ready\n{self.tail()}")
            return await http_ok(f"{self.base}/readyz")

        await wait_for(up, timeout=timeout, what=f"{self.name} ready", interval=0.1)

    async def wait_exit(self, timeout: float) -> int:
        return await asyncio.to_thread(self.popen.wait, timeout)

    def stopped(self) -> bool:
        """SIGSTOP has taken effect (state T in /proc)."""
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
        return False

    async def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

        async def stopped() -> bool:
            return self.stopped()

        await wait_for(stopped, timeout=10, what=f"{self.name} stopped", interval=0.01)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)  # not needed for SIGKILL; harmless, and tidy for logs
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=30)


async def http_ok(url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


class Cluster:
    """Real service processes on one valkey-server. Every process started here is killed at teardown."""

    def __init__(self, valkey: EmbeddedValkey, model_dir: Path, workdir: Path) -> None:
        self.valkey = valkey
        self.model_dir = model_dir
        self.dir = workdir
        self.procs: list[Proc] = []

    def _log(self, name: str) -> Path:
        path = self.dir / f"{name}.log"
        i = 1
        while path.exists():
            i += 1
            path = self.dir / f"{name}.{i}.log"
        return path

    def worker(self, name: str, **env: str) -> Proc:
        health = free_port()
        full = {
            **TINY_ENV,
            "REDIS_URL": self.valkey.url,
            "SPECSERVE_MODEL": str(self.model_dir),
            "SPECSERVE_HEALTH_PORT": str(health),
            "SPECSERVE_WORKER_NAME": name,
            **env,
        }
        log = self._log(name)
        proc = Proc(name, spawn_cli(["worker"], full, log), log, f"http://127.0.0.1:{health}")
        self.procs.append(proc)
        return proc

    def api(self, name: str = "api", port: int | None = None, **env: str) -> Proc:
        port = port or free_port()
        full = {"REDIS_URL": self.valkey.url, "SPECSERVE_PORT": str(port), **env}
        log = self._log(name)
        proc = Proc(name, spawn_cli(["api"], full, log), log, f"http://127.0.0.1:{port}")
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def chaos_valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A private valkey-server on loopback with a password and its append-only file on (fsync each second)."""
    server = EmbeddedValkey(tmp_path / "valkey", password="chaos-" + secrets.token_hex(12)).start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)  # a test that failed while it was frozen
        server.stop()


@pytest.fixture
def cluster(chaos_valkey: EmbeddedValkey, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(chaos_valkey, tiny_model_dir, tmp_path)
    try:
        yield c
    finally:
        c.close()


class Timeline:
    """Phase marks printed with their elapsed time (seen with -s; for the runtime figures, not asserted)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = time.monotonic()

    def mark(self, what: str) -> None:
        print(f"[{self.name} +{time.monotonic() - self.t0:6.2f}s] {what}", flush=True)


def run_bounded(coro, timeout: float):
    """Run a scenario on a fresh loop; past `timeout` it fails instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class SseClient:
    """Reads /v1/requests/{id}/stream as a browser's EventSource would: an event counts once its blank line
    has arrived (a connection cut mid-event drops the partial one), Last-Event-ID is the id of the last event
    dispatched, and a lost connection is resumed from it."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.token_ids: list[int] = []
        self.text = ""
        self.last_id: str | None = None
        self.done: dict | None = None
        self.connections = 0  # answered with 200
        self.refused = 0  # connection refused, or a 5xx (the API or its Redis away)

    async def read(self, base: str, until_tokens: int | None = None) -> None:
        """Read until the `done` event, `until_tokens` tokens in all, or the connection breaks."""
        headers = {"Last-Event-ID": self.last_id} if self.last_id else {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
        event: dict[str, str] = {}
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as http,
                http.get(f"{base}/v1/requests/{self.rid}/stream", headers=headers) as resp,
            ):
                if resp.status >= 500:
                    self.refused += 1
                    return
                assert resp.status == 200, (self.rid, resp.status, await resp.text())
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
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.refused += 1  # the API went away; resume later from last_id

    async def follow(self, base: str, timeout: float) -> SseClient:
        """Read to the `done` event, resuming with Last-Event-ID whenever the connection is lost."""
        deadline = time.monotonic() + timeout
        while self.done is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"SSE of {self.rid}: no done event within {timeout}s")
            before = self.connections + self.refused
            await self.read(base)
            if self.done is None and self.connections + self.refused > before:
                await asyncio.sleep(0.1)
        return self

    def _dispatch(self, event: dict[str, str]) -> None:
        data = orjson.loads(event.get("data", "{}"))
        if "id" in event:
            self.last_id = event["id"]
        if event.get("event") == "token":
            self.token_ids += data["token_ids"]
            self.text += data["text"]
        elif event.get("event") == "done":
            self.done = data

    def problems(self, want_ids: list[int], want_text: str) -> list[str]:
        """Why this stream is not the reference exactly, with one `done` saying finished."""
        p = []
        if self.done is None or self.done.get("status") != "finished":
            p.append(f"SSE done event {self.done}")
        if self.token_ids != want_ids or self.text != want_text:
            p.append(f"SSE saw {len(self.token_ids)} tokens {self.text!r}, reference {len(want_ids)}")
        if self.done is not None and self.last_id != f"{len(want_ids)}.{len(want_text)}":
            p.append(f"SSE last event id {self.last_id}")
        return p


# ---- raw Redis --------------------------------------------------------------------------------------------


def raw_redis(valkey: EmbeddedValkey) -> aioredis.Redis:
    """A client that hands out bytes: poison entries (non-UTF-8) are written and read back as they are."""
    return aioredis.Redis.from_url(valkey.url, decode_responses=False, socket_timeout=15)


def _s(b: bytes | str) -> str:
    return b.decode("utf-8", errors="backslashreplace") if isinstance(b, bytes) else b


async def xadd_multi(r: aioredis.Redis, entries: list[dict[bytes, bytes]]) -> list[str]:
    """XADD every entry to the request stream in one MULTI/EXEC (one batch, as a worker will read it)."""
    pipe = r.pipeline(transaction=True)
    for fields in entries:
        pipe.xadd(KEYS.requests, fields)
    return [_s(eid) for eid in await pipe.execute()]


async def _group_reads_held(r: aioredis.Redis) -> list[int]:
    """Seconds since each client the server holds in a blocking XREADGROUP sent it (CLIENT LIST, flag b)."""
    idle = []
    for line in _s(await r.execute_command("CLIENT", "LIST")).splitlines():
        kv = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if kv.get("cmd") == "xreadgroup" and "b" in kv.get("flags", ""):
            idle.append(int(kv.get("idle", "9")))
    return idle


async def blocked_group_readers(r: aioredis.Redis) -> int:
    """Clients the server holds in a blocking XREADGROUP right now."""
    return len(await _group_reads_held(r))


async def fresh_blocked_reader(r: aioredis.Redis) -> bool:
    """One client is held in a blocking XREADGROUP that it sent less than a second ago (CLIENT LIST idle 0),
    so at least a second of its 2 s block is left."""
    return await _group_reads_held(r) == [0]


async def pending_of(r: aioredis.Redis, consumer: str) -> list[str]:
    items = await r.xpending_range(KEYS.requests, KEYS.group, "-", "+", 100_000, consumername=consumer)
    return [_s(p["message_id"]) for p in items]


async def deliver_to_frozen(r: aioredis.Redis, worker: Proc, entries: list[dict[bytes, bytes]]) -> list[str]:
    """Have `worker`'s own blocking XREADGROUP take `entries` as one batch while the process is stopped.

    The worker is frozen (SIGSTOP) at a moment the server holds its XREADGROUP; the entries are then added in
    one MULTI and the server answers that read with all of them: they are pending under the worker's name,
    and the reply sits unread in its socket. The worker leaves this function frozen; it either resumes
    (SIGCONT) or dies (SIGKILL) with the batch read and not yet handled, at the test's choice.

    The server is watched with the worker running, and the worker frozen only once a fresh read is seen:
    freezing it on every look kept it from sending its next read, and on a loaded machine the moment
    came only after its long requests had ended.
    """
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # A read sent under a second ago: at least a second of its 2 s block is left for the XADD.
        if await fresh_blocked_reader(r):
            await worker.freeze()
            if await fresh_blocked_reader(r):  # still held (or a newer one) now that the worker is stopped
                ids = await xadd_multi(r, entries)
                pending = await pending_of(r, worker.name)
                assert set(ids) <= set(pending), "the frozen worker's read did not take the whole batch"
                return ids
            worker.thaw()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{worker.name} was never caught blocked in XREADGROUP")


async def group_state(r: aioredis.Redis) -> dict[str, Any]:
    for g in await r.xinfo_groups(KEYS.requests):
        g = {_s(k): v for k, v in g.items()}
        if _s(g["name"]) == KEYS.group:
            return g
    raise AssertionError("no workers' group")


async def dead_letters(r: aioredis.Redis) -> dict[str, dict[str, str]]:
    """The dead-letter stream, by the request stream entry id each one names."""
    out: dict[str, dict[str, str]] = {}
    for _, fields in await r.xrange(KEYS.dead):
        f = {_s(k): _s(v) for k, v in fields.items()}
        out[f.get("entry", "")] = f
    return out


async def unfinished_requests(r: aioredis.Redis) -> dict[str, str]:
    """Every status hash on the server that is not terminal: id -> status."""
    left = {}
    async for key in r.scan_iter(match=KEYS.req("*").encode(), count=1000):
        status = _s(await r.hget(key, "status") or b"")
        if status not in TERMINAL:
            left[_s(key)[len(KEYS.req("")) :]] = status
    return left


async def terminal_count(r: aioredis.Redis, ids: list[str]) -> int:
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hget(KEYS.req(rid), "status")
    return sum(_s(s or b"") in TERMINAL for s in await pipe.execute())


async def wait_terminal(r: aioredis.Redis, ids: list[str], timeout: float, cluster: Cluster) -> None:
    async def done() -> bool:
        return await terminal_count(r, ids) == len(ids)

    try:
        await wait_for(done, timeout=timeout, what="every request to end", interval=0.2)
    except AssertionError:
        n = await terminal_count(r, ids)
        raise AssertionError(
            f"{n} of {len(ids)} requests ended within {timeout}s\n{cluster.logs()}"
        ) from None


# ---- the audit --------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the server holds about one request after the fact."""

    id: str
    info: dict[str, str]
    entries: list[OutputEntry]
    token_ids: list[int] = field(default_factory=list)  # what a reader following the rule sees
    text: str = ""

    @property
    def finals(self) -> list[OutputEntry]:
        return [e for e in self.entries if e.final]

    @property
    def status(self) -> str:
        return self.info.get("status", "")


async def outcomes(r: Any, ids: list[str], keys: Keys = KEYS) -> dict[str, Outcome]:
    """`r`: a client of the server (a cluster's too, with `keys` naming its shards)."""
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        mine = keys.of_request(rid)
        pipe.hgetall(mine.req(rid))
        pipe.xrange(mine.out(rid))
    replies = await pipe.execute()
    out = {}
    for i, rid in enumerate(ids):
        info = {_s(k): _s(v) for k, v in replies[2 * i].items()}
        entries = [
            OutputEntry.from_fields({_s(k): _s(v) for k, v in f.items()}) for _, f in replies[2 * i + 1]
        ]
        res = assemble(rid, info, entries)
        out[rid] = Outcome(rid, info, entries, res.token_ids, res.text)
    return out


def finished_once_problems(o: Outcome, want_ids: list[int], want_text: str) -> list[str]:
    """Why `o` is not one finished run with the reference output (empty: it is).

    Exactly once: one final entry, status finished in both the hash and the final entry, written by the
    hash's last run, with usage counting the whole completion. Every entry of every run (a crashed run's
    partial output included) carries the reference's tokens and text at its offsets; in stream order the
    entries cover the completion without a gap (a rerun continues after what earlier runs wrote, or repeats
    part of it, docs/wire-format.md); and the reader-visible sequence (OutputCursor, via assemble) is the
    reference exactly.
    """
    p = []
    finals = o.finals
    if len(finals) != 1:
        p.append(f"{len(finals)} final entries")
    if o.status != "finished":
        p.append(f"status {o.status!r} ({o.info.get('error_field')}: {o.info.get('error')})")
    runs = int(o.info.get("run", "0") or 0)
    if finals:
        f = finals[0]
        if f.status != "finished" or f.run != runs:
            p.append(f"final entry status {f.status!r} of run {f.run}, hash run {runs}")
        if f.usage is not None and f.usage.get("completion_tokens") != len(want_ids):
            p.append(f"usage {f.usage}, reference {len(want_ids)} completion tokens")
    tokens = chars = 0
    for e in o.entries:
        if not 1 <= e.run <= runs:
            p.append(f"entry of run {e.run} (hash run {runs})")
        if e.token_ids != want_ids[e.offset : e.offset + len(e.token_ids)]:
            p.append(f"run {e.run} offset {e.offset}: tokens {e.token_ids} differ from the reference")
        if e.text != want_text[e.text_offset : e.text_offset + len(e.text)]:
            p.append(f"run {e.run} text offset {e.text_offset}: text {e.text!r} differs from the reference")
        if e.offset > tokens or e.text_offset > chars:
            p.append(f"run {e.run}: gap before offset {e.offset}/{e.text_offset} (covered {tokens}/{chars})")
        tokens = max(tokens, e.offset + len(e.token_ids))
        chars = max(chars, e.text_offset + len(e.text))
    if o.token_ids != want_ids or o.text != want_text:
        p.append(f"reader sees {len(o.token_ids)} tokens {o.text!r}, reference {len(want_ids)} {want_text!r}")
    return p


def failed_once_problems(o: Outcome, field_prefix: str | tuple[str, ...] | None = None) -> list[str]:
    """Why `o` is not a request that ended `failed` once, with `error_field` set (and starting with one of
    `field_prefix` when given)."""
    p = []
    if len(o.finals) != 1:
        p.append(f"{len(o.finals)} final entries")
    if o.status != "failed":
        p.append(f"status {o.status!r}")
    err_field = o.info.get("error_field") or (o.finals[0].error_field if o.finals else None)
    if not err_field:
        p.append(f"no error_field (error {o.info.get('error')!r})")
    elif field_prefix is not None and not err_field.startswith(field_prefix):
        p.append(f"error_field {err_field!r}, expected {field_prefix!r}")
    if o.finals and o.finals[0].status != "failed":
        p.append(f"final entry status {o.finals[0].status!r}")
    return p


def assert_no_problems(problems: dict[str, list[str]], what: str, cluster: Cluster | None = None) -> None:
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        lines = [f"{k}: {'; '.join(v)}" for k, v in list(bad.items())[:20]]
        logs = f"\n{cluster.logs()}" if cluster is not None else ""
        raise AssertionError(f"{len(bad)} of {len(problems)} {what}:\n" + "\n".join(lines) + logs)


# ---- reference outputs -------------------------------------------------------------------------------------

_REFERENCE: dict[tuple[str, str], tuple[list[int], str]] = {}


def reference(model_dir: Path, prompts: list[str], **params: Any) -> list[tuple[list[int], str]]:
    """Greedy reference (token ids, text) per prompt from the engine driven directly (cached per process)."""
    key = repr(sorted(params.items()))
    todo = [p for p in dict.fromkeys(prompts) if (p, key) not in _REFERENCE]
    if todo:
        outs = TINY.llm(model_dir).generate(todo, SamplingParams(**params))
        for prompt, out in zip(todo, outs):
            _REFERENCE[(prompt, key)] = (list(out.token_ids), out.text)
    return [_REFERENCE[(p, key)] for p in prompts]


# ---- bad raw entries --------------------------------------------------------------------------------------


def non_utf8_entries(tag: str) -> list[tuple[str, str | None, dict[bytes, bytes]]]:
    """(kind, request id when usable, fields): the red team's F1 entries. One with a usable id must end
    `failed` with `error_field` `body` (its body cannot be read, or it has none); one without goes to the
    dead letters, by entry id, with a reason (docs/wire-format.md)."""
    return [
        ("non-UTF-8 body", f"{tag}-body", {b"id": f"{tag}-body".encode(), b"body": b'{"prompt":"\xff"}'}),
        ("non-UTF-8 id", None, {b"id": b"junk-\xff\xfe", b"body": b'{"prompt": "x", "max_tokens": 2}'}),
        (
            "non-UTF-8 field name",
            f"{tag}-field",
            {b"id": f"{tag}-field".encode(), b"bo\xffdy": b'{"prompt": "x", "max_tokens": 2}'},
        ),
    ]


async def wait_settled(r: aioredis.Redis, timeout: float = 30) -> None:
    """Until nothing is pending or undelivered in the workers' group (a dead letter is acknowledged with the
    XADD that records it, so this also waits for those)."""

    async def settled() -> bool:
        g = await group_state(r)
        return g["pending"] == 0 and g["lag"] == 0

    await wait_for(settled, timeout=timeout, what="nothing pending or undelivered", interval=0.1)


def poison_problems(
    poison: list[tuple[str, str | None, dict[bytes, bytes]]],
    entry_ids: list[str],
    dead: dict[str, dict[str, str]],
    got: dict[str, Outcome],
) -> dict[str, list[str]]:
    """Each poison entry (non_utf8_entries) ended alone: `failed` once naming `body` where its id is usable;
    otherwise a dead letter for its entry id with a reason and the entry's body byte for byte."""
    problems = {}
    for (kind, rid, fields), entry_id in zip(poison, entry_ids):
        if rid is None:
            letter = dead.get(entry_id, {})
            p = [] if letter.get("reason") else [f"entry {entry_id} not in {KEYS.dead} with a reason"]
            if letter and letter.get("body") != _s(fields.get(b"body", b"")):
                p.append(f"dead letter body {letter.get('body')!r}, entry's {fields.get(b'body')!r}")
            problems[kind] = p
        else:
            problems[kind] = failed_once_problems(got[rid], "body")
    return problems
