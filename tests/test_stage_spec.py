"""The speculative-decoding stages, each from hand-made inputs: the n-gram lookup, the policy's choice of k,
lookahead, verification (alone and through the decoder's flat DraftBatch), and SpeculativeConfig."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.errors import InvalidParameter
from specserve.engine.sampler import RowParams
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import SeqStatus, Sequence
from specserve.engine.step import Accepted, DraftBatch, ScheduledSeq, SchedulerOutput
from specserve.spec.config import SpeculativeConfig
from specserve.spec.decoder import SpeculativeDecoder
from specserve.spec.ngram import NgramProposer
from specserve.spec.policy import (
    ACCEPTANCE_PRIOR,
    CALIBRATED_PLACES,
    CALIBRATION_PRIOR,
    GUARD_MIN_STEPS,
    GUARD_PROBE_FIRST,
    GUARD_PROBE_MOST,
    AdaptivePolicy,
    DraftCalibration,
    SpeculationGuard,
)
from specserve.spec.verifier import VerifyBatch, verify

VOCAB = 8


def make_seq(seq_id: int, prompt: list[int], decoding: bool = True, **params) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(**params), detokenizer=None, arrival_time=0.0)
    seq.num_computed_tokens = seq.num_tokens - 1 if decoding else 0
    seq.status = SeqStatus.RUNNING
    return seq


class SizedNgram(NgramProposer):
    """N-gram drafts sized up front by the request's own acceptance, as a draft model's are (its drafts are
    not priced token by token)."""

    priced_drafts = False


def peaked(argmaxes: list[int]) -> torch.Tensor:
    """Logits rows whose softmax is (all but) one-hot on each given token."""
    logits = torch.zeros(len(argmaxes), VOCAB)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 100.0
    return logits


# ---- n-gram lookup ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, k, max_n, min_n, expected",
    [
        ([1, 2, 3, 9, 1, 2], 2, 4, 1, [3, 9]),  # "1 2" seen before: continue after it
        ([1, 2, 3, 9, 1, 2], 5, 4, 1, [3, 9, 1, 2]),  # no further than the sequence goes
        ([5, 1, 7, 2, 1, 7], 1, 4, 1, [2]),  # longest n first: "1 7", not just "7"
        ([1, 4, 1, 5, 1], 2, 4, 1, [5, 1]),  # the latest occurrence wins
        ([1, 2, 3, 4], 3, 4, 1, []),  # nothing repeats
        ([3, 1, 2, 9, 2], 2, 4, 2, []),  # only "2" repeats, shorter than prompt_lookup_min
    ],
)
def test_ngram_lookup(tokens, k, max_n, min_n, expected):
    assert NgramProposer(max_n, min_n).lookup(np.asarray(tokens, dtype=np.int64), k) == expected


@pytest.mark.parametrize(
    "tokens, expected",
    [
        ([5, 1, 7, 2, 1, 7], ([2], 2)),  # "1 7" matched: its length goes with the draft
        ([1, 2, 3, 9, 1, 2, 3], ([9], 3)),
        ([1, 2, 3, 4], ([], 0)),  # no draft, no match length
    ],
)
def test_ngram_drafts_say_their_match_length(tokens, expected):
    proposer = NgramProposer(4, 1)
    assert proposer.match(np.asarray(tokens, dtype=np.int64), 1) == expected
    seq = make_seq(0, tokens)
    draft = proposer.propose([(seq, 1)])[0]
    assert (draft.token_ids, draft.match_len) == expected


def _ngram_by_windows(tokens: list[int], k: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """The n-gram lookup as defined: for n from the longest down, the latest window of n tokens before the
    final one that equals the final n tokens; the k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[-n:]:
                return tokens[end + 1 : end + 1 + k], n
    return [], 0


