"""400 requests from 12 concurrent producers against two worker processes and an API process: valid ones over
HTTP and as raw XADDs (some retried with the same id), and a sprinkling of bad raw entries (bad JSON,
non-UTF-8 bytes, huge numbers, oversize prompts) added in the same MULTI batches as valid ones.

Every valid request finishes exactly once with the reference tokens; every bad one with a usable id ends
`failed` once, with an `error_field` naming the culprit; one without a usable id ends in the dead letters
with a reason; none is lost, none stays queued, running or pending.
"""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import orjson
import pytest

from .conftest import (
    KEYS,
    Cluster,
    SseClient,
    Timeline,
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
    wait_for,
    wait_terminal,
)

pytestmark = pytest.mark.chaos

PROMPTS = [f"Prompt number {i}, about {topic}:" for i, topic in enumerate("abcdefghijkl")]
MAX_TOKENS = (3, 5, 6)
HTTP_PRODUCERS = RAW_PRODUCERS = 6
PER_PRODUCER = 30  # 6 * 30 over HTTP + 6 * 30 raw = 360 valid requests
BATCH = 5  # raw producers add their entries in MULTI batches of 5 valid ones (plus any bad ones)
OVERSIZE = 1_100_000  # characters: past the API's 1 MiB body and 200,000-character prompt limits
BIG = 1e308


def _params(n: int) -> dict:
    return {"max_tokens": MAX_TOKENS[n % len(MAX_TOKENS)], "temperature": 0.0, "ignore_eos": True}


def _json(body) -> bytes:
    return orjson.dumps(body)


# kind -> (body, the field prefix its `failed` status must name). Each kind is added twice.
BAD_BODIES: dict[str, tuple[bytes, str | tuple[str, ...]]] = {
    "truncated JSON": (b'{"prompt": "x"', "body"),
    "not JSON": (b"not json at all", "body"),
    "JSON array": (b"[1, 2, 3]", "body"),
    "NaN": (b'{"prompt": "x", "temperature": NaN}', "body"),
    "1e400 (infinite)": (b'{"prompt": "x", "max_tokens": 1e400}', "body"),
    "empty body": (b"", "body"),
    "deadline 1e308": (_json({"prompt": "x", "deadline": BIG}), "deadline"),
    "max_tokens 1e308": (_json({"prompt": "x", "max_tokens": BIG}), "max_tokens"),
    "max_tokens 2^20+1": (_json({"prompt": "x", "max_tokens": (1 << 20) + 1}), "max_tokens"),
    "temperature 1e308": (_json({"prompt": "x", "temperature": BIG}), "temperature"),
    "seed 2^64": (b'{"prompt": "x", "seed": %d}' % (1 << 64), "seed"),
    "top_k 1e20": (_json({"prompt": "x", "top_k": 1e20}), "top_k"),
    "stop_token_ids [1e308]": (_json({"prompt": "x", "stop_token_ids": [BIG]}), "stop_token_ids"),
    "speculation 1e308": (_json({"prompt": "x", "speculation": BIG}), "speculation"),
    "prompt token id 2^63": (_json({"prompt": [1 << 63]}), "prompt"),
    "oversize prompt": (_json({"prompt": "x" * OVERSIZE, "max_tokens": 2}), ("prompt", "body")),
    "oversize messages": (
        _json({"messages": [{"role": "user", "content": "y" * OVERSIZE}], "max_tokens": 2}),
        ("messages", "body"),
    ),
}
NON_UTF8 = ("non-UTF-8 body", "non-UTF-8 id", "non-UTF-8 field name")


def _bad_entries() -> list[tuple[str, str | None, dict[bytes, bytes], str | tuple[str, ...]]]:
    """(kind, usable request id or None, fields, expectation), 40 of them."""
    out = []
    for n in range(2):
        for kind, (body, expect) in BAD_BODIES.items():
            rid = f"bad{n}-{len(out)}"
            out.append((kind, rid, {b"id": rid.encode(), b"body": body}, expect))
        rid = f"bad{n}-{len(out)}"
        out.append((NON_UTF8[0], rid, {b"id": rid.encode(), b"body": b'{"prompt": "\xff\xfe"}'}, "body"))
        out.append((NON_UTF8[1], None, {b"id": b"bad-\xff-%d" % n, b"body": b'{"prompt": "x"}'}, "dead"))
        rid = f"bad{n}-{len(out)}"
        out.append((NON_UTF8[2], rid, {b"id": rid.encode(), b"\xffbody": b'{"prompt": "x"}'}, "body"))
    return out


