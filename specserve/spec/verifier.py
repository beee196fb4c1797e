"""Verification of draft tokens against the target's logits, for a whole batch at once.

Each position a step decides gets the target's own token there: the argmax on a greedy row, on a sampled
row the token sampler.sample would draw at that position (its distribution's CDF inverted at the uniform of
(seed, position)). A row accepts the longest run of drafts equal to those tokens and then takes the target's
token at the first mismatch (or after the last draft). Every emitted token is the target's sample given the
tokens before it, so the output is distributed as without speculation (lossless) and is, token for token,
what the same seed gives without speculation, at any k and beside any batch mates.

Against rejection sampling (Leviathan et al. 2023), which accepts a draft with probability min(1, p/q):
that is the largest acceptance any verifier can have, but the token it emits at a position depends on
whether a draft was proposed there and on q, so a seeded request would repeat only at a fixed k. Here a
draft model draws its proposals at the same uniforms (spec/draft_model.py), so a draft is accepted where
the two CDFs put that uniform on the same token: all of them when q equals p, fewer than min(1, p/q) as
they part.

A draft tree (kernels/tree.py) is verified the same way: every node gets the target's token at the position
it decides (its depth past the first), a child is accepted where its token equals its parent's target token
and its parent was accepted, and the step emits the deepest accepted node's path and that node's target
token. Each emitted token is still the target's own at its position, so a tree is as lossless as a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampler import RowParams, nucleus, position_uniforms


@dataclass
class VerifyBatch:
    """The speculating sequences of one step, padded to K positions (K = the longest proposal)."""

    target_logits: torch.Tensor  # [S, K + 1, V] target logits at the last token and at every draft
    draft_tokens: torch.Tensor  # [S, K] (padding: 0)
    num_drafts: torch.Tensor  # [S]
    rows: RowParams  # one row per sequence
    first_position: list[int]  # [S] the sequence position of the first token the step decides
    # Given, target_logits is the forward's packed [T, V] and position j of sequence s is its row
    # index[s, j]: no padded copy is made (at 32 in flight, S x (K + 1) x V is 31 MB a step, mostly padding)
    index: torch.Tensor | None = None  # [S, K + 1]
    # Given, the drafts form a tree per sequence: parents[s, j] is the parent of node j (node 0 the last
    # token, parent -1; draft j - 1 is node j; padding nodes -1); None: chains
    parents: torch.Tensor | None = None  # [S, K + 1] long

    def positions(self, seqs: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """[real.sum(), V]: those sequences' logits at the positions `real` ([len(seqs), K + 1]) marks,
        row-major."""
        if self.index is None:
            return self.target_logits[seqs][real]
        return self.target_logits[self.index[seqs][real]]


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [S] accepted drafts
    next_token: torch.Tensor  # [S] the target's token after them
    last_node: torch.Tensor | None = None  # [S] trees only: the deepest accepted node (0: none accepted)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """[S, N] each node's depth from [S, N] parents (parents precede their children; -1 for roots and
    padding)."""
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, 0)
    return depth


def target_tokens(batch: VerifyBatch) -> torch.Tensor:
    """[S, K + 1] the target's token at every position the step decides (padding: a real one's)."""
    logits = batch.target_logits
    num_seqs, k = batch.draft_tokens.shape
    rows = batch.rows
    tokens = logits.argmax(dim=-1)  # [S, K + 1]
    if batch.index is not None:
        tokens = tokens[batch.index]
    if rows.all_greedy:
        return tokens
    # Sampled rows only, at their real positions (a row's drafts and the one after them), not at the
    # padding up to K: with one of 16 rows drafting 4, that is 20 rows, not 80.
    sampled = (~rows.greedy).nonzero().squeeze(1)
    sub = rows.select(sampled)
    counts = batch.num_drafts[sampled]
    real = torch.arange(k + 1)[None, :] <= counts[:, None]  # [s, K + 1]
    origin = torch.arange(len(sampled)).repeat_interleave(counts + 1)  # the sampled row of each real position
    if batch.parents is None:
        ahead = torch.arange(k + 1).expand(len(sampled), -1)
    else:
        ahead = tree_depths(batch.parents)[sampled]
    offset = ahead[real]  # each real position's distance past first
    first = [batch.first_position[i] for i in sampled.tolist()]
    seeds = [sub.seeds[r] for r in origin.tolist()]
    where = [first[r] + j for r, j in zip(origin.tolist(), offset.tolist())]
    p = nucleus(batch.positions(sampled, real), sub.select(origin))
    drawn = tokens[sampled].masked_scatter(real, p.draw(position_uniforms(seeds, where)))
    tokens[sampled] = drawn
    return tokens


def verify(batch: VerifyBatch) -> VerifyResult:
    if batch.parents is not None:
        return _verify_tree(batch)
    k = batch.draft_tokens.shape[1]
    valid = torch.arange(k)[None, :] < batch.num_drafts[:, None]  # [S, K]
    target = target_tokens(batch)
    accept = (target[:, :k] == batch.draft_tokens) & valid
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # leading run of acceptances
    return VerifyResult(num_accepted, target.gather(1, num_accepted[:, None]).squeeze(1))


def _verify_tree(batch: VerifyBatch) -> VerifyResult:
    num_seqs, k = batch.draft_tokens.shape
    parents = batch.parents
    target = target_tokens(batch)
    valid = torch.arange(k)[None, :] < batch.num_drafts[:, None]
    alive = torch.zeros(num_seqs, k + 1, dtype=torch.bool)
    alive[:, 0] = True
    for i in range(1, k + 1):  # parents precede children: one pass in node order
        p = parents[:, i].clamp(min=0)[:, None]
        matches = batch.draft_tokens[:, i - 1] == target.gather(1, p)[:, 0]
        alive[:, i] = alive.gather(1, p)[:, 0] & matches & valid[:, i - 1] & (parents[:, i] >= 0)
    depth = tree_depths(parents)
    # the deepest accepted node; siblings carry distinct tokens, and on a tie the lowest index wins
    key = torch.where(alive, depth * (k + 1) + (k - torch.arange(k + 1))[None, :], -1)
    last = key.argmax(dim=1)
    return VerifyResult(depth.gather(1, last[:, None])[:, 0], target.gather(1, last[:, None])[:, 0], last)