def test_ngram_lookup_is_the_definition_on_random_contexts():
    rng = np.random.default_rng(0)
    for trial in range(400):
        tokens = rng.integers(0, 1 + trial % 6, size=int(rng.integers(1, 40))).tolist()
        max_n = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        k = int(rng.integers(1, 6))
        got = NgramProposer(max_n, min_n).match(np.asarray(tokens, dtype=np.int64), k)
        assert got == _ngram_by_windows(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


# ---- the policy's k ----------------------------------------------------------------------------------------


def policy(target_seconds, draft_seconds: float = 0.0002, k_max: int = 4) -> AdaptivePolicy:
    p = AdaptivePolicy(k_max)
    for _ in range(4):
        for n in (1, 2, 5, 9, 17, 33, 65):
            p.target.observe(n, target_seconds(n))
    p.draft_step_seconds.observe(1, draft_seconds)
    return p


MEMORY_BOUND = lambda n: 0.010 + 0.0002 * n  # noqa: E731 (a step costs about the same for 1 or 9 tokens)
COMPUTE_BOUND = lambda n: 0.001 * n  # noqa: E731 (every token costs the same)


MIDDLE = lambda n: 0.010 + 0.001 * n  # noqa: E731 (a token costs a tenth of the fixed part)


@pytest.mark.parametrize(
    "target, acceptances, other_tokens, expected",
    [
        (MEMORY_BOUND, [0.9], 0, [4]),  # cheap drafts, high acceptance: the longest k
        (MEMORY_BOUND, [0.0], 0, [0]),  # nothing is ever accepted: do not speculate
        (MEMORY_BOUND, [], 0, []),  # no auto request
        (COMPUTE_BOUND, [0.5] * 32, 0, [0] * 32),  # a draft costs what a real token does and half are lost
        (COMPUTE_BOUND, [0.5], 500, [4]),  # beside a 500-token prefill, one request's 4 drafts are cheap
        # 16 in flight, a token a tenth of a step's fixed cost: the copying requests draft (2 deep: a third
        # draft step costs more than their third drafts bring), the ones rarely accepted draft nothing
        (MIDDLE, [0.9] * 4 + [0.1] * 12, 0, [2] * 4 + [0] * 12),
    ],
)
def test_choose_ks(target, acceptances, other_tokens, expected):
    assert policy(target).choose_ks(acceptances, other_tokens) == expected


def test_choose_ks_gives_the_next_slot_to_the_highest_gain():
    ks = policy(MIDDLE).choose_ks([0.95, 0.6, 0.3], 0)
    assert ks[0] >= ks[1] >= ks[2] and ks[0] > ks[2]


# A quantized model's int kernels serve up to 8 rows, larger steps a dense copy: the AVX2 EPYC's int4 demo
# took ~0.75 s for a plain 8-row step and 2.1-2.9 s for 8 requests' verify steps (loaded machine).
CLIFF = lambda n: 0.3 + 0.05 * n if n <= 8 else 2.0 + 0.02 * n  # noqa: E731


def test_choose_ks_prices_a_jump_in_step_cost():
    p = AdaptivePolicy(4)
    for _ in range(4):
        for n in (1, 2, 3, 5, 8, 16, 24, 40):
            p.target.observe(n, CLIFF(n))
    p.draft_step_seconds.observe(1, 0.0002)
    assert p.target.predict(8) == pytest.approx(CLIFF(8))
    assert p.target.predict(12) == pytest.approx((CLIFF(8) + CLIFF(16)) / 2)
    # one request: drafts stay under the jump and pay (3 deep, as on the straight 0.3 + 0.05 n alone)
    assert p.choose_ks([0.7], 0) == [3]
    # eight: any draft crosses it (a line through these counts made 8 x 1 draft look worth it)
    assert p.choose_ks([0.7] * 8, 0) == [0] * 8


def test_choose_ks_tries_the_longest_k_until_the_target_is_measured():
    assert AdaptivePolicy(5).choose_ks([0.0, 0.2], 0) == [5, 5]


# ---- lookahead: k per decoding sequence, without side effects ---------------------------------------------


def test_lookahead():
    spec = SpeculativeDecoder(NgramProposer(), num_speculative_tokens=4, max_model_len=100)
    spec.policy = policy(MEMORY_BOUND)
    running = [
        make_seq(0, [1, 2, 3], speculation="auto"),
        make_seq(1, [1, 2, 3], speculation=2),
        make_seq(2, [1, 2, 3], speculation="off"),
        make_seq(3, [1, 2, 3], speculation=9),  # capped at num_speculative_tokens
        make_seq(4, [1, 2, 3], speculation=4, max_tokens=3),  # room for 1 draft + the bonus token
        make_seq(5, [1, 2, 3], decoding=False),  # a prompt: not decoding, no k
        make_seq(6, [1] * 98, speculation=4),  # 2 positions left before max_model_len
    ]
    for seq in running[:5]:
        seq.token_ids.append(5)  # one output token, as after a prefill
        seq.num_computed_tokens += 1
    before = [seq.__dict__.copy() for seq in running]
    expected = {0: 4, 1: 2, 3: 4, 4: 1, 6: 2}
    assert spec.lookahead(running) == expected
    assert spec.lookahead(running) == expected  # asking twice changes nothing
    assert [seq.__dict__ for seq in running] == before
    assert spec.acceptance(0) == ACCEPTANCE_PRIOR


def test_what_update_learns_moves_the_next_lookahead():
    spec = SpeculativeDecoder(SizedNgram(), num_speculative_tokens=4, max_model_len=100)
    spec.policy = policy(MEMORY_BOUND)
    seq = make_seq(0, [1, 2, 3])
    plan = SchedulerOutput((ScheduledSeq(seq, 1, 4),))
    spec.update(plan, [Accepted((9,), 0, 4)])  # four drafts, none accepted
    assert spec.acceptance(0) < ACCEPTANCE_PRIOR
    assert (spec.num_proposed, spec.num_accepted) == (4, 0)
    for _ in range(20):
        spec.update(plan, [Accepted((9,), 0, 4)])
    assert spec.lookahead([seq]) == {0: 0}


def test_a_new_request_starts_from_the_workloads_acceptance():
    """Drafts rejected across earlier requests lower where a new one starts (it need not spend its own
    drafts proving the optimistic prior wrong); accepted ones raise it again."""
    spec = SpeculativeDecoder(SizedNgram(), num_speculative_tokens=4, max_model_len=100)
    spec.policy = policy(MEMORY_BOUND)
    assert spec.acceptance(99) == ACCEPTANCE_PRIOR
    for i in range(12):  # twelve requests, each rejecting its four drafts once, then finishing
        seq = make_seq(i, [1, 2, 3])
        spec.update(SchedulerOutput((ScheduledSeq(seq, 1, 4),)), [Accepted((9,), 0, 4)])
        spec.forget(seq)
    low = spec.acceptance(99)
    assert low < 0.3
    fresh = make_seq(99, [1, 2, 3])
    fresh.token_ids.append(5)
    fresh.num_computed_tokens += 1
    assert spec.lookahead([fresh])[99] < 4  # where a request starting from the prior drafts 4
    spec.update(SchedulerOutput((ScheduledSeq(fresh, 1, 0),)), [Accepted((9,), 0, 0)])
    assert low < spec.acceptance(99) < ACCEPTANCE_PRIOR  # idle, it relaxes toward the prior: it will probe
    for i in range(12, 40):
        seq = make_seq(i, [1, 2, 3])
        spec.update(SchedulerOutput((ScheduledSeq(seq, 1, 4),)), [Accepted((9, 9, 9, 9, 9), 4, 4)])
    assert spec.acceptance(1000) > 0.6


# ---- the guard: whether auto requests draft at a load, by what whole steps made ----------------------------


def _run_guard(
    guard: SpeculationGuard, steps: int, on_rate: float, off_rate: float, decoding: int = 8
) -> str:
    """`steps` steps at a load where a second of speculating steps makes on_rate tokens and one of plain steps
    off_rate; the choices taken, "+" speculating, "." not."""
    taken = ""
    for _ in range(steps):
        on = guard.speculates(decoding)
        guard.observe(decoding, on, round(on_rate if on else off_rate), 1.0, measured=True)
        taken += "+" if on else "."
    return taken


def test_the_guard_speculates_until_plain_steps_are_measured_faster():
    guard = SpeculationGuard()
    taken = _run_guard(guard, GUARD_PROBE_FIRST * GUARD_MIN_STEPS + GUARD_MIN_STEPS, on_rate=90, off_rate=100)
    # a plain step every GUARD_PROBE_FIRST + 1 steps until both are measured, then plain
    probe = "+" * GUARD_PROBE_FIRST + "."
    assert taken.startswith(probe * GUARD_MIN_STEPS)
    assert taken.endswith(".")
    assert not guard.speculates(8)


def test_the_guard_probes_ever_more_rarely_while_its_choice_holds_and_turns_when_it_does_not():
    guard = SpeculationGuard(decay=0.5)
    taken = _run_guard(guard, 600, on_rate=100, off_rate=120)
    decided = (GUARD_PROBE_FIRST + 1) * GUARD_MIN_STEPS  # from here on plain, with speculating probes
    probes = [i for i, c in enumerate(taken) if c == "+" and i >= decided]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] == GUARD_PROBE_MOST + 1  # a speculating probe between GUARD_PROBE_MOST plain steps
    assert gaps == sorted(gaps)
    # the load changes: speculating now makes more, and the next probe says so
    taken = _run_guard(guard, 2 * GUARD_PROBE_MOST + 2, on_rate=150, off_rate=120)
    assert taken.endswith("+" * GUARD_PROBE_FIRST)
    assert guard.speculates(8)


