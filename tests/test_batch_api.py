"""OpenAI's Files and Batch APIs on the queue, through the official `openai` client unchanged: a 20-line
JSONL with one bad line completes with 19 output lines keyed by custom_id and one error line; lines are
ordinary requests (results equal LLM.generate); files and batches belong to the API key that made them."""

from __future__ import annotations

import asyncio
import io

import openai
import orjson
import pytest
from test_api_hardening import guarded_stack
from valkey_helpers import run

from specserve import SamplingParams

pytest_plugins = ("valkey_fixtures",)
PROMPTS = [f"Item {i}:" for i in range(19)]


def _jsonl(model: str) -> bytes:
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        for i, p in enumerate(PROMPTS)
    ]
    rows.insert(7, {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "prompt": "x", "top_p": 5}})  # fmt: skip
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


def test_a_batch_through_the_openai_client(valkey, tiny_model_dir, tiny_engines):
    model = str(tiny_model_dir)
    ref = tiny_engines.llm(tiny_model_dir).generate(
        PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )

    async def main():
        async with guarded_stack(valkey.url, tiny_model_dir, api_keys=["a:tok-a", "b:tok-b"]) as (
            base,
            _w,
            _c,
        ):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            other = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-b", max_retries=0)
            f = await oai.files.create(file=("in.jsonl", io.BytesIO(_jsonl(model))), purpose="batch")
            batch = await oai.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
            for _ in range(600):
                batch = await oai.batches.retrieve(batch.id)
                if batch.status not in ("validating", "in_progress", "finalizing"):
                    break
                await asyncio.sleep(0.1)
            output = (await oai.files.content(batch.output_file_id)).content
            errors = (await oai.files.content(batch.error_file_id)).content
            listed = await oai.batches.list()
            with pytest.raises(openai.NotFoundError):
                await other.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await other.files.content(f.id)
            deleted = await oai.files.delete(f.id)
            return batch, output, errors, [b.id for b in listed.data], deleted

    batch, output, errors, listed, deleted = run(main(), timeout=300)
    assert batch.status == "completed" and batch.request_counts.total == 20
    assert (batch.request_counts.completed, batch.request_counts.failed) == (19, 1)
    lines = {row["custom_id"]: row for row in map(orjson.loads, output.splitlines())}
    assert set(lines) == {f"req-{i}" for i in range(19)}
    for i, want in enumerate(ref):
        body = lines[f"req-{i}"]["response"]["body"]
        assert lines[f"req-{i}"]["response"]["status_code"] == 200
        assert body["choices"][0]["text"] == want.text and body["usage"]["completion_tokens"] == 6
    (bad,) = map(orjson.loads, errors.splitlines())
    assert bad["custom_id"] == "bad" and "top_p" in bad["error"]["message"]
    assert listed == [batch.id] and deleted.deleted


