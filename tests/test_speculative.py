"""Speculative decoding is lossless: greedy outputs equal HF and the non-speculative engine, sampled
outputs follow the target's exact distribution, and rejected tokens' KV blocks are all given back."""

from __future__ import annotations

import math
import uuid
from collections import Counter

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS, build_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams
from specserve.spec import verifier as verifier_module

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def spec_configs(factory):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "draft_self": {
            "method": "draft_model",
            "model": str(factory("llama_gqa_tied")),
            "num_speculative_tokens": 4,
        },
        "draft_other": {
            "method": "draft_model",
            "model": str(factory("mistral")),
            "num_speculative_tokens": 3,
        },
    }


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_greedy_speculation_matches_hf(method, tiny_model_factory, hf_reference):
    llm = LLM(
        str(tiny_model_factory("llama_gqa_tied")),
        dtype="float32",
        speculative_config=spec_configs(tiny_model_factory)[method],
    )
    outs = llm.generate(PROMPTS, [SamplingParams(**{**GREEDY.__dict__, "speculation": 4})] * len(PROMPTS))
    assert [o.token_ids for o in outs] == hf_reference("llama_gqa_tied")
    proposed = sum(o.usage.draft_proposed for o in outs)
    accepted = sum(o.usage.draft_accepted for o in outs)
    assert proposed > 0
    if method == "draft_self":
        assert accepted == proposed  # the target drafting for itself is always right
        # k + 1 = 5 tokens per verify step: the first token comes from prefill, then ceil(23 / 5) steps
        assert all(o.usage.draft_proposed <= 4 * math.ceil((MAX_TOKENS - 1) / 5) for o in outs)
    if method == "draft_other":
        assert accepted < proposed  # a different random model is mostly wrong, and the output is still exact
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_mixed_batch_with_chunked_prefill_and_preemption(tiny_model_factory, hf_reference):
    """Some requests speculate, some do not, some let the engine decide; small chunks and a tiny pool."""
    llm = LLM(
        str(tiny_model_factory("llama_gqa_tied")),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=12,
        speculative_config=spec_configs(tiny_model_factory)["draft_self"],
    )
    modes = ["off", 3, "auto", 1]
    params = [SamplingParams(**{**GREEDY.__dict__, "speculation": m}) for m in modes]
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == hf_reference("llama_gqa_tied")
    assert outs[0].usage.draft_proposed == 0 and outs[1].usage.draft_proposed > 0
    assert llm.engine.scheduler.num_preemptions > 0
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.spec.proposer.block_manager.num_free_blocks == engine.spec.proposer.block_manager.num_blocks


@pytest.fixture(scope="module")
def rollback_llm(tiny_model_factory):
    """A mostly-wrong draft (so accepts and rejects mix) and a pool small enough to force preemptions."""
    return LLM(
        str(tiny_model_factory("llama_gqa_tied")),
        dtype="float32",
        block_size=4,
        num_kv_blocks=20,
        speculative_config=spec_configs(tiny_model_factory)["draft_other"],
    )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ks=st.lists(st.sampled_from(["off", "auto", 1, 2, 3]), min_size=4, max_size=4),
    max_tokens=st.lists(st.integers(1, 30), min_size=4, max_size=4),
    temperature=st.sampled_from([0.0, 0.8]),
)
def test_rollback_returns_every_block(ks, max_tokens, temperature, rollback_llm):
    """After every step each sequence holds at least the blocks of its computed tokens (accepted K/V kept)
    and none past its tokens (rejected drafts' blocks are back in the pool); at the end every block of both
    caches is free."""
    engine = rollback_llm.engine
    bm, draft_bm = engine.block_manager, engine.spec.proposer.block_manager
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            max_tokens=max_tokens[i], temperature=temperature, seed=i, ignore_eos=True, speculation=ks[i]
        )
        engine.add_request(f"{uuid.uuid4()}", prompt, params)
    while engine.has_unfinished():
        engine.step()
        bm.check_invariants()
        draft_bm.check_invariants()
        for seq in engine.scheduler.running:
            held = len(bm.block_table(seq.seq_id))
            assert -(-seq.num_computed_tokens // 4) <= held <= -(-seq.num_tokens // 4)
    assert bm.num_free_blocks == bm.num_blocks
    assert draft_bm.num_free_blocks == draft_bm.num_blocks


# ---- the output distribution ---------------------------------------------------------------------------

VOCAB = 4
PROMPT = [1, 3, 0, 2]
N_SAMPLES = 3000


@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory, demo_tokenizer):
    target = build_tiny_model("llama_gqa_tied", demo_tokenizer, tmp_path_factory.mktemp("t4"), 1, VOCAB)
    draft = build_tiny_model("mistral", demo_tokenizer, tmp_path_factory.mktemp("d4"), 2, VOCAB)
    return target, draft


