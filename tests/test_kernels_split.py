"""The C++ kernels' split of a few sequences' keys into parts (flash-decoding): steps of fewer (sequence,
head) tasks than two a thread give each short query's head several tasks, one per run of blocks, merged after
by their softmax statistics. Each case is one or two sequences over long contexts at four threads, so the
split runs; its output is held to float64 dense attention and to the unsplit kernel's (the batch-invariant
form, which never splits), with causal limits, sliding windows, soft-capping and GQA groups."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from kernel_cases import PagedBatch, assert_close, make_batch, tolerance
from test_kernels_window import dense_window_attention, poison_outside_window

from specserve.kernels import cpu

THREADS = 4  # more than the tasks of every case below, whatever this machine's cores
# The split and the unsplit kernel round differently (see below), by up to one bf16 step of the largest output
NEAR = {torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


@dataclass(frozen=True)
class Case:
    query_lens: list[int]
    context_lens: list[int]
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    window: int | None = None
    softcap: float | None = None


CASES = {
    # SmolLM2's heads: a decode step and a verify step of 1 + 4 tokens at batch 1
    "decode": Case([1], [600], 3, 3, 64, 16),
    "verify": Case([5], [600], 3, 3, 64, 16),
    # a whole query tile of rows over wide heads, Llama's 8-way group, blocks of 32
    "query tile": Case([16], [1000], 1, 8, 128, 32),
    # a context just past a part's keys: its last block holds 1 token
    "short last block": Case([3], [190], 1, 1, 64, 16),
    "two sequences": Case([1, 5], [300, 800], 1, 2, 64, 16),
    # the parts cover only the blocks from the first row's window start, and poisoned blocks before it
    "window": Case([4], [500], 2, 4, 128, 16, window=200),
    # the last row's window starts past the first part: that part holds none of its keys
    "window past a part": Case([16], [241], 1, 1, 64, 64, window=60),
    "softcap": Case([3], [700], 2, 2, 256, 16, softcap=0.7),
    "window and softcap": Case([2], [900], 1, 3, 64, 64, window=300, softcap=0.7),
}


@pytest.fixture
def threads() -> Iterator[int]:
    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield THREADS
    torch.set_num_threads(before)


def _batch(case: Case, dtype: torch.dtype, seed: int) -> PagedBatch:
    batch = make_batch(
        case.query_lens,
        case.context_lens,
        num_kv_heads=case.num_kv_heads,
        group=case.group,
        head_dim=case.head_dim,
        block_size=case.block_size,
        dtype=dtype,
        seed=seed,
    )
    if case.window:
        assert poison_outside_window(batch, case.query_lens, case.window) > 0
    return batch


def _attend(
    batch: PagedBatch, seq_ids: list[int], *, invariant: bool, window: int | None, softcap: float | None
) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    cpu.attention.paged_attention_short(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        torch.tensor(seq_ids, dtype=torch.int64), batch.scale, out, window=window, softcap=softcap,
        invariant=invariant,
    )  # fmt: skip
    return out


def _fast(dtype: torch.dtype) -> None:
    if str(dtype).removeprefix("torch.") not in cpu.build.fast_paths():
        pytest.skip(f"this build has no fast {dtype} kernel, which is where the split lives")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(CASES))
def test_split_matches_dense_and_the_unsplit_kernel(threads, dtype, name) -> None:
    _fast(dtype)
    case = CASES[name]
    batch = _batch(case, dtype, seed=len(name))
    ids = list(range(len(case.query_lens)))
    split = _attend(batch, ids, invariant=False, window=case.window, softcap=case.softcap)
    whole = _attend(batch, ids, invariant=True, window=case.window, softcap=case.softcap)
    expected = dense_window_attention(batch, case.window, case.softcap)
    assert_close(split, expected, tolerance(dtype))
    assert_close(whole, expected, tolerance(dtype))
    # the parts and the whole differ in rounding only: each part's probabilities (bf16 before P.V, as HF
    # rounds them) against its own max and sum, and the merge's float32 sums
    assert_close(split, whole, NEAR[dtype])
    if dtype == torch.bfloat16:
        # so the split ran: a part's bf16 probabilities are not the whole row's
        assert not torch.equal(split, whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_rows_are_alike_alone_and_among_others(threads, dtype) -> None:
    """Alone, a sequence is one task per head, which a free step would split; beside seven others it is not.
    In the batch-invariant form neither splits, so its rows come out bit for bit the same."""
    _fast(dtype)
    case = Case([5] + [1] * 7, [700] + [300] * 7, 3, 3, 64, 16)
    batch = _batch(case, dtype, seed=7)
    alone = _attend(batch, [0], invariant=True, window=None, softcap=None)
    among = _attend(batch, list(range(8)), invariant=True, window=None, softcap=None)
    assert torch.equal(alone[:5], among[:5])
    free = _attend(batch, [0], invariant=False, window=None, softcap=None)
    assert_close(free[:5], among[:5], NEAR[dtype])


# (context before the verified tokens, drafts, KV heads, group, head dim, block size): rows whose decode steps
# see one part where the verify step sees two, octave boundaries (64, 128, 256, 512) inside the drafts, suffix
# decoding's 16 drafts and the most a short query takes (31), Llama's 8-way group and blocks of 32
VERIFY_ROWS = [
    (60, 16, 3, 3, 64, 16),
    (61, 3, 3, 3, 64, 16),
    (120, 9, 3, 3, 64, 16),
    (250, 16, 3, 3, 64, 16),
    (500, 31, 1, 8, 128, 32),
    (1021, 4, 3, 3, 64, 16),
]


@pytest.mark.parametrize(("context", "drafts", "kv_heads", "group", "head_dim", "block"), VERIFY_ROWS)
def test_float32_verify_rows_equal_their_decode_steps_whatever_the_team(
    context, drafts, kv_heads, group, head_dim, block
) -> None:
    """A float32 step of few sequences splits its keys in parts fixed by position, scores every short query's
    rows in one form, and gives a row that sees one part that part's output: each row of a verify step comes
    out bit for bit as the decode step of its token, on teams of any size (the engine's adaptive team), so
    greedy speculation gives the tokens decoding without it gives."""
    if cpu.build.load() is None or "float32" not in cpu.build.fast_paths():
        pytest.skip("this build has no fast float32 kernel")
    rows = drafts + 1
    batch = make_batch(
        [rows], [context], num_kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block,
        dtype=torch.float32, seed=context,
    )  # fmt: skip
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        verify = _attend(batch, [0], invariant=False, window=None, softcap=None)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for i in range(rows):
                out = torch.full_like(batch.q[i : i + 1], float("nan"))
                seq_len, starts = torch.tensor([context + i + 1], dtype=torch.int32), torch.tensor([0, 1])
                cpu.attention.paged_attention_short(
                    batch.q[i : i + 1].contiguous(), batch.k_cache, batch.v_cache, batch.block_tables,
                    seq_len, starts.int(), torch.tensor([0]), batch.scale, out,
                )  # fmt: skip
                assert torch.equal(out[0], verify[i]), (threads, i)
    finally:
        torch.set_num_threads(before)
    assert_close(verify, dense_window_attention(batch, None, None), tolerance(torch.float32))
