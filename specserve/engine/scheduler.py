"""Iteration-level scheduler: who runs this step and how many tokens each computes, and, after the step,
what its accepted tokens do to each sequence.

Every step, running sequences go first (FIFO), each asking for its remaining prefill chunk or one decode
token plus k speculative lookahead slots; then waiting sequences are admitted in arrival order while the
per-step token budget, max_num_seqs and the KV pool allow. When the pool runs dry, a sequence's lookahead is
dropped first, then the most recently admitted sequence is preempted (its blocks freed, recomputed later).
With prefix caching, an admitted sequence starts from its longest cached prefix (those tokens are not
computed again); the prompt blocks a step will fill are named when it is planned, and after each step the
blocks its committed tokens fill, for later sequences; a
preempted sequence's blocks become evictable cache, so its recompute often finds them.

A step's limits (its tokens, the slots left for admissions, and the two shares below) are one StepBudget,
made when the step is planned, which grants each sequence its tokens and is charged for them.

With prefill_tokens_beside_decode set, a step in which some running sequence decodes computes at most that
many prompt tokens (running prompts' chunks first, then admissions); the rest wait for the next step, so
arrivals' prefill stretches no decode step by more than that (_prefill_share says why).

With policy "priority" (vLLM's scheduling_policy), order is (priority, arrival) instead of arrival: the
waiting queue is kept in that order, running sequences are scheduled in it (so the one preempted when memory
runs dry is the lowest priority, latest arrival), and a waiting sequence that outranks the lowest running one
preempts it when there is no slot or no KV room to admit it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specserve.blockmgr import BlockManager
from specserve.engine.sequence import SeqStatus, Sequence
from specserve.engine.step import Accepted, ScheduledSeq, SchedulerOutput

# A prompt-logprobs request's prefill chunk returns logits for every position: [chunk, vocab] floats, 50 MB
# for a 49k vocabulary, 268 MB for Gemma's 262k, instead of the whole step budget's worth.
PROMPT_LOGPROBS_CHUNK = 256

POLICIES = ("fcfs", "priority")

# Priority policy: how long worse bands stay at their background share after the last better sequence left.
# Interactive clients send their next request right after the last answer, and it reaches the engine tens of
# ms later; without this, the batch behind them ran one step of all its rows in that gap (64 rows: 330-430 ms
# on the 2-core EPYC, fp32, against ~30 ms for a step of 2 interactive + 2 background rows), and the arrival
# waited for that step to end: most of bench/shared_queue.py's busy TTFT (614 ms against 174 idle). While
# it lingers, a step of the share lasts ~25 ms, so an arrival waits that long at most; a batch alone (no
# better band ever present) never lingers.
BACKGROUND_LINGER_S = 0.25

# Given the running sequences, how many draft tokens each decoding one may propose this step (seq_id -> k).
LookaheadPolicy = Callable[[list[Sequence]], dict[int, int]]


@dataclass(slots=True)
class StepBudget:
    """What one step may still hand out, and the one place its limits are applied and spent (vLLM v1's
    token_budget, with this scheduler's other three beside it):

        tokens      query tokens and lookahead slots of the whole step (max_num_batched_tokens)
        slots       sequences that may still be admitted (max_num_seqs less those running; a step that
                    preempted admits nobody, so its victims' slots are never handed out again in it)
        prefill     prompt tokens left beside decoding sequences (Scheduler._prefill_share); None: no bound
        background  tokens left to the sequences of a worse band than `best` (Scheduler._background_share);
                    None: everyone present is of one band and nobody is held back
    """

    tokens: int
    slots: int
    prefill: int | None = None
    background: int | None = None
    best: int = 0

    def is_background(self, seq: Sequence) -> bool:
        return self.background is not None and seq.priority > self.best

    def grant(self, seq: Sequence, wanted: int, prefill: bool) -> int:
        """Of `wanted` tokens (a prefill chunk, or 1 when decoding), how many `seq` may compute this step;
        0 when a share it draws on is spent."""
        n = min(wanted, self.tokens)
        if self.is_background(seq):
            n = min(n, self.background)
        if prefill and self.prefill is not None:
            n = min(n, self.prefill)
        return n

    def lookahead(self, seq: Sequence, n: int, wanted: int) -> int:
        """KV slots for draft tokens past `n` computed ones: from the step's tokens, never for background."""
        return 0 if self.is_background(seq) else min(wanted, self.tokens - n)

    def spend(self, seq: Sequence, n: int, k: int, prefill: bool) -> None:
        """`n` tokens computed and `k` lookahead slots given to a running sequence."""
        self.tokens -= n + k
        if self.is_background(seq):
            self.background -= n
        if prefill and self.prefill is not None:
            self.prefill -= n

    def admit(self, seq: Sequence, n: int) -> None:
        """A waiting sequence admitted with its first `n` prompt tokens."""
        self.slots -= 1
        self.spend(seq, n, 0, prefill=True)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Collection[int] = (),
        enable_chunked_prefill: bool = True,
        lookahead: LookaheadPolicy | None = None,
        policy: str = "fcfs",
        background_tokens: int = 1,
        background_linger_s: float | None = None,
        prefill_tokens_beside_decode: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, not {policy!r}")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chunked = enable_chunked_prefill
        self.lookahead = lookahead
        self.by_priority = policy == "priority"
        # Priority policy: tokens per step that sequences of a worse band than the best one present share
        # (see _background_share); the rest of them pause, holding their KV, while better work runs.
        self.background_tokens = background_tokens
        # ... and keep sharing for this long after the better work has left (see _background_share)
        self.background_linger_s = BACKGROUND_LINGER_S if background_linger_s is None else background_linger_s
        self.prefill_tokens_beside_decode = prefill_tokens_beside_decode
        self._clock = clock
        self._best = 0  # the best band present, while a share applies
        self._best_seen: float | None = None  # when a better band than the worst present was last seen
        self._turn = 0  # rotates which background sequences get the share
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache (vLLM's name)
        self.prefix_hits = 0  # of those, found there

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, int]:
        return seq.priority, seq.seq_id  # seq ids count arrivals

    def _insert_waiting(self, seq: Sequence) -> None:
        rank = self._rank(seq)
        at = next((i for i, w in enumerate(self.waiting) if self._rank(w) > rank), len(self.waiting))
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ---------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        displaced = self._displace_for_waiting() if self.by_priority else []
        budget = self._step_budget()
        scheduled, preempted = self._schedule_running(budget)
        if not preempted:  # memory is short: admitting now would only preempt again next step
            # nor is one displaced this step taken back in it (the room was made for the better one)
            scheduled += self._schedule_waiting(budget, {s.seq_id for s in displaced}, scheduled)
        return SchedulerOutput(tuple(scheduled), tuple(displaced + preempted))

    def _step_budget(self) -> StepBudget:
        background = self._background_share() if self.by_priority else None  # rotates the background turn
        return StepBudget(
            tokens=self.max_num_batched_tokens,
            slots=self.max_num_seqs - len(self.running),
            prefill=self._prefill_share(),
            background=background,
            best=self._best,
        )

    def _displace_for_waiting(self) -> list[Sequence]:
        """Priority policy: order the running sequences by rank (the last is the first to go), then preempt
        the lowest while the best waiting sequence outranks it and has no slot or no KV room for its first
        chunk. A displaced sequence waits behind it and is recomputed when there is room again."""
        self.running.sort(key=self._rank)
        displaced: list[Sequence] = []
        while self.waiting and self.running and self._rank(self.waiting[0]) < self._rank(self.running[-1]):
            head = self.waiting[0]
            chunk = min(head.num_tokens - head.num_computed_tokens, self.max_num_batched_tokens)
            if len(self.running) < self.max_num_seqs and self.bm.blocks_for(chunk) <= self.bm.num_free_blocks:
                break
            victim = self._make_room()
            if victim is not None:
                displaced.append(victim)
        return displaced

    def _background_share(self) -> int | None:
        """Priority policy: when sequences of different bands are present (running or waiting),
        those of a worse band than the best are background and share `background_tokens` per step; the
        others of them pause, keeping their KV. A step's time grows with its rows on a CPU (each row is
        ~2.7 ms of fp32 compute for SmolLM2 on the 2-core EPYC, against ~27 ms for one read of the weights),
        so a batch job running beside interactive requests would otherwise stretch every one of their tokens.
        None when everyone is of one band: then nobody is held back. Members take turns (the background part
        of `running` is rotated by step), so none of them waits for good. When the better work has all gone,
        the share holds for `background_linger_s` more (BACKGROUND_LINGER_S says why)."""
        bands = [s.priority for s in self.running] + [w.priority for w in self.waiting]
        if not bands:
            return None
        now = self._clock()
        if min(bands) < max(bands):
            self._best, self._best_seen = min(bands), now
        elif (
            self._best_seen is None
            or min(bands) <= self._best
            or now - self._best_seen > self.background_linger_s
        ):
            self._best_seen = None
            return None
        # else the better work has just left: whoever is present stays background for the linger
        split = next((i for i, s in enumerate(self.running) if s.priority > self._best), len(self.running))
        background = self.running[split:]
        if background:
            self._turn += 1
            at = self._turn % len(background)
            self.running[split:] = background[at:] + background[:at]
        return self.background_tokens

    def _prefill_share(self) -> int | None:
        """Prompt tokens this step may compute, when some running sequence is decoding and a bound is set
        (prefill_tokens_beside_decode > 0); None: up to the step budget. Every decoding sequence waits for
        the whole step, and a step's time grows with its prompt tokens on a CPU (~1 ms a token in bf16 on
        the 2-core Zen 4 EPYC): with 16 streams in flight and arrivals' prompts of ~280 tokens, a step that
        prefilled them took 316-648 ms against ~40 ms for a decode step, the p99 of inter-token latency in
        bench/serve_peer.py. Without chunked prefill a prompt cannot be split, so no bound applies."""
        cap = self.prefill_tokens_beside_decode
        if not cap or not self.chunked or not any(s.in_decode for s in self.running):
            return None
        return cap

    def _schedule_running(self, budget: StepBudget) -> tuple[list[ScheduledSeq], list[Sequence]]:
        ks = self.lookahead(self.running) if self.lookahead is not None and self.running else {}
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            seq = self.running[i]
            prefill = not seq.in_decode
            wanted = seq.num_tokens - seq.num_computed_tokens
            if seq.wants_prompt_rows:
                wanted = min(wanted, PROMPT_LOGPROBS_CHUNK)
            n = budget.grant(seq, wanted, prefill)
            if not n:
                i += 1  # a share it draws on is spent: paused this step, its KV kept
                continue
            k = budget.lookahead(seq, n, ks.get(seq.seq_id, 0)) if seq.in_decode else 0
            if k and not self._allocate(seq, n + k):
                k = 0  # speculation yields to memory before anyone is preempted
            while not self._allocate(seq, n + k):
                victim = self._make_room()
                if victim is not None:
                    preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: nobody behind it can run either
            scheduled.append(ScheduledSeq(seq, n, k, seq.num_computed_tokens + n == seq.num_tokens))
            self._name_scheduled(seq, n)
            budget.spend(seq, n, k, prefill)
            i += 1
        return scheduled, preempted

    def _schedule_waiting(
        self, budget: StepBudget, stop_at: set[int] = frozenset(), running: Seq[ScheduledSeq] = ()
    ) -> list[ScheduledSeq]:
        """Admit waiting sequences in order while the step has room; `running`: what this step already
        computes of the running ones. A sequence whose prompt another is still computing waits for it (see
        _computing_its_prompt) and keeps its place; those behind it are not held up by it."""
        scheduled: list[ScheduledSeq] = []
        named = {s.seq.seq_id: s.seq.num_computed_tokens + s.num_tokens for s in running}
        deferred: list[Sequence] = []
        while self.waiting and budget.tokens > 0 and budget.slots > 0:
            seq = self.waiting[0]
            if seq.seq_id in stop_at:
                break
            if self._computing_its_prompt(seq, named):
                deferred.append(self.waiting.popleft())
                continue
            # before the prefix lookup, which touches the cache: admissions wait for a step with room
            room = budget.grant(seq, budget.tokens, prefill=True)
            if not room:
                break
            # prompt logprobs need every prompt position computed: no prefix cache hit then
            cached = self.bm.allocate_prefix(seq.seq_id, [] if seq.wants_prompt_rows else seq.token_ids)
            seq.num_computed_tokens = cached
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, room, PROMPT_LOGPROBS_CHUNK if seq.wants_prompt_rows else room)
            if (not self.chunked and remaining > room) or not self._allocate(seq, n):
                self.bm.free(seq.seq_id)  # the cached blocks go back, still cached
                seq.num_computed_tokens = 0
                break  # FIFO: a later, smaller request does not jump the queue
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n, 0, n == remaining))
            named[seq.seq_id] = seq.num_computed_tokens + n
            self._name_scheduled(seq, n)
            budget.admit(seq, n)
        self.waiting.extendleft(reversed(deferred))
        return scheduled

    def _computing_its_prompt(self, seq: Sequence, named: dict[int, int]) -> bool:
        """Whether a running sequence, after this step (`named`: where this step leaves those it computes),
        still has to compute a prompt that starts with seq's first block. seq then waits and takes those
        blocks from the prefix cache once they are named, instead of computing them again beside it: n
        choices of one prompt whose first asks for prompt logprobs, which computes its prompt
        PROMPT_LOGPROBS_CHUNK tokens a step while the others would each compute the rest of it, or a long
        prompt chunked over steps with copies arriving meanwhile."""
        if not self.bm.enable_prefix_caching or seq.wants_prompt_rows or seq.num_output_tokens:
            return False
        size = self.bm.block_size
        head = seq.prompt_token_ids[:size]
        if len(head) < size:
            return False
        for r in self.running:
            done = named.get(r.seq_id, r.num_computed_tokens)
            if not r.num_output_tokens and done < r.num_prompt_tokens and r.prompt_token_ids[:size] == head:
                return True
        return False

    def _name_scheduled(self, seq: Sequence, n: int) -> None:
        """Name the prompt blocks this step's forward fills, before it runs, as vLLM v1 does: a sequence
        admitted later in the same step (n > 1 choices, a burst of one system prompt) then starts after them.
        Each layer writes the whole batch's K/V before any attention reads it, so a block filled and read
        in one forward holds its values when it is read. Only prompt tokens: generated ones are named once
        accepted (update)."""
        if not seq.num_output_tokens:
            self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)

    def _allocate(self, seq: Sequence, num_new_slots: int) -> bool:
        return self.bm.ensure(seq.seq_id, seq.num_computed_tokens + num_new_slots)

    def _make_room(self) -> Sequence | None:
        """Free blocks for the running loop: preempt the most recently admitted sequence (returned)."""
        victim = self.running.pop()  # under the priority policy, running is in rank order
        self.bm.free(victim.seq_id)
        victim.num_computed_tokens = 0
        victim.status = SeqStatus.WAITING
        if self.by_priority:
            self._insert_waiting(victim)
        else:
            self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    # ---- update -----------------------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, accepted: Seq[Accepted]) -> list[Sequence]:
        """Apply a step's results (accepted[i] belongs to plan.scheduled[i]): advance the cache, append the
        tokens up to the first stop token or length limit, give back rejected drafts' KV. Returns the
        sequences this finished."""
        finished = []
        for s, acc in zip(plan.scheduled, accepted):
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens + acc.num_accepted_drafts
            seq.draft_proposed += acc.num_draft_tokens
            seq.draft_accepted += acc.num_accepted_drafts
            if not acc.token_ids:  # a prefill chunk: its full blocks can be shared already
                self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
                continue
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            reason = None
            for j, token in enumerate(acc.token_ids):
                seq.token_ids.append(token)
                if acc.logprobs is not None and seq.logprobs is not None:
                    seq.logprobs.append(acc.logprobs[j])
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    break
            self.bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif s.num_lookahead:
                # Keep room for the tokens we have, free whole blocks past them (the rejected drafts').
                self.bm.truncate(seq.seq_id, seq.num_tokens)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and give its blocks back. On a finished one (a stop string
        found after a length stop, in the same step's tokens), only the reason changes."""
        was_running = seq.status is SeqStatus.RUNNING
        if was_running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            seq.finish_reason = reason
            return
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq, was_running)

    def _release(self, seq: Sequence, was_running: bool) -> None:
        self.bm.free(seq.seq_id)
