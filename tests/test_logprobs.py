"""Token logprobs: the target's log_softmax at each generated token, equal to HF transformers' on
the same tokens (fp32), the same with speculation on and off (n-gram, a draft model; greedy and sampled), cut
with the tokens a stop string cuts, and refused out of range naming the field."""

from __future__ import annotations

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS
from test_speculative import spec_configs

from specserve import LLM, SamplingParams
from specserve.engine.errors import InvalidParameter
from specserve.models.loader import load_tokenizer

TOP = 5
# fp32 logits of one position differ in the last bits between a one-row decode and a batched verify forward
# (other shapes, other summation order): far below anything a logprob is used for.
ATOL = 2e-4


def _params(**kw) -> SamplingParams:
    base = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "logprobs": TOP}
    return SamplingParams(**{**base, **kw})


def _hf_logprobs(model_dir, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.float().log_softmax(-1)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama_gqa_tied")


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(str(model_dir), dtype="float32").generate(PROMPTS, _params())


def test_logprobs_equal_hf_log_softmax_on_the_same_tokens(model_dir, plain):
    tokenizer = load_tokenizer(model_dir)
    for prompt, out in zip(PROMPTS, plain):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        ref = _hf_logprobs(model_dir, tokenizer.encode(prompt), out.token_ids)
        chosen = torch.tensor([lp.logprob for lp in out.logprobs])
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(chosen, want, atol=ATOL, rtol=0)
        want_top, want_ids = ref.topk(TOP, dim=-1)
        for pos, lp in enumerate(out.logprobs):
            assert len(lp.top) == TOP
            got_ids = [t for t, _ in lp.top]
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), want_top[pos], atol=ATOL, rtol=0)
            assert got_ids == want_ids[pos].tolist() or torch.allclose(  # ties may order either way
                want_top[pos], ref[pos][got_ids], atol=ATOL
            )
            assert got_ids[0] == out.token_ids[pos]  # greedy: the chosen token is the most likely one


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_speculation_does_not_change_logprobs(method, model_dir, tiny_model_factory, plain):
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec_configs(tiny_model_factory)[method])
    outs = llm.generate(PROMPTS, _params(speculation=4))
    if method == "draft_other":  # a different random model: rejections and resampled tokens
        assert sum(o.usage.draft_proposed for o in outs) > 0
    else:  # tokens came from accepted drafts
        assert sum(o.usage.draft_accepted for o in outs) > 0
    for got, want in zip(outs, plain):
        assert got.token_ids == want.token_ids
        _assert_same_logprobs(got.logprobs, want.logprobs)


def test_sampled_logprobs_with_speculation_are_the_targets(model_dir, tiny_model_factory):
    """Seeded sampling draws other tokens with speculation (rejection sampling uses the randomness
    differently), so each run is held to HF on its own tokens, before temperature and top-p."""
    tokenizer = load_tokenizer(model_dir)
    params = _params(temperature=0.8, top_p=0.9, seed=3)
    spec = spec_configs(tiny_model_factory)["draft_other"]
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec)
    for prompt, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], params)):
        ref = _hf_logprobs(model_dir, tokenizer.encode(prompt), out.token_ids)
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), want, atol=ATOL, rtol=0)


def test_a_stop_string_cuts_the_logprobs_with_its_tokens(model_dir, plain):
    text = plain[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = LLM(str(model_dir), dtype="float32").generate(PROMPTS[:1], _params(stop=[stop]))[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < len(plain[0].token_ids)
    _assert_same_logprobs(out.logprobs, plain[0].logprobs[: len(out.token_ids)])


def test_zero_gives_the_chosen_tokens_only_and_none_gives_nothing(model_dir):
    llm = LLM(str(model_dir), dtype="float32")
    zero, none = llm.generate(PROMPTS[:2], [_params(logprobs=0), _params(logprobs=None)])
    assert len(zero.logprobs) == len(zero.token_ids) and all(lp.top == () for lp in zero.logprobs)
    assert none.logprobs is None


@pytest.mark.parametrize("bad", [-1, 2.5, True, "5"])
def test_out_of_range_is_refused_naming_the_field(bad):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(logprobs=bad)
    assert e.value.field == "logprobs"


def test_more_than_max_logprobs_is_refused_naming_the_field():
    SamplingParams(logprobs=20).check_logprobs(20)
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(logprobs=21).check_logprobs(20)
    assert e.value.field == "logprobs"


def _assert_same_logprobs(got, want) -> None:
    assert got is not None and want is not None and len(got) == len(want)
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in got]), torch.tensor([lp.logprob for lp in want]), atol=ATOL, rtol=0
    )
    for a, b in zip(got, want):
        assert [t for t, _ in a.top][:1] == [t for t, _ in b.top][:1]
        torch.testing.assert_close(
            torch.tensor([v for _, v in a.top]), torch.tensor([v for _, v in b.top]), atol=ATOL, rtol=0
        )


def test_prompt_logprobs_equal_hf_across_chunks_a_warm_cache_and_speculation(model_dir, tiny_model_factory):
    """vLLM's prompt_logprobs: position 0 has none, position i the prompt token's logprob given tokens
    before it, with its rank and the top-k; a prompt over the 256-token chunk is computed in pieces, and a
    prompt already in the prefix cache is computed again rather than read from it."""
    tokenizer = load_tokenizer(model_dir)
    long_prompt = " ".join(PROMPTS) * 12
    ids = tokenizer.encode(long_prompt)[:600]
    ref = _hf_logprobs(model_dir, ids[:1], ids[1:])  # rows predict ids[1:]
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    want_rank = (ref > want[:, None]).sum(-1) + 1
    spec = spec_configs(tiny_model_factory)["ngram"]
    engines = (
        LLM(str(model_dir), dtype="float32"),
        LLM(str(model_dir), dtype="float32", speculative_config=spec),
    )
    for llm in engines:
        for _ in range(2):  # the second run finds the prompt in the prefix cache, and must not use it
            out = llm.generate([ids], _params(max_tokens=4, logprobs=None, prompt_logprobs=3))[0]
            got = out.prompt_logprobs
            assert got is not None and len(got) == len(ids) and got[0] is None
            got_lp = torch.tensor([g.logprob for g in got[1:]])
            torch.testing.assert_close(got_lp, want, atol=ATOL, rtol=0)
            # a rank counts the tokens more likely: random tiny-model logits tie within fp32 noise at times
            rank_diff = (torch.tensor([g.rank for g in got[1:]]) - want_rank).abs()
            assert int(rank_diff.max()) <= 2 and int((rank_diff > 0).sum()) <= len(ids) // 50
            assert all(len(g.top) == 3 for g in got[1:])
            assert out.usage.cached_tokens == 0
    plain = LLM(str(model_dir), dtype="float32").generate([ids], _params(max_tokens=4))[0]
    assert plain.prompt_logprobs is None