def test_the_guard_keeps_loads_apart_and_does_not_time_steps_with_prompt_chunks():
    guard = SpeculationGuard()
    _run_guard(guard, 100, on_rate=50, off_rate=100, decoding=32)
    assert not guard.speculates(32) and not guard.speculates(63)
    assert guard.speculates(1) and guard.speculates(8)  # other octaves are their own
    fresh = SpeculationGuard()
    for _ in range(100):  # every step also computed a prompt chunk: nothing measured, nothing decided
        on = fresh.speculates(8)
        fresh.observe(8, on, 1 if on else 100, 1.0, measured=False)
    assert fresh.speculates(8)


def test_the_decoder_drafts_for_auto_requests_only_where_the_guard_lets_it():
    spec = SpeculativeDecoder(NgramProposer(), num_speculative_tokens=4, max_model_len=100)
    spec.policy = policy(MEMORY_BOUND)
    auto = make_seq(0, [1, 2, 3], speculation="auto")
    fixed = make_seq(1, [1, 2, 3], speculation=2)
    for seq in (auto, fixed):
        seq.token_ids.append(5)
        seq.num_computed_tokens += 1
    plan = SchedulerOutput((ScheduledSeq(auto, 1, 4), ScheduledSeq(fixed, 1, 2)))
    assert spec.lookahead([auto, fixed]) == {0: 4, 1: 2}
    # the steps the guard times are whole: their tokens (drafts kept and the next one) over their seconds
    spec.record_step(plan, [Accepted((3, 4, 7), 2, 4), Accepted((3, 7), 1, 2)], 0.5)
    measured = spec.guard.loads[2].on
    assert (measured.tokens, measured.seconds, measured.steps) == (5, 0.5, 1)
    _run_guard(spec.guard, 200, on_rate=10, off_rate=20, decoding=2)
    assert spec.lookahead([auto, fixed]) == {0: 0, 1: 2}  # a fixed-k request drafts as it asks


