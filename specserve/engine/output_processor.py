"""From appended tokens to what callers see: detokenizing, stop strings, and per-step deltas.

The one place that calls the detokenizer. Token-level stops (EOS, stop ids, lengths) are the scheduler's;
stop strings are found here because only text shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

from specserve.engine.outputs import StepDelta, Usage
from specserve.engine.sequence import Sequence
from specserve.engine.step import Accepted, SchedulerOutput


class OutputProcessor:
    def __init__(self, finish: Callable[[Sequence, str], None]) -> None:
        self.finish = finish  # the scheduler's: a stop string ends a sequence like any other stop

    def process(self, plan: SchedulerOutput, accepted: Seq[Accepted]) -> list[StepDelta]:
        """Text and deltas for the sequences that got tokens (accepted[i] is plan.scheduled[i]'s)."""
        deltas: list[StepDelta] = []
        for s, acc in zip(plan.scheduled, accepted):
            seq = s.seq
            if not acc.token_ids:
                continue
            if seq.params.stop and self._find_stop(seq, len(acc.token_ids)):
                self.finish(seq, "stop")
            elif seq.is_finished:
                self._finalize(seq)
            elif not seq.params.stop:
                seq.text += seq.detokenizer.step(seq.token_ids)
            if seq.stream or seq.is_finished:
                deltas.append(self.delta(seq))
        return deltas

    def _find_stop(self, seq: Sequence, num_new: int) -> bool:
        """Detokenize the new tokens one by one; at a completed stop string cut text and tokens there."""
        stops = seq.params.stop
        longest = max(map(len, stops))
        new = seq.token_ids[len(seq.token_ids) - num_new :]
        del seq.token_ids[len(seq.token_ids) - num_new :]
        for token in new:
            seq.token_ids.append(token)
            # A stop string completed by this token ends inside its new text; it may start just before it.
            tail_from = max(0, len(seq.text) - longest + 1)
            seq.text += seq.detokenizer.step(seq.token_ids)
            if seq.num_output_tokens < seq.params.min_tokens:  # too early for a stop string (vLLM's rule)
                continue
            for stop in stops:
                at = seq.text.find(stop, tail_from)
                if at != -1:
                    seq.text = seq.text[:at]
                    return True
        return False

    def _finalize(self, seq: Sequence) -> None:
        # After a stop (EOS or stop id) with stop strings set, the text was already decoded token by token
        # and a final flush could reveal text the stop-string check never saw.
        if seq.finish_reason != "stop" or not seq.params.stop:
            seq.text += seq.detokenizer.step(seq.token_ids, final=True)

    def aborted(self, seqs: Iterable[Sequence]) -> list[StepDelta]:
        deltas = []
        for seq in seqs:
            self._finalize(seq)
            deltas.append(self.delta(seq))
        return deltas

    def delta(self, seq: Sequence) -> StepDelta:
        final = seq.is_finished
        hold = 0 if final or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        text_end = max(seq.num_emitted_chars, len(seq.text) - hold)
        delta = StepDelta(
            request_id=seq.request_id,
            offset=seq.num_emitted_tokens,
            token_ids=seq.output_token_ids[seq.num_emitted_tokens :],
            text=seq.text[seq.num_emitted_chars : text_end],
            finished=final,
            finish_reason=seq.finish_reason,
        )
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            delta.prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        if seq.logprobs is not None:  # a stop string may have cut tokens whose logprobs were kept
            delta.logprobs = seq.logprobs[seq.num_emitted_tokens : seq.num_output_tokens]
        seq.num_emitted_tokens = seq.num_output_tokens
        seq.num_emitted_chars = text_end
        if final:
            delta.first_token_time = seq.first_token_time
            delta.usage = Usage(
                seq.num_prompt_tokens,
                seq.num_output_tokens,
                seq.draft_proposed,
                seq.draft_accepted,
                seq.num_cached_tokens,
                seq.usage_by_method(),
            )
        return delta
