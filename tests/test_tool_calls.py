"""Tool calling: the readers that take calls out of a choice's text, streamed and whole,
the request's ToolPlan and its errors, and the forced-call schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specserve.service import config
from specserve.service.http import ApiError
from specserve.service.openai.tool_calls import (
    TOOL_PARSERS,
    CallStart,
    HermesReader,
    Llama3JsonReader,
    NamedCallReader,
    RequiredCallsReader,
    assemble,
    delta_tool_calls,
    finish_reason,
    read_whole,
    required_schema,
    tool_plan,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _streamed(reader, text: str, step: int = 1):
    events = []
    for i in range(0, len(text), step):
        events += reader.feed(text[i : i + step])
    return assemble(events + reader.finish())


def _plain(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES_CASES = [
    ("Just text, no calls.", "Just text, no calls.", []),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        None,
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    # a model that stops at EOS before the closing tag, its JSON complete
    ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
    # not a call: left as it was written
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("a < b and <tool", "a < b and <tool", []),
    # arguments written as JSON text
    (
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        None,
        [("get_time", {"tz": "UTC"})],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_reads_the_same_calls_streamed_a_character_at_a_time_and_whole(text, content, calls):
    whole = read_whole(HermesReader(), text)
    streamed = _streamed(HermesReader(), text)
    assert whole[0] == content and _plain(whole[1]) == calls
    assert streamed[0] == content and _plain(streamed[1]) == calls


def test_hermes_with_parallel_calls_off_keeps_the_first_call():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    _, calls = read_whole(HermesReader(max_calls=1), text)
    assert _plain(calls) == [("get_weather", {"city": "Oslo"})]


def test_hermes_streams_text_before_a_call_and_holds_only_a_possible_tag():
    r = HermesReader()
    assert [e.text for e in r.feed("Hello there <tool")] == ["Hello there"]
    events = r.feed('_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert isinstance(events[0], CallStart) and events[0].name == "get_time"
    deltas = delta_tool_calls(events)
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"] == {
        "name": "get_time",
        "arguments": "",
    }
    assert deltas[1] == {"index": 0, "function": {"arguments": "{}"}}


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '{"name": "get_weather", "parameters": {"city": "Rome"}}',
            None,
            [("get_weather", {"city": "Rome"})],
        ),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}',
            None,
            [("get_time", {}), ("get_weather", {"city": "Oslo"})],
        ),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
        ('{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
    ],
)
def test_llama3_json_reads_calls_streamed_and_whole(text, content, calls):
    for got in (read_whole(Llama3JsonReader(), text), _streamed(Llama3JsonReader(), text, 3)):
        assert got[0] == content and _plain(got[1]) == calls


def test_llama3_json_streams_content_as_soon_as_it_is_not_a_call():
    r = Llama3JsonReader()
    assert r.feed("  ") == [] and [e.text for e in r.feed("Sun")] == ["  Sun"]


def test_named_and_required_readers():
    named = _streamed(NamedCallReader("get_weather"), '{"city": "Oslo"}', 4)
    assert named[0] is None and _plain(named[1]) == [("get_weather", {"city": "Oslo"})]
    out = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "X"}}]'
    required = _streamed(RequiredCallsReader(), out, 5)
    assert required[0] is None and _plain(required[1]) == [("get_time", {}), ("get_weather", {"city": "X"})]
    cut = read_whole(RequiredCallsReader(), '[{"name": "get_time", "parameters": {}}, {"name": "get_w')
    assert _plain(cut[1]) == [("get_time", {})] and cut[0] == ', {"name": "get_w'


def test_finish_reason_is_tool_calls_only_for_an_answer_that_ended_by_itself():
    assert finish_reason("stop", 1) == "tool_calls"
    assert finish_reason("length", 1) == "length"
    assert finish_reason("stop", 0) == "stop"


def test_finish_reason_is_tool_calls_for_a_forced_call_complete_when_max_tokens_cut_it():
    """The grammar of a forced call ends with its JSON: max_tokens that runs out right after it (before the
    end-of-sequence token) cut nothing of the call."""
    whole, cut = '{"city": "Oslo"}', '{"city": "Os'
    for text, want in ((whole, "tool_calls"), (cut, "length")):
        reader = NamedCallReader("get_weather")
        _content, calls = read_whole(reader, text)
        assert finish_reason("length", len(calls), reader) == want, text
    array = '[{"name": "get_time", "parameters": {}}]'
    for text, want in ((array, "tool_calls"), (array[:-1], "length"), (array + " ", "tool_calls")):
        reader = RequiredCallsReader()
        _content, calls = read_whole(reader, text)
        assert finish_reason("length", len(calls), reader) == want, text
    # tool_choice auto reads free text, which may always go on: cut short, it stays `length`
    reader = HermesReader(None)
    _content, calls = read_whole(reader, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert calls and finish_reason("length", len(calls), reader) == "length"
    assert finish_reason("stop", len(calls), reader) == "tool_calls"


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_schema([WEATHER, TIME], parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate(
        [{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}], schema
    )
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema([TIME], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)


def test_tool_plan_defaults_and_constraints():
    assert tool_plan({}, "hermes").mode == "none"
    auto = tool_plan({"tools": [WEATHER]}, "hermes")
    assert auto.mode == "auto" and auto.constraint() is None and isinstance(auto.reader(), HermesReader)
    named = tool_plan(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "hermes",
    )
    assert named.constraint() == {"json": WEATHER["function"]["parameters"]}
    none = tool_plan({"tools": [WEATHER], "tool_choice": "none"}, "hermes")
    assert none.reader() is None and none.tools == [WEATHER]  # still rendered, as OpenAI does


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(data, field):
    with pytest.raises(ApiError) as e:
        tool_plan(data, "hermes")
    assert e.value.status == 400 and e.value.param == field


def test_the_settings_list_every_registered_parser():
    assert sorted(config.TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)
