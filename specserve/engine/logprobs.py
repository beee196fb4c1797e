"""Log-probabilities of generated tokens (vLLM's `logprobs`), exact under speculation.

A speculative step's target forward already holds, at every verify position, the target's logits given the
accepted tokens before it: the same context a step without speculation would have. So a token's logprob is
read from the row that produced it, whether it was drafted and accepted, sampled, or the bonus token.
"""

from __future__ import annotations

import dataclasses

import torch

from specserve.engine.outputs import TokenLogprobs
from specserve.engine.sequence import Sequence
from specserve.engine.step import Accepted, DraftBatch, SchedulerOutput


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the log-probability of `tokens[row]` and the `num_top` most likely tokens with theirs.

    From the logits as they come (after a grammar's mask, before temperature, top-k and top-p: vLLM's
    default raw logprobs), in float32. At a verify position the logits are the target's given the accepted
    drafts before it, the same context a step without speculation has, so the values do not depend on
    whether the token was drafted."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top_lp, top_ids = logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_lp


def with_logprobs(
    plan: SchedulerOutput, drafts: DraftBatch | None, logits: torch.Tensor, accepted: list[Accepted]
) -> list[Accepted]:
    """Attach each asking sequence's token logprobs: its accepted tokens came from its first rows of the
    packed logits (1 + its drafts rows per sampling sequence, in plan order), one row per token."""
    rows: list[int] = []
    tokens: list[int] = []
    asking: list[int] = []  # plan indices
    start = 0
    for i, (s, acc) in enumerate(zip(plan.scheduled, accepted)):
        if not s.samples:
            continue
        if s.seq.params.logprobs is not None:
            rows.extend(range(start, start + len(acc.token_ids)))
            tokens.extend(acc.token_ids)
            asking.append(i)
        start += 1 + (drafts.num_drafts(i) if drafts is not None else 0)
    num_top = max(plan.scheduled[i].seq.params.logprobs or 0 for i in asking)
    chosen, top_ids, top_lp = token_logprobs(logits[rows], torch.tensor(tokens), num_top)
    chosen_l, ids_l, lp_l = chosen.tolist(), top_ids.tolist(), top_lp.tolist()
    out = list(accepted)
    at = 0
    for i in asking:
        acc, k = accepted[i], plan.scheduled[i].seq.params.logprobs or 0
        n = len(acc.token_ids)
        per_token = tuple(
            TokenLogprobs(chosen_l[r], tuple(zip(ids_l[r][:k], lp_l[r][:k]))) for r in range(at, at + n)
        )
        out[i] = dataclasses.replace(acc, logprobs=per_token)
        at += n
    return out


def record_prompt_logprobs(seq: Sequence, start: int, rows: torch.Tensor) -> None:
    """rows[r] are the logits at position start + r, which predict the token at start + r + 1: store that
    prompt token's logprob (and top-k, and rank) once; positions past the prompt are ignored (a preempted
    sequence recomputes its output tokens too)."""
    assert seq.prompt_logprobs is not None
    num_prompt = seq.num_prompt_tokens
    n = max(0, min(rows.shape[0], num_prompt - 1 - start))
    if n == 0:
        return
    targets = torch.tensor(seq.prompt_token_ids[start + 1 : start + 1 + n])
    num_top = seq.params.prompt_logprobs or 0
    logp = rows[:n].float().log_softmax(dim=-1)
    chosen = logp.gather(1, targets[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], targets[:, None][:, :0])
    for r, (token, lp, rank, ids, lps) in enumerate(
        zip(targets.tolist(), chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())
    ):
        if seq.prompt_logprobs[start + 1 + r] is None:
            seq.prompt_logprobs[start + 1 + r] = TokenLogprobs(lp, tuple(zip(ids, lps)), rank, token)
