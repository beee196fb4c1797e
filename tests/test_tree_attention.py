"""Tree attention (kernels/tree.py) in the torch reference and every build variant of the C++ kernel,
against a float64 dense-mask oracle (tests/tree_cases.py) on hand-made trees beside decodes, prefill chunks
and chains; the Triton kernel's cases are in test_kernels_triton.py. A chain given as a tree stays on the
causal path bit for bit."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CACHE_DTYPES, assert_close, make_batch, tolerance, with_cache_dtype
from tree_cases import LAYOUTS, TREES, dense_tree_attention, parents_of, query_lens

from specserve.kernels import select_backend
from specserve.kernels import tree as tree_mask

# (group, head_dim, block_size): MHA, SmolLM2's GQA 3, Llama's 4 with 128-wide heads, 80 on the generic loops
SHAPES = [(1, 64, 8), (3, 64, 16), (4, 128, 32), (2, 80, 16)]
# (window, softcap): none, a window inside the deepest tree and the contexts, a cap, both
MODIFIERS = [(None, None), (6, None), (None, 0.7), (9, 0.7)]


def _run(
    backend, names, context_lens, group, head_dim, block_size, dtype, window, softcap, seed, trees=None,
    cache_dtype=None,
):  # fmt: skip
    qls = query_lens(names)
    batch = make_batch(
        qls, context_lens, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
        dtype=dtype, seed=seed,
    )  # fmt: skip
    batch = with_cache_dtype(batch, cache_dtype or dtype)
    trees = parents_of(names) if trees is None else trees
    plan = None
    if backend.build_plan is not None:
        plan = backend.build_plan(
            batch.block_tables.tolist(), batch.seq_lens.tolist(), qls, block_size, window=window, trees=trees
        )
    out = torch.full_like(batch.q, float("nan"))
    backend.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
        batch.scale, plan=plan, out=out, window=window, softcap=softcap,
    )  # fmt: skip
    return batch, out


def _check(backend, dtype, group, head_dim, block_size, cache_dtype=None) -> None:
    for n, (names, context_lens) in enumerate(LAYOUTS):
        for window, softcap in MODIFIERS:
            batch, out = _run(
                backend, names, context_lens, group, head_dim, block_size, dtype, window, softcap, seed=n,
                cache_dtype=cache_dtype,
            )  # fmt: skip
            expected = dense_tree_attention(batch, parents_of(names), window, softcap)
            assert_close(out, expected, tolerance(dtype))


def test_ancestor_masks_depths_and_chains() -> None:
    parents = TREES["uneven"]  # [-1, 0, 0, 1, 3, 3, 2, 6, 0, 4]
    masks = tree_mask.ancestor_masks(parents)
    assert masks[4] == 0b11011 and masks[7] == 0b11000101 and masks[8] == 0b100000001
    assert tree_mask.depths(parents) == [0, 1, 1, 2, 3, 3, 2, 3, 1, 4]
    assert tree_mask.normalize([TREES["chain"], None]) is None
    rows = tree_mask.tree_rows([TREES["chain"], TREES["star"], None], [5, 6, 2])
    assert rows.seq_ids == [1]
    assert rows.mask.tolist()[:5] == [-1] * 5
    assert rows.depth.tolist() == [0, 1, 2, 3, 4] + [0, 1, 1, 1, 1, 1] + [0, 1]
    deepest = tree_mask.tree_rows([TREES["full64"]], [64])
    assert deepest.mask[63].item() < 0  # bit 63 set: the uint64's top bit in an int64


@pytest.mark.parametrize(
    ("parents", "match"),
    [([0, 0], "root"), ([-1, 1], "precede"), ([-1, 0, 3, 1], "precede"), ([-1] + [0] * 64, "at most 64")],
)
def test_bad_trees_are_refused(parents, match) -> None:
    with pytest.raises(ValueError, match=match):
        tree_mask.check_parents(parents)


def test_tree_over_the_wrong_query_length_is_refused() -> None:
    with pytest.raises(ValueError, match="4 nodes over 5 query rows"):
        tree_mask.tree_rows([[-1, 0, 0, 1]], [5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim", "block_size"), SHAPES)
def test_reference_tree_matches_dense(dtype, group, head_dim, block_size) -> None:
    _check(select_backend("cpu", "torch"), dtype, group, head_dim, block_size)


def _variant(monkeypatch, isa: str):
    from specserve.kernels import cpu

    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    if isa not in cpu.build.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    lib = cpu.build.build_variant(isa)
    monkeypatch.setattr(cpu.build, "_lib", lib)
    monkeypatch.setattr(cpu.build, "_paths", int(lib.specserve_paths()))
    return cpu


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHE_DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), SHAPES)
def test_cpu_kernel_tree_matches_dense(
    monkeypatch, isa, dtype, cache_dtype, group, head_dim, block_size
) -> None:
    _variant(monkeypatch, isa)
    _check(select_backend("cpu", "cpu"), dtype, group, head_dim, block_size, cache_dtype)


def test_cpu_float16_falls_back_to_the_reference_with_its_trees() -> None:
    if select_backend("cpu").name != "cpu":
        pytest.skip("no C++ compiler")
    names, context_lens = LAYOUTS[0]
    batch, out = _run(select_backend("cpu", "cpu"), names, context_lens, 2, 64, 16, torch.float16, 6, None, 0)
    assert_close(out, dense_tree_attention(batch, parents_of(names), 6, None), tolerance(torch.bfloat16))


@pytest.mark.parametrize("prefer", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chain_given_as_a_tree_is_the_causal_path_bit_for_bit(prefer, dtype) -> None:
    if prefer == "cpu" and select_backend("cpu").name != "cpu":
        pytest.skip("no C++ compiler")
    backend = select_backend("cpu", prefer)
    names, context_lens = ["chain", None, "chain"], [30, 12, 5]
    _, causal = _run(backend, names, context_lens, 3, 64, 16, dtype, None, None, 4, trees=[None] * 3)
    _, chained = _run(backend, names, context_lens, 3, 64, 16, dtype, None, None, 4)
    assert torch.equal(causal, chained)
