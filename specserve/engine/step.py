"""The messages between the stages of one engine step, as plain frozen data.

    SchedulerOutput --propose--> DraftBatch --forward--> logits --sample / verify--> Accepted per sequence
    --> Scheduler.update(plan, accepted) --> OutputProcessor.process(plan, accepted) --> StepDelta

Each stage can be tested alone by building its input by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.outputs import TokenLogprobs
from specserve.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of the sequence computed this step (a prefill chunk, or 1 when decoding)
    num_lookahead: int = 0  # KV slots reserved past them for draft tokens (the proposer fills up to this)
    samples: bool = True  # the chunk reaches the sequence's end, so this step yields its next token


@dataclass(frozen=True, slots=True)
class PadRow:
    """A finished member of a padded static batch (benchmark only): computed on, its output dropped."""

    seq_id: int
    token_id: int
    position: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    padding: tuple[PadRow, ...] = ()


@dataclass(frozen=True, slots=True)
class DraftBatch:
    """Every draft token of a step, flat, in plan order: plan.scheduled[i]'s are
    token_ids[cu_num_draft_tokens[i] : cu_num_draft_tokens[i + 1]] (vLLM v1's SpecDecodeMetadata)."""

    token_ids: tuple[int, ...]
    cu_num_draft_tokens: tuple[int, ...]  # len(plan.scheduled) + 1 offsets, starting at 0
    # Per scheduled sequence, the parents of its verify rows where its drafts form a tree (kernels/tree.py:
    # row 0 the last token, draft j is row j + 1); None where every sequence drafted a chain
    parents: tuple[tuple[int, ...] | None, ...] | None = None

    def tree(self, i: int) -> tuple[int, ...] | None:
        return None if self.parents is None else self.parents[i]

    def num_drafts(self, i: int) -> int:
        return self.cu_num_draft_tokens[i + 1] - self.cu_num_draft_tokens[i]

    def drafts(self, i: int) -> tuple[int, ...]:
        return self.token_ids[self.cu_num_draft_tokens[i] : self.cu_num_draft_tokens[i + 1]]


@dataclass(frozen=True, slots=True)
class Accepted:
    """One scheduled sequence's result: the tokens to append (accepted drafts, then the sampled one)."""

    token_ids: tuple[int, ...] = ()  # empty mid-prompt
    num_accepted_drafts: int = 0
    num_draft_tokens: int = 0  # drafts verified this step
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token, when the request asked
    # A draft tree's accepted path: its verify rows, root first (the emitted tokens' rows); None for chains
    path: tuple[int, ...] | None = None


NOTHING = Accepted()