# ---- priced drafts: DraftCalibration, AdaptivePolicy.prune, the decoder's cut ----------------------------

P0 = ACCEPTANCE_PRIOR
W = CALIBRATION_PRIOR


def _after(rate: float, reached: float, kept: float) -> float:
    return (kept + W * rate) / (reached + W)


R1 = _after(P0, 1, 1)  # a place seen once and kept, after the prior
R2 = _after(R1, 1, 1)  # ... after a place at R1
R3 = _after(R2, 1, 1)


@pytest.mark.parametrize(
    "observed, match_len, expected",
    [
        ([], 3, [P0, P0**2, P0**3]),  # nothing seen: the prior at every place
        # one draft of 4 at match 3, its first token kept: place 0 went 1 / 1, place 1 0 / 1; place 2 unseen
        # is priced as place 1
        (
            [(3, 4, 1)],
            3,
            [R1, R1 * _after(R1, 1, 0), None],
        ),
        ([(3, 4, 1)], 5, [P0, P0**2, P0**3]),  # another match length learns nothing from it
        # long matches share the last bucket: a draft of 4 wholly kept, each place 1 / 1
        (
            [(16, 4, 4)],
            40,
            [R1, R1 * R2, R1 * R2 * R3],
        ),
    ],
)
def test_calibration_prices_each_place_by_its_match_length(observed, match_len, expected):
    cal = DraftCalibration()
    for m, proposed, accepted in observed:
        cal.observe("suffix", True, m, proposed, accepted)
    got = cal.probabilities("suffix", True, match_len, len(expected))
    for j, (g, e) in enumerate(zip(got, expected)):
        if e is None:  # an unseen place keeps the rate of the place before it
            e = got[j - 1] * (got[j - 1] / got[j - 2] if j >= 2 else got[0])
        assert g == pytest.approx(e)
    assert all(a >= b for a, b in zip(got, got[1:]))


