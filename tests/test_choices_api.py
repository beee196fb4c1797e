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
