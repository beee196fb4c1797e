"""Block manager invariants under random interleavings of ensure (allocate/append/reserve), truncate, free."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.blockmgr import BlockManager

ops = st.lists(
    st.tuples(
        st.sampled_from(["ensure", "reserve", "truncate", "free", "fork"]),
        st.integers(0, 5),  # sequence id
        st.integers(0, 70),  # token count
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]))
def test_random_interleavings_keep_invariants(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size)
    tokens: dict[int, int] = {}  # our own model of how many slots each sequence holds
    for op, seq, n in ops:
        if op in ("ensure", "reserve"):
            # reserve = ensure room for the current length plus a lookahead of n tokens
            want = n if op == "ensure" else tokens.get(seq, 0) + n
            free_before = bm.num_free_blocks
            ok = bm.ensure(seq, want)
            need = max(0, -(-want // block_size) - -(-tokens.get(seq, 0) // block_size))
            assert ok == (need <= free_before)
            if ok:
                tokens[seq] = max(tokens.get(seq, 0), want)
                assert len(bm.block_table(seq)) * block_size >= want
            else:
                assert bm.num_free_blocks == free_before
        elif op == "truncate":
            if seq in tokens:
                bm.truncate(seq, min(n, tokens[seq]))
                tokens[seq] = min(n, tokens[seq])
                assert len(bm.block_table(seq)) == -(-tokens[seq] // block_size)
        elif op == "free":
            bm.free(seq)
            tokens.pop(seq, None)
        elif op == "fork":
            dst = seq + 100
            if seq in bm.tables and dst not in bm.tables:
                bm.fork(seq, dst)
        bm.check_invariants()
        shared = sum(len(t) for t in bm.tables.values())
        assert bm.num_used_blocks <= shared
    for seq in list(bm.tables):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks


def test_truncate_frees_whole_blocks_past_the_kept_length():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.ensure("a", 9)  # 3 blocks
    assert bm.ensure("a", 9 + 4)  # lookahead of 4 more tokens -> 4 blocks
    assert bm.num_used_blocks == 4
    bm.truncate("a", 10)  # rejected drafts rolled back: 10 tokens need 3 blocks
    assert bm.num_used_blocks == 3
    bm.truncate("a", 8)
    assert bm.num_used_blocks == 2
    bm.free("a")
    assert bm.num_free_blocks == 10


def test_shared_blocks_survive_until_last_owner_frees():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.ensure("a", 4)
    bm.fork("a", "b")
    assert bm.num_used_blocks == 2
    bm.free("a")
    assert bm.num_used_blocks == 2
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_all_or_nothing_when_the_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.ensure("a", 9)
    assert bm.num_free_blocks == 2 and "a" not in bm.tables
    with pytest.raises(ValueError):
        BlockManager(0, 4)