def test_calibration_keys_greedy_apart_and_pools_late_places():
    cal = DraftCalibration()
    cal.observe("ngram", True, 2, 12, 12)  # a long draft wholly accepted
    assert cal.probabilities("ngram", False, 2, 1) == [P0]  # sampled requests are priced apart
    last = cal.counts[("ngram", True, 2, CALIBRATED_PLACES - 1)]
    assert last[:2] == [12 - (CALIBRATED_PLACES - 1)] * 2  # places 7..11 all count at the last place
    assert ("ngram", True, 2, CALIBRATED_PLACES) not in cal.counts


def test_calibration_forgets_so_a_cut_bucket_is_tried_again():
    cal = DraftCalibration(half_life=10)
    for _ in range(20):
        cal.observe("suffix", True, 1, 1, 0)  # one-token matches: never accepted
    low = cal.probabilities("suffix", True, 1, 1)[0]
    assert low < 0.1
    for _ in range(100):  # steps with drafts priced, none of this bucket's verified
        cal.tick()
    assert cal.probabilities("suffix", True, 1, 1)[0] > 0.6  # its evidence has faded: back near the prior


def test_calibration_best_is_the_best_match_length_and_never_below_the_prior():
    cal = DraftCalibration()
    for _ in range(10):
        cal.observe("suffix", True, 1, 1, 0)
    assert cal.best("suffix", True) == P0
    for _ in range(10):
        cal.observe("suffix", True, 12, 1, 1)
    assert cal.best("suffix", True) == pytest.approx(_after(P0, 10, 10))


STEP = lambda n: 0.010 + 0.002 * (n - 1)  # noqa: E731 (a verify row costs a fifth of a one-row step)


@pytest.mark.parametrize(
    "target, probabilities, base_tokens, sampling, expected",
    [
        # one request: 1 + .9 + .8 tokens in 14 ms beat 1.9 in 12 and 3.0 in 16 (the 0.3 does not pay)
        (STEP, [[0.9, 0.8, 0.3]], 1, 1, [2]),
        (MEMORY_BOUND, [[0.9, 0.8, 0.3]], 1, 1, [3]),  # rows cost nothing: every token with a chance
        (STEP, [[0.05, 0.01]], 1, 1, [0]),  # no draft beats not drafting
        # the likelier tokens of two drafts first, each draft cut to a prefix
        (STEP, [[0.5, 0.2], [0.95, 0.9, 0.85, 0.8]], 2, 2, [0, 4]),
        (COMPUTE_BOUND, [[0.9] * 4] * 32, 32, 32, [0] * 32),  # a draft costs what a token does: none
    ],
)
def test_prune(target, probabilities, base_tokens, sampling, expected):
    assert policy(target).prune(probabilities, base_tokens, sampling) == expected


def test_prune_keeps_whole_drafts_until_the_target_is_measured():
    assert AdaptivePolicy(4).prune([[0.01, 0.001], [0.5]], 2, 2) == [2, 1]


