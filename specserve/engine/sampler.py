"""Batched sampling: temperature, top-k, top-p and per-request seeds, vectorised over the rows of a step.

The token at position t of a sampled request inverts its distribution's CDF at one uniform that is a
function of (the request's seed, t) alone: no stream is consumed, so what a request draws does not depend
on its batch mates, on how many tokens a step decides for it, or on whether drafts were proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampling_params import SamplingParams


@dataclass
class RowParams:
    """Per-row sampling settings as tensors, built once per step."""

    temperature: torch.Tensor  # [R, 1], 1.0 on greedy rows (they never divide)
    top_k: torch.Tensor | None  # [R] (vocab size where off), None when no row uses it
    top_p: torch.Tensor | None  # [R], None when no row uses it
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    seeds: list[int]
    min_p: torch.Tensor | None = None  # [R], None when no row uses it

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], vocab_size: int) -> RowParams:
        greedy = [p.temperature == 0.0 for p in params]
        temps = torch.tensor([[1.0 if g else p.temperature] for p, g in zip(params, greedy)])
        top_k = None
        if any(p.top_k and not g for p, g in zip(params, greedy)):
            top_k = torch.tensor(
                [p.top_k if p.top_k and p.top_k < vocab_size else vocab_size for p in params]
            )
        top_p = None
        if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
            top_p = torch.tensor([p.top_p for p in params])
        min_p = None
        if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
            min_p = torch.tensor([p.min_p for p in params])
        return cls(temps, top_k, top_p, torch.tensor(greedy), all(greedy), seeds, min_p)

    def select(self, rows: torch.Tensor | list[int]) -> RowParams:
        idx = torch.as_tensor(rows, dtype=torch.long)
        ids = idx.tolist()
        return RowParams(
            self.temperature[idx],
            None if self.top_k is None else self.top_k[idx],
            None if self.top_p is None else self.top_p[idx],
            self.greedy[idx],
            bool(self.greedy[idx].all()),
            [self.seeds[i] for i in ids],
            None if self.min_p is None else self.min_p[idx],
        )


# Candidate widths tried before a row's whole vocabulary is sorted: a top-p or top-k row's cut almost always
# falls within its 64 most likely tokens, and torch.topk(64) over SmolLM2's 49,152 logits costs 0.04 ms a row
# where the full sort top-p used to take cost 1.8 ms (2-core EPYC, bf16 model, fp32 logits): at 32 chat
# requests in flight, half of them sampled at top_p 0.95, sampling took 58 ms a step beside a 47 ms forward.
CANDIDATE_WIDTHS = (64, 1024)


@dataclass(frozen=True)
class Nucleus:
    """Each row's sampling distribution as the tokens it can draw, in vocabulary order: probs[r, j] is the
    chance of token token_ids[r, j] (zero on padding; each row sums to 1). token_ids None: the rows span
    the whole vocabulary and probs is [R, V]."""

    token_ids: torch.Tensor | None  # [R, W] long
    probs: torch.Tensor  # [R, W] float32

    def dense(self, vocab_size: int) -> torch.Tensor:
        if self.token_ids is None:
            return self.probs
        out = torch.zeros(self.probs.shape[0], vocab_size, dtype=self.probs.dtype)
        return out.scatter_add_(1, self.token_ids, self.probs)  # padding repeats token 0 with mass 0

    def rows(self, index: torch.Tensor) -> Nucleus:
        return Nucleus(None if self.token_ids is None else self.token_ids[index], self.probs[index])

    def prob_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """[R] the chance of each row's token (zero outside its nucleus)."""
        if self.token_ids is None:
            return self.probs.gather(1, tokens[:, None]).squeeze(1)
        return (self.probs * (self.token_ids == tokens[:, None])).sum(dim=1)

    def draw(self, uniform: torch.Tensor) -> torch.Tensor:
        """[R] tokens, row r by inverting its distribution's CDF at uniform[r] in [0, 1): one draw a row,
        exact up to float64 rounding. A wide row is walked in blocks (which block, then where in it), so a
        draw over the whole vocabulary costs one pass that sums blocks, not a cumulative sum over it."""
        num_rows, width = self.probs.shape
        block = next((b for b in (256, 128, 64) if width > 4 * b and width % b == 0), width)
        blocks = self.probs.view(num_rows, width // block, block)
        block_cdf = blocks.sum(dim=2, dtype=torch.float64).cumsum(dim=1)
        target = uniform.double() * block_cdf[:, -1]
        b = _search(block_cdf, target, block_cdf.diff(dim=1, prepend=block_cdf.new_zeros(num_rows, 1)) > 0)
        before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
        inside = blocks[torch.arange(num_rows), b]  # [R, block]
        j = _search(inside.double().cumsum(dim=1), target - before, inside > 0)
        pick = b * block + j
        return pick if self.token_ids is None else self.token_ids.gather(1, pick[:, None]).squeeze(1)


def _search(cdf: torch.Tensor, target: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose cdf exceeds target, kept on an entry of positive mass (rounding may
    carry the target onto or past the row's total)."""
    at = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    last = (positive.long() * torch.arange(1, cdf.shape[1] + 1)).argmax(dim=1)
    return torch.minimum(at, last)


def _top_candidates(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `width` most likely tokens of each row with top-k, then top-p over the top-k tokens' own
    distribution, applied (vLLM's order; a token stays while the share ranked above it is below top_p), and
    whether each row's cut fell inside them."""
    vals, ids = probs.topk(width, dim=-1)
    keep = vals > 0
    resolved = torch.zeros(probs.shape[0], dtype=torch.bool)
    mass = torch.ones(probs.shape[0])  # what top-p's shares are of: the top-k tokens' mass
    uncut = torch.ones(probs.shape[0], dtype=torch.bool)  # no top-k: the whole vocabulary's mass, 1
    if top_k is not None:
        # every token tied with the k-th stays (vLLM masks only those below it: bf16 logits tie often)
        kth = vals.gather(1, (top_k - 1).clamp(max=width - 1)[:, None])
        keep &= (vals >= kth) | (top_k[:, None] > width)
        within = top_k <= width
        resolved |= within & (vals[:, -1] < kth[:, 0])  # a run of ties to the end may go on past it
        mass = torch.where(within, (vals * keep).sum(dim=-1), mass)
        uncut = top_k >= probs.shape[-1]
    if top_p is not None:
        # float64: summed from the top, float32 shares stop adding up within the tail of a flat row
        share = vals.double() * keep / mass.double()[:, None]
        cum = share.cumsum(dim=-1)
        keep &= ((cum - share) < top_p[:, None]) | (top_p[:, None] >= 1.0)
        # the next token's share above it would already be >= top_p (a top-k wider than `width` leaves the
        # shares' denominator unknown here)
        resolved |= uncut & (cum[:, -1] >= top_p)
    return vals * keep, ids, resolved


def _cut(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> Nucleus:
    """Rows whose top-k or top-p cuts the vocabulary: each as narrow as its cut allows."""
    num_rows, vocab = probs.shape
    widths = [w for w in CANDIDATE_WIDTHS if w < vocab] + [vocab]
    vals = torch.zeros(num_rows, 0)
    ids = torch.zeros(num_rows, 0, dtype=torch.long)
    pending = torch.arange(num_rows)
    for width in widths:
        sub_k = None if top_k is None else top_k[pending]
        sub_p = None if top_p is None else top_p[pending]
        v, i, resolved = _top_candidates(probs[pending], sub_k, sub_p, width)
        if width == vocab:
            resolved[:] = True
        if width > vals.shape[1]:  # widen what is kept so far (zero mass on padding)
            pad = width - vals.shape[1]
            vals = torch.cat([vals, torch.zeros(num_rows, pad)], dim=1)
            ids = torch.cat([ids, torch.zeros(num_rows, pad, dtype=torch.long)], dim=1)
        done = pending[resolved]
        vals[done] = v[resolved]
        ids[done] = i[resolved]
        pending = pending[~resolved]
        if not len(pending):
            break
    # in vocabulary order, as a dense row is: a seeded draw then picks the same token whichever form its
    # batch mates leave the step in
    ids, order = ids.sort(dim=1)
    vals = vals.gather(1, order)
    return Nucleus(ids, vals / vals.sum(dim=1, keepdim=True))


def nucleus(logits: torch.Tensor, rows: RowParams) -> Nucleus:
    """The distribution each row samples from: temperature, min_p, top-k and top-p applied in vLLM's order,
    without sorting the vocabulary where a row's cut falls among its most likely tokens (nearly always)."""
    probs = (logits.float() / rows.temperature).softmax(dim=-1)
    if rows.min_p is not None:
        floor = rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if rows.top_k is None and rows.top_p is None:
        return Nucleus(None, probs)
    vocab = probs.shape[-1]
    cuts = torch.zeros(probs.shape[0], dtype=torch.bool)
    if rows.top_k is not None:
        cuts |= rows.top_k < vocab
    if rows.top_p is not None:
        cuts |= rows.top_p < 1.0
    if bool(cuts.all()):
        return _cut(probs, rows.top_k, rows.top_p)
    # some row draws from its whole vocabulary: every row dense, the cut ones scattered back
    idx = cuts.nonzero().squeeze(1)
    if len(idx):
        sub_k = None if rows.top_k is None else rows.top_k[idx]
        sub_p = None if rows.top_p is None else rows.top_p[idx]
        probs[idx] = _cut(probs[idx], sub_k, sub_p).dense(vocab)
    return Nucleus(None, probs)


def probabilities(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """nucleus() as [R, V] probabilities (a draft model's q for rejection sampling); float32."""
    return nucleus(logits, rows).dense(logits.shape[-1])


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit words whose outputs pass BigCrush for counter inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[R] float64 U[0, 1): row r's uniform for the token at position positions[r] (its index in the
    sequence, prompt included) of a request seeded seeds[r]. A counter, not a stream: the draw for a
    position is the same whichever step decides it and however many draws came before. A request draws
    once per position; a draft model proposing that position draws the same uniform (the coupling that lets
    verification compare tokens: spec/verifier.py)."""
    return torch.tensor(
        [(_mix64(_mix64(s & _MASK64) ^ p) >> 11) * 2.0**-53 for s, p in zip(seeds, positions)],
        dtype=torch.float64,
    )


def sample(logits: torch.Tensor, rows: RowParams, positions: list[int]) -> torch.Tensor:
    """One token per row: argmax on greedy rows, on the others nucleus() inverted at the row's uniform for
    positions[r], the position the token takes in its sequence."""
    greedy_tokens = logits.argmax(dim=-1)
    if rows.all_greedy:
        return greedy_tokens
    sampled = (~rows.greedy).nonzero().squeeze(1)
    sub = rows.select(sampled)
    picked = sampled.tolist()
    drawn = nucleus(logits[sampled], sub).draw(position_uniforms(sub.seeds, [positions[i] for i in picked]))
    return greedy_tokens.index_copy(0, sampled, drawn)
