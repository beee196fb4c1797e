"""What a proposer returns, and the interface both proposers implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specserve.engine.sequence import Sequence


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]  # up to k proposed tokens (may be fewer, or none)
    # A draft tree (kernels/tree.py) whose node 0 is the last token: token_ids[i - 1] is node i's token and
    # parents[i] its parent (parents[0] = -1); None: a chain
    parents: list[int] | None = None
    # How many tokens of the context the draft continues (a suffix tree's or n-gram's match); 0: not known.
    # The decoder prices a draft's tokens by what drafts of that match length did (policy.DraftCalibration).
    match_len: int = 0

    def best_chain(self) -> Draft:
        """A tree's first-child path (each node's most likely child comes first), as a chain."""
        if self.parents is None:
            return self
        chain, node = [], 0
        while child := next((c for c in range(node + 1, len(self.parents)) if self.parents[c] == node), None):
            chain.append(self.token_ids[child - 1])
            node = child
        return Draft(chain)


class Proposer(Protocol):
    # Proposers whose drafts cost next to nothing to make and say their match_len (suffix, n-gram) set
    # `priced_drafts = True`: an "auto" request then drafts as far as the proposer finds and the decoder
    # keeps what pays (SpeculativeDecoder._price), rather than asking for k up front.
    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        """Up to k draft tokens for each (sequence, k); keyed by seq_id."""
        ...

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Verification kept num_accepted of the proposal: roll back whatever state went past it."""
        ...

    def forget(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop its state (a draft cache's blocks)."""
        ...