class Producers:
    def __init__(self, cluster: Cluster, api_base: str) -> None:
        self.cluster = cluster
        self.api = api_base
        self.valid: dict[str, tuple[str, int]] = {}  # id -> (prompt, max_tokens)
        self.bad = _bad_entries()
        self.bad_entry_ids: dict[int, str] = {}  # index in self.bad -> stream entry id
        self.http_retries = 0
        self.raw_duplicates = 0
        self._n = itertools.count()

    def _next_valid(self, tag: str) -> tuple[str, dict]:
        n = next(self._n)
        rid = f"{tag}-{n}"
        params = _params(n)
        body = {"prompt": PROMPTS[n % len(PROMPTS)], **params}
        if n % 5 == 0:
            body["stream"] = False  # final-only output
        self.valid[rid] = (body["prompt"], params["max_tokens"])
        return rid, body

    async def http(self, p: int) -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(PER_PRODUCER):
                rid, body = self._next_valid(f"http{p}")
                for attempt in range(2 if i % 10 == 3 else 1):  # some clients retry their POST
                    async with s.post(f"{self.api}/v1/requests", json={"id": rid, **body}) as resp:
                        text = await resp.text()
                        assert resp.status == (202 if attempt == 0 else 200), text
                        assert orjson.loads(text)["id"] == rid
                    self.http_retries += attempt

    async def raw(self, p: int, r) -> None:
        mine = [i for i in range(len(self.bad)) if i % RAW_PRODUCERS == p]
        batches = PER_PRODUCER // BATCH
        for b in range(batches):
            entries: list[tuple[int | None, dict[bytes, bytes]]] = []
            for i in range(BATCH):
                rid, body = self._next_valid(f"raw{p}")
                entries.append((None, {b"id": rid.encode(), b"body": _json(body)}))
                if i == 2 and b % 2 == 0:  # a producer retrying its XADD: the worker must not run it twice
                    entries.append((None, {b"id": rid.encode(), b"body": _json(body)}))
                    self.raw_duplicates += 1
            for j in mine[b::batches]:
                entries.insert(len(entries) // 2, (j, self.bad[j][2]))
            pipe = r.pipeline(transaction=True)
            for _, fields in entries:
                pipe.xadd(KEYS.requests, fields)
            for (j, _), eid in zip(entries, await pipe.execute()):
                if j is not None:
                    self.bad_entry_ids[j] = eid.decode()
            await asyncio.sleep(0.02)


def test_400_requests_with_bad_entries_from_many_producers(cluster, tiny_model_dir):
    t = Timeline("load")
    workers = [cluster.worker(f"w{i}", SPECSERVE_CLAIM_TIMEOUT="5") for i in range(2)]
    api = cluster.api()
    refs = {
        mt: dict(zip(PROMPTS, reference(tiny_model_dir, PROMPTS, **_params(i))))
        for i, mt in enumerate(MAX_TOKENS)
    }
    assert all(_params(i)["max_tokens"] == mt for i, mt in enumerate(MAX_TOKENS))

    async def main():
        r = raw_redis(cluster.valkey)
        try:
            for proc in (*workers, api):
                await proc.ready()
            t.mark("workers and API ready")
            prod = Producers(cluster, api.base)
            await asyncio.gather(
                *(prod.http(p) for p in range(HTTP_PRODUCERS)),
                *(prod.raw(p, r) for p in range(RAW_PRODUCERS)),
            )
            total = len(prod.valid) + len(prod.bad)
            t.mark(f"{total} requests added ({len(prod.valid)} valid, {len(prod.bad)} bad)")
            with_id = [rid for _, rid, _, _ in prod.bad if rid is not None]
            await wait_terminal(r, list(prod.valid) + with_id, timeout=150, cluster=cluster)
            t.mark("every request with an id ended")

            async def no_pending() -> bool:
                g = await group_state(r)
                return g["pending"] == 0 and g["lag"] == 0

            await wait_for(
                no_pending, timeout=30, what="nothing pending"
            )  # dead letters are acknowledged too
            got = await outcomes(r, list(prod.valid))
            problems = {
                rid: finished_once_problems(got[rid], *refs[mt][prompt])
                for rid, (prompt, mt) in prod.valid.items()
            }
            sampled = list(prod.valid)[::10]  # and read back as SSE through the API, to the done event
            for sse in await asyncio.gather(*(SseClient(rid).follow(api.base, 60) for rid in sampled)):
                prompt, mt = prod.valid[sse.rid]
                problems[sse.rid] += sse.problems(*refs[mt][prompt])
            assert_no_problems(problems, "valid requests", cluster)
            dead = await dead_letters(r)
            bad_got = await outcomes(r, with_id)
            bad_problems = {}
            for j, (kind, rid, fields, expect) in enumerate(prod.bad):
                if expect == "dead":
                    letter = dead.get(prod.bad_entry_ids[j], {})
                    p = [] if letter.get("reason") else ["not in the dead letters with a reason"]
                    if letter and letter.get("body") != fields[b"body"].decode():
                        p.append(f"dead letter body {letter.get('body')!r}")
                else:
                    p = failed_once_problems(bad_got[rid], expect)
                bad_problems[f"{kind} ({rid or prod.bad_entry_ids[j]})"] = p
            assert_no_problems(bad_problems, "bad entries", cluster)
            assert await unfinished_requests(r) == {}
            reruns = sum(int(o.info.get("run", 0)) > 1 for o in got.values())
            return {
                "requests": total,
                "valid": len(prod.valid),
                "valid_finished_once": sum(not v for v in problems.values()),
                "sse_exact": len(sampled),
                "bad": len(prod.bad),
                "bad_failed_with_field": sum(e != "dead" for *_, e in prod.bad),
                "bad_dead_lettered": sum(e == "dead" for *_, e in prod.bad),
                "http_retries": prod.http_retries,
                "raw_duplicates": prod.raw_duplicates,
                "reruns": reruns,
                "producers": HTTP_PRODUCERS + RAW_PRODUCERS,
            }
        finally:
            await r.aclose()

    print("mixed load:", run_bounded(main(), timeout=230))
