"""Suffix decoding: the trees' matching and scoring on hand-made token sequences, incremental updates equal
to building from scratch, the shared tree's eviction, and in the engine: greedy outputs equal HF's and the
engine's without speculation, sampled ones keep the target's distribution, constrained ones stay valid."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
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
from specserve.engine.sampling_params import InvalidParameter
from specserve.engine.sequence import SeqStatus, Sequence
from specserve.spec.config import SpeculativeConfig
from specserve.spec.decoder import SpeculativeDecoder, check_speculation
from specserve.spec.ngram import NgramProposer
from specserve.spec.suffix import GlobalTree, RequestTree, SuffixProposer, SuffixTree

pytest_plugins = ("valkey_fixtures",)


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams(), detokenizer=None, arrival_time=0.0)


def _draft(proposer: SuffixProposer, seq: Sequence, k: int = 8) -> list[int]:
    return proposer.propose([(seq, k)])[seq.seq_id].token_ids


def _finish(proposer: SuffixProposer, seq_id: int, prompt: list[int], output: list[int]) -> None:
    seq = _seq(seq_id, prompt)
    seq.token_ids.extend(output)
    seq.status, seq.finish_reason = SeqStatus.FINISHED, "stop"
    proposer.forget(seq)


def _shape(tree: SuffixTree | RequestTree) -> dict[tuple[int, ...], tuple[int, int | None]]:
    """Every path's occurrence count and its most frequent next token."""
    if isinstance(tree, RequestTree):
        return tree.paths()
    out: dict[tuple[int, ...], tuple[int, int | None]] = {}
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for kid in tree.children(node):
            best = tree.best[kid]
            out[path + (tree.token[kid],)] = (tree.count[kid], None if best < 0 else tree.token[best])
            stack.append((path + (tree.token[kid],), kid))
    return out


def _counted(tokens: list[int], depth: int) -> dict[tuple[int, ...], tuple[int, int | None]]:
    """_shape of a tree over `tokens`, by counting every substring of at most `depth` tokens."""
    return _with_best(
        Counter(
            tuple(tokens[i : i + n])
            for i in range(len(tokens))
            for n in range(1, min(depth, len(tokens) - i) + 1)
        )
    )


def _with_best(counts: Counter[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, int | None]]:
    """Each counted path's count and its most frequent next token (the lowest token on a tie), as _shape."""
    best: dict[tuple[int, ...], tuple[int, int]] = {}
    for path, count in counts.items():
        parent = path[:-1]
        if parent not in best or (count, -path[-1]) > (best[parent][0], -best[parent][1]):
            best[parent] = (count, path[-1])
    return {path: (count, best[path][1] if path in best else None) for path, count in counts.items()}


# ---- matching and scoring --------------------------------------------------------------------------------

