"""EAGLE-3 in the engine (spec/eagle3/proposer.py): greedy output equals HF transformers token for token,
sampled output keeps the target's distribution, and each draft equals the head's dense reference forward
(head.py: forward_dense) over the target's own hidden states, which checks the paged head forward, its
catch-up and the rollback of its K/V together. Heads are tiny random ones in speculators' layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS, build_tiny_model
from test_speculative import (
    N_SAMPLES,
    VOCAB,
    chi_square_exceeds,
    exact_joint,
    sample_triples,
    trust_the_drafts,
)

from specserve import LLM, SamplingParams
from specserve.engine.errors import InvalidParameter
from specserve.spec.eagle3.head import Eagle3Config, load_eagle3, random_eagle3, save_eagle3

SHAPE = "llama_8l_hd64"  # 8 layers: the head reads layers (2, 4, 5)
TARGET_HIDDEN = 128
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def head_config(
    target_vocab: int, draft_vocab: int, layer_ids: tuple[int, ...] | None = None
) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        draft_vocab_size=draft_vocab,
        target_vocab_size=target_vocab,
        target_hidden_size=TARGET_HIDDEN,
        target_layer_ids=layer_ids,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def make_head(out: Path, target_vocab: int, draft_vocab: int, seed: int = 0, **kw) -> Path:
    return save_eagle3(random_eagle3(head_config(target_vocab, draft_vocab, **kw), seed), out, "tiny-target")


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, demo_tokenizer) -> Path:
    """A head for the 8-layer target over the SmolLM2 vocabulary, its draft vocabulary 512 random ids."""
    return make_head(tmp_path_factory.mktemp("head"), len(demo_tokenizer), 512)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, demo_tokenizer) -> tuple[Path, Path]:
    """A target of 6 tokens and a head over 5 of them (the sixth only the target proposes): a random head
    is then right often enough that drafts are both accepted and rejected."""
    target = build_tiny_model(SHAPE, demo_tokenizer, tmp_path_factory.mktemp("t6"), 3, 6)
    return target, make_head(tmp_path_factory.mktemp("h6"), 6, 5, seed=1)


def eagle3(head: Path, k: int = 4) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out = []
    for ids in prompts:
        # the mask given: token 0 is a real token here, not padding for generate to infer
        x = torch.tensor([ids])
        gen = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


def test_greedy_eagle3_matches_hf(tiny_model_factory, hf_reference, head_dir):
    llm = LLM(str(tiny_model_factory(SHAPE)), dtype="float32", speculative_config=eagle3(head_dir))
    params = SamplingParams(**{**GREEDY.__dict__, "speculation": 4})
    outs = llm.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.token_ids for o in outs] == hf_reference(SHAPE)
    assert sum(o.usage.draft_proposed for o in outs) > 0
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.spec.proposer._seqs  # finished sequences are forgotten


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_greedy_eagle3_chunked_prefill_preemption_prefix_cache(small_vocab, prefix_caching):
    """Small chunks, a pool that forces preemptions, shared prefixes; speculation off, fixed and auto."""
    target, head = small_vocab
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 6, (9,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 6, (n,), generator=generator).tolist() for n in (3, 11, 1, 6)]
    llm = LLM(
        str(target),
        dtype="float32",
        block_size=4,
        num_kv_blocks=22,
        max_num_batched_tokens=12,
        enable_prefix_caching=prefix_caching,
        speculative_config=eagle3(head, 3),
    )
    modes = [3, "auto", "off", 2]
    params = [SamplingParams(**{**GREEDY.__dict__, "speculation": m}) for m in modes]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == hf_greedy(target, prompts, MAX_TOKENS)
    proposed = sum(o.usage.draft_proposed for o in outs)
    accepted = sum(o.usage.draft_accepted for o in outs)
    assert 0 < accepted < proposed
    assert outs[2].usage.draft_proposed == 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def dense_drafts(hf, head, tokens: list[int], k: int, layers: tuple[int, ...]) -> list[int]:
    """The k greedy drafts after `tokens` from the head's dense forward over the target's hidden states
    (HF's): rows 0..N-2 read token i + 1 and fc(states at i); each draft row reads the draft before it and
    the hidden output of the row before."""
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0, :-1] for i in layers], dim=-1)
        ids = list(tokens[1:])
        hidden = head.fuse(aux)
        drafts: list[int] = []
        for _ in range(k):
            n = len(ids)
            logits, out = head.forward_dense(torch.tensor([ids]), hidden[None], torch.arange(n)[None])
            draft = int(head.draft_to_target(logits[0, -1].argmax()))
            drafts.append(draft)
            ids.append(draft)
            hidden = torch.cat([hidden, out[0, -1:]])
    return drafts


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_each_draft_equals_the_dense_head_over_hf_states(small_vocab, prefix_caching):
    """Every proposal of a run with accepts, rejects, chunked prefill and shared prefixes equals the dense
    reference computed from scratch on the committed tokens: the paged forward is the dense one, the
    catch-up reads the right states, and the K/V of rejected drafts never leaks into a later draft."""
    from transformers import AutoModelForCausalLM

    target, head_path = small_vocab
    llm = LLM(
        str(target),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=10,
        enable_prefix_caching=prefix_caching,
        speculative_config=eagle3(head_path, 3),
    )
    proposer = llm.engine.spec.proposer
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = proposer.propose

    def recording(requests):
        drafts = propose(requests)
        for seq, k in requests:
            if drafts[seq.seq_id].token_ids:
                seen.append((list(seq.token_ids), k, drafts[seq.seq_id].token_ids))
        return drafts

    proposer.propose = recording
    generator = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 6, (8,), generator=generator).tolist()
    prompts = [shared + torch.randint(0, 6, (n,), generator=generator).tolist() for n in (2, 9, 5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculation=3)
    outs = llm.generate(prompts, [params] * len(prompts))
    assert 0 < sum(o.usage.draft_accepted for o in outs) < sum(o.usage.draft_proposed for o in outs)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = load_eagle3(head_path)
    assert len(seen) > 10
    for tokens, k, drafts in seen:
        assert drafts == dense_drafts(hf, head, tokens, k, proposer.aux_layers), tokens


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 3, 0.8)])
def test_sampled_eagle3_keeps_the_target_distribution(
    tmp_path_factory, demo_tokenizer, temperature, top_k, top_p, monkeypatch
):
    target = build_tiny_model(SHAPE, demo_tokenizer, tmp_path_factory.mktemp("t4"), 1, VOCAB)
    head = make_head(tmp_path_factory.mktemp("h4"), VOCAB, VOCAB - 1, seed=2)
    joint = exact_joint(target, temperature, top_k, top_p)
    llm = LLM(
        str(target),
        dtype="float32",
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        speculative_config=eagle3(head, 2),
    )
    stat, limit = chi_square_exceeds(sample_triples(llm, temperature, top_k, top_p), joint, N_SAMPLES)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f}: speculation changed the distribution"
    # the same test catches a verifier that takes the head's word (the output is then the head's)
    trust_the_drafts(monkeypatch)
    stat, limit = chi_square_exceeds(sample_triples(llm, temperature, top_k, top_p), joint, N_SAMPLES)
    assert stat > limit, f"a broken verifier passed: chi-square {stat:.1f} < {limit:.1f}"


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(target_vocab=1000), "vocab"),
        (dict(layer_ids=(2, 4, 8)), "eagle_aux_hidden_state_layer_ids"),
        (dict(hidden=96), "target_hidden_size"),
    ],
)
def test_a_head_for_another_target_is_refused_naming_the_field(
    tiny_model_factory, demo_tokenizer, tmp_path, kw, field
):
    from dataclasses import replace

    cfg = head_config(kw.get("target_vocab", len(demo_tokenizer)), 64, kw.get("layer_ids"))
    if "hidden" in kw:
        cfg = replace(cfg, target_hidden_size=kw["hidden"])
    head = save_eagle3(random_eagle3(cfg), tmp_path / "head", "other")
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_model_factory(SHAPE)), dtype="float32", speculative_config=eagle3(head))


def test_eagle3_needs_its_head_dir():
    from specserve.spec.config import SpeculativeConfig

    with pytest.raises(InvalidParameter, match="speculative_config.model"):
        SpeculativeConfig.from_dict({"method": "eagle3"})
    with pytest.raises(InvalidParameter, match="speculative_config.method"):
        SpeculativeConfig.from_dict({"method": "eagle3,draft_model", "model": "x"})


def test_constraints_penalties_and_logprobs_are_those_of_speculation_off(tiny_model_factory, head_dir):
    """A grammar cuts the head's drafts, penalties count them at each verify position, logprobs come from
    the target's rows: the output is the same with the head drafting as without."""
    llm = LLM(
        str(tiny_model_factory(SHAPE)),
        dtype="float32",
        num_kv_blocks=128,
        speculative_config=eagle3(head_dir),
    )
    prompts = ["Pick one: ", "The code is ", "Hello there"]
    kinds = [
        dict(structured_outputs={"choice": ["alpha", "beta gamma", "delta"]}),
        dict(structured_outputs={"regex": r"(ab|cd)[0-9]{2,4}-[xyz]{3}"}),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, logprobs=2),
    ]
    outs = {}
    for spec in ("off", 4):
        params = [
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=i == 2, speculation=spec, **kw)
            for i, kw in enumerate(kinds)
        ]
        outs[spec] = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[4]] == [o.token_ids for o in outs["off"]]
    assert outs[4][0].text in ("alpha", "beta gamma", "delta")
    assert sum(o.usage.draft_proposed for o in outs[4]) > 0
    off, on = outs["off"][2].logprobs, outs[4][2].logprobs
    assert len(on) == len(off) == 20
    for a, b in zip(on, off):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
