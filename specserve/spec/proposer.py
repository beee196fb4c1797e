"""What a proposer returns, and the interface both proposers implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # up to k proposed tokens (may be fewer, or none)
    # The draft's distribution at each proposed position [len(token_ids), vocab] (request's temperature,
    # top-k, top-p applied), which rejection sampling needs. None: the proposal is deterministic (n-gram
    # lookup, or a greedy request), i.e. a one-hot q.
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[tuple[Sequence, int]], generator: torch.Generator) -> dict[int, Draft]:
        """Up to k draft tokens for each (sequence, k); keyed by seq_id."""
        ...

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Verification kept num_accepted of the proposal: roll back whatever state went past it."""
        ...

    def forget(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop its state (a draft cache's blocks)."""
        ...