CASES = {
    # name: (context, proposer settings, expected draft)
    "nothing seen before": ([1, 2, 3, 4], {}, []),
    # "1 2 3" was followed by 9 once (p 1/2, the current occurrence counts too); "2 3" by 9 and by 7
    # (p 1/3 each): the longest match scores highest
    "longest suffix wins": ([5, 1, 2, 3, 9, 2, 3, 7, 1, 2, 3], {}, [9, 2, 3]),
    # "1 2" went on to 3 twice and to 4 once: the walk follows the more frequent child
    "most frequent child": ([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2], {}, [3, 1]),
    # ... and from "1 2 4" on to 1 and to 9 once each (p 1/2 x 1/2, the lower token id on a tie)
    "most frequent child, other way": ([1, 2, 4, 1, 2, 3, 1, 2, 4, 9, 1, 2], {}, [4, 1]),
    # "1 2" went on to 3, 4 and 5 once each: p = 1/4 for the first token, then 1/4 x 1
    "below min_token_prob": ([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], {"min_token_prob": 0.3}, []),
    "at min_token_prob": ([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], {"min_token_prob": 0.25}, [3, 1]),
    # a single earlier "7" followed by a long run: the draft is as long as the match times the factor
    "factor 1 caps at the match": ([7, 8, 9, 10, 11, 12, 7], {}, [8]),
    "factor 3": ([7, 8, 9, 10, 11, 12, 7], {"max_spec_factor": 3.0}, [8, 9, 10]),
    "k caps the factor": ([7, 8, 9, 10, 11, 12, 7], {"max_spec_factor": 10.0, "k": 4}, [8, 9, 10, 11]),
    "tree depth caps the walk": (
        [7, 8, 9, 10, 11, 12, 7],
        {"max_spec_factor": 10.0, "max_tree_depth": 3},
        [8, 9],
    ),
    # "1 2" went on to 3 twice of 4 (p 1/2), "1 2 3" to 4 once of 2 (p 1/2 x 1/2), then 1/4 on
    "probability is a product": (
        [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6, 1, 2],
        {"max_spec_factor": 4.0, "min_token_prob": 0.2, "k": 3},
        [3, 4, 1],
    ),
    "product below min_token_prob": (
        [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 6, 1, 2],
        {"max_spec_factor": 4.0, "min_token_prob": 0.3, "k": 3},
        [3],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_draft_follows_the_match(name: str) -> None:
    context, settings, expected = CASES[name]
    settings = dict(settings)
    k = settings.pop("k", 8)
    proposer = SuffixProposer(num_speculative_tokens=8, max_cached_requests=0, **settings)
    assert _draft(proposer, _seq(0, context), k) == expected


def test_the_request_with_the_higher_score_drafts_from_its_tree_or_the_shared_one() -> None:
    proposer = SuffixProposer(num_speculative_tokens=8, max_spec_factor=4.0)
    # finished outputs that went on "1 2" -> "3 4 5" twice
    _finish(proposer, 100, [0], [1, 2, 3, 4, 5])
    _finish(proposer, 101, [0], [9, 1, 2, 3, 4, 5])
    # the request's own text says "1 2" -> 8 once (p 1/2); the shared tree says 3 (p 1, then 1 ...)
    assert _draft(proposer, _seq(0, [1, 2, 8, 1, 2])) == [3, 4, 5]
    # its own text saying "7 1 2" -> 8 three times of four (p 3/4, then 3/4 x 2/3, ...) outscores it
    assert _draft(proposer, _seq(1, [7, 1, 2, 8, 7, 1, 2, 8, 7, 1, 2, 8, 7, 1, 2]))[0] == 8


def test_a_draft_says_the_length_of_the_match_it_continues() -> None:
    """The decoder prices a suffix draft by its match length (policy.DraftCalibration)."""
    proposer = SuffixProposer(num_speculative_tokens=8, max_cached_requests=0, max_spec_factor=4.0)
    seq = _seq(0, [5, 1, 2, 3, 4, 9, 1, 2, 3])  # "1 2 3" recurs, then 4 9 follow
    draft = proposer.propose([(seq, 8)])[0]
    assert draft.token_ids[:2] == [4, 9] and draft.match_len == 3
    none = proposer.propose([(_seq(1, [1, 2, 3]), 8)])[1]
    assert (none.token_ids, none.match_len) == ([], 0)


def test_the_shared_tree_evicts_the_oldest_output_and_all_its_counts() -> None:
    cache = GlobalTree(max_depth=4, max_requests=2)
    for key, tokens in enumerate([[1, 2, 3, 6], [4, 5, 6], [1, 2, 7]]):
        cache.add(key, tokens)
    fresh = SuffixTree(4)
    fresh.insert([4, 5, 6])
    fresh.insert([1, 2, 7])
    assert list(cache.outputs) == [1, 2]
    assert _shape(cache.tree) == _shape(fresh) and cache.num_nodes == len(_shape(fresh))
    assert cache.tree.match([3]) is None and cache.tree.match([1, 2, 3]) is None

    proposer = SuffixProposer(num_speculative_tokens=4, max_cached_requests=2)
    _finish(proposer, 100, [0], [1, 2, 3])
    _finish(proposer, 101, [0], [1, 2, 7])
    assert _draft(proposer, _seq(0, [5, 1, 2])) == [3]  # a tie: the lower token id
    _finish(proposer, 102, [0], [9, 9])  # evicts [1, 2, 3]
    assert _draft(proposer, _seq(0, [5, 1, 2])) == [7]
    _finish(proposer, 103, [0], [8, 8])
    assert _draft(proposer, _seq(0, [5, 1, 2])) == []


def test_the_shared_tree_evicts_the_oldest_outputs_past_its_node_bound() -> None:
    cache = GlobalTree(max_depth=3, max_requests=100, max_nodes=12)
    cache.add(0, [1, 2, 3])  # 6 nodes: 1, 2, 3, 12, 23, 123
    cache.add(1, [1, 2, 4])  # 3 more: 4, 24, 124 (1, 12 and 2 are there)
    assert cache.num_nodes == len(_shape(cache.tree)) == 9
    cache.add(2, [5, 6, 7])  # 6 more: 15 > 12, so the oldest goes (with 123, 23, 3)
    assert list(cache.outputs) == [1, 2] and cache.num_nodes == len(_shape(cache.tree)) == 12
    cache.add(3, list(range(10, 20)))  # alone over the bound: it stays, everything older goes
    assert list(cache.outputs) == [3] and cache.num_nodes == len(_shape(cache.tree)) == 27


def test_no_shared_tree_at_zero_cached_requests_nor_from_aborted_or_preempted_requests() -> None:
    proposer = SuffixProposer(num_speculative_tokens=4, max_cached_requests=0)
    _finish(proposer, 100, [0], [1, 2, 3])
    assert not proposer.cache.outputs
    proposer = SuffixProposer(num_speculative_tokens=4)
    aborted = _seq(100, [1, 2, 3])
    aborted.status, aborted.finish_reason = SeqStatus.FINISHED, "abort"
    proposer.forget(aborted)
    proposer.forget(_seq(101, [1, 2, 3]))  # preempted: still waiting
    assert not proposer.cache.outputs
    assert _draft(proposer, _seq(0, [5, 1, 2])) == []


@pytest.mark.parametrize("seed", range(6))
def test_incremental_appends_equal_building_from_scratch(seed: int) -> None:
    """Tokens arrive in steps of 1-5 (accepted drafts + the bonus token) while other requests finish and
    are evicted: every draft and the request's tree equal a fresh proposer's over the same tokens."""
    rng = random.Random(seed)
    depth, vocab = rng.choice([(3, 3), (5, 4), (8, 5)])
    kwargs = dict(num_speculative_tokens=6, max_tree_depth=depth, max_cached_requests=3, max_spec_factor=2.0)
    proposer = SuffixProposer(**kwargs)
    outputs: list[list[int]] = []
    seq = _seq(0, [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))])
    for step in range(40):
        seq.token_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 6)))
        if rng.random() < 0.3:
            outputs.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 15))])
            _finish(proposer, 1000 + step, [0], outputs[-1])
        fresh = SuffixProposer(**kwargs)
        for i, output in enumerate(outputs[-3:]):
            _finish(fresh, 1000 + i, [0], output)
        assert _draft(proposer, seq, 6) == _draft(fresh, seq, 6)
        assert _shape(proposer._requests[0].tree) == _shape(fresh._requests[0].tree)
        assert _shape(proposer._requests[0].tree) == _counted(seq.token_ids, depth)
        assert _shape(proposer.cache.tree) == _shape(fresh.cache.tree)


