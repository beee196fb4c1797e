"""The decoder layers chained in one library call (cpu.chain.LayerChain) against the model's Python
loop over the same kernels: bit for bit, step by step, in every step shape the chain takes or declines."""

from __future__ import annotations

import math

import pytest
import torch

from specserve import LLM
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.kernels import cpu
from specserve.models import linear, quant

BLOCK = 16


class Counting:
    """The model's chain, counting the steps it ran."""

    def __init__(self, chain: cpu.chain.LayerChain) -> None:
        self.chain, self.calls = chain, 0

    def __call__(self, *args):
        self.calls += 1
        return self.chain(*args)


# Each step's (sequence, start, tokens): prefill chunks longer than a short query (16), decodes, a verify
# of 5 beside a decode, one sequence's 12 rows (past the few-row kernels' 8), a mixed step, a decode.
STEPS = [
    [(0, 0, 23), (1, 0, 5)],
    [(0, 23, 1), (1, 5, 1)],
    [(0, 24, 5), (1, 6, 1)],
    [(1, 7, 12)],
    [(0, 29, 1), (1, 19, 1), (2, 0, 30)],
    [(2, 30, 1)],
]


def _chains(dtype: str, shape: str, mode: str) -> bool:
    """Whether the model's products run in the library, for some steps at least: float32 on AVX2 + FMA
    builds; bfloat16 on AVX512-BF16 ones, but not with biases (added in float32 only), nor dense matrices
    where AMX runs oneDNN's tiles in place of our panels (models/linear.py). w8a8 / w4a8: where the integer
    products run on SIMD, in either dtype (bf16 still without biases)."""
    if mode in quant.A8_MODES:
        return cpu.build.int_dot_fast() and (dtype == "float32" or "bias" not in shape)
    if dtype == "float32":
        return cpu.build.quant_fast()
    dense_on_amx = mode == "none" and torch.cpu._is_amx_tile_supported()
    return cpu.build.quant_bf16_fast() and "bias" not in shape and not dense_on_amx


def _chained_steps(dtype: str, shape: str, mode: str) -> int:
    """STEPS' steps the chain takes: not prefill chunks, which it takes only where the library's attention
    runs long queries (head size 64, and a build whose attention path takes the dtype's long queries: bf16's
    is AVX512-BF16's); of the others every size (float32 products of int8 / int4 widen panels past 8 rows;
    bf16 int4 runs our few-row product up to 8 rows and our tiles' kernel past them)."""
    long_queries = shape == "llama_hd64" and cpu.attention.supports_long(getattr(torch, dtype), 64, BLOCK)
    return sum(long_queries or all(n <= 16 for _, _, n in step) for step in STEPS)


def _counting(model) -> list[Counting]:
    counters = [Counting(chain) for _, chain in model.chain_runs if chain is not None]
    chains = iter(counters)
    model.chain_runs = [(most, chain and next(chains)) for most, chain in model.chain_runs]
    return counters