def test_the_decoder_cuts_priced_drafts_and_learns_from_what_was_verified():
    """An auto request's n-gram draft is cut to the tokens that pay at their calibrated chance; a fixed-k
    request's stays whole; what the verify kept is learned by match length."""
    spec = SpeculativeDecoder(NgramProposer(), num_speculative_tokens=4, max_model_len=100)
    spec.policy = policy(STEP)
    spec.calibration = DraftCalibration(half_life=10**9)  # no fading within the test
    for _ in range(50):  # 2-gram matches: the first token always kept, the second never
        spec.calibration.observe("", True, 2, 2, 1)
    prompt = [1, 2, 3, 4, 5, 6, 9, 1, 2]  # "1 2" recurs: drafts 3 4 5 6 at match length 2
    auto = make_seq(0, prompt, temperature=0.0)
    fixed = make_seq(1, prompt, temperature=0.0, speculation=4)
    plan = SchedulerOutput((ScheduledSeq(auto, 1, 4), ScheduledSeq(fixed, 1, 4)))
    drafts = spec.propose(plan)
    assert drafts is not None
    assert drafts.drafts(0) == (3,) and drafts.drafts(1) == (3, 4, 5, 6)
    before = spec.calibration.counts[("", True, 2, 0)][:2]
    spec.update(plan, [Accepted((3, 7), 1, 1), Accepted((3, 7), 1, 4)])
    after = spec.calibration.counts[("", True, 2, 0)][:2]
    assert after[0] == pytest.approx(before[0] + 1) and after[1] == pytest.approx(before[1] + 1)


def test_auto_verifies_the_priced_draft_worth_most_and_learns_from_both():
    """An auto request of an engine with two priced proposers drafts with both and verifies the draft whose
    calibrated tokens are worth most; from the target's greedy tokens both drafts are learned from, the one
    not verified and the chosen one's cut tail too."""
    proposers = {"long": NgramProposer(4, 3), "short": NgramProposer(1, 1)}
    spec = SpeculativeDecoder(proposers, num_speculative_tokens=4, max_model_len=100)
    spec.policy = policy(STEP)
    spec.calibration = DraftCalibration(half_life=10**9)
    for _ in range(50):
        spec.calibration.observe("long", True, 3, 1, 0)  # 3-gram matches of "long": never accepted
        spec.calibration.observe("short", True, 1, 2, 1)  # "short"'s 1-gram matches: the first token only
    # "1 2 3" recurs ("long" drafts 4 7 3 9 at match 3); the last "3" recurs ("short": 9 1 2 3 at match 1)
    seq = make_seq(0, [1, 2, 3, 4, 7, 3, 9, 1, 2, 3], temperature=0.0)
    plan = SchedulerOutput((ScheduledSeq(seq, 1, 4),))
    assert spec.lookahead([seq]) == {0: 4}
    drafts = spec.propose(plan)
    assert drafts is not None and drafts.drafts(0) == (9,)  # "short"'s, cut where its chance falls
    assert spec._state[0].method == "short"
    before = {key: counts[:2] for key, counts in spec.calibration.counts.items()}
    spec.update(plan, [Accepted((9, 1), 1, 1)])  # the target: 9, then 1 (where "short" drafted 1 too)
    seen = {
        key: [a - b for a, b in zip(counts[:2], before.get(key, [0, 0]))]
        for key, counts in spec.calibration.counts.items()
    }
    assert seen[("long", True, 3, 0)] == pytest.approx([1, 0])  # 4 where the target chose 9
    assert seen[("short", True, 1, 0)] == pytest.approx([1, 1])
    # the cut token was right: learned all the same
    assert seen[("short", True, 1, 1)] == pytest.approx([1, 1])
    assert ("short", True, 1, 2) not in seen  # past the target's tokens nothing is known
    assert (spec.by_method["short"], spec.by_method["long"]) == ([1, 1], [0, 0])
    # a later step with no drafts learns nothing (the last step's drafts are not scored again)
    counts = {key: c[:2] for key, c in spec.calibration.counts.items()}
    plain = SchedulerOutput((ScheduledSeq(seq, 1, 0),))
    assert spec.propose(plain) is None
    spec.update(plain, [Accepted((5,), 0, 0)])
    assert {key: c[:2] for key, c in spec.calibration.counts.items()} == counts