def test_a_preempted_request_is_rebuilt() -> None:
    proposer = SuffixProposer(num_speculative_tokens=4)
    seq = _seq(0, [1, 2, 3, 4, 1, 2])
    assert _draft(proposer, seq) == [3, 4]
    proposer.forget(seq)  # preempted
    assert not proposer._requests
    assert _draft(proposer, seq) == [3, 4]


# ---- configuration and per-request choice ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("suffix_decoding_max_tree_depth", 1),
        ("suffix_decoding_max_tree_depth", 2.5),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", 0),
        ("suffix_decoding_max_spec_factor", float("nan")),
        ("suffix_decoding_min_token_prob", 1.5),
        ("suffix_decoding_min_token_prob", True),
    ],
)
def test_bad_suffix_settings_name_their_field(field: str, value: object) -> None:
    with pytest.raises(InvalidParameter) as err:
        SpeculativeConfig.from_dict({"method": "suffix", field: value})
    assert err.value.field == f"speculative_config.{field}"


def test_a_request_may_name_the_method_its_worker_holds_and_no_other(tiny_model_dir) -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(speculation="medusa")
    assert err.value.field == "speculation"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, speculation="suffix")
    suffix = LLM(str(tiny_model_dir), dtype="float32", speculative_config={"method": "suffix"})
    first = suffix.generate([PROMPTS[1]], params)[0]
    again = suffix.generate([PROMPTS[1]], params)[0]  # "auto" with the suffix trees: the first output's
    assert again.token_ids == first.token_ids and again.usage.draft_accepted > 0
    ngram = LLM(str(tiny_model_dir), dtype="float32", speculative_config={"method": "ngram"})
    with pytest.raises(InvalidParameter, match="drafts with 'ngram' only") as err:
        ngram.generate([PROMPTS[1]], params)
    assert err.value.field == "speculation" and not ngram.engine.has_unfinished()
    with pytest.raises(InvalidParameter, match="does not speculate") as err:
        check_speculation("suffix", None)  # an engine without a speculative_config
    assert err.value.field == "speculation"


