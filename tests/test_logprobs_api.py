"""Logprobs end to end: the official openai client against a real `specserve serve` (tiny model,
fp32, n-gram speculation on). Completions' legacy shape and chat's content list, whole and streamed, equal the
engine's own values without speculation; the native status API and the wire carry them; bad values are a
400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import openai
import pytest
from valkey_helpers import run, serve_process, wait_for

from specserve import LLM, SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:"
MESSAGES = [{"role": "user", "content": "Count from one to five."}]
ATOL = 2e-4  # batched verify vs one-row decode in fp32: see tests/test_logprobs.py


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[openai.OpenAI, str, str]]:
    tmp = tmp_path_factory.mktemp("serve-logprobs")
    with serve_process(tiny_model_dir, tmp, SPECSERVE_SPEC_METHOD="ngram") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        yield client, tiny_model_dir.name, base


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The engine without speculation, in this process: the values the service must give back."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    return LLM(str(tiny_model_dir), dtype="float32").generate([PROMPT], params)[0]


def _completion(client, model, **kw):
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3, extra_body=extra, **kw
    )


def test_completions_logprobs_equal_the_engines_with_speculation_on(serve, reference):
    client, model, _ = serve
    choice = _completion(client, model).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(reference.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for got, want, top, want_lp in zip(
        lp.token_logprobs, reference.logprobs, lp.top_logprobs, reference.logprobs
    ):
        assert got == pytest.approx(want.logprob, abs=ATOL)
        assert 3 <= len(top) <= 4  # the top 3, and the chosen token if it is not among them
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([v for _, v in want_lp.top], abs=ATOL)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # vLLM's return_tokens_as_token_ids names each token by its id
    as_ids = _completion(client, model, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert as_ids.logprobs.tokens == [f"token_id:{t}" for t in reference.token_ids]


def test_streamed_completion_logprobs_equal_the_whole_answer(serve):
    client, model, _ = serve
    whole = _completion(client, model).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in _completion(client, model, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            lp = chunk.choices[0].logprobs
            tokens += lp.tokens
            values += lp.token_logprobs
            offsets += lp.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values == pytest.approx(whole.token_logprobs, abs=ATOL)


def test_chat_logprobs_whole_and_streamed(serve):
    client, model, _ = serve
    kw = {"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True}
    kw["top_logprobs"] = 2
    whole = client.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    content = whole.logprobs.content
    assert len(content) == 12
    for item in content:
        assert item.bytes == list(item.token.encode()) and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=ATOL)  # greedy: the best
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=ATOL)
    # logprobs: true alone gives each chosen token's, with no alternatives
    bare = client.chat.completions.create(**{**kw, "top_logprobs": None}, extra_body={"ignore_eos": True})
    assert all(item.top_logprobs == [] for item in bare.choices[0].logprobs.content)
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_the_native_api_and_the_wire_carry_them(serve):
    _, _, base = serve

    async def main():
        async with aiohttp.ClientSession() as http:
            body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "ignore_eos": True}
            async with http.post(f"{base}/v1/requests", json=body) as r:
                rid = (await r.json())["id"]
            got: dict = {}

            async def finished() -> bool:
                async with http.get(f"{base}/v1/requests/{rid}") as r:
                    got.update(await r.json())
                return got["status"] not in ("queued", "running")

            await wait_for(finished, timeout=60, what="finished")
            return got

    result = run(main())
    assert result["status"] == "finished" and len(result["logprobs"]) == len(result["token_ids"]) == 6
    for entry in result["logprobs"]:
        assert isinstance(entry["token"], str) and entry["logprob"] <= 0
        assert [set(x) for x in entry["top_logprobs"]] == [{"id", "token", "logprob"}] * 2


@pytest.mark.parametrize(
    ("route", "extra", "field"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("chat", {"logprobs": "yes"}, "logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 25}, "top_logprobs"),
        ("completions", {"return_tokens_as_token_ids": "no"}, "return_tokens_as_token_ids"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(serve, route, extra, field):
    client, model, _ = serve
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == field


def test_prompt_logprobs_in_vllms_shape_whole_and_streamed(serve, tiny_model_dir):
    client, model, _ = serve
    from specserve.models.loader import load_tokenizer

    ids = load_tokenizer(tiny_model_dir).encode(PROMPT)
    extra = {"prompt_logprobs": 2, "ignore_eos": True}
    whole = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=extra
    )
    prompt = whole.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    want = LLM(str(tiny_model_dir), dtype="float32").generate(
        [PROMPT], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    )[0]
    for pos, (entry, ref) in enumerate(zip(prompt[1:], want.prompt_logprobs[1:]), start=1):
        assert str(ids[pos]) in entry  # the prompt token itself, with its rank
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(ref.logprob, abs=ATOL)
        assert entry[str(ids[pos])]["rank"] == ref.rank
        assert 2 <= len(entry) <= 3 and {v["rank"] for v in entry.values()} >= {1, 2}
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=extra, stream=True
    )
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream if c.choices]
    assert [p for p in streamed if p is not None] == [prompt]  # once, with the first tokens
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, temperature=0, extra_body=extra
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 99}
        )
    assert e.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("completions", {"n": 6, "logprobs": 20}),
        ("completions", {"n": 11, "logprobs": 1, "prompt_logprobs": 10}),
        ("chat", {"n": 16, "logprobs": True, "top_logprobs": 20}),
    ],
)
def test_n_times_logprobs_over_the_ceiling_is_a_400_naming_n(serve, route, extra):
    """n choices of k logprobs cost n x k a token (max_total_logprobs, 100 by default); over it nothing
    asks and the answer names n, while the ceiling itself is served."""
    client, model, _ = serve

    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == "n" and "max_total_logprobs" in e.value.body["message"]
    at_ceiling = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, n=5, logprobs=20, extra_body={"prompt_logprobs": 20}
    )
    assert len(at_ceiling.choices) == 5
    assert all(len(c.logprobs.top_logprobs[0]) >= 20 for c in at_ceiling.choices)
