"""The target's features, computed once per answer: one forward over prompt + answer gives, per token,
the three aux hidden states (the head's layer ids), the final hidden state (after the target's norm) and
the target's greedy next token. Training never runs the target again: its soft targets come from the
final hidden state times the lm_head rows of the draft vocabulary.

CPU: shards on disk under the work directory (bf16), resumable. CUDA: kept in GPU memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .answers import Answer


@dataclass
class Sample:
    tokens: torch.Tensor  # [L] int64: the chat-templated prompt and the target's answer
    prompt_len: int
    aux: torch.Tensor  # [L, 3 * hidden] bf16: the aux hidden states, layer-id order
    last: torch.Tensor  # [L, hidden] bf16: the final hidden state (after the target's norm)
    greedy_next: torch.Tensor  # [L] int64: the target's argmax at each position
    greedy: bool  # answered greedily (the held-out figure reads only these)
    holdout: bool


@torch.inference_mode()
def forward_features(model, layer_ids: tuple[int, ...], sequences: list[list[int]]):
    """Per sequence (aux [L, 3H], last [L, H], greedy next [L]) from one right-padded forward; the argmax
    is taken in slices so the full-vocabulary logits never exist for the whole batch at once."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
    out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[i] for i in layer_ids], dim=-1)
    last = out.last_hidden_state  # after the final norm (hs[-1] is the same tensor in HF's Llama)
    lm_head = model.get_output_embeddings()
    argmax = torch.cat([lm_head(last[b : b + 1]).argmax(-1) for b in range(len(sequences))])
    return [
        # copies: a slice would keep (and torch.save would write) the whole padded batch
        (
            aux[b, : len(s)].to(torch.bfloat16, copy=True),
            last[b, : len(s)].to(torch.bfloat16, copy=True),
            argmax[b, : len(s)].int(),
        )
        for b, s in enumerate(sequences)
    ]


def length_groups(answers: list[Answer], batch_tokens: int) -> list[list[Answer]]:
    """Answers of similar length, about batch_tokens padded tokens a group (held-out ones first)."""
    order = sorted(answers, key=lambda a: (not a.holdout, len(a.prompt_ids) + len(a.answer_ids)))
    groups, cur, width = [], [], 0
    for a in order:
        n = len(a.prompt_ids) + len(a.answer_ids)
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, width = [], 0
        cur.append(a)
        width = max(width, n)
    if cur:
        groups.append(cur)
    return groups


def compute_features(
    model,
    layer_ids: tuple[int, ...],
    answers: list[Answer],
    deadline: float,
    *,
    batch_tokens: int,
    shard_dir: Path | None,
    on_batch: Callable[[int, int], None] = lambda answers, tokens: None,
) -> list[Sample]:
    """Samples for every answer (until the deadline). With `shard_dir` each batch is a shard on disk named
    by its answers' indices (CPU), and answers already in a shard are read back, not recomputed."""
    samples: list[Sample] = []
    done: set[int] = set()
    if shard_dir is not None:
        shard_dir.mkdir(parents=True, exist_ok=True)
        for f in sorted(shard_dir.glob("shard_*.pt")):
            rows = torch.load(f, weights_only=True)
            samples += [_sample(r) for r in rows]
            done.update(int(r["index"]) for r in rows)
    todo = [a for a in answers if a.index not in done]
    for group in length_groups(todo, batch_tokens):
        # the deadline waits for one training and one held-out answer: a run needs both to mean anything
        if time.monotonic() > deadline and {s.holdout for s in samples} == {True, False}:
            break
        seqs = [a.prompt_ids + a.answer_ids for a in group]
        rows = [
            {
                "index": a.index,
                "tokens": torch.tensor(seq, dtype=torch.int32, device=aux.device),
                "prompt_len": len(a.prompt_ids),
                "aux": aux,
                "last": last,
                "greedy_next": nxt,
                "greedy": a.greedy,
                "holdout": a.holdout,
            }
            for a, seq, (aux, last, nxt) in zip(group, seqs, forward_features(model, layer_ids, seqs))
        ]
        if shard_dir is not None:
            rows = [{k: v.cpu() if torch.is_tensor(v) else v for k, v in r.items()} for r in rows]
            name = f"shard_{min(a.index for a in group):06d}_{len(group)}"
            tmp = shard_dir / f"{name}.tmp"
            torch.save(rows, tmp)
            tmp.rename(shard_dir / f"{name}.pt")  # a killed run never leaves half a shard
        samples += [_sample(r) for r in rows]
        on_batch(len(group), sum(len(s) for s in seqs))
    return samples


def _sample(r: dict) -> Sample:
    return Sample(
        tokens=r["tokens"].long(),
        prompt_len=int(r["prompt_len"]),
        aux=r["aux"],
        last=r["last"],
        greedy_next=r["greedy_next"].long(),
        greedy=bool(r["greedy"]),
        holdout=bool(r["holdout"]),
    )
