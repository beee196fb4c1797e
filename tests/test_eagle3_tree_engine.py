"""EAGLE-3 with draft trees in the engine (speculative_token_tree): greedy output equals HF transformers
token for token in fp32 (chunked prefill, preemption, prefix caching), trees are drafted and verified on
the way (some accepted paths leave the first child), and sampled output keeps the target's distribution.
Tiny random targets and heads in speculators' layout, as tests/test_eagle3_engine.py builds them."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS, build_tiny_model
from test_eagle3_engine import GREEDY, SHAPE, eagle3, hf_greedy, make_head
from test_speculative import N_SAMPLES, PROMPT, VOCAB, chi_square_exceeds

from specserve import LLM, SamplingParams
from specserve.engine.errors import InvalidParameter
from specserve.spec.eagle3 import proposer as eagle3_proposer

TREE = {"depth": 3, "branching": 2}


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, demo_tokenizer) -> Path:
    """A head for the 8-layer target over the SmolLM2 vocabulary, its draft vocabulary 512 random ids."""
    return make_head(tmp_path_factory.mktemp("head"), len(demo_tokenizer), 512)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, demo_tokenizer) -> tuple[Path, Path]:
    """A target of 6 tokens and a head over 5 of them: a random head is then right often enough that
    drafts are both accepted and rejected, and trees branch among few tokens."""
    target = build_tiny_model(SHAPE, demo_tokenizer, tmp_path_factory.mktemp("t6"), 3, 6)
    return target, make_head(tmp_path_factory.mktemp("h6"), 6, 5, seed=1)


def tree_config(head, k: int, tree=None) -> dict:
    return {**eagle3(head, k), "speculative_token_tree": TREE if tree is None else tree}


def _record_paths(llm) -> list[tuple[int, ...]]:
    """The accepted paths of the run's verified trees."""
    spec = llm.engine.spec
    paths: list[tuple[int, ...]] = []
    verify = spec.verify

    def recording(plan, drafts, logits, eos=()):
        accepted = verify(plan, drafts, logits, eos)
        paths.extend(a.path for a in accepted if a.path is not None)
        return accepted

    spec.verify = recording
    return paths


