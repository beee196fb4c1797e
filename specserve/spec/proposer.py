"""What a proposer returns, and the interface both proposers implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # up to k proposed tokens (may be fewer, or none)


class Proposer(Protocol):
    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        """Up to k draft tokens for each (sequence, k); keyed by seq_id."""
        ...

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Verification kept num_accepted of the proposal: roll back whatever state went past it."""
        ...

    def forget(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop its state (a draft cache's blocks)."""
        ...
