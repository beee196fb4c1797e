"""The thread team chosen by trial (engine/cpu_tuning.py TeamTuner): its decisions on fake step timings, and
an engine whose team changes between steps still producing HF's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS

from specserve import LLM, SamplingParams
from specserve.engine.cpu_tuning import TeamTuner, TrialPlan, team_tuner

PLAN = TrialPlan(warmup=1, measured=3, margin=0.05, first_hold=4, max_hold=16, comparable=0.75)

# A fake machine: seconds a step of `tokens` takes at team `size`, the step's index given.
Machine = Callable[[int, int, int], float]


def run(tuner: TeamTuner, machine: Machine, steps: int, tokens: Callable[[int], int] = lambda i: 64):
    """Steps the tuner through `steps` steps; the team each step ran at."""
    sizes = []
    for i in range(steps):
        size = tuner.size
        sizes.append(size)
        tuner.observe(tokens(i), machine(size, tokens(i), i))
    return sizes


def rates(full: float, smaller: float) -> Machine:
    """Tokens per second at the full team (2) and one fewer (1)."""
    return lambda size, tokens, i: tokens / (full if size == 2 else smaller)


# hold 4, trial (1 + 3 steps at the other size, then 1 + 3 at the chosen one), hold 8, trial, hold 16, ...
QUIET_TRIALS = [*[2] * 4, *[1] * 4, *[2] * 4, *[2] * 8, *[1] * 4, *[2] * 4, *[2] * 16, *[1] * 4, *[2] * 4]


@pytest.mark.parametrize(
    ("case", "machine", "tokens", "expected"),
    [
        # quiet: the full team is faster; each trial keeps it and the hold doubles, up to max_hold
        ("quiet", rates(450, 225), lambda i: 64, QUIET_TRIALS),
        # a neighbour: one thread fewer runs 30 % faster, taken at the first trial; the next trial (after
        # first_hold again) tries the full team, which is still slower
        (
            "busy neighbour",
            rates(200, 260),
            lambda i: 64,
            [*[2] * 4, *[1] * 4, *[2] * 4, *[1] * 4, *[2] * 4, *[1] * 4, *[1] * 8],
        ),
        # within the margin: not worth a change
        ("within margin", rates(250, 260), lambda i: 64, QUIET_TRIALS),
        # the other size ran prefill chunks of 512 tokens, the chosen one decode steps of 64: nothing
        # decided, the hold stays first_hold
        (
            "incomparable steps",
            rates(250, 400),
            lambda i: 512 if 4 <= i < 8 else 64,
            [*[2] * 4, *[1] * 4, *[2] * 4, *[2] * 4, *[1] * 4, *[2] * 4],
        ),
    ],
)
def test_decisions(case, machine, tokens, expected):
    tuner = TeamTuner(2, PLAN)
    assert run(tuner, machine, len(expected), tokens) == expected, case


def test_warmup_steps_are_not_counted():
    """The first step after a change is slow whatever the size (primitives rebuilt): left out, the smaller
    team's faster steps decide."""
    tuner = TeamTuner(2, PLAN)
    slow_first = {4, 8}  # the first step of each half of the trial

    def machine(size: int, tokens: int, i: int) -> float:
        return 100.0 if i in slow_first else tokens / (200 if size == 2 else 260)

    run(tuner, machine, 12)
    assert tuner.chosen == 1 and tuner.size == 1 and tuner.trials == 1


def test_neighbour_leaving_brings_the_full_team_back():
    tuner = TeamTuner(2, PLAN)
    busy = rates(200, 260)
    quiet = rates(450, 225)
    run(tuner, busy, 12)
    assert tuner.chosen == 1
    run(tuner, quiet, 12)  # first_hold at one thread, then the trial of the full team
    assert tuner.chosen == 2 and tuner.size == 2


def test_larger_budget_tries_one_fewer():
    tuner = TeamTuner(4, PLAN)
    sizes = run(tuner, lambda size, tokens, i: tokens / (300 if size == 4 else 400), 12)
    assert sizes == [*[4] * 4, *[3] * 4, *[4] * 4]
    assert tuner.chosen == 3


def test_who_gets_a_tuner(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert isinstance(team_tuner(2, True), TeamTuner)
    assert team_tuner(2, False) is None  # adaptive_threads off
    assert team_tuner(1, True) is None  # nothing smaller to try
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert team_tuner(2, True) is None  # the operator's team rules
    with pytest.raises(ValueError, match="no smaller size"):
        TeamTuner(1)


def test_engine_changing_team_between_steps_matches_hf(tiny_model_factory, hf_reference, monkeypatch):
    """A tuner trying sizes every few steps: the engine sets each size it asks for, and greedy output stays
    HF's, token for token."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    llm = LLM(str(tiny_model_factory("llama_gqa_tied")), dtype="float32")
    engine = llm.engine
    try:
        if torch.get_num_threads() < 2:
            torch.set_num_threads(2)  # a one-CPU runner still switches between two and one
        engine._team = TeamTuner(2, TrialPlan(warmup=1, measured=1, first_hold=1, max_hold=2))
        seen: set[int] = set()
        original = engine._forward

        def forward(plan, drafts):
            seen.add(torch.get_num_threads())
            return original(plan, drafts)

        engine._forward = forward
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy)
        assert seen == {1, 2}
        assert engine._team.trials > 0
        assert [o.token_ids for o in outs] == hf_reference("llama_gqa_tied")
    finally:
        torch.set_num_threads(before)


def test_engine_setting_turns_it_off(tiny_model_factory, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_model_factory("llama_gqa_tied")), dtype="float32", adaptive_threads=False)
        assert llm.engine._team is None
        llm = LLM(str(tiny_model_factory("llama_gqa_tied")), dtype="float32", batch_invariant=True)
        assert llm.engine._team is None
    finally:
        torch.set_num_threads(before)
