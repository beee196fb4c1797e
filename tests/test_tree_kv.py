"""A draft tree through the target: one forward over the tree's rows (ForwardEntry.tree) gives, on every
root-to-leaf path, the logits the path gets run as a chain; after verification the accepted path's K/V moves
to context + depth (tree.path_slots / move_kv) and the cache then holds what the chain wrote, every layer."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close
from tree_cases import TREES

from specserve import LLM
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.kernels import tree as tree_mask

BLOCK = 8
PROMPT = 21  # the committed context: the tree's rows start mid-block


def _leaf_paths(parents: list[int]) -> list[list[int]]:
    leaves = set(range(len(parents))) - set(parents)
    paths = []
    for leaf in sorted(leaves):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", ["uneven", "binary3", "star"])
def test_tree_forward_and_path_kv_equal_the_chain(tiny_model_factory, backend, name) -> None:
    llm = LLM(str(tiny_model_factory()), dtype="float32", num_kv_blocks=16, attention_backend=backend)
    model = llm.engine.model
    if model.backend.name != backend:
        pytest.skip(f"the {backend} backend does not run here")
    parents = TREES[name]
    gen = torch.Generator().manual_seed(len(parents))
    prompt = torch.randint(0, model.cfg.vocab_size, (PROMPT,), generator=gen).tolist()
    nodes = torch.randint(0, model.cfg.vocab_size, (len(parents),), generator=gen).tolist()
    table = [5, 2, 9, 7, 11]  # scattered blocks
    tree_runner, chain_runner = ModelRunner(model, 16, BLOCK), ModelRunner(model, 16, BLOCK)
    for runner in (tree_runner, chain_runner):
        runner.run([ForwardEntry(prompt, 0, table, 1)])
    tree_logits = tree_runner.run([ForwardEntry(nodes, PROMPT, table, len(nodes), tree=list(parents))])
    before = [(k.clone(), v.clone()) for k, v in tree_runner.kv_caches]

    for path in _leaf_paths(parents):
        chain_logits = chain_runner.run([ForwardEntry([nodes[i] for i in path], PROMPT, table, len(path))])
        assert_close(tree_logits[path], chain_logits, 1e-5)

        caches = [(k.clone(), v.clone()) for k, v in before]
        src, dst = tree_mask.path_slots(parents, path, table, PROMPT, BLOCK)
        assert len(src) == sum(node != d for d, node in enumerate(path))
        tree_mask.move_kv(caches, src, dst)
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(PROMPT + len(path))]
        for (k, v), (ck, cv) in zip(caches, chain_runner.kv_caches):
            for got, want in ((k, ck), (v, cv)):
                rows, ref = got.view(-1, *got.shape[2:])[slots], want.view(-1, *want.shape[2:])[slots]
                assert torch.equal(rows[:PROMPT], ref[:PROMPT])  # the context is untouched
                assert_close(rows[PROMPT:], ref[PROMPT:], 1e-5)


def test_a_path_off_the_tree_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves the tree at depth 2"):
        tree_mask.path_slots(TREES["uneven"], [0, 1, 2], [0, 1], 3, 8)
    with pytest.raises(ValueError, match="root"):
        tree_mask.path_slots(TREES["uneven"], [1, 3], [0, 1], 3, 8)
