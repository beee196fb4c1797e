"""Iteration-level scheduler: who runs this step and how many tokens each computes.

Every step, running sequences go first (FIFO), each asking for its remaining prefill chunk or one decode
token plus k speculative lookahead slots; then waiting sequences are admitted in arrival order while the
per-step token budget, max_num_seqs and the KV pool allow. When the pool runs dry, a sequence's lookahead is
dropped first, then the most recently admitted sequence is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.blockmgr import BlockManager
from specserve.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of the sequence computed this step (a prefill chunk, or 1 when decoding)
    num_lookahead: int = 0  # KV slots reserved past them for draft tokens (the proposer fills up to this)

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's end, so this step yields its next token."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class PadRow:
    """A finished member of a padded static batch: still computed, one token a step, output thrown away."""

    seq_id: int
    token_id: int
    position: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    padding: list[PadRow] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens + s.num_lookahead for s in self.scheduled)


# Given the running sequences, how many draft tokens each decoding one may propose this step (seq_id -> k).
LookaheadPolicy = Callable[[list[Sequence]], dict[int, int]]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        static_batching: bool = False,
        lookahead: LookaheadPolicy | None = None,
        static_padding: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.static = static_batching
        self.pad = static_batching and static_padding
        self.max_model_len = max_model_len
        self.padding: list[PadRow] = []
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.static and not self.running:
            self._admit_static_batch()

        ks = self.lookahead(self.running) if self.lookahead is not None and self.running else {}
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            k = 0
            if seq.in_decode and ks:
                k = min(ks.get(seq.seq_id, 0), budget - n)
            while not self.bm.ensure(seq.seq_id, seq.num_computed_tokens + n + k):
                if k:
                    k = 0  # speculation yields to memory before anyone is preempted
                    continue
                if self.padding:
                    self.bm.free(self.padding.pop().seq_id)  # and padding before real work
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n, k))
                budget -= n + k
                index += 1
                continue
            break  # the sequence preempted itself: nobody behind it can run either

        if self.static:
            out.padding = self._pad_rows() if self.running else []
            return out
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if not self.chunked and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.bm.ensure(seq.seq_id, seq.num_computed_tokens + n):
                break  # FIFO: a later, smaller request does not jump the queue
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _admit_static_batch(self) -> None:
        """Static batching (benchmark baseline): a new batch starts only when the previous one is done."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _pad_rows(self) -> list[PadRow]:
        """Advance every padding row one position; a row with no room (context or KV) stops being computed."""
        rows = []
        for row in self.padding:
            row.position += 1
            fits = self.max_model_len is None or row.position < self.max_model_len
            if fits and self.bm.ensure(row.seq_id, row.position + 1):
                rows.append(row)
            else:
                self.bm.free(row.seq_id)
        self.padding = rows
        return rows

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and give its blocks back."""
        was_running = seq.status is SeqStatus.RUNNING
        if was_running:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.pad and was_running and self.running and seq.num_computed_tokens:
            # _pad_rows moves it one on before its first use: position of its last token, which has no K/V yet
            self.padding.append(PadRow(seq.seq_id, seq.token_ids[-1], seq.num_computed_tokens - 1))
            return
        self.bm.free(seq.seq_id)
        if self.padding and not self.running:  # the batch is over
            for row in self.padding:
                self.bm.free(row.seq_id)
            self.padding.clear()
