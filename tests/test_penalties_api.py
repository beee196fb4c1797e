"""Penalties through the OpenAI routes of a real `specserve serve` with n-gram speculation on: the answer is
the engine's own (no speculation) for the same adjustments, and OpenAI's string-keyed logit_bias bans a
token."""

from __future__ import annotations

from test_logprobs_api import PROMPT, serve  # noqa: F401  (the module's `specserve serve` fixture)

from specserve import LLM, SamplingParams

ADJUSTED = {"presence_penalty": 0.6, "frequency_penalty": 0.3, "logit_bias": {"198": -100}}
EXTRA = {"repetition_penalty": 1.2, "min_tokens": 4, "ignore_eos": True}


def test_penalised_completions_equal_the_engines(serve, tiny_model_dir):  # noqa: F811
    client, model, _ = serve
    got = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=EXTRA, **ADJUSTED
    ).choices[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, **ADJUSTED, **EXTRA)
    want = LLM(str(tiny_model_dir), dtype="float32").generate([PROMPT], params)[0]
    assert got.text == want.text and "\n" not in got.text  # 198 is the newline token: banned
