"""`auto` across proposers: a request drafts with the method that makes it the most tokens per second, its
acceptance priced by the target's measured step cost and each proposer's measured cost per draft step
(AdaptivePolicy.method_rate), by acceptance alone while the costs are not yet measured; a method it has
not drafted with is judged at that method's workload acceptance scaled by how the request fares with its
current one. This choice is between proposers sized up front (a draft model, EAGLE-3, or as here an n-gram
proposer made so): between two whose drafts are priced token by token, each step's drafts decide
(test_stage_spec.py)."""

from __future__ import annotations

import pytest

from specserve import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.engine.step import ScheduledSeq, SchedulerOutput
from specserve.spec.decoder import SpeculativeDecoder
from specserve.spec.ngram import NgramProposer
from specserve.spec.policy import AdaptivePolicy, expected_tokens
from specserve.spec.suffix import SuffixProposer


class SizedNgram(NgramProposer):
    priced_drafts = False


# the target's step: 10 ms + 1 ms per query token
BASE, PER_TOKEN = 0.010, 0.001


def _measured(policy: AdaptivePolicy, costs: dict[str, float]) -> AdaptivePolicy:
    for n in range(1, 2 * policy.warmup_steps):  # past the warm-up (its count decays as it goes)
        policy.target.observe(n, BASE + PER_TOKEN * n)
    for method, seconds in costs.items():
        for n in (1, 2, 4):  # a draft step costs the same whatever the batch: seconds per step
            policy.observe_draft(method, n, seconds)
    return policy


def _rate(acceptance: float, draft: float, k_max: int = 4) -> float:
    return max(
        expected_tokens(acceptance, k) / (BASE + PER_TOKEN * (1 + k) + k * draft) for k in range(k_max + 1)
    )


def test_no_rate_before_the_targets_cost_is_measured() -> None:
    assert AdaptivePolicy(4).method_rate(0.9, "suffix") is None


@pytest.mark.parametrize(
    ("acceptance", "draft_seconds"),
    [(0.0, 0.0), (0.6, 0.0), (0.9, 0.0), (0.9, 0.002), (0.9, 0.05), (0.3, 0.01)],
)
def test_the_rate_is_the_best_k_of_expected_tokens_over_the_steps_cost(
    acceptance: float, draft_seconds: float
) -> None:
    policy = _measured(AdaptivePolicy(4), {"m": draft_seconds})
    assert policy.method_rate(acceptance, "m") == pytest.approx(_rate(acceptance, draft_seconds), rel=1e-6)
    # never below not drafting: k = 0 is one of the choices
    assert policy.method_rate(acceptance, "m") >= 1 / (BASE + PER_TOKEN) - 1e-9


# (suffix's acceptance, its seconds per draft step, n-gram's acceptance, its seconds, the method auto takes)
TABLE = [
    (0.8, 0.0, 0.6, 0.0, "suffix"),  # equal costs: the more accurate one
    (0.5, 0.0, 0.7, 0.0, "ngram"),
    (0.8, 0.02, 0.6, 0.0, "ngram"),  # suffix's drafts cost more than their extra acceptance makes
    (0.8, 0.0005, 0.6, 0.0, "suffix"),  # a cheap draft step does not outweigh it
    (0.6, 0.0, 0.6, 0.001, "suffix"),  # equal acceptance: the cheaper one
]


@pytest.mark.parametrize(("suffix_a", "suffix_s", "ngram_a", "ngram_s", "chosen"), TABLE)
def test_auto_takes_the_method_with_the_best_rate(
    suffix_a: float, suffix_s: float, ngram_a: float, ngram_s: float, chosen: str
) -> None:
    spec = SpeculativeDecoder(
        {"suffix": SuffixProposer(4), "ngram": SizedNgram()}, num_speculative_tokens=4, max_model_len=1000
    )
    _measured(spec.policy, {"suffix": suffix_s, "ngram": ngram_s})
    spec.workload_acceptance.update(suffix=suffix_a, ngram=ngram_a)  # a new request's estimates
    seq = Sequence(0, "r0", [1, 2, 3], SamplingParams(), detokenizer=None, arrival_time=0.0)
    seq.num_computed_tokens = seq.num_tokens - 1
    spec.lookahead([seq])
    assert spec._state[0].method == chosen
    expected = {"suffix": _rate(suffix_a, suffix_s), "ngram": _rate(ngram_a, ngram_s)}
    assert max(expected, key=expected.__getitem__) == chosen  # the table agrees with the formula


def _decoder() -> SpeculativeDecoder:
    return SpeculativeDecoder(
        {"suffix": SuffixProposer(4), "ngram": SizedNgram()}, num_speculative_tokens=4, max_model_len=1000
    )


def _decoding(seq_id: int = 0) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", [1, 2, 3], SamplingParams(), detokenizer=None, arrival_time=0.0)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


# (the workload's suffix and n-gram acceptance, the request's on suffix, its estimate for n-gram untried)
UNTRIED = [
    (0.6, 0.5, 0.6, 0.5),  # no evidence yet (a fresh request is at the workload's): n-gram's workload
    (0.6, 0.5, 0.3, 0.25),  # half the workload's with suffix: half n-gram's
    (0.6, 0.5, 0.9, 0.75),
    (0.4, 0.8, 0.8, 0.999),  # capped below 1 (expected_tokens' bound)
    (0.0, 0.5, 0.0, 0.5),  # a workload at 0 tells nothing: n-gram's own
]


