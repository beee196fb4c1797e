"""Verification of draft tokens against the target's logits, for a whole batch at once.

Greedy rows accept the longest prefix equal to the target's argmax. Sampled rows use rejection sampling
(Leviathan et al. 2023; Chen et al. 2023): accept draft x with probability min(1, p(x) / q(x)); at the first
rejection draw from norm(max(0, p - q)); when every draft survives draw a bonus token from p. The emitted
tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampler import Nucleus, RowParams, nucleus, per_row_uniform


@dataclass
class VerifyBatch:
    """The speculating sequences of one step, padded to K positions (K = the longest proposal)."""

    target_logits: torch.Tensor  # [S, K + 1, V] target logits at the last token and at every draft
    draft_tokens: torch.Tensor  # [S, K] (padding: 0)
    num_drafts: torch.Tensor  # [S]
    draft_probs: torch.Tensor | None  # [S, K, V]; None: every proposal is one-hot (n-gram or greedy)
    rows: RowParams  # one row per sequence
    # Given, target_logits is the forward's packed [T, V] and position j of sequence s is its row
    # index[s, j]: no padded copy is made (at 32 in flight, S x (K + 1) x V is 31 MB a step, mostly padding)
    index: torch.Tensor | None = None  # [S, K + 1]

    def positions(self, seqs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """[real.sum(), V]: those sequences' logits at the positions `real` ([len(seqs), K + 1]) marks,
        row-major."""
        if self.index is None:
            return self.target_logits[seqs][real]
        return self.target_logits[self.index[seqs][real]]


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
    vocab = logits.shape[-1]
    num_seqs, k = batch.draft_tokens.shape
    k_plus_1 = k + 1
    rows = batch.rows
    valid = torch.arange(k)[None, :] < batch.num_drafts[:, None]  # [S, K]
    target_argmax = logits.argmax(dim=-1)  # [S, K + 1]
    if batch.index is not None:
        target_argmax = target_argmax[batch.index]
    accept = (target_argmax[:, :k] == batch.draft_tokens) & valid
    if rows.all_greedy:
        num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # leading run of acceptances
        return VerifyResult(num_accepted, target_argmax.gather(1, num_accepted[:, None]).squeeze(1))

    # Sampled rows only: their distribution at each real position (a row's drafts and the one after
    # them), not at the padding up to K: with one of 16 rows drafting 4, that is 20 rows, not 80.
    sampled = (~rows.greedy).nonzero().squeeze(1)
    sub = rows.select(sampled)
    s = len(sampled)
    counts = batch.num_drafts[sampled]
    real = torch.arange(k_plus_1)[None, :] <= counts[:, None]  # [s, K + 1]
    # position -> its row among the real ones; padding maps to its row's last real one
    flat = real.long().view(-1).cumsum(0).view(s, k_plus_1) - 1
    origin = torch.arange(s).repeat_interleave(counts + 1)  # the sampled row each real position belongs to
    p = nucleus(batch.positions(sampled, real), sub.select(origin))
    drafts = batch.draft_tokens[sampled]  # [s, K]
    padded = torch.cat([drafts, torch.zeros(s, 1, dtype=torch.long)], dim=1)  # a token at every position
    p_draft = p.prob_of(padded[real]).gather(0, flat.view(-1)).view(s, k_plus_1)[:, :k]  # p(x) [s, K]
    q = batch.draft_probs[sampled] if batch.draft_probs is not None else None
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, drafts[:, :, None]).squeeze(2)
    u = per_row_uniform(sub, k, fallback, counts.tolist())  # its own drafts' worth
    accept[sampled] = (u * q_draft < p_draft) & valid[sampled]  # u < p/q without dividing by a zero q
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # greedy rows: argmax there

    at = num_accepted[sampled]  # where each sampled row stops
    p_at = p.rows(flat.gather(1, at[:, None]).squeeze(1))  # the target distribution there
    rejected = at < counts
    stop = at.clamp(max=max(k - 1, 0))  # the rejected draft's position (k > 0 wherever one was rejected)
    if not bool(rejected.any()):
        residual = p_at  # every draft accepted: the bonus token comes from p
    elif q is None:  # one-hot q: p with the rejected token removed
        residual = p_at.without(drafts.gather(1, stop[:, None]).squeeze(1), rejected)
    else:
        q_at = q.gather(1, stop[:, None, None].expand(-1, 1, vocab)).squeeze(1)
        p_dense = p_at.dense(vocab)
        dense = torch.where(rejected[:, None], residual_distribution(p_dense, q_at), p_dense)
        residual = Nucleus(None, dense)
    drawn = residual.draw(per_row_uniform(sub, 1, fallback)[:, 0])
    return VerifyResult(num_accepted, next_token.index_copy(0, sampled, drawn))
