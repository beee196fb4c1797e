"""The suffix trees' rows against counting by brute force: inserts and removals in any order leave every
path's count and most frequent child a fresh build over the remaining sequences gives, removed rows are
reused, and the proposer's drafts (its own tree, the shared one, the fleet's) equal a draft worked out from
substring counts alone."""

from __future__ import annotations

import gc
import random
import time
from collections import Counter

import pytest
from test_suffix import _draft, _finish, _seq, _shape, _with_best

from specserve.spec.suffix import FLEET_REFRESH, GlobalTree, RequestTree, SuffixProposer, SuffixTree


def _substrings(texts: list[list[int]], depth: int) -> Counter[tuple[int, ...]]:
    """Occurrences of every substring of at most `depth` tokens, over all `texts`."""
    return Counter(
        tuple(text[i : i + n])
        for text in texts
        for i in range(len(text))
        for n in range(1, min(depth, len(text) - i) + 1)
    )


def _oracle_shape(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int | None]]:
    return _with_best(_substrings(texts, depth))


@pytest.mark.parametrize("seed", range(8))
def test_inserts_and_removals_in_any_order_equal_a_fresh_count(seed: int) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.choice([(2, 2), (3, 3), (4, 3), (6, 4)])
    tree = SuffixTree(depth)
    live: list[list[int]] = []
    for _ in range(60):
        if live and rng.random() < 0.4:
            text = live.pop(rng.randrange(len(live)))
            before = tree.num_nodes
            dropped = tree.remove(text)
            assert tree.num_nodes == before - dropped
        else:
            text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
            live.append(text)
            before = tree.num_nodes
            assert tree.insert(text) == tree.num_nodes - before
        expected = _oracle_shape(live, depth)
        assert _shape(tree) == expected
        assert tree.num_nodes == len(expected) == len(tree.kids)
        assert all(tree.count[row] == 0 and tree.best[row] == -1 for row in tree.free)


def test_removed_rows_are_reused_before_the_tree_grows() -> None:
    tree = SuffixTree(4)
    tree.insert([1, 2, 3, 4, 5])
    rows = len(tree.token)
    assert tree.remove([1, 2, 3, 4, 5]) == rows - 1 and tree.num_nodes == 0 and not tree.kids
    assert len(tree.free) == rows - 1
    tree.insert([6, 7, 8, 9, 10])  # as many nodes as went: all in freed rows
    assert len(tree.token) == rows and not tree.free
    assert _shape(tree) == _oracle_shape([[6, 7, 8, 9, 10]], 4)
    tree.insert([11])
    assert len(tree.token) == rows + 1


def test_the_most_frequent_child_moves_as_occurrences_go() -> None:
    tree = SuffixTree(3)
    for text in ([1, 2], [1, 2], [1, 3], [1, 3], [1, 3], [1, 4]):
        tree.insert(text)
    one = tree.match([1])
    assert one is not None and tree.token[tree.best[one]] == 3
    tree.remove([1, 3])
    assert tree.token[tree.best[one]] == 2  # 2 and 3 twice each: the lower token
    tree.remove([1, 2])
    tree.remove([1, 2])
    assert tree.token[tree.best[one]] == 3
    tree.remove([1, 3])
    tree.remove([1, 3])
    assert tree.token[tree.best[one]] == 4
    tree.remove([1, 4])
    assert tree.best[one] == -1 and tree.match([1]) is None


def test_a_shared_trees_chunked_eviction_recycles_its_rows() -> None:
    cache = GlobalTree(max_depth=5, max_requests=2)
    rng = random.Random(0)
    outputs = [[rng.randrange(50) for _ in range(30)] for _ in range(12)]
    for key, tokens in enumerate(outputs):
        for _ in cache.add_steps(key, tokens, 4):
            pass
    assert _shape(cache.tree) == _oracle_shape(outputs[-2:], 5)
    assert cache.num_nodes == cache.tree.num_nodes
    # two outputs' nodes at most were ever live at once, plus one being inserted
    assert len(cache.tree.token) <= 1 + 3 * 30 * 5