def test_greedy_eagle3_tree_matches_hf(tiny_model_factory, hf_reference, head_dir):
    llm = LLM(str(tiny_model_factory(SHAPE)), dtype="float32", speculative_config=tree_config(head_dir, 6))
    paths = _record_paths(llm)
    params = SamplingParams(**{**GREEDY.__dict__, "speculation": 6})
    outs = llm.generate(PROMPTS, [params] * len(PROMPTS))
    assert [o.token_ids for o in outs] == hf_reference(SHAPE)
    assert paths, "no tree was verified"
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_eagle3_tree_chunked_prefill_preemption_prefix_cache(small_vocab, prefix_caching, backend):
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
        attention_backend=backend,
        speculative_config=tree_config(head, 4, {"depth": 2, "branching": 3}),
    )
    paths = _record_paths(llm)
    modes = [4, "auto", "off", 3]
    params = [SamplingParams(**{**GREEDY.__dict__, "speculation": m}) for m in modes]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == hf_greedy(target, prompts, MAX_TOKENS)
    accepted = sum(o.usage.draft_accepted for o in outs)
    assert 0 < accepted < sum(o.usage.draft_proposed for o in outs)
    # paths through a later sibling: the K/V of a node moved to the position its depth gives
    assert any(node != depth for path in paths for depth, node in enumerate(path))
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_logprobs_of_a_tree_step_are_the_chain_runs(small_vocab):
    target, head = small_vocab
    prompts = [[1, 2, 3, 4, 5, 0, 2], [3, 3, 1]]
    runs = []
    for config in (eagle3(head, 4), tree_config(head, 4, {"depth": 2, "branching": 3})):
        llm = LLM(str(target), dtype="float32", speculative_config=config)
        params = SamplingParams(**{**GREEDY.__dict__, "speculation": 4, "logprobs": 2})
        runs.append(llm.generate(prompts, [params] * 2))
    for chain, tree in zip(*runs):
        assert chain.token_ids == tree.token_ids
        assert len(chain.logprobs) == len(tree.logprobs) == len(tree.token_ids)
        for a, b in zip(chain.logprobs, tree.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def exact_joint4(model_dir, temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """P(x1..x4) of the target from HF logits (as test_speculative.exact_joint, one token further: the
    first decode step then has room for a tree of two nodes)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    cache: dict[tuple[int, ...], list[float]] = {}

    def dist(prefix: tuple[int, ...]) -> list[float]:
        if prefix not in cache:
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1] / temperature
            probs = logits.softmax(-1)
            if top_k:
                probs[probs.argsort(descending=True)[top_k:]] = 0
            cache[prefix] = (probs / probs.sum()).tolist()
        return cache[prefix]

    return {
        cell: dist(())[cell[0]] * dist(cell[:1])[cell[1]] * dist(cell[:2])[cell[2]] * dist(cell[:3])[cell[3]]
        for cell in itertools.product(range(VOCAB), repeat=4)
    }


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_sampled_eagle3_tree_keeps_the_target_distribution(
    tmp_path_factory, demo_tokenizer, temperature, top_k, monkeypatch
):
    monkeypatch.setattr(eagle3_proposer, "TREE_STEP_NODES", 10**6)  # trees at any batch
    target = build_tiny_model(SHAPE, demo_tokenizer, tmp_path_factory.mktemp("t4"), 1, VOCAB)
    head = make_head(tmp_path_factory.mktemp("h4"), VOCAB, VOCAB - 1, seed=2)
    joint = exact_joint4(target, temperature, top_k)
    llm = LLM(
        str(target),
        dtype="float32",
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        speculative_config=tree_config(head, 2, {"depth": 1, "branching": 2}),
    )
    paths = _record_paths(llm)
    params = [
        SamplingParams(
            max_tokens=4, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True, speculation=2
        )
        for s in range(N_SAMPLES)
    ]
    outs = llm.generate([PROMPT] * N_SAMPLES, params)
    stat, limit = chi_square_exceeds(Counter(tuple(o.token_ids) for o in outs), joint, N_SAMPLES)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f}: tree speculation changed the distribution"
    assert any(path[-1] == 2 for path in paths), "no second child was ever accepted"


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ({"depth": 0, "branching": 2}, "depth"),
        ("[(0,), (0, 1, 2)]", "before its parent"),
        ([(0,), (1,), (0, 0), (0, 1), (1, 0)], "more than num_speculative_tokens"),
        ("not a tree", "not a list of paths"),
    ],
)
def test_bad_trees_are_refused_naming_the_field(head_dir, tree, match):
    from specserve.spec.config import SpeculativeConfig

    with pytest.raises(InvalidParameter, match=match) as err:
        SpeculativeConfig.from_dict(tree_config(head_dir, 4, tree))
    assert err.value.field == "speculative_token_tree" or "speculative_token_tree" in str(err.value)


def test_vllm_paths_give_branching_and_depth(head_dir):
    from specserve.spec.config import SpeculativeConfig

    cfg = SpeculativeConfig.from_dict(tree_config(head_dir, 5, "[(0,), (1,), (2,), (0, 0), (0, 1)]"))
    assert cfg.tree_shape() == (3, 2)
    with pytest.raises(InvalidParameter, match="eagle3 only"):
        SpeculativeConfig.from_dict({"method": "ngram", "speculative_token_tree": TREE})


def test_the_service_setting_reaches_the_speculative_config(head_dir):
    from specserve.service.config import ServiceConfig
    from specserve.spec.config import SpeculativeConfig

    cfg = ServiceConfig(
        speculative_method="eagle3",
        speculative_model=str(head_dir),
        speculative_token_tree="{'depth': 3, 'branching': 2}",
    )
    spec = cfg.speculative_config()
    assert SpeculativeConfig.from_dict(spec).tree_shape() == (2, 3)
    assert "speculative_token_tree" not in ServiceConfig().speculative_config()
