"""Batched sampling: temperature, top-k, top-p and per-request seeds, vectorised over the rows of a step.

Random draws use the exponential-race form (argmax p / E, E ~ Exp(1)), which samples exactly from p and
lets every seeded request draw its noise from its own generator: its tokens do not depend on batch mates.
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
    generators: list[torch.Generator | None]
    min_p: torch.Tensor | None = None  # [R], None when no row uses it

    @classmethod
    def build(
        cls, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int
    ) -> RowParams:
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
        return cls(temps, top_k, top_p, torch.tensor(greedy), all(greedy), generators, min_p)

    def select(self, rows: torch.Tensor | list[int]) -> RowParams:
        idx = torch.as_tensor(rows, dtype=torch.long)
        ids = idx.tolist()
        return RowParams(
            self.temperature[idx],
            None if self.top_k is None else self.top_k[idx],
            None if self.top_p is None else self.top_p[idx],
            self.greedy[idx],
            bool(self.greedy[idx].all()),
            [self.generators[i] for i in ids],
            None if self.min_p is None else self.min_p[idx],
        )

    def per_position(self, n: int) -> RowParams:
        """Each row repeated n times in place (a speculative step's positions of one sequence)."""
        rep = torch.arange(len(self.generators)).repeat_interleave(n)
        return self.select(rep)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (at least one token always survives)."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).clamp(min=0)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def probabilities(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """The distribution each row samples from (temperature, min_p, top-k, top-p applied, in vLLM's order);
    float32."""
    logits = logits / rows.temperature
    if rows.min_p is not None:
        probs = logits.softmax(dim=-1)
        floor = rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    logits = apply_top_k_top_p(logits, rows.top_k, rows.top_p)
    return logits.softmax(dim=-1)


def per_row_draws(rows: RowParams, width: int, fallback: torch.Generator, kind: str) -> torch.Tensor:
    """Exp(1) ("exponential") or U(0, 1) ("uniform") draws per row from the row's own generator (the
    engine's where it has none); greedy rows draw nothing and consume no RNG, and hold 1 (or 0)."""
    draws = (
        torch.ones(len(rows.generators), width)
        if kind == "exponential"
        else torch.zeros(len(rows.generators), width)
    )
    for i, (gen, greedy) in enumerate(zip(rows.generators, rows.greedy.tolist())):
        if not greedy:
            getattr(draws[i], kind + "_")(generator=gen if gen is not None else fallback)
    return draws


def sample(logits: torch.Tensor, rows: RowParams, fallback: torch.Generator) -> torch.Tensor:
    """One token per row: argmax on greedy rows, a draw from probabilities() on the others."""
    greedy_tokens = logits.argmax(dim=-1)
    if rows.all_greedy:
        return greedy_tokens
    probs = probabilities(logits, rows)
    noise = per_row_draws(rows, probs.shape[-1], fallback, "exponential")
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(rows.greedy, greedy_tokens, drawn)
