"""Verification of draft trees (spec/verifier.py): the accepted path descends, at each node, to the child
whose token is the target's own token there, drawn as sampling would draw it at the node's position
(first + depth); a chain written as a tree verifies as the chain."""

from __future__ import annotations

import pytest
import torch
from tree_cases import TREES

from specserve.engine.sampler import RowParams, sample
from specserve.engine.sampling_params import SamplingParams
from specserve.spec.verifier import VerifyBatch, tree_depths, verify

VOCAB = 12  # few tokens: drafts often equal the target's, so paths run deep


def _padded(trees: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in trees)
    return torch.tensor([t + [-1] * (width - len(t)) for t in trees])


def _expected(parents, drafts, targets) -> list[int]:
    """Walk from the root: descend to the first child whose draft is the target's token at its parent."""
    node, out = 0, []
    while True:
        child = next(
            (i for i in range(1, len(parents)) if parents[i] == node and drafts[i - 1] == targets[node]), None
        )
        if child is None:
            return [*out, targets[node]]
        out.append(drafts[child - 1])
        node = child


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_path_is_the_walk_by_the_targets_tokens(temperature) -> None:
    names = ["uneven", "binary3", "star", "chain"]
    trees = [TREES[n] for n in names]
    parents = _padded(trees)
    width = parents.shape[1]
    counts = torch.tensor([len(t) - 1 for t in trees])
    first = [30, 7, 100, 12]
    params = [SamplingParams(temperature=temperature, seed=5)] * len(trees)
    depth = tree_depths(parents)
    for seed in range(25):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(len(trees), width, VOCAB, generator=gen) * 2
        rows = RowParams.build(params, [seed] * len(trees), VOCAB)
        targets = [
            [
                int(sample(logits[s, i : i + 1], rows.select([s]), [first[s] + int(depth[s, i])])[0])
                for i in range(len(trees[s]))
            ]
            for s in range(len(trees))
        ]
        drafts = torch.randint(0, VOCAB, (len(trees), width - 1), generator=gen)
        for s, t in enumerate(trees):  # half the nodes carry their parent's target token
            for i in range(1, len(t)):
                if (seed + i) % 2:
                    drafts[s, i - 1] = targets[s][t[i]]
        batch = VerifyBatch(logits, drafts, counts, rows, first, parents=parents)
        result = verify(batch)
        for s, t in enumerate(trees):
            want = _expected(t, drafts[s].tolist(), targets[s])
            a, last = int(result.num_accepted[s]), int(result.last_node[s])
            path = [last]
            while t[path[-1]] >= 0:
                path.append(t[path[-1]])
            got = [int(drafts[s, i - 1]) for i in path[::-1][1:]] + [int(result.next_token[s])]
            assert a == len(path) - 1 and got == want


def test_a_chain_as_a_tree_verifies_as_the_chain() -> None:
    vocab, k = 20, 5
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(2, k + 1, vocab, generator=gen)
        rows = RowParams.build(params, [seed, 0], vocab)
        drafts = logits[:, :k].argmax(-1) if seed % 2 else torch.randint(0, vocab, (2, k), generator=gen)
        counts = torch.tensor([k, 3])
        chain = verify(VerifyBatch(logits, drafts, counts, rows, [9, 40]))
        parents = torch.arange(-1, k)[None, :].repeat(2, 1)
        parents[1, 4:] = -1  # row 1 drafts 3: its nodes past them are padding
        tree = verify(VerifyBatch(logits, drafts, counts, rows, [9, 40], parents=parents))
        assert torch.equal(chain.num_accepted, tree.num_accepted)
        assert torch.equal(chain.next_token, tree.next_token)
