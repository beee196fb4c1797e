"""Penalties and biases: presence, frequency and repetition penalties, logit_bias,
min_tokens and min_p. Greedy outputs equal HF transformers' generate with the same adjustments as logits
processors (fp32, token for token), with speculation on and off: inside a speculative step each verify
position counts the drafts accepted before it. Bad values are refused naming the field."""

from __future__ import annotations

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS
from test_speculative import spec_configs
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from specserve import LLM, SamplingParams
from specserve.engine.errors import InvalidParameter
from specserve.engine.sampler import RowParams, probabilities
from specserve.models.loader import load_tokenizer

ADJUSTED = {
    "presence_penalty": 0.7,
    "frequency_penalty": 0.4,
    "repetition_penalty": 1.3,
    "logit_bias": {"11": 3.0, "198": -100.0, "29": 1.5},  # as OpenAI's JSON sends them: ids as strings
}


class _Openai(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens, or a logit bias."""

    def __init__(self, prompt_len: int, frequency: float = 0.0, presence: float = 0.0, bias=None) -> None:
        self.prompt_len, self.frequency, self.presence, self.bias = prompt_len, frequency, presence, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        if self.bias:
            for token, value in self.bias.items():
                scores[:, int(token)] += value
        out = input_ids[:, self.prompt_len :]
        for b in range(scores.shape[0]):
            counts = torch.bincount(out[b], minlength=scores.shape[1])[: scores.shape[1]].float()
            scores[b] -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores


def _hf(model_dir, prompt_ids: list[int], processors, **kw) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt_ids])
    out = hf.generate(
        ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, logits_processor=processors, **kw
    )
    return out[0, ids.shape[1] :].tolist()


def _vllm_order(prompt_len: int, adjusted: dict = ADJUSTED) -> LogitsProcessorList:
    """Bias first, then repetition over prompt and output, then frequency and presence (vLLM's order)."""
    return LogitsProcessorList(
        [
            _Openai(prompt_len, bias=adjusted["logit_bias"]),
            RepetitionPenaltyLogitsProcessor(adjusted["repetition_penalty"]),
            _Openai(prompt_len, adjusted["frequency_penalty"], adjusted["presence_penalty"]),
        ]
    )


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama_gqa_tied")


@pytest.fixture(scope="module")
def hf_adjusted(model_dir):
    tokenizer = load_tokenizer(model_dir)
    refs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        refs.append(_hf(model_dir, ids, _vllm_order(len(ids))))
    return refs


def test_penalties_and_bias_equal_hf(model_dir, hf_adjusted):
    outs = LLM(str(model_dir), dtype="float32").generate(PROMPTS, _greedy(**ADJUSTED))
    assert [o.token_ids for o in outs] == hf_adjusted
    plain = LLM(str(model_dir), dtype="float32").generate(PROMPTS, _greedy())
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]  # they did change something
    assert all(198 not in o.token_ids for o in outs)  # a -100 bias bans a token


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_speculation_keeps_penalized_greedy_outputs(method, model_dir, tiny_model_factory, hf_adjusted):
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec_configs(tiny_model_factory)[method])
    outs = llm.generate(PROMPTS, _greedy(speculation=4, **ADJUSTED))
    assert [o.token_ids for o in outs] == hf_adjusted
    if method != "ngram":  # penalised text rarely repeats itself, so n-gram lookup may find nothing to draft
        assert sum(o.usage.draft_proposed for o in outs) > 0
    if method == "draft_self":  # the draft knows no penalties, so some of its tokens are rejected
        assert sum(o.usage.draft_accepted for o in outs) > 0


def test_ngram_drafts_under_mild_penalties_are_verified_with_their_counts(model_dir, tiny_model_factory):
    """Mild penalties leave repetition for n-gram lookup to draft from: accepted drafts count toward the
    penalties of the positions after them, and the output is HF's."""
    mild = {"presence_penalty": 0.1, "frequency_penalty": 0.05, "repetition_penalty": 1.02}
    mild["logit_bias"] = {"11": 1.0}
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec_configs(tiny_model_factory)["ngram"])
    outs = llm.generate(PROMPTS, _greedy(speculation=4, **mild))
    assert sum(o.usage.draft_accepted for o in outs) > 0
    tokenizer = load_tokenizer(model_dir)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        assert out.token_ids == _hf(model_dir, ids, _vllm_order(len(ids), mild))


