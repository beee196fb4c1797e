"""Prompt lookup (n-gram) proposer: continue the latest earlier occurrence of the sequence's last n tokens.

No model and no state: a vectorised search over prompt + output per sequence, longest n first.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specserve.engine.sequence import Sequence
from specserve.spec.proposer import Draft


class NgramProposer:
    stateless = True  # drafts it did not make may replace or extend its own (grammar-forced tokens)
    priced_drafts = True  # proposer.Proposer

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        return self.match(tokens, k)[0]

    def match(self, tokens: np.ndarray, k: int) -> tuple[list[int], int]:
        """Up to k tokens after the latest earlier occurrence of the longest final n-gram found, and n."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            # windows that start before the final n-gram itself and leave at least one token to propose
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist(), n
        return [], 0

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        drafts = {}
        for seq, k in requests:
            tokens = np.asarray(seq.token_ids, dtype=np.int64)
            draft, n = self.match(tokens, k)
            drafts[seq.seq_id] = Draft(draft, match_len=n if draft else 0)
        return drafts

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        pass