def test_a_cancelled_batch_ends_cancelled_with_what_finished(valkey, tiny_model_dir):
    model = str(tiny_model_dir)
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500,
                  "ignore_eos": True}}
        for i in range(4)
    ]  # fmt: skip

    async def main():
        async with guarded_stack(valkey.url, tiny_model_dir) as (base, _w, _c):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
            f = await oai.files.create(file=("c.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await oai.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            batch = await oai.batches.cancel(batch.id)
            for _ in range(600):
                if batch.status in ("cancelled", "completed", "failed", "expired"):
                    break
                await asyncio.sleep(0.1)
                batch = await oai.batches.retrieve(batch.id)
            return batch

    batch = run(main(), timeout=300)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.request_counts.total == 4
    assert batch.error_file_id is not None


def test_bad_batch_requests_name_their_field(valkey, tiny_model_dir):
    async def main():
        async with guarded_stack(valkey.url, tiny_model_dir) as (base, _w, _c):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            out = {}
            for name, call in {
                "input_file_id": oai.batches.create(
                    input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
                ),
                "endpoint": oai.batches.create(
                    input_file_id="x", endpoint="/v1/embeddings", completion_window="24h"
                ),
                "purpose": oai.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="assistants"),
            }.items():
                try:
                    await call
                except openai.APIStatusError as e:
                    out[name] = (e.status_code, e.body.get("param") if isinstance(e.body, dict) else None)
            return out

    out = run(main())
    assert out == {
        "input_file_id": (404, "file_id"),
        "endpoint": (400, "endpoint"),
        "purpose": (400, "purpose"),
    }


def test_list_files_shows_the_callers_files_newest_first(valkey, tiny_model_dir):
    async def main():
        async with guarded_stack(valkey.url, tiny_model_dir, api_keys=["a:tok-a", "b:tok-b"]) as (
            base,
            _w,
            _c,
        ):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-a", max_retries=0)
            other = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="tok-b", max_retries=0)
            mine = [
                (await oai.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch")).id
                for i in range(3)
            ]
            theirs = await other.files.create(file=("b.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
            listed = [f.id for f in (await oai.files.list()).data]
            oldest_first = [f.id for f in (await oai.files.list(order="asc")).data]
            first = await oai.files.list(limit=2)
            rest = await oai.files.list(after=first.data[-1].id)
            outputs = (await oai.files.list(purpose="batch_output")).data
            await oai.files.delete(mine[1])
            after_delete = [f.id for f in (await oai.files.list()).data]
            their_list = [f.id for f in (await other.files.list()).data]
            return mine, theirs.id, listed, oldest_first, first, rest, outputs, after_delete, their_list

    mine, theirs, listed, oldest_first, first, rest, outputs, after_delete, their_list = run(main())
    assert sorted(listed) == sorted(mine) and theirs not in listed
    assert oldest_first == list(reversed(listed))
    assert first.has_more and [f.id for f in first.data] + [f.id for f in rest.data] == listed
    assert outputs == []
    assert after_delete == [i for i in listed if i != mine[1]]
    assert their_list == [theirs]


def test_seeded_batch_lines_are_the_engines_beside_unseeded_ones(valkey, tiny_model_dir, tiny_engines):
    """Lines seeded 7, 8, 9 (n = 3 with seed 7, sent as lines) among unseeded sampled lines of other
    lengths: each seeded line's answer is the engine's for its seed, whatever ran beside it."""
    model = str(tiny_model_dir)
    messages = [{"role": "user", "content": "Tell me a story."}]
    llm = tiny_engines.llm(tiny_model_dir)
    seeded = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in (7, 8, 9)]
    want = [o.text for o in llm.generate([llm.engine.encode_chat(messages)] * 3, seeded)]
    body = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    rows = [
        {"custom_id": f"mate-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {**body, "max_tokens": 3 + 5 * i, "messages": [{"role": "user", "content": "x " * (i + 1)}]}}
        for i in range(6)
    ]  # fmt: skip
    for i, seed in enumerate((7, 8, 9)):
        rows.insert(2 * i + 1, {"custom_id": f"seed-{seed}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {**body, "seed": seed}})  # fmt: skip

    async def main():
        async with guarded_stack(valkey.url, tiny_model_dir) as (base, _w, _c):
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
            f = await oai.files.create(file=("s.jsonl", io.BytesIO(data)), purpose="batch")
            batch = await oai.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            for _ in range(600):
                batch = await oai.batches.retrieve(batch.id)
                if batch.status not in ("validating", "in_progress", "finalizing"):
                    break
                await asyncio.sleep(0.1)
            return batch, (await oai.files.content(batch.output_file_id)).content

    batch, output = run(main(), timeout=300)
    assert batch.status == "completed" and batch.request_counts.completed == 9
    lines = {row["custom_id"]: row for row in map(orjson.loads, output.splitlines())}
    got = [lines[f"seed-{s}"]["response"]["body"]["choices"][0]["message"]["content"] for s in (7, 8, 9)]
    assert got == want
