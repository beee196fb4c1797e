"""n > 1 through the OpenAI routes of a real `specserve serve` (tiny model, fp32, n-gram speculation on):
n choices, each indexed, whole and streamed; greedy choices equal the engine's answer, seeded ones repeat
and choice i is the single request with seed + i; usage counts the prompt once; bad n is a 400 naming it."""

from __future__ import annotations

import openai
import pytest
from test_logprobs_api import MESSAGES, PROMPT, serve  # noqa: F401  (the module's `specserve serve` fixture)

from specserve import LLM, SamplingParams

EXTRA = {"ignore_eos": True}


def test_greedy_choices_are_each_the_engines_answer(serve, tiny_model_dir):  # noqa: F811
    client, model, _ = serve
    got = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, n=3, extra_body=EXTRA
    )
    want = LLM(str(tiny_model_dir), dtype="float32").generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [want.text] * 3
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == 3 * 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 36


def test_seeded_choices_repeat_and_choice_i_samples_with_seed_plus_i(serve):  # noqa: F811
    client, model, _ = serve

    def texts(n: int, seed: int) -> list[str]:
        out = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, n=n, seed=seed, extra_body=EXTRA
        )
        assert [c.index for c in out.choices] == list(range(n))
        return [c.message.content for c in out.choices]

    four = texts(4, seed=7)
    assert texts(4, seed=7) == four  # reproducible
    assert len(set(four)) > 1  # each choice draws from a stream of its own
    assert texts(1, seed=9) == [four[2]]  # choice 2 of seed 7 is the request with seed 9


def test_streamed_choices_carry_their_index_and_equal_the_whole_answer(serve):  # noqa: F811
    client, model, _ = serve
    kw = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=1.0, n=3, seed=3, extra_body=EXTRA)
    whole = client.chat.completions.create(**kw)
    texts = {i: "" for i in range(3)}
    finish, usage, roles = {}, None, set()
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert finish == {i: "length" for i in range(3)}
    assert usage.completion_tokens == 30 and usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("n", [0, 17, "2", True])
def test_a_bad_n_is_a_400_naming_it(serve, n):  # noqa: F811
    client, model, _ = serve
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={"n": n})
    assert err.value.body["param"] == "n"


def test_seeded_choices_are_the_engines_and_repeat_beside_other_traffic(serve, tiny_model_dir):  # noqa: F811
    """n = 3 with seed 7, chat and completions, streamed and whole, alone and while other sampled requests
    (unseeded, other prompts, other lengths) run beside them: always choice i of the engine's seed 7 + i."""
    from concurrent.futures import ThreadPoolExecutor

    client, model, _ = serve
    llm = LLM(str(tiny_model_dir), dtype="float32")
    seeded = [SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(3)]
    want_chat = [o.text for o in llm.generate([llm.engine.encode_chat(MESSAGES)] * 3, seeded)]
    want_text = [o.text for o in llm.generate([PROMPT] * 3, seeded)]
    kw = dict(model=model, max_tokens=12, temperature=1.0, n=3, seed=7, extra_body=EXTRA)

    def chat(stream: bool) -> list[str]:
        if not stream:
            return [
                c.message.content for c in client.chat.completions.create(messages=MESSAGES, **kw).choices
            ]
        texts = [""] * 3
        for chunk in client.chat.completions.create(messages=MESSAGES, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        return texts

    def completion(stream: bool) -> list[str]:
        if not stream:
            return [c.text for c in client.completions.create(prompt=PROMPT, **kw).choices]
        texts = [""] * 3
        for chunk in client.completions.create(prompt=PROMPT, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
        return texts

    def mate(i: int) -> None:
        client.completions.create(
            model=model, prompt=f"Other traffic {i}: " * (1 + i % 5), max_tokens=4 + 3 * i, temperature=0.9
        )

    for busy in (False, True):
        with ThreadPoolExecutor(12) as pool:  # every request in flight at once
            mates = [pool.submit(mate, i) for i in range(8)] if busy else []
            runs = [pool.submit(fn, stream) for fn in (chat, completion) for stream in (False, True)]
            got = [r.result() for r in runs]
            for m in mates:
                m.result()
        assert got == [want_chat, want_chat, want_text, want_text]