# ---- in the engine -----------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_with_suffix_equals_hf_and_the_shared_tree_drafts_what_was_said_before(
    tiny_model_dir, hf_reference
) -> None:
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        speculative_config={"method": "suffix", "num_speculative_tokens": 4},
    )
    params = [SamplingParams(**{**GREEDY.__dict__, "speculation": 4})] * len(PROMPTS)
    first = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == hf_reference("llama_gqa_tied")
    # the same prompts again: the shared tree holds their outputs, so most drafts are right
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == hf_reference("llama_gqa_tied")
    proposed = sum(o.usage.draft_proposed for o in again)
    accepted = sum(o.usage.draft_accepted for o in again)
    assert accepted > sum(o.usage.draft_accepted for o in first)
    assert accepted >= 0.8 * proposed > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_parallel_samples_of_one_prompt_are_exact_and_feed_each_other(tiny_model_dir, hf_reference) -> None:
    """n > 1 as the API runs it: one request per sample, the same prompt, batched together. A fixed k: the
    adaptive policy prices k from step timings, and on a loaded machine it once chose none."""
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        max_num_seqs=2,
        speculative_config={"method": "suffix", "num_speculative_tokens": 4},
    )
    outs = llm.generate([PROMPTS[0]] * 4, SamplingParams(**{**GREEDY.__dict__, "speculation": 4}))
    assert all(o.token_ids == hf_reference("llama_gqa_tied")[0] for o in outs)
    assert sum(o.usage.draft_accepted for o in outs[2:]) > sum(o.usage.draft_accepted for o in outs[:2])


@pytest.fixture(scope="module")
def tiny_vocab_target(tmp_path_factory, demo_tokenizer):
    return build_tiny_model("llama_gqa_tied", demo_tokenizer, tmp_path_factory.mktemp("t4"), 1, VOCAB)


def test_sampled_suffix_speculation_keeps_the_target_distribution(tiny_vocab_target, monkeypatch) -> None:
    target = tiny_vocab_target
    joint = exact_joint(target, 1.0, 0, 1.0)
    llm = LLM(
        str(target),
        dtype="float32",
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        speculative_config={
            "method": "suffix",
            "num_speculative_tokens": 2,
            "suffix_decoding_max_spec_factor": 2.0,
        },
    )
    stat, limit = chi_square_exceeds(sample_triples(llm, 1.0, 0, 1.0), joint, N_SAMPLES)
    assert stat < limit, f"chi-square {stat:.1f} >= {limit:.1f}: suffix speculation changed the distribution"

    # It has the drafts to tell: a verifier that takes the trees' word leans the output toward what they
    # propose.
    trust_the_drafts(monkeypatch)
    stat, limit = chi_square_exceeds(sample_triples(llm, 1.0, 0, 1.0), joint, N_SAMPLES)
    assert stat > limit, f"a broken verifier passed: chi-square {stat:.1f} < {limit:.1f}"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "tier": {"enum": ["gold", "silver"]}},
    "required": ["name", "tier"],
    "additionalProperties": False,
}


