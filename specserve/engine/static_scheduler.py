"""Static batching, the benchmark's baseline (bench/throughput.py): a new batch starts only when the previous
one is done. With padding, a finished member keeps its slot and is computed on, its output dropped, until
the batch ends (HF generate's padded batches); without, finished members leave the batch.

Kept out of Scheduler so that production scheduling carries none of it.
"""

from __future__ import annotations

from specserve.engine.scheduler import Scheduler, StepBudget
from specserve.engine.sequence import SeqStatus, Sequence
from specserve.engine.step import PadRow, SchedulerOutput


class StaticScheduler(Scheduler):
    def __init__(self, *args, padding: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pad = padding
        self.padding: list[PadRow] = []

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting.popleft()
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
        # a static batch is admitted above, whole, and shares no step with other work: tokens alone bound it
        scheduled, preempted = self._schedule_running(StepBudget(self.max_num_batched_tokens, slots=0))
        padding = self._pad_rows() if self.running else ()
        return SchedulerOutput(tuple(scheduled), tuple(preempted), tuple(padding))

    def _make_room(self) -> Sequence | None:
        if self.padding:  # padding goes before real work does
            self.bm.free(self.padding.pop().seq_id)
            return None
        return super()._make_room()

    def _pad_rows(self) -> list[PadRow]:
        """Advance every padding row one position; a row with no room (context or KV) stops being computed."""
        rows = []
        for row in self.padding:
            position = row.position + 1
            if position < self.max_model_len and self.bm.ensure(row.seq_id, position + 1):
                rows.append(PadRow(row.seq_id, row.token_id, position))
            else:
                self.bm.free(row.seq_id)
        self.padding = rows
        return rows

    def _release(self, seq: Sequence, was_running: bool) -> None:
        if self.pad and was_running and self.running and seq.num_computed_tokens:
            # _pad_rows moves it one on before its first use: position of its last token, which has no K/V yet
            self.padding.append(PadRow(seq.seq_id, seq.token_ids[-1], seq.num_computed_tokens - 1))
            return
        self.bm.free(seq.seq_id)
        if self.padding and not self.running:  # the batch is over
            for row in self.padding:
                self.bm.free(row.seq_id)
            self.padding.clear()
