"""Tool calling end to end: the official openai client against a real `specserve serve`
on a tiny model whose chat template renders tools as Qwen 2.5's does (Hermes-style <tool_call> tags), n-gram
speculation on. Forced calls (a named function, `required`) are generated under their schemas, so even a
random model's calls validate against the tools' parameters."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from valkey_helpers import serve_process

# Qwen 2.5's tool template, shortened to what it renders: the tools as JSON in the system turn, earlier calls
# as <tool_call> tags, tool results as <tool_response> in a user turn.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{%- else %}You are a helpful assistant.{% endif %}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 10}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str]]:
    model_dir = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    with serve_process(model_dir, tmp_path_factory.mktemp("serve"), SPECSERVE_SPEC_METHOD="ngram") as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60), model_dir.name


def _validate(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_named_tool_choice_calls_it_with_valid_arguments_greedy_and_sampled(serve):
    client, model = serve
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        c = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, **kw
        ).choices[0]
        assert c.message.content is None and len(c.message.tool_calls) == 1
        assert c.message.tool_calls[0].function.name == "get_weather"
        assert c.finish_reason == "tool_calls"
        _validate(c.message.tool_calls)


def test_required_calls_validate_and_streamed_deltas_put_together_equal_the_whole(serve):
    client, model = serve
    whole = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0
    ).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    _validate(whole.message.tool_calls)
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": None, "arguments": "", "id": None})
            if d.id:
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]


def test_parallel_calls_off_gives_one_call(serve):
    client, model = serve
    c = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=1.0,
        seed=5,
    ).choices[0]
    assert len(c.message.tool_calls) == 1
    _validate(c.message.tool_calls)


def test_tools_are_rendered_by_the_template_and_a_tool_conversation_continues(serve):
    client, model = serve
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, temperature=0)
    with_tools = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2, temperature=0
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' JSON is in the prompt
    assert with_tools.choices[0].message.tool_calls is None
    convo = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"},
    ]
    after = client.chat.completions.create(
        model=model, messages=convo, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert after.usage.prompt_tokens > with_tools.usage.prompt_tokens
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_speculation_on_equals_off_for_a_forced_call(serve):
    client, model = serve
    choice = {"type": "function", "function": {"name": "get_time"}}
    args = set()
    for spec in ("off", 4, "auto"):
        c = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
            extra_body={"speculation": spec},
        )
        args.add(c.choices[0].message.tool_calls[0].function.arguments)
    assert len(args) == 1


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(serve, kw, param):
    client, model = serve
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body