@pytest.mark.parametrize(("suffix_w", "ngram_w", "own", "estimate"), UNTRIED)
def test_an_untried_methods_estimate_carries_how_the_request_fares_with_its_current_one(
    suffix_w: float, ngram_w: float, own: float, estimate: float
) -> None:
    spec = _decoder()
    spec.workload_acceptance.update(suffix=suffix_w, ngram=ngram_w)
    seq = _decoding()
    state = spec._seq_state(seq)
    state.acceptance = own
    assert spec._untried(state, "ngram") == pytest.approx(estimate)


def test_a_request_that_copies_badly_does_not_switch_to_the_workloads_mean() -> None:
    """Suffix's workload 0.6, n-gram's 0.5: a request at 0.2 with suffix is judged at 0.5 x 0.2 / 0.6 with
    n-gram, not 0.5, stays on suffix (at equal costs), and drafts no more than suffix alone would."""
    spec = _decoder()
    _measured(spec.policy, {"suffix": 0.0, "ngram": 0.0})
    spec.workload_acceptance.update(suffix=0.6, ngram=0.5)
    seq = _decoding()
    spec._seq_state(seq).acceptance = 0.2
    ks = spec.lookahead([seq])
    state = spec._state[0]
    assert (state.method, state.acceptance, state.shelved) == ("suffix", 0.2, {})
    alone = SpeculativeDecoder(SuffixProposer(4), 4, 1000, method="suffix")
    _measured(alone.policy, {})
    alone._seq_state(seq).acceptance = 0.2
    assert ks == alone.lookahead([seq])


def test_a_switch_to_an_untried_method_takes_the_carried_estimate() -> None:
    spec = _decoder()
    _measured(spec.policy, {"suffix": 0.0, "ngram": 0.0})
    spec.workload_acceptance.update(suffix=0.4, ngram=0.8)
    seq = _decoding()
    spec._seq_state(seq).acceptance = 0.3
    spec.lookahead([seq])
    state = spec._state[0]
    assert (state.method, state.acceptance) == ("ngram", pytest.approx(0.6))
    assert state.shelved["suffix"].acceptance == 0.3


def test_method_costs_are_the_steps_seconds_for_each_k() -> None:
    policy = AdaptivePolicy(4)
    assert policy.method_costs("m") is None  # warm-up
    _measured(policy, {"m": 0.002})
    costs = policy.method_costs("m")
    assert costs == pytest.approx([BASE + PER_TOKEN * (1 + k) + k * 0.002 for k in range(5)], rel=1e-6)
    assert policy.method_rate(0.6, "m", costs) == policy.method_rate(0.6, "m")


def test_proposing_measures_each_methods_draft_cost() -> None:
    spec = SpeculativeDecoder(
        {"suffix": SuffixProposer(4), "ngram": SizedNgram()}, num_speculative_tokens=4, max_model_len=1000
    )
    seqs = []
    for i, method in enumerate(("suffix", "ngram")):
        seq = Sequence(
            i,
            f"r{i}",
            [1, 2, 3, 1, 2],
            SamplingParams(speculation=method),
            detokenizer=None,
            arrival_time=0.0,
        )
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    ks = spec.lookahead(seqs)
    plan = SchedulerOutput(
        scheduled=tuple(ScheduledSeq(s, 1, ks[s.seq_id], True) for s in seqs), preempted=()
    )
    spec.propose(plan)
    assert set(spec.policy.method_seconds) == {"suffix", "ngram"}
    assert all(c.samples == 1 for c in spec.policy.method_seconds.values())


def test_usage_and_engine_stats_count_draft_tokens_by_the_method_that_proposed_them(tiny_model_dir) -> None:
    from conftest import PROMPTS

    from specserve import LLM

    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        speculative_config={"method": "suffix,ngram", "num_speculative_tokens": 4},
    )
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, speculation=method)
        for method in ("suffix", "ngram", "suffix", "ngram")
    ]
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[1], PROMPTS[1]]
    outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    for out, sp in zip(outs, params):
        u = out.usage
        # a request that names its method drafts with it alone: all its drafts are counted under it
        assert set(u.draft_by_method) <= {sp.speculation}
        assert sum(p for p, _ in u.draft_by_method.values()) == u.draft_proposed
        assert sum(a for _, a in u.draft_by_method.values()) == u.draft_accepted
    assert any(o.usage.draft_proposed for o in outs[2:])  # the repeats draft
    stats = llm.engine.stats()
    assert set(stats.draft_by_method) == {"suffix", "ngram"}
    for method in ("suffix", "ngram"):
        mine = [o.usage for o, sp in zip(outs, params) if sp.speculation == method]
        assert stats.draft_by_method[method] == (
            sum(u.draft_proposed for u in mine),
            sum(u.draft_accepted for u in mine),
        )
    assert sum(p for p, _ in stats.draft_by_method.values()) == stats.draft_proposed
