"""Chat templates come from the model, and `chat_template_kwargs` (vLLM's extra field) reaches them: through
the engine, the wire format and the OpenAI chat route. A template's own refusal is a 400 naming `messages`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from valkey_helpers import api_stack, run

from specserve import LLM, SamplingParams
from specserve.engine.config import EngineConfig
from specserve.engine.errors import InvalidParameter
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


@pytest.fixture(scope="module")
def templateless_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with no chat template anywhere (a base model's checkpoint)."""
    path = tmp_path_factory.mktemp("templateless")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = path / "tokenizer_config.json"
    config.write_text(
        json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"})
    )
    assert load_tokenizer(path).chat_template is None
    return path


def test_a_model_without_a_template_is_refused_for_chat_and_serves_prompts(templateless_model):
    llm = LLM(str(templateless_model), dtype="float32")
    with pytest.raises(InvalidParameter) as e:
        llm.engine.encode_chat(CHAT)
    assert e.value.field == "chat_template" and "--chat-template" in e.value.message
    assert len(llm.generate("Once upon", SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids) == 3


def test_chat_template_as_a_string_or_a_file(templateless_model, thinking_llm, tiny_model_dir, tmp_path):
    want = thinking_llm.engine.encode_chat(CHAT)
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(THINKING_TEMPLATE)
    for given in (THINKING_TEMPLATE, str(template_file)):
        llm = LLM(str(templateless_model), dtype="float32", chat_template=given)
        assert llm.engine.encode_chat(CHAT) == want
    # and it replaces a model's own (the tiny model carries SmolLM2's)
    own = LLM(str(tiny_model_dir), dtype="float32").engine.encode_chat(CHAT)
    replaced = LLM(str(tiny_model_dir), dtype="float32", chat_template=str(template_file))
    assert replaced.engine.encode_chat(CHAT) == want != own


@pytest.mark.parametrize("given", ["no/such/template.jinja", "", 3])
def test_a_chat_template_that_is_neither_is_refused_before_the_load(given):
    with pytest.raises(ValueError, match="chat_template"):
        EngineConfig(model="never/loaded", chat_template=given)


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


def test_chat_on_a_model_without_a_template_is_a_400_naming_it(valkey, templateless_model):
    model = str(templateless_model)

    async def main():
        async with api_stack(valkey.url, templateless_model) as (base, _w, _q):
            async with aiohttp.ClientSession() as http:
                r = await http.post(
                    f"{base}/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 2}
                )
                assert r.status == 400, await r.text()
                error = (await r.json())["error"]
                assert error["param"] == "chat_template" and "--chat-template" in error["message"]
                r = await http.post(
                    f"{base}/v1/completions", json={"model": model, "prompt": "Once", "max_tokens": 2}
                )
                assert r.status == 200, await r.text()
                models = (await (await http.get(f"{base}/v1/models")).json())["data"]
                assert [m["has_chat_template"] for m in models if m["id"] == model] == [False]

    run(main())


def test_v1_models_says_a_model_has_a_template(valkey, thinking_model):
    async def main():
        async with api_stack(valkey.url, thinking_model) as (base, _w, _q):
            async with aiohttp.ClientSession() as http:
                models = (await (await http.get(f"{base}/v1/models")).json())["data"]
                assert [m["has_chat_template"] for m in models if m["id"] == str(thinking_model)] == [True]

    run(main())


def test_specserve_models_describes_a_models_template(templateless_model, thinking_model):
    for path, says in ((templateless_model, "chat template: none"), (thinking_model, "chat template: yes")):
        out = subprocess.run(
            [sys.executable, "-m", "specserve.service.cli", "models", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        assert says in out.stdout and "context: 2048 tokens" in out.stdout