# ---- verify ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target_argmax, drafts, expected_accepted, expected_next",
    [
        # per sequence: the target's argmax at the last token and after each draft; the drafts
        ([[3, 4, 5]], [[3, 4]], [2], [5]),  # every draft matches: the bonus token follows
        ([[3, 4, 5]], [[3, 1]], [1], [4]),  # the second is wrong: the target's token replaces it
        ([[3, 4, 5]], [[2, 4]], [0], [3]),  # a later match does not count after a miss
        ([[3, 4, 5], [6, 0, 0]], [[3, 4], []], [2, 0], [5, 6]),  # a sequence without drafts decodes
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify(target_argmax, drafts, expected_accepted, expected_next, temperature):
    # With (all but) one-hot target distributions, a sampled row decides exactly as greedy matching does.
    k = max(len(d) for d in drafts)
    logits = torch.stack([peaked(row) for row in target_argmax])
    draft_tokens = torch.tensor([d + [0] * (k - len(d)) for d in drafts])
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(len(drafts))]
    rows = RowParams.build(params, list(range(len(drafts))), VOCAB)
    batch = VerifyBatch(
        logits, draft_tokens, torch.tensor([len(d) for d in drafts]), rows, [10] * len(drafts)
    )
    result = verify(batch)
    assert result.num_accepted.tolist() == expected_accepted
    assert result.next_token.tolist() == expected_next


def test_the_decoder_verifies_a_flat_draft_batch_in_plan_order():
    chunk = make_seq(0, [1, 2, 3, 4], decoding=False, temperature=0.0)  # mid-prompt: no logits, no result
    speculating = make_seq(1, [1, 2], temperature=0.0)
    plain = make_seq(2, [1, 2], temperature=0.0)
    plan = SchedulerOutput(
        (ScheduledSeq(chunk, 2, 0, False), ScheduledSeq(speculating, 1, 3), ScheduledSeq(plain, 1))
    )
    drafts = DraftBatch(token_ids=(5, 6, 1), cu_num_draft_tokens=(0, 0, 3, 3))
    # packed logits rows: 1 + 3 for the speculating sequence, 1 for the plain one
    logits = peaked([5, 6, 7, 0, 4])
    spec = SpeculativeDecoder(NgramProposer(), num_speculative_tokens=4, max_model_len=100)
    accepted = spec.verify(plan, drafts, logits)
    assert accepted == [Accepted((5, 6, 7), 2, 3), Accepted((4,), 0, 0)]  # "1" was rejected for 7


# ---- SpeculativeConfig ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "medusa"}, "method"),
        ({"num_speculative_tokens": 4}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
        ({"method": "ngram", "lookahead": 3}, "lookahead"),
    ],
)
def test_speculative_config_names_the_wrong_field(config, field):
    with pytest.raises(InvalidParameter) as err:
        SpeculativeConfig.from_dict(config)
    assert err.value.field == f"speculative_config.{field}"


def test_engine_config_turns_a_dict_into_a_speculative_config():
    cfg = EngineConfig(speculative_config={"method": "ngram", "prompt_lookup_max": 3})
    assert cfg.speculative_config == SpeculativeConfig("ngram", 4, None, 3, 1)
    assert EngineConfig(speculative_config={}).speculative_config is None


@pytest.mark.parametrize(
    "config, k",
    [
        ({"method": "ngram"}, 4),
        ({"method": "suffix"}, 16),  # vLLM's: the tree depth (24), here capped at the most a step takes
        ({"method": "suffix,ngram"}, 16),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 6}, 6),
        ({"method": "suffix", "num_speculative_tokens": 3}, 3),  # asked for: as asked
        ({"method": "ngram", "num_speculative_tokens": 9}, 9),
    ],
)
def test_num_speculative_tokens_defaults_by_method(config, k):
    assert SpeculativeConfig.from_dict(config).num_speculative_tokens == k
