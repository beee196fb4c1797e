"""Seeded sampling repeats: the same seeded choices (seeds 7, 8, 9, as n = 3 with seed 7 fans out) give the
same tokens alone and beside random traffic, with speculation off, n-gram at any k, "auto", a draft model,
chunked prefill, streamed or whole; each token is a function of (seed, position) only (engine/sampler.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import build_tiny_model

from specserve import LLM, SamplingParams
from specserve.engine.async_engine import AsyncLLMEngine

SEEDS = (7, 8, 9)
MAX_TOKENS = 32
# Eight tokens: a sampled output's n-grams recur, so the n-gram proposer finds drafts and verification takes
# some (over a whole vocabulary a random model's samples almost never repeat).
VOCAB = 8
PROMPT = [1, 3, 0, 2, 5, 1, 3, 0, 2, 5, 1, 3]


def _params(seed: int | None, speculation: str | int = "off", **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.7, seed=seed, ignore_eos=True, speculation=speculation, **kw
    )


def _mates(rng: random.Random, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Random batch mates: other prompts, greedy and sampled, seeded and not, their own speculation."""
    prompts, params = [], []
    for _ in range(count):
        prompts.append(rng.choices(range(VOCAB), k=rng.randint(2, 80)))
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 60),
                temperature=rng.choice([0.0, 0.5, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.choice([None, rng.randint(0, 1000)]),
                ignore_eos=True,
                speculation=rng.choice(["off", "auto", 1, 4, 8]),
            )
        )
    return prompts, params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_tokenizer):
    return build_tiny_model("llama_gqa_tied", demo_tokenizer, tmp_path_factory.mktemp("v8"), 3, VOCAB)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[list[int]]:
    """The seeded choices alone on an engine without speculation."""
    llm = LLM(str(model_dir), dtype="float32")
    return [o.token_ids for o in llm.generate([PROMPT] * 3, [_params(s) for s in SEEDS])]


@pytest.fixture(scope="module")
def ngram_llm(model_dir) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_num_batched_tokens=40,  # long mates' prompts come in chunks beside the choices' decodes
        enable_prefix_caching=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1},
    )


@pytest.mark.parametrize("speculation", ["off", 1, 3, 8, "auto", "ngram"])
@pytest.mark.parametrize("num_mates", [0, 9])
def test_seeded_choices_repeat_beside_any_traffic(ngram_llm, reference, speculation, num_mates) -> None:
    prompts, params = _mates(random.Random(f"{speculation}-{num_mates}"), num_mates)
    # the choices among the mates, not first: they join steps whose shapes the mates decide
    at = len(prompts) // 2
    prompts[at:at] = [PROMPT] * 3
    params[at:at] = [_params(s, speculation) for s in SEEDS]
    outs = ngram_llm.generate(prompts, params)[at : at + 3]
    assert [o.token_ids for o in outs] == reference
    assert len(set(map(tuple, reference))) == 3  # each choice draws its own tokens


def test_ngram_drafts_are_accepted_and_still_repeat(ngram_llm, reference) -> None:
    """The repeats above are not for want of drafts: at k = 4, some are proposed and taken."""
    outs = ngram_llm.generate([PROMPT] * 3, [_params(s, 4) for s in SEEDS])
    assert [o.token_ids for o in outs] == reference
    assert sum(o.usage.draft_accepted for o in outs) > 0


def test_a_draft_model_drafts_at_the_seeds_uniforms(model_dir, reference) -> None:
    """A draft model that is the target draws the same tokens the target does at each position, so nearly
    every draft is accepted (not min(1, p/q) on average), and the output is the seeds' own."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        speculative_config={
            "method": "draft_model",
            "model": str(model_dir),
            "num_speculative_tokens": 4,
        },
    )
    outs = llm.generate([PROMPT] * 3, [_params(s, 4) for s in SEEDS])
    assert [o.token_ids for o in outs] == reference
    proposed = sum(o.usage.draft_proposed for o in outs)
    assert proposed > 0 and sum(o.usage.draft_accepted for o in outs) >= 0.9 * proposed


def test_streamed_and_whole_through_the_async_engine(ngram_llm, reference) -> None:
    """AsyncLLMEngine, streamed (deltas) and not, beside unseeded sampled requests started in between."""

    async def main() -> list[list[int]]:
        engine = AsyncLLMEngine(ngram_llm.engine)
        await engine.start()
        try:

            async def run(rid: str, prompt: list[int], params: SamplingParams, stream: bool) -> list[int]:
                tokens: list[int] = []
                async for delta in engine.add_request(rid, prompt, params, stream=stream):
                    assert delta.offset == len(tokens)
                    tokens += delta.token_ids
                return tokens

            prompts, params = _mates(random.Random(3), 6)
            mates = [run(f"m{i}", p, q, True) for i, (p, q) in enumerate(zip(prompts, params))]
            choices = [run(f"c{i}", PROMPT, _params(s, "auto"), i != 1) for i, s in enumerate(SEEDS)]
            return (await asyncio.gather(*choices, *mates))[:3]
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == reference


def test_unseeded_requests_repeat_on_an_engine_with_the_same_seed(model_dir) -> None:
    """A request without a seed takes one from the engine's stream (EngineConfig.seed)."""
    runs = []
    for _ in range(2):
        llm = LLM(str(model_dir), dtype="float32")
        runs.append([o.token_ids for o in llm.generate([PROMPT] * 2, _params(None))])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]
