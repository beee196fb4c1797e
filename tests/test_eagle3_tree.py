"""EAGLE-3 tree drafting (Eagle3Proposer.propose_tree) with a tiny random head in speculators' layout:
branching 1 drafts the chain proposer's greedy chain, and every expanded node's children are the most likely
tokens of the head's dense reference forward (head.py: forward_dense) over that node's path."""

from __future__ import annotations

import pytest
import torch
from test_eagle3_engine import TARGET_HIDDEN, head_config

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.spec.eagle3.head import random_eagle3
from specserve.spec.eagle3.proposer import Eagle3Proposer, PagedHead

VOCAB, DRAFT_VOCAB, BLOCK = 40, 30, 4
LAYERS = (2, 4, 5)


def _proposer(backend: str, seqs: list[tuple[Sequence, torch.Tensor]]) -> Eagle3Proposer:
    head = random_eagle3(head_config(VOCAB, DRAFT_VOCAB, LAYERS), seed=3)
    paged = PagedHead(head, torch.float32, torch.device("cpu"), backend)
    tables = {seq.seq_id: list(range(8 * seq.seq_id, 8 * seq.seq_id + 8)) for seq, _ in seqs}
    proposer = Eagle3Proposer(paged, LAYERS, VOCAB, 32, BLOCK, tables.__getitem__)
    for seq, aux in seqs:
        proposer.capture(seq, 0, aux)
    return proposer


def _seqs(temperature: float) -> list[tuple[Sequence, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for seq_id, n in ((1, 9), (2, 14), (3, 5)):
        prompt = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        params = SamplingParams(temperature=temperature, seed=seq_id)
        seq = Sequence(seq_id, f"r{seq_id}", prompt, params, detokenizer=None, arrival_time=0.0)
        out.append((seq, torch.randn(n - 1, 3 * TARGET_HIDDEN, generator=gen)))
    return out


def _dense_top(head, seq: Sequence, aux: torch.Tensor, path_tokens: list[int], b: int) -> list[int]:
    """The head's b most likely target tokens after the committed tokens and the drafts on a path."""
    with torch.no_grad():
        ids = list(seq.token_ids[1:])
        hidden = head.fuse(aux)
        logits, out = head.forward_dense(torch.tensor([ids]), hidden[None], torch.arange(len(ids))[None])
        for token in path_tokens:
            ids.append(token)
            hidden = torch.cat([hidden, out[0, -1:]])
            logits, out = head.forward_dense(torch.tensor([ids]), hidden[None], torch.arange(len(ids))[None])
        return head.draft_to_target(logits[0, -1].topk(b).indices).tolist()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branching_one_is_the_greedy_chain(backend, temperature) -> None:
    seqs = _seqs(0.0)
    chain = _proposer(backend, seqs).propose([(seq, 4) for seq, _ in seqs])
    seqs = _seqs(temperature)
    tree = _proposer(backend, seqs).propose_tree([(seq, 4) for seq, _ in seqs], branching=1)
    for seq, _ in seqs:
        assert tree[seq.seq_id].token_ids == chain[seq.seq_id].token_ids
        assert tree[seq.seq_id].parents == [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_children_are_the_dense_heads_most_likely_tokens(backend) -> None:
    seqs = _seqs(0.0)
    proposer = _proposer(backend, seqs)
    b, k = 2, 7
    drafts = proposer.propose_tree([(seq, k) for seq, _ in seqs], branching=b)
    head = proposer.head.head
    for seq, aux in seqs:
        draft = drafts[seq.seq_id]
        parents, tokens = draft.parents, [None, *draft.token_ids]
        assert len(draft.token_ids) == k and max(parents) < k
        for node in range(len(parents)):
            children = [tokens[c] for c in range(1, len(parents)) if parents[c] == node]
            if not children:
                continue
            path = []
            at = node
            while at > 0:
                path.append(tokens[at])
                at = parents[at]
            top = _dense_top(head, seq, aux, path[::-1], b)
            assert children == top[: len(children)]