def exact_joint(model_dir, temperature, top_k, top_p) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) of the target with the request's processing, from HF logits (independent of our code)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def dist(prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1] / temperature
        probs = logits.softmax(-1)
        order = probs.argsort(descending=True).tolist()
        if top_k:  # top-k first, then the nucleus of what is left, renormalised (HF's and vLLM's order)
            probs[order[top_k:]] = 0
            probs = probs / probs.sum()
        keep, mass = [], 0.0
        for tok in order:
            if mass >= top_p or probs[tok] == 0:
                break
            keep.append(tok)
            mass += float(probs[tok])
        kept = torch.zeros_like(probs)
        kept[keep] = probs[keep]
        return (kept / kept.sum()).tolist()

    joint = {}
    p1 = dist(())
    for a in range(VOCAB):
        p2 = dist((a,))
        for b in range(VOCAB):
            p3 = dist((a, b))
            for c in range(VOCAB):
                joint[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return joint


def chi_square_exceeds(counts: Counter, joint: dict, n: int) -> tuple[float, float]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled), and its 1e-4 quantile."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for cell, p in joint.items():
        exp, obs = p * n, counts.get(cell, 0)
        if exp >= 5:
            stat += (obs - exp) ** 2 / exp
            cells += 1
        else:
            pooled_obs += obs
            pooled_exp += exp
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    df = cells - 1
    z = 3.719  # one-sided 1e-4 normal quantile; Wilson-Hilferty for the chi-square quantile
    quantile = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, quantile


def trust_the_drafts(monkeypatch) -> None:
    """Break the verifier: every proposed token counts as the target's own at its position."""
    honest = verifier_module.target_tokens

    def trusting(batch):
        tokens = honest(batch)
        k = batch.draft_tokens.shape[1]
        proposed = torch.arange(k)[None, :] < batch.num_drafts[:, None]
        tokens[:, :k] = torch.where(proposed, batch.draft_tokens, tokens[:, :k])
        return tokens

    monkeypatch.setattr(verifier_module, "target_tokens", trusting)


def sample_triples(llm, temperature, top_k, top_p) -> Counter:
    params = [
        SamplingParams(
            max_tokens=3,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=s,
            ignore_eos=True,
            speculation=2,
        )
        for s in range(N_SAMPLES)
    ]
    outs = llm.generate([PROMPT] * N_SAMPLES, params)
    assert sum(o.usage.draft_proposed for o in outs) > 0  # tokens 2 and 3 really went through verification
    return Counter(tuple(o.token_ids) for o in outs)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 3, 0.8)])
def test_sampled_speculation_keeps_the_target_distribution(
    tiny_vocab_models, temperature, top_k, top_p, monkeypatch
):
    target, draft = tiny_vocab_models
    joint = exact_joint(target, temperature, top_k, top_p)
    llm = LLM(
        str(target),
        dtype="float32",
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
    )
    stat, limit = chi_square_exceeds(sample_triples(llm, temperature, top_k, top_p), joint, N_SAMPLES)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f}: speculation changed the distribution"

    # The same test catches a verifier that takes the draft's word (the output is then the draft's).
    trust_the_drafts(monkeypatch)
    stat, limit = chi_square_exceeds(sample_triples(llm, temperature, top_k, top_p), joint, N_SAMPLES)
    assert stat > limit, f"a broken verifier passed: chi-square {stat:.1f} < {limit:.1f}"


def _probe_steps(max_backoff: int, monkeypatch) -> list[int]:
    """Steps at which "auto" speculates for one decoding request whose drafts are never accepted."""
    from specserve.engine.sequence import Sequence
    from specserve.spec import decoder
    from specserve.spec.ngram import NgramProposer

    class SizedNgram(NgramProposer):  # sized up front by the request's acceptance, as a draft model is
        priced_drafts = False

    monkeypatch.setattr(decoder, "MAX_BACKOFF", max_backoff)
    spec = decoder.SpeculativeDecoder(SizedNgram(), num_speculative_tokens=4, max_model_len=100_000)
    # A memory-bound target (a step costs about the same for 1 or 9 tokens) and a cheap proposer: the
    # policy would speculate at any fair acceptance, so only the measured acceptance holds it back.
    for _ in range(4):
        for n in (1, 2, 5, 9):
            spec.policy.target.observe(n, 0.010 + 0.0002 * n)
    spec.policy.draft_step_seconds.observe(1, 0.0002)
    params = SamplingParams(max_tokens=100_000, speculation="auto")
    seq = Sequence(0, "r", [1, 2, 3], params, detokenizer=None, arrival_time=0.0)
    seq.num_computed_tokens = seq.num_tokens - 1
    probes = []
    for step in range(4000):
        k = spec.lookahead([seq]).get(seq.seq_id, 0)
        if k:
            probes.append(step)
        spec.observe(seq, k, 0)  # as spec.update does after each decode step; k = 0 relaxes the estimate
    return probes


def test_auto_retries_a_useless_proposer_ever_more_rarely(monkeypatch) -> None:
    constant = _probe_steps(0, monkeypatch)  # no backoff: a retry every few dozen steps, forever
    probes = _probe_steps(6, monkeypatch)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(constant) > 50
    assert len(probes) < len(constant) / 4
    assert gaps[-1] >= 16 * gaps[0]  # each fruitless retry waits about twice as long as the one before