def test_min_tokens_holds_off_stop_tokens_and_stop_strings(model_dir):
    tokenizer = load_tokenizer(model_dir)
    llm = LLM(str(model_dir), dtype="float32")
    plain = llm.generate(PROMPTS[:1], _greedy())[0]
    stop_token = plain.token_ids[1]  # the greedy output would stop at its second token
    ids = tokenizer.encode(PROMPTS[0])
    want = _hf(
        model_dir,
        ids,
        LogitsProcessorList([MinNewTokensLengthLogitsProcessor(len(ids), 6, [stop_token])]),
        eos_token_id=[stop_token],
    )
    got = llm.generate(PROMPTS[:1], _greedy(stop_token_ids=[stop_token], min_tokens=6))[0]
    assert got.token_ids == want and len(got.token_ids) > 6
    early = llm.generate(PROMPTS[:1], _greedy(stop_token_ids=[stop_token]))[0]
    assert len(early.token_ids) == 2 and early.finish_reason == "stop"
    # a stop string is not looked for before min_tokens either
    stop = plain.text[: max(1, len(plain.text) // 8)]
    held = llm.generate(PROMPTS[:1], _greedy(stop=[stop], min_tokens=MAX_TOKENS))[0]
    assert held.finish_reason == "length" and len(held.token_ids) == MAX_TOKENS


def test_min_p_drops_tokens_below_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, min_p=0.4)
    probs = probabilities(logits, RowParams.build([params], [0], 4))
    assert probs[0, 2:].tolist() == [0.0, 0.0]  # 0.15 and 0.05 < 0.4 * 0.5
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))


def test_sampled_penalized_requests_run_with_speculation(model_dir, tiny_model_factory):
    """Sampled rows go through rejection sampling on the adjusted distribution: seeded runs repeat."""
    spec = spec_configs(tiny_model_factory)["draft_other"]
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec)
    params = _greedy(temperature=0.9, seed=11, min_p=0.05, speculation=3, **ADJUSTED)
    a = llm.generate(PROMPTS, params)
    b = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(198 not in o.token_ids for o in a)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("logit_bias", {"11": 101}),
        ("logit_bias", {"eleven": 1.0}),
        ("logit_bias", [1, 2]),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_bad_words_are_never_generated_and_match_hf(model_dir, tiny_model_factory):
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    tokenizer = load_tokenizer(model_dir)
    llm = LLM(str(model_dir), dtype="float32")
    plain = llm.generate(PROMPTS, _greedy())
    # one word the greedy output would produce mid-way, another of several tokens from another prompt
    words = [tokenizer.decode(plain[0].token_ids[3:4]), tokenizer.decode(plain[1].token_ids[5:8])]
    words = [w for w in words if w.strip()]
    ids = llm.engine.bad_words_ids(words)
    assert any(len(w) > 1 for w in ids)
    spec = spec_configs(tiny_model_factory)["draft_self"]
    for engine in (llm, LLM(str(model_dir), dtype="float32", speculative_config=spec)):
        outs = engine.generate(PROMPTS, _greedy(bad_words=words, speculation=4))
        for prompt, out in zip(PROMPTS, outs):
            prompt_ids = tokenizer.encode(prompt)
            no_bad = LogitsProcessorList([NoBadWordsLogitsProcessor(ids, eos_token_id=None)])
            assert out.token_ids == _hf(model_dir, prompt_ids, no_bad)
            for w in ids:
                n = len(w)
                assert all(out.token_ids[k : k + n] != w for k in range(len(out.token_ids) - n + 1))
        assert outs[0].token_ids != plain[0].token_ids