def test_constrained_outputs_are_valid_and_equal_with_suffix_on_and_off(tiny_model_dir) -> None:
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        num_kv_blocks=256,
        speculative_config={"method": "suffix", "num_speculative_tokens": 4},
    )
    prompts = ['Reply in JSON: {"name": "ab", "tier": "gold"}', "records to JSON"] * 2
    outs = {}
    for spec in ("off", "suffix"):
        params = SamplingParams(
            max_tokens=120, temperature=0.0, speculation=spec, structured_outputs={"json": SCHEMA}
        )
        outs[spec] = llm.generate(prompts, params)
    assert [o.token_ids for o in outs["suffix"]] == [o.token_ids for o in outs["off"]]
    for o in outs["suffix"]:
        record = json.loads(o.text)
        assert set(record) == {"name", "tier"} and record["tier"] in ("gold", "silver"), o.text
    assert sum(o.usage.draft_accepted for o in outs["suffix"]) > 0


# ---- several proposers in one engine ---------------------------------------------------------------------


def test_several_methods_are_one_setting_without_repeats() -> None:
    assert SpeculativeConfig.from_dict({"method": "suffix,ngram"}).methods == ("suffix", "ngram")
    for bad in ("suffix,suffix", "suffix,medusa", "suffix,", "draft_model,ngram"):
        with pytest.raises(InvalidParameter) as err:
            SpeculativeConfig.from_dict({"method": bad})
        assert err.value.field.startswith("speculative_config.")


class SizedNgram(NgramProposer):
    """N-gram drafts sized up front, as a draft model's are: between it and the suffix tree, `auto` picks a
    proposer per request by acceptance (between two priced proposers each step's drafts decide)."""

    priced_drafts = False


def test_auto_moves_a_request_to_the_proposer_that_does_better_for_it() -> None:
    spec = SpeculativeDecoder(
        {"suffix": SuffixProposer(4), "ngram": SizedNgram()}, num_speculative_tokens=4, max_model_len=1000
    )
    auto = _seq(0, [1, 2, 3])
    named = Sequence(
        1, "r1", [1, 2, 3], SamplingParams(speculation="ngram"), detokenizer=None, arrival_time=0.0
    )
    for seq in (auto, named):
        seq.num_computed_tokens = seq.num_tokens - 1

    def method(seq: Sequence) -> str:
        assert spec.lookahead([seq])[seq.seq_id] > 0  # the policy's warm-up: it drafts k_max
        return spec._state[seq.seq_id].method

    assert method(auto) == "suffix" and method(named) == "ngram"
    used = []
    for _ in range(12):  # nothing either proposer drafts is accepted: it goes back and forth between them
        used.append(method(auto))
        spec.observe(auto, 4, 0)
    assert used[0] == "suffix" and "ngram" in used and used.count("suffix") >= 4
    for _ in range(12):  # a request that names a method keeps it, however it fares
        assert method(named) == "ngram"
        spec.observe(named, 4, 0)


def test_an_engine_with_suffix_and_ngram_is_exact_and_serves_either_by_name(
    tiny_model_dir, hf_reference
) -> None:
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        speculative_config={"method": "suffix,ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    for speculation in ("auto", "suffix", "ngram", 3):
        params = SamplingParams(**{**GREEDY.__dict__, "speculation": speculation})
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == hf_reference("llama_gqa_tied"), speculation
    assert llm.engine.spec.num_proposed > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("method", ["suffix", "suffix,ngram"])
def test_the_service_setting_selects_suffix(method: str) -> None:
    from specserve.service.config import ServiceConfig

    spec = ServiceConfig(speculative_method=method).speculative_config()
    assert SpeculativeConfig.from_dict(spec).methods == tuple(method.split(","))


def test_a_worker_refuses_a_method_it_does_not_hold_naming_the_field(valkey, tiny_model_dir) -> None:
    from valkey_helpers import run, service_stack

    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    spec = {"speculative_config": {"method": "suffix", "num_speculative_tokens": 3}}

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, engine_args=spec) as (_worker, client):
            wrong = await client.enqueue({"prompt": "abc abc abc", **params, "speculation": "ngram"})
            held = await client.enqueue({"prompt": "abc abc abc", **params, "speculation": "suffix"})
            return await client.wait(wrong.id), await client.wait(held.id)

    wrong, held = run(main())
    assert wrong.status == "failed" and wrong.error_field == "speculation", wrong.error
    assert "'suffix'" in wrong.error  # what the worker does draft with
    assert held.status == "finished" and len(held.token_ids) == 6