@pytest.mark.parametrize("shape", ["llama_gqa_tied", "qwen2_bias", "llama_bias", "llama_hd64"])
@pytest.mark.parametrize("mode", ["none", "int8", "int4", "w8a8", "w4a8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chained_layers_equal_the_python_loop_bit_for_bit(tiny_model_factory, dtype, shape, mode):
    # the forms a step's rows pick, whose runs _chained_steps counts (a batch-invariant plan chains only the
    # steps its kernels take in one pass; tests/test_batch_invariance.py holds those to the loop's rows)
    llm = LLM(
        str(tiny_model_factory(shape)),
        dtype=dtype,
        quantization=mode,
        num_kv_blocks=32,
        batch_invariant=False,
    )
    model = llm.engine.model
    if not _chains(dtype, shape, mode):
        assert model.chain_runs == []
        return
    counters = _counting(model)
    runs = model.chain_runs
    chained, looped = ModelRunner(model, 32, BLOCK), ModelRunner(model, 32, BLOCK)
    generator = torch.Generator().manual_seed(0)
    tables = {0: [0, 1, 2], 1: [3, 4], 2: [5, 6, 7]}
    for step in STEPS:
        entries = [
            ForwardEntry(
                torch.randint(0, 1000, (n,), generator=generator).tolist(), start, tables[seq], num_logits=1
            )
            for seq, start, n in step
        ]
        model.chain_runs = runs
        got, _ = chained.forward(entries)
        model.chain_runs = []
        want, _ = looped.forward(entries)
        assert torch.equal(got, want), step
    for (k1, v1), (k2, v2) in zip(chained.kv_caches, looped.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert sum(c.calls for c in counters) == _chained_steps(dtype, shape, mode)


def test_a_step_in_a_run_of_sizes_without_a_chain_takes_the_loop(tiny_model_factory):
    """Where a product serves few rows outside the library (torch's bf16 int4 kernel) the model holds no chain
    for those sizes, and a step of that size runs the Python loop even though larger steps chain."""
    llm = LLM(
        str(tiny_model_factory("llama_gqa_tied")),
        dtype="float32",
        quantization="int8",
        num_kv_blocks=32,
        batch_invariant=False,  # every size chained: the test takes some away
    )
    model = llm.engine.model
    if not model.chain_runs:
        pytest.skip("the chain runs the AVX2 + FMA build's products")
    counting = Counting(model.chain_runs[-1][1])
    model.chain_runs = [(8, None), (math.inf, counting)]
    runner = ModelRunner(model, 32, BLOCK)
    runner.forward([ForwardEntry(list(range(5, 17)), 0, [0], num_logits=1)])  # 12 rows: chained
    assert counting.calls == 1
    runner.forward([ForwardEntry([17], 12, [0], num_logits=1), ForwardEntry([3], 0, [1], num_logits=1)])
    assert counting.calls == 1


def test_bf16_auto_chains_every_step_our_int4_product_for_few_rows_and_the_dense_copy_for_more():
    """The demo's Q4_1 under auto in bf16: steps of up to the few-row form's rows (16 on its 16-output tiles,
    linear.OwnInt4TileRowsBf16) run our int4 product on the GGUF's blocks, larger ones the dense copy's
    panels; both chained, bit for bit the loop's."""
    if not (cpu.build.load() is not None and cpu.build.quant_bf16_fast()):
        pytest.skip("bf16 panels need AVX512-BF16")
    llm = LLM(None, dtype="bfloat16", quantization="auto", num_kv_blocks=32, batch_invariant=False)
    model = llm.engine.model
    if not isinstance(getattr(model.layers[0].qkv.many_rows, "__self__", None), quant.DensePanels):
        pytest.skip("auto's dense copy runs on oneDNN here (AMX)")
    most = model.layers[0].qkv.kernel_max_rows
    assert most == linear.OwnInt4TileRowsBf16.BESIDE_COPY_MAX_ROWS and model.layers[0].qkv.own_tile_rows_bf16
    assert [m for m, _ in model.chain_runs] == [most, math.inf]
    assert all(chain is not None for _, chain in model.chain_runs)
    counters = _counting(model)
    runs = model.chain_runs
    chained, looped = ModelRunner(model, 32, BLOCK), ModelRunner(model, 32, BLOCK)
    p = most + 4  # a prompt past the few-row form's rows
    steps = [[(0, 0, p)], [(0, p, 1)], [(0, p + 1, 1), (1, 0, 1)], [(0, p + 2, 1), (1, 1, 3)]]
    steps += [[(1, 4, most)], [(1, 4 + most, 1)]]
    tables = {0: [0, 1, 2], 1: [3, 4, 5]}
    for step in steps:
        entries = [
            ForwardEntry(list(range(7, 7 + n)), start, tables[seq], num_logits=1) for seq, start, n in step
        ]
        model.chain_runs = runs
        got, _ = chained.forward(entries)
        model.chain_runs = []
        want, _ = looped.forward(entries)
        assert torch.equal(got, want), step
    # 1, 2, 4, most and 1 rows on our int4 product; the prompt on the copy's panels
    assert [c.calls for c in counters] == [5, 1]


def test_bf16_auto_chains_verify_steps_on_the_amx_int4_product():
    """The demo's Q4_1 under auto in bf16 where the int4 few-row product runs AMX tiles: a verify step of up
    to 64 rows stays on it and in the chain (not on the dense copy through torch), bit for bit the loop's."""
    if not (cpu.build.load() is not None and cpu.build.int4_rows_amx()):
        pytest.skip("the int4 product runs 2..64 rows on AMX tiles only")
    llm = LLM(None, dtype="bfloat16", quantization="auto", num_kv_blocks=32, batch_invariant=False)
    model = llm.engine.model
    most = linear.OwnInt4RowsBf16.AMX_BESIDE_COPY_MAX_ROWS
    assert model.layers[0].qkv.kernel_max_rows == most
    assert model.chain_runs[0][0] == most and model.chain_runs[0][1] is not None
    counters = _counting(model)
    runs = model.chain_runs
    chained, looped = ModelRunner(model, 32, BLOCK), ModelRunner(model, 32, BLOCK)
    start = 0
    for rows in (12, 1, 3, 9, most):  # a prompt, a decode step, verify steps of 2, 8 and most - 1 drafts
        entry = ForwardEntry(list(range(7 + start, 7 + start + rows)), start, list(range(8)), num_logits=rows)
        model.chain_runs = runs
        got, _ = chained.forward([entry])
        model.chain_runs = []
        want, _ = looped.forward([entry])
        assert torch.equal(got, want), rows
        start += rows
    assert counters[0].calls == 5
