"""Verification of draft tokens against the target's logits, for a whole batch at once.

Greedy rows accept the longest prefix equal to the target's argmax. Sampled rows use rejection sampling
(Leviathan et al. 2023; Chen et al. 2023): accept draft x with probability min(1, p(x) / q(x)); at the first
rejection draw from norm(max(0, p - q)); when every draft survives draw a bonus token from p. The emitted
tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampler import RowParams, per_row_draws, probabilities


@dataclass
class VerifyBatch:
    """Padded view of the speculating sequences of one step (K = the longest proposal)."""

    target_logits: torch.Tensor  # [S, K + 1, V] target logits at the last token and at every draft
    draft_tokens: torch.Tensor  # [S, K] (padding: 0)
    num_drafts: torch.Tensor  # [S]
    draft_probs: torch.Tensor | None  # [S, K, V]; None: every proposal is one-hot (n-gram or greedy)
    rows: RowParams  # one row per sequence


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [S] accepted drafts
    next_token: torch.Tensor  # [S] the token after them: recovered on rejection, bonus otherwise


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row: what to draw from after rejecting a draft."""
    diff = (p - q).clamp(min=0)
    mass = diff.sum(dim=1, keepdim=True)
    # p == q exactly leaves no residual; rejection then had probability 0, and p itself is right.
    return torch.where(mass > 0, diff / mass.clamp(min=1e-30), p)


def verify(batch: VerifyBatch, fallback: torch.Generator) -> VerifyResult:
    logits = batch.target_logits
    num_seqs, k_plus_1, vocab = logits.shape
    k = k_plus_1 - 1
    rows = batch.rows
    valid = torch.arange(k)[None, :] < batch.num_drafts[:, None]  # [S, K]
    target_argmax = logits.argmax(dim=-1)  # [S, K + 1]
    accept = target_argmax[:, :k] == batch.draft_tokens

    if not rows.all_greedy:
        per_pos = rows.per_position(k_plus_1)
        p = probabilities(logits.reshape(-1, vocab), per_pos).view(num_seqs, k_plus_1, vocab)
        p_draft = p[:, :k].gather(2, batch.draft_tokens[:, :, None]).squeeze(2)  # p(x) [S, K]
        if batch.draft_probs is None:
            q = None
            q_draft = torch.ones_like(p_draft)
        else:
            q = batch.draft_probs
            q_draft = q.gather(2, batch.draft_tokens[:, :, None]).squeeze(2)
        u = per_row_draws(rows, k, fallback, "uniform")
        stochastic_accept = u * q_draft < p_draft  # u < p/q without dividing by a zero q
        accept = torch.where(rows.greedy[:, None], accept, stochastic_accept)

    accept &= valid
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # leading run of acceptances
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # greedy rows: argmax there

    if not rows.all_greedy:
        at = num_accepted[:, None, None].expand(-1, 1, vocab)
        p_at = p.gather(1, at).squeeze(1)  # [S, V] target distribution at the stop position
        rejected = num_accepted < batch.num_drafts
        residual = p_at
        if rejected.any():
            if q is None:
                # one-hot q: the residual is p with the rejected token removed
                q_at = torch.zeros_like(p_at)
                rejected_tok = batch.draft_tokens.gather(1, num_accepted.clamp(max=max(k - 1, 0))[:, None])
                q_at.scatter_(1, rejected_tok, 1.0)
            else:
                q_at = q.gather(1, num_accepted.clamp(max=max(k - 1, 0))[:, None, None].expand(-1, 1, vocab))
                q_at = q_at.squeeze(1)
            residual = torch.where(rejected[:, None], residual_distribution(p_at, q_at), p_at)
        noise = per_row_draws(rows, vocab, fallback, "exponential")
        drawn = (residual / noise).argmax(dim=-1)
        next_token = torch.where(rows.greedy, next_token, drawn)
    return VerifyResult(num_accepted, next_token)
