"""The decoder layers chained in one library call (cpu_paged_attention.LayerChain) against the model's Python
loop over the same kernels: bit for bit, step by step, in every step shape the chain takes or declines."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.kernels import cpu_paged_attention as cpu_kernels

BLOCK = 16


class Counting:
    """The model's chain, counting the steps it ran."""

    def __init__(self, chain: cpu_kernels.LayerChain) -> None:
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
    """Whether every product of the model runs in the library: float32 on AVX2 + FMA builds; bfloat16 on
    AVX512-BF16 ones, but not int4 (few rows are torch's kernel) nor biases (added in float32 only)."""
    if dtype == "float32":
        return cpu_kernels.quant_fast()
    return cpu_kernels.quant_bf16_fast() and mode != "int4" and "bias" not in shape


@pytest.mark.parametrize("shape", ["llama_gqa_tied", "qwen2_bias", "llama_bias", "llama_hd64"])
@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chained_layers_equal_the_python_loop_bit_for_bit(tiny_model_factory, dtype, shape, mode):
    llm = LLM(str(tiny_model_factory(shape)), dtype=dtype, quantization=mode, num_kv_blocks=32)
    model = llm.engine.model
    if not _chains(dtype, shape, mode):
        assert model.layer_chain is None
        return
    assert model.layer_chain is not None
    counting = Counting(model.layer_chain)
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
        model.layer_chain = counting
        got, _ = chained.forward(entries)
        model.layer_chain = None
        want, _ = looped.forward(entries)
        assert torch.equal(got, want), step
    for (k1, v1), (k2, v2) in zip(chained.kv_caches, looped.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # every step but the prefill chunks, which the chain takes only where the library's attention runs
    # long queries (head size 64); float32 products of int8 / int4 widen panels past 8 rows, so no row limit
    assert counting.calls == (len(STEPS) if shape == "llama_hd64" else len(STEPS) - 2)


def test_a_step_of_more_rows_than_a_products_kernel_serves_takes_the_loop(tiny_model_factory):
    """With a dense copy for steps of many rows (auto where that pays), the chain's products serve few rows
    only; a larger step runs the Python loop, whose linear picks the copy."""
    llm = LLM(
        str(tiny_model_factory("llama_gqa_tied")), dtype="float32", quantization="int8", num_kv_blocks=32
    )
    model = llm.engine.model
    if model.layer_chain is None:
        pytest.skip("the chain runs the AVX2 + FMA build's products")
    counting = Counting(model.layer_chain)
    model.layer_chain, model._chain_rows = counting, 8
    runner = ModelRunner(model, 32, BLOCK)
    runner.forward([ForwardEntry(list(range(5, 17)), 0, [0], num_logits=1)])  # 12 rows: the loop
    assert counting.calls == 0
    runner.forward([ForwardEntry([17], 12, [0], num_logits=1), ForwardEntry([3], 0, [1], num_logits=1)])
    assert counting.calls == 1
