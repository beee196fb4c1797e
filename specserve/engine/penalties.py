"""Logit adjustments that depend on what a sequence has generated (vLLM's and OpenAI's): logit_bias,
min_tokens, repetition, frequency and presence penalties, applied per position so they stay exact inside a
speculative step.

At verify position j of a step the sequence's output is its committed output plus drafts 0..j-1 (they are
what it will have generated if position j is reached), so position j is adjusted with those counts: the
target distribution at every position is the one a step without speculation would sample from, and greedy
and rejection-sampled acceptance stay lossless. The order is vLLM's: bias and min_tokens, then the
penalties; temperature, min_p, top-k and top-p follow in the sampler. Logprobs are read from the logits
before any of this (vLLM's raw logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import Sequence


def adjusts(params: SamplingParams) -> bool:
    """Whether a request changes its logits beyond temperature, top-k, top-p and min_p."""
    return bool(
        params.logit_bias
        or params.min_tokens
        or params.repetition_penalty != 1.0
        or params.frequency_penalty
        or params.presence_penalty
        or params.bad_words
    )


def adjust_logits(
    logits: torch.Tensor,
    seqs: Seq[Sequence],
    draft_tokens: torch.Tensor | None,
    eos_token_ids: Seq[int],
) -> torch.Tensor:
    """logits [S, J, V]: sequence s's positions 0..J-1 of this step; draft_tokens [S, J - 1] (or None when
    J == 1) the tokens before positions 1..J-1. Returns adjusted logits (a new tensor when any row
    adjusts; `logits` itself otherwise)."""
    rows = [i for i, seq in enumerate(seqs) if adjusts(seq.params)]
    if not rows:
        return logits
    out = logits.clone()
    num_pos, vocab = logits.shape[1], logits.shape[2]
    for i in rows:
        seq, p = seqs[i], seqs[i].params
        row = out[i].float()  # [J, V]
        # Output counts before each position: committed output, then the drafts before it.
        counts = torch.zeros(num_pos, vocab)
        out_ids = seq.output_token_ids
        if out_ids:
            counts += torch.bincount(torch.tensor(out_ids), minlength=vocab)[:vocab].float()
        if num_pos > 1 and draft_tokens is not None:
            seen = torch.zeros(num_pos, vocab)
            seen[torch.arange(1, num_pos), draft_tokens[i, : num_pos - 1]] = 1.0
            counts += seen.cumsum(dim=0)
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
            bias = torch.tensor([v for t, v in p.logit_bias.items() if t < vocab])
            row[:, ids] += bias
        if p.min_tokens:
            generated = seq.num_output_tokens + torch.arange(num_pos)
            early = generated < p.min_tokens
            stops = {*p.stop_token_ids} | (set() if p.ignore_eos else {*eos_token_ids})
            if stops and bool(early.any()):
                row[early[:, None] & _one_hot(stops, vocab)[None, :]] = float("-inf")
        if seq.bad_words_ids:
            _ban_bad_words(row, seq.bad_words_ids, seq.output_token_ids, draft_tokens, i, num_pos, vocab)
        if p.repetition_penalty != 1.0:
            present = counts > 0
            present |= _one_hot(seq.prompt_token_ids, vocab)[None, :]
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(present, penalized, row)
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).float()
        out[i] = row.to(out.dtype)
    return out


def _one_hot(token_ids: Seq[int], vocab: int) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    if token_ids:
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        mask[ids[ids < vocab]] = True
    return mask


def _ban_bad_words(
    row: torch.Tensor,
    words: list[list[int]],
    output: list[int],
    draft_tokens: torch.Tensor | None,
    i: int,
    num_pos: int,
    vocab: int,
) -> None:
    """A bad word's last token is banned at a position whose preceding tokens (the output, then the drafts
    before it) end with the rest of the word; a one-token word is banned everywhere."""
    drafts = draft_tokens[i, : num_pos - 1].tolist() if draft_tokens is not None and num_pos > 1 else []
    longest = max(len(w) for w in words) - 1
    for j in range(num_pos):
        tail = (output[-longest:] if longest else []) + drafts[:j]
        for w in words:
            if w[-1] < vocab and (len(w) == 1 or tail[len(tail) - len(w) + 1 :] == w[:-1]):
                row[j, w[-1]] = float("-inf")
