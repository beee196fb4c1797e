"""The wire format's parsing and the reader's exactly-once view of output streams (no Redis needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import orjson
import pytest

from specserve.queue.keys import Keys, valid_request_id
from specserve.queue.wire import (
    OutputCursor,
    OutputEntry,
    RequestEntry,
    WireError,
    assemble,
    decode_body,
    parse_body,
)


def test_keys_follow_the_documented_names():
    k = Keys("acme")
    assert (k.requests, k.group, k.dead) == ("acme:requests", "acme:workers", "acme:dead")
    assert (k.req("r1"), k.out("r1")) == ("acme:req:r1", "acme:out:r1")


@pytest.mark.parametrize("rid", ["a", "req-1", "A.b:c_d-9", "x" * 200])
def test_valid_request_ids(rid):
    assert valid_request_id(rid)


@pytest.mark.parametrize("rid", ["", "has space", "x" * 201, "a*b", "new\nline", None, 7])
def test_invalid_request_ids(rid):
    assert not valid_request_id(rid)


def test_body_with_prompt_and_sampling_fields():
    body = parse_body({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": ["\n"], "model": "m"})
    assert body.prompt == "hi" and body.messages is None and body.model == "m"
    assert body.sampling == {"max_tokens": 5, "temperature": 0, "stop": ["\n"]}
    assert orjson.loads(body.to_json()) == {
        "prompt": "hi",
        "model": "m",
        "max_tokens": 5,
        "temperature": 0,
        "stop": ["\n"],
    }


def test_final_only_bodies_say_so_on_the_wire_and_others_do_not():
    final_only = parse_body({"prompt": "hi", "stream": False})
    assert final_only.stream is False and final_only.sampling == {}
    assert orjson.loads(final_only.to_json()) == {"prompt": "hi", "stream": False}
    assert parse_body({"prompt": "hi", "stream": True}).stream is True
    assert "stream" not in orjson.loads(parse_body({"prompt": "hi"}).to_json())


def test_body_with_token_ids_and_chat_messages():
    assert parse_body({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert parse_body({"messages": msgs}).messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]


@pytest.mark.parametrize(
    "data, field",
    [
        ([1, 2], "body"),
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": 12}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"prompt": "a", "model": 3}, "model"),
        ({"prompt": "a", "deadline": "soon"}, "deadline"),
        ({"prompt": "a", "stream": "no"}, "stream"),
    ],
)
def test_malformed_bodies_name_the_field(data, field):
    with pytest.raises(WireError) as e:
        parse_body(data)
    assert e.value.field == field


def test_prompt_length_limit():
    with pytest.raises(WireError, match="too long"):
        parse_body({"prompt": "x" * 11}, max_prompt_chars=10)
    with pytest.raises(WireError, match="too long"):
        parse_body({"messages": [{"role": "user", "content": "x" * 11}]}, max_prompt_chars=10)


def test_invalid_json_is_a_body_error():
    with pytest.raises(WireError) as e:
        decode_body("{not json")
    assert e.value.field == "body"


def test_request_entry_without_a_usable_id():
    assert RequestEntry.from_fields("1-0", {"body": "{}"}).request_id is None
    assert RequestEntry.from_fields("1-0", {"id": "bad id", "body": "{}"}).request_id is None
    e = RequestEntry.from_fields("1-0", {"id": "ok", "body": "{}", "traceparent": "tp"})
    assert (e.request_id, e.traceparent) == ("ok", "tp")


def test_output_entry_round_trip():
    final = OutputEntry(2, 5, 9, [7, 8], "ab", "length", "finished", {"prompt_tokens": 3}, None, None)
    assert OutputEntry.from_fields(final.to_fields()) == final
    delta = OutputEntry(1, 0, 0, [1], "x")
    f = delta.to_fields()
    assert "finish_reason" not in f and OutputEntry.from_fields(f) == delta


def _entries(run: int, chunks: list[list[int]], final: bool) -> list[OutputEntry]:
    """Entries of one run that splits tokens (each token t has text chr(65+t)) into `chunks`."""
    out, offset = [], 0
    for i, ids in enumerate(chunks):
        text = "".join(chr(65 + t) for t in ids)
        last = final and i == len(chunks) - 1
        out.append(
            OutputEntry(
                run, offset, offset, ids, text, "length" if last else None, "finished" if last else None
            )
        )
        offset += len(ids)
    return out


def test_cursor_shows_each_token_once_across_a_restart():
    # Run 1 publishes 0..4 then dies; run 2 starts over with different chunking and finishes.
    entries = _entries(1, [[0, 1], [2, 3, 4]], final=False) + _entries(
        2, [[0], [1, 2, 3], [4, 5], [6]], final=True
    )
    cursor, ids, text = OutputCursor(), [], ""
    for e in entries:
        d = cursor.feed(e)
        if d is not None:
            assert d.offset == len(ids)
            ids += d.token_ids
            text += d.text
    assert ids == [0, 1, 2, 3, 4, 5, 6] and text == "ABCDEFG" and cursor.done


def test_cursor_resumes_after_what_was_shown():
    cursor = OutputCursor(tokens=3, chars=3)
    deltas = [cursor.feed(e) for e in _entries(1, [[0, 1], [2, 3], [4]], final=True)]
    shown = [d for d in deltas if d is not None]
    assert [d.token_ids for d in shown] == [[3], [4]] and "".join(d.text for d in shown) == "DE"


def test_cursor_ignores_anything_after_the_final_entry():
    cursor = OutputCursor()
    entries = _entries(1, [[0, 1]], final=True)
    assert cursor.feed(entries[0]).final is not None
    assert cursor.feed(entries[0]) is None


def test_assemble_dedups_and_takes_the_final_entry():
    entries = _entries(1, [[0, 1, 2]], final=False) + _entries(2, [[0, 1], [2, 3]], final=True)
    entries[-1].usage = {"prompt_tokens": 1, "completion_tokens": 4}
    res = assemble("r", {"status": "running"}, entries)
    assert res.token_ids == [0, 1, 2, 3] and res.text == "ABCD"
    assert res.status == "finished" and res.finish_reason == "length" and res.usage["completion_tokens"] == 4


def test_queue_package_imports_neither_torch_nor_the_engine():
    """queue/ knows Redis and the wire format only (the layering rule): check its imports statically."""
    queue_dir = Path(__file__).resolve().parent.parent / "specserve" / "queue"
    for path in queue_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(("torch", "specserve.engine", "specserve.service")), (
                    path.name,
                    name,
                )
