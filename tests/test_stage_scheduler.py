"""The scheduler as a stage: hand-made sequences and Accepted results in, plans and sequence state out.

Block size 4 throughout, so a sequence of n tokens holds ceil(n / 4) blocks.
"""

from __future__ import annotations

import pytest

from specserve.blockmgr import BlockManager
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler, StepBudget
from specserve.engine.sequence import SeqStatus, Sequence
from specserve.engine.static_scheduler import StaticScheduler
from specserve.engine.step import NOTHING, Accepted

EOS = 2
BLOCK = 4


def make_seq(seq_id: int, prompt_len: int, **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    prompt = [10 + i for i in range(prompt_len)]
    return Sequence(
        seq_id, f"r{seq_id}", prompt, SamplingParams(**params), detokenizer=None, arrival_time=0.0
    )


def decoding(seq_id: int, prompt_len: int, **params) -> Sequence:
    """A running sequence whose prompt is in the cache and whose first output token is not yet."""
    seq = make_seq(seq_id, prompt_len, **params)
    seq.token_ids.append(7)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SeqStatus.RUNNING
    return seq


def scheduler(num_blocks=64, budget=64, max_num_seqs=8, ks=None, chunked=True, cls=Scheduler, **kw):
    lookahead = (lambda running: dict(ks)) if ks else None
    return cls(
        BlockManager(num_blocks, BLOCK),
        max_num_seqs,
        budget,
        max_model_len=1000,
        eos_token_ids=[EOS],
        enable_chunked_prefill=chunked,
        lookahead=lookahead,
        **kw,
    )


def run(sched: Scheduler, seq: Sequence) -> None:
    sched.running.append(seq)
    assert sched.bm.ensure(seq.seq_id, seq.num_tokens)


def plan_rows(plan):
    return [(s.seq.seq_id, s.num_tokens, s.num_lookahead, s.samples) for s in plan.scheduled]


# ---- schedule: who runs, how many tokens, how much lookahead ----------------------------------------------


@pytest.mark.parametrize(
    "prompts, budget, max_num_seqs, chunked, expected",
    [
        # (prompt lengths waiting), token budget, max_num_seqs, chunked prefill -> (id, tokens, k, samples)
        ([5, 3], 64, 8, True, [(0, 5, 0, True), (1, 3, 0, True)]),
        ([20], 8, 8, True, [(0, 8, 0, False)]),  # a chunk mid-prompt samples nothing
        ([6, 6], 8, 8, True, [(0, 6, 0, True), (1, 2, 0, False)]),  # the budget's rest goes to the next
        ([6, 6], 8, 8, False, [(0, 6, 0, True)]),  # without chunking a prompt waits for a whole budget
        ([2, 2, 2], 64, 2, True, [(0, 2, 0, True), (1, 2, 0, True)]),  # max_num_seqs
    ],
)
def test_admission(prompts, budget, max_num_seqs, chunked, expected):
    sched = scheduler(budget=budget, max_num_seqs=max_num_seqs, chunked=chunked)
    for i, n in enumerate(prompts):
        sched.add(make_seq(i, n))
    assert plan_rows(sched.schedule()) == expected


@pytest.mark.parametrize(
    "num_blocks, ks, expected_rows, expected_preempted",
    [
        # two decoding sequences of 8 tokens (7 in the cache, 2 blocks each) ask for k drafts each
        (8, {0: 3, 1: 3}, [(0, 1, 3, True), (1, 1, 3, True)], []),  # 8 + 3 slots: 3 blocks each, room
        (5, {0: 3, 1: 3}, [(0, 1, 3, True), (1, 1, 0, True)], []),  # no room for 1's drafts: k dropped
        (4, {0: 3, 1: 3}, [(0, 1, 0, True), (1, 1, 0, True)], []),  # nor for 0's: both decode plainly
        (4, {0: 3, 1: 0}, [(0, 1, 0, True), (1, 1, 0, True)], []),
    ],
)
def test_running_sequences_drop_lookahead_before_anyone_is_preempted(
    num_blocks, ks, expected_rows, expected_preempted
):
    sched = scheduler(num_blocks=num_blocks, ks=ks)
    for i in range(2):
        run(sched, decoding(i, 7))
    plan = sched.schedule()
    assert plan_rows(plan) == expected_rows
    assert [s.seq_id for s in plan.preempted] == expected_preempted


def test_when_memory_runs_out_the_last_admitted_is_preempted_and_nobody_is_admitted():
    sched = scheduler(num_blocks=4)
    first, second = decoding(0, 7), decoding(1, 7)  # 8 tokens: 2 blocks each, the pool is full
    for seq in (first, second):
        run(sched, seq)
    first.token_ids.append(8)  # 0 now needs a third block for its next decode
    first.num_computed_tokens += 1
    sched.add(make_seq(2, 1))
    plan = sched.schedule()
    assert plan_rows(plan) == [(0, 1, 0, True)]
    assert plan.preempted == (second,)
    assert second.status is SeqStatus.WAITING and second.num_computed_tokens == 0
    assert [s.seq_id for s in sched.waiting] == [1, 2]  # the preempted goes first when room returns
    assert sched.num_preemptions == 1


# ---- update: what a step's Accepted does to a sequence -------------------------------------------------


@pytest.mark.parametrize(
    "params, lookahead, accepted, tokens_after, computed_after, reason, blocks_after",
    [
        # 8 tokens, 7 cached; the plan gave it 1 token + lookahead k. Accepted: tokens, drafts accepted.
        ({}, 0, Accepted((30,)), [7, 30], 8, None, 2),  # the next step asks for the next block
        ({}, 3, Accepted((30, 31, 32), 2, 3), [7, 30, 31, 32], 10, None, 3),  # 11 tokens: 3 blocks
        ({}, 3, Accepted((30,), 0, 3), [7, 30], 8, None, 3),  # all rejected: 9 tokens keep 3 blocks
        ({}, 7, Accepted((30,), 0, 7), [7, 30], 8, None, 3),  # 15 slots asked, 4 blocks; 1 freed
        ({}, 3, Accepted((30, EOS, 32), 2, 3), [7, 30, EOS], 10, "stop", 0),  # EOS ends it, blocks freed
        ({"ignore_eos": True}, 3, Accepted((30, EOS, 32), 2, 3), [7, 30, EOS, 32], 10, None, 3),
        ({"stop_token_ids": [31]}, 3, Accepted((31, 32), 1, 3), [7, 31], 9, "stop", 0),
        ({"max_tokens": 3}, 3, Accepted((30, 31, 32), 2, 3), [7, 30, 31], 10, "length", 0),
    ],
)
def test_update(params, lookahead, accepted, tokens_after, computed_after, reason, blocks_after):
    sched = scheduler(ks={0: lookahead} if lookahead else None)
    seq = decoding(0, 7, **params)
    run(sched, seq)
    plan = sched.schedule()
    assert plan_rows(plan) == [(0, 1, lookahead, True)]
    finished = sched.update(plan, [accepted])
    assert seq.output_token_ids == tokens_after
    assert seq.num_computed_tokens == computed_after
    assert seq.finish_reason == reason
    assert finished == ([seq] if reason else [])
    assert len(sched.bm.block_table(0)) == blocks_after
    assert (seq.draft_proposed, seq.draft_accepted) == (
        accepted.num_draft_tokens,
        accepted.num_accepted_drafts,
    )


def test_a_prefill_in_chunks_then_its_first_token_then_a_decode():
    sched = scheduler(budget=8)
    seq = make_seq(0, 12)
    sched.add(seq)
    steps = []
    for result in (NOTHING, Accepted((40,)), Accepted((41,))):
        plan = sched.schedule()
        steps.append(plan_rows(plan))
        sched.update(plan, [result])
    assert steps == [[(0, 8, 0, False)], [(0, 4, 0, True)], [(0, 1, 0, True)]]
    assert seq.output_token_ids == [40, 41] and seq.num_computed_tokens == 13
    assert seq.first_token_time is not None


# ---- static batching (the benchmark's baseline) ---------------------------------------------------------


def test_static_batches_admit_nobody_until_the_batch_is_done():
    sched = scheduler(max_num_seqs=2, cls=StaticScheduler)
    first, second = make_seq(0, 2, max_tokens=1), make_seq(1, 2, max_tokens=2)
    for seq in (first, second, make_seq(2, 2)):
        sched.add(seq)
    plan = sched.schedule()
    assert plan_rows(plan) == [(0, 2, 0, True), (1, 2, 0, True)]
    sched.update(plan, [Accepted((30,)), Accepted((31,))])
    assert first.is_finished  # its slot stays empty: 2 waits for the whole batch
    plan = sched.schedule()
    assert plan_rows(plan) == [(1, 1, 0, True)]
    sched.update(plan, [Accepted((32,))])
    assert second.finish_reason == "length"
    assert plan_rows(sched.schedule()) == [(2, 2, 0, True)]


def test_a_padded_static_batch_computes_finished_rows_on():
    sched = scheduler(max_num_seqs=2, cls=StaticScheduler, padding=True)
    short, long = decoding(0, 3, max_tokens=2), decoding(1, 3, max_tokens=5)
    for seq in (short, long):
        run(sched, seq)
    plan = sched.schedule()
    sched.update(plan, [Accepted((30,)), Accepted((31,))])
    assert short.finish_reason == "length" and sched.bm.block_table(0)  # keeps its blocks as padding
    padding = [sched.schedule().padding for _ in range(2)]
    # its last token (position 4, no K/V yet) is computed, then the positions after it
    assert [[(r.seq_id, r.token_id, r.position) for r in p] for p in padding] == [[(0, 30, 4)], [(0, 30, 5)]]
    sched.finish(long, "abort")
    assert not sched.bm.tables  # the batch is over: padding freed with it


# ---- the priority policy (vLLM's scheduling_policy="priority"): lower `priority` first ----------------


def ranked(seq: Sequence, priority: int) -> Sequence:
    seq.priority = priority
    return seq


def test_priority_admits_the_best_waiting_first_whatever_its_arrival():
    sched = scheduler(max_num_seqs=2, policy="priority")
    for seq_id, priority in [(0, 5), (1, 0), (2, 5), (3, -1)]:
        sched.add(ranked(make_seq(seq_id, 3), priority))
    assert [s.seq_id for s in sched.waiting] == [3, 1, 0, 2]  # rank, then arrival
    plan = sched.schedule()
    assert [s.seq.seq_id for s in plan.scheduled] == [3, 1] and plan.preempted == ()


def test_a_better_arrival_preempts_the_worst_running_when_no_slot_is_free():
    sched = scheduler(max_num_seqs=2, policy="priority")
    low, worse = ranked(decoding(0, 3), 5), ranked(decoding(1, 3), 7)
    for seq in (low, worse):
        run(sched, seq)
    sched.add(ranked(make_seq(2, 3), 0))
    plan = sched.schedule()
    assert plan.preempted == (worse,)  # the lowest rank goes, not the latest admitted
    assert [s.seq.seq_id for s in plan.scheduled] == [0, 2]
    assert worse.status is SeqStatus.WAITING and worse.num_computed_tokens == 0
    assert sched.bm.num_free_blocks == 64 - 1 - 1  # its block was freed: 0 holds one, 2's prompt one
    assert [s.seq_id for s in sched.waiting] == [1]


def test_an_equal_or_worse_arrival_preempts_nobody_and_fcfs_never_does():
    for policy, priority in [("priority", 5), ("priority", 9), ("fcfs", -100)]:
        sched = scheduler(max_num_seqs=2, policy=policy)
        for seq in (ranked(decoding(0, 3), 5), ranked(decoding(1, 3), 5)):
            run(sched, seq)
        sched.add(ranked(make_seq(2, 3), priority))
        plan = sched.schedule()
        assert plan.preempted == () and [s.seq.seq_id for s in plan.scheduled] == [0, 1], policy


def test_a_better_arrival_preempts_for_kv_room_too():
    sched = scheduler(num_blocks=4, max_num_seqs=8, policy="priority")
    a, b = ranked(decoding(0, 7), 3), ranked(decoding(1, 7), 1)  # 2 blocks each: the pool is full
    for seq in (a, b):
        run(sched, seq)
    sched.add(ranked(make_seq(2, 3), 0))
    plan = sched.schedule()
    assert plan.preempted == (a,)  # rank 3 is the worst, though b was admitted later
    assert sorted(s.seq.seq_id for s in plan.scheduled) == [1, 2]


def test_when_memory_runs_out_under_priority_the_worst_rank_is_preempted():
    sched = scheduler(num_blocks=4, policy="priority")
    worst, best = ranked(decoding(0, 7), 9), ranked(decoding(1, 7), 0)
    for seq in (worst, best):
        run(sched, seq)
    best.token_ids.append(8)  # the best now needs a third block
    best.num_computed_tokens += 1
    plan = sched.schedule()
    assert plan.preempted == (worst,) and plan_rows(plan) == [(1, 1, 0, True)]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        scheduler(policy="lifo")


def test_background_bands_share_a_few_tokens_a_step_while_better_work_runs():
    """Beside a band-0 sequence, band-5 sequences share `background_tokens` per step, taking turns, and keep
    their KV while paused; alone, they run in full."""
    sched = scheduler(max_num_seqs=8, policy="priority", background_tokens=2)
    bg = [ranked(decoding(i, 3), 5) for i in range(4)]
    for seq in bg:
        run(sched, seq)
    alone = sched.schedule()
    assert sorted(s.seq.seq_id for s in alone.scheduled) == [0, 1, 2, 3]
    fg = ranked(decoding(9, 3), 0)
    run(sched, fg)
    picked = []
    for _ in range(4):
        plan = sched.schedule()
        rows = {s.seq.seq_id: s.num_tokens for s in plan.scheduled}
        assert rows.pop(9) == 1 and sum(rows.values()) == 2 and plan.preempted == ()
        picked += list(rows)
    assert sorted(set(picked)) == [0, 1, 2, 3]  # every background sequence got turns
    assert all(len(sched.bm.block_table(s.seq_id)) == 1 for s in bg)  # paused ones kept their blocks


def test_a_waiting_better_sequence_holds_background_admissions_and_prefill_to_the_share():
    sched = scheduler(budget=64, max_num_seqs=8, policy="priority", background_tokens=2)
    sched.add(ranked(make_seq(0, 20), 5))
    sched.add(ranked(make_seq(1, 20), 0))
    plan = sched.schedule()
    rows = {s.seq.seq_id: s.num_tokens for s in plan.scheduled}
    assert rows == {1: 20, 0: 2}  # the band-0 prompt whole, the band-5 one two tokens of it


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_background_keeps_its_share_for_a_linger_after_the_better_work_leaves():
    """The next interactive request reaches the engine tens of ms after the last one finished: for
    background_linger_s the background bands keep their share instead of running all their rows in one
    long step that the arrival would wait behind. After it, they run in full."""
    clock = FakeClock()
    sched = scheduler(
        max_num_seqs=8, policy="priority", background_tokens=2, background_linger_s=0.25, clock=clock
    )
    bg = [ranked(decoding(i, 3), 5) for i in range(4)]
    for seq in bg:
        run(sched, seq)
    fg = ranked(decoding(9, 3), 0)
    run(sched, fg)
    assert sum(s.num_tokens for s in sched.schedule().scheduled if s.seq.priority == 5) == 2
    sched.finish(fg, "stop")
    clock.now = 0.2  # within the linger: still the share, though only band 5 is left
    plan = sched.schedule()
    assert len(plan.scheduled) == 2 and all(s.seq.priority == 5 for s in plan.scheduled)
    clock.now = 0.3  # past it: everyone runs
    assert sorted(s.seq.seq_id for s in sched.schedule().scheduled) == [0, 1, 2, 3]
    # and stays so: the linger follows better work only
    clock.now = 10.0
    assert len(sched.schedule().scheduled) == 4


def test_a_band_alone_never_lingers_and_the_best_band_is_never_held():
    clock = FakeClock()
    sched = scheduler(max_num_seqs=8, policy="priority", background_linger_s=0.25, clock=clock)
    for i in range(4):
        run(sched, ranked(decoding(i, 3), 5))
    assert len(sched.schedule().scheduled) == 4  # a batch alone from the start runs in full
    fg = ranked(decoding(9, 3), 0)
    run(sched, fg)
    sched.schedule()
    for seq in list(sched.running):
        if seq.priority == 5:
            sched.finish(seq, "stop")
    plan = sched.schedule()  # the best band left alone within the linger is not background
    assert plan_rows(plan) == [(9, 1, 0, True)]


# ---- prefill beside decodes --------------------------------------------------------------------------------


def test_prefill_beside_decodes_is_bounded_running_chunks_first_then_admissions():
    sched = scheduler(budget=64, prefill_tokens_beside_decode=6)
    run(sched, decoding(0, 5))
    mid_prompt = make_seq(1, 20)
    run(sched, mid_prompt)
    mid_prompt.status, mid_prompt.num_computed_tokens = SeqStatus.RUNNING, 16  # 4 prompt tokens left
    sched.add(make_seq(2, 10))
    sched.add(make_seq(3, 10))
    # the decode, the running prompt's 4 tokens, then 2 of the arrival's; the next arrival waits
    assert plan_rows(sched.schedule()) == [(0, 1, 0, True), (1, 4, 0, True), (2, 2, 0, False)]
    assert [s.seq_id for s in sched.waiting] == [3]


def test_prefill_beside_decodes_leaves_a_spent_share_s_running_prompt_waiting_with_its_kv():
    sched = scheduler(budget=64, prefill_tokens_beside_decode=3, ks={0: 2})
    first, second = make_seq(1, 10), make_seq(2, 10)
    run(sched, first)
    run(sched, second)
    run(sched, decoding(0, 5))
    for s in (first, second):
        s.status, s.num_computed_tokens = SeqStatus.RUNNING, 4
    blocks = sched.bm.num_free_blocks
    # decodes are not prompt tokens: the decode keeps its lookahead whatever the share
    assert plan_rows(sched.schedule()) == [(1, 3, 0, False), (0, 1, 2, True)]
    assert second.status is SeqStatus.RUNNING and sched.bm.num_free_blocks <= blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_without_decodes_or_chunking_prefill_takes_the_whole_budget(chunked):
    sched = scheduler(budget=64, prefill_tokens_beside_decode=4, chunked=chunked)
    sched.add(make_seq(0, 30))
    sched.add(make_seq(1, 20))
    assert plan_rows(sched.schedule()) == [(0, 30, 0, True), (1, 20, 0, True)]
    if not chunked:  # a prompt cannot be split, so nothing bounds it even beside a decode
        run(sched, decoding(2, 5))
        sched.add(make_seq(3, 12))
        assert (3, 12, 0, True) in plan_rows(sched.schedule())


def test_prefill_beside_decode_must_be_a_non_negative_integer():
    from specserve.engine.config import EngineConfig

    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="prefill_tokens_beside_decode"):
            EngineConfig(prefill_tokens_beside_decode=bad)


def test_step_budget_grants_within_every_limit_and_is_charged_for_it():
    budget = StepBudget(tokens=10, slots=2, prefill=6, background=3, best=0)
    urgent, batch = make_seq(1, 8), make_seq(2, 8)
    batch.priority = 1
    assert not budget.is_background(urgent) and budget.is_background(batch)
    assert budget.grant(urgent, 8, prefill=True) == 6  # the prefill share
    assert budget.grant(urgent, 1, prefill=False) == 1  # a decode draws on tokens alone
    assert budget.grant(batch, 8, prefill=True) == 3  # the background share
    assert budget.lookahead(urgent, 1, 4) == 4 and budget.lookahead(batch, 1, 4) == 0
    assert budget.lookahead(urgent, 8, 4) == 2  # lookahead slots come out of the step's tokens
    budget.spend(urgent, 1, 4, prefill=False)
    budget.admit(batch, 3)
    assert (budget.tokens, budget.slots, budget.prefill, budget.background) == (2, 1, 3, 0)
    assert budget.grant(batch, 8, prefill=False) == 0  # its share is spent: it pauses this step
    assert budget.grant(urgent, 8, prefill=True) == 2