@pytest.mark.parametrize("seed", range(8))
def test_a_requests_tree_keeps_rows_for_repeated_paths_alone_and_counts_them_all(seed: int) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.choice([(2, 2), (3, 3), (5, 3), (8, 4), (24, 6)])
    tree = RequestTree(depth)
    text: list[int] = []
    for _ in range(80):
        token = rng.randrange(vocab)
        text.append(token)
        tree.append(token)
        expected = _oracle_shape([text], depth)
        assert tree.paths() == expected
        assert len(tree.token) - 1 == sum(count >= 2 for count, _ in expected.values())
        repeated = [tuple(text[-n:]) for n in range(1, min(len(text), depth - 1) + 1)]
        assert [tree.count[row] for row in tree.ends] == [
            expected[path][0] for path in repeated[: len(tree.ends)]
        ]
        assert all(expected[path][0] == 1 for path in repeated[len(tree.ends) :])


@pytest.mark.parametrize("kind", [SuffixTree, RequestTree])
def test_a_tree_holds_nothing_the_cyclic_collector_walks_whatever_its_size(kind: type) -> None:
    rng = random.Random(0)
    tree = kind(24)
    text = [rng.randrange(6) for _ in range(3000)]
    if kind is SuffixTree:
        tree.insert(text)
        tree.remove(text[:1000])
    else:
        for token in text:
            tree.append(token)
    held = list(vars(tree).values())
    assert len(tree.token) > 1500  # rows enough that one object per node would show
    assert not [o for o in gc.get_referents(*held) if gc.is_tracked(o)]  # lists of ints, int-keyed dicts
    assert not gc.is_tracked(tree.kids)


# ---- drafts from counts alone ----------------------------------------------------------------------------


def _oracle_draft(
    trees: list[list[list[int]]], context: list[int], depth: int, k: int, factor: float, min_prob: float
) -> list[int]:
    """The draft by its definition: from every suffix of the context (up to depth - 1 tokens) in each tree,
    the most frequent next token while the running product of count ratios stays at min_prob or above; the
    highest sum of those products wins, a tie going to the longer match, then to the earlier tree."""
    best: tuple[float, list[int]] = (0.0, [])
    for texts in trees:
        counts = _substrings(texts, depth)
        found: tuple[float, list[int]] = (0.0, [])
        for n in range(1, min(len(context), depth - 1) + 1):
            path = tuple(context[-n:])
            if not counts[path]:
                continue
            limit = min(k, int(n * factor + 1e-6))
            tokens: list[int] = []
            prob, score = 1.0, 0.0
            while len(tokens) < limit and len(path) < depth:
                nexts = [(counts[path + (t,)], -t) for t in {p[-1] for p in counts if p[:-1] == path}]
                if not nexts:
                    break
                count, neg = max(nexts)
                prob *= count / counts[path]
                if prob < min_prob:
                    break
                tokens.append(-neg)
                score += prob
                path = path + (-neg,)
            if tokens and score >= found[0]:
                found = (score, tokens)
        if found[0] > best[0]:
            best = found
    return best[1]


@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_drafts_from_counts(seed: int) -> None:
    rng = random.Random(seed)
    depth, vocab = rng.choice([(3, 3), (5, 4), (8, 5)])
    settings = {"max_spec_factor": rng.choice([1.0, 2.0]), "min_token_prob": rng.choice([0.1, 0.3])}
    proposer = SuffixProposer(6, max_tree_depth=depth, max_cached_requests=3, **settings)
    fleet = proposer.fleet_tree()
    assert fleet is not None
    outputs: list[list[int]] = []
    fleets: list[list[int]] = []
    seq = _seq(0, [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))])
    drafted = 0
    for step in range(30):
        seq.token_ids.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
        if rng.random() < 0.3:
            outputs.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 12))])
            _finish(proposer, 1000 + step, [0], outputs[-1])
        if rng.random() < 0.3:
            fleets.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 12))])
            fleet.offer(("other", step), fleets[-1])
            deadline = time.monotonic() + 10
            while fleet.pending and time.monotonic() < deadline:
                time.sleep(0.002)
        k = rng.randrange(1, 7)
        trees = [[seq.token_ids], outputs[-3:], fleets[-3:]]
        expected = _oracle_draft(
            trees, seq.token_ids, depth, k, settings["max_spec_factor"], settings["min_token_prob"]
        )
        for _ in range(FLEET_REFRESH + 1):  # a sequence re-finds its place in the fleet's tree this late
            got = _draft(proposer, seq, k)
        assert got == expected, (step, seq.token_ids)
        drafted += bool(expected)
    assert drafted >= 10  # most steps draft: the test compares drafts, not empty lists
    fleet.close()
