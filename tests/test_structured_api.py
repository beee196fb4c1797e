"""Structured output end to end: the official openai client against a real `specserve serve` (tiny model,
n-gram speculation on), and raw producers' bad constraints failing with the field named."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import orjson
import pytest
import redis.asyncio as aioredis
import xgrammar as xgr
from valkey_helpers import run, serve_process, service_stack

pytest_plugins = ("valkey_fixtures",)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver", "bronze"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Ann is 31, a gold member. Give her record as JSON."}]


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str]]:
    """`specserve serve` (embedded valkey, one worker, n-gram speculation) and an openai client on it."""
    with serve_process(
        tiny_model_dir, tmp_path_factory.mktemp("serve"), SPECSERVE_SPEC_METHOD="ngram"
    ) as base:
        yield (
            openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60),
            tiny_model_dir.name,
        )


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, **kw).choices[0]


def test_json_schema_outputs_validate_greedy_and_sampled(serve):
    client, model = serve
    rf = {"type": "json_schema", "json_schema": {"name": "member", "schema": SCHEMA, "strict": True}}
    outs = [_chat(client, model, temperature=0, response_format=rf)]
    outs += [_chat(client, model, temperature=1.0, seed=s, response_format=rf) for s in range(3)]
    for choice in outs:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    # json_object: any object. A random model may not close it within max_tokens; every token it wrote is
    # one the grammar allowed (the text is a prefix of a JSON object), and a finished one parses.
    obj = _chat(client, model, temperature=0, response_format={"type": "json_object"})
    grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    assert xgr.testing._get_matcher_from_grammar(grammar).accept_string(obj.message.content)
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    # streamed: the same text as the whole answer
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=120, temperature=0, response_format=rf, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == outs[0].message.content


def test_regex_choice_grammar_and_aliases(serve):
    client, model = serve
    regex = r"(ab|cd)[0-9]{2,4}-[xyz]{3}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        text = client.completions.create(
            model=model, prompt="code:", max_tokens=40, temperature=0.8, seed=3, extra_body=extra
        )
        assert re.fullmatch(regex, text.choices[0].text) and text.choices[0].finish_reason == "stop"
    choices = ["red", "green", "light blue"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        c = _chat(client, model, temperature=1.0, seed=5, extra_body=extra)
        assert c.message.content in choices and c.finish_reason == "stop"
    ebnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    c = _chat(client, model, temperature=0, extra_body={"guided_grammar": ebnf})
    assert re.fullmatch(r"yes|no|maybe [0-9]", c.message.content)
    c = _chat(client, model, temperature=0, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_speculation_on_equals_off_for_constrained_greedy(serve):
    client, model = serve
    rf = {"type": "json_schema", "json_schema": {"name": "member", "schema": SCHEMA}}
    texts = {}
    for spec in ("off", 4, "auto"):
        c = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=120,
            temperature=0,
            response_format=rf,
            extra_body={"speculation": spec},
        )
        texts[spec] = (c.choices[0].message.content, c.usage.completion_tokens)
    assert texts["off"] == texts[4] == texts["auto"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": "red"}}, "structured_outputs.choice"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar"),
        ({"guided_json": {"type": "object", "properties": []}}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(serve, extra, param):
    client, model = serve
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_raw_producer_bad_constraint_fails_with_field_and_the_worker_keeps_going(valkey, tiny_model_dir):
    bad = {
        "bad-regex": ({"regex": "[a-"}, "structured_outputs.regex"),
        "bad-schema": ({"json": {"type": "object", "required": 3}}, "structured_outputs.json"),
        "two": ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        "not-object": ("regex", "structured_outputs"),
    }

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (worker, client):
            raw = aioredis.Redis.from_url(valkey.url)
            try:
                for rid, (so, _) in bad.items():
                    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": so}
                    await raw.xadd("specserve:requests", {"id": rid, "body": orjson.dumps(body)})
                good = {
                    "prompt": "x",
                    "max_tokens": 30,
                    "temperature": 0,
                    "structured_outputs": {"choice": ["ok"]},
                }
                await raw.xadd("specserve:requests", {"id": "good", "body": orjson.dumps(good)})
                results = {rid: await asyncio.wait_for(client.wait(rid), 60) for rid in [*bad, "good"]}
                return results, worker.engine.error
            finally:
                await raw.aclose()

    results, engine_error = run(main())
    assert engine_error is None
    for rid, (_, field) in bad.items():
        assert results[rid].status == "failed" and results[rid].error_field == field, results[rid]
    assert results["good"].status == "finished" and results["good"].text == "ok"
