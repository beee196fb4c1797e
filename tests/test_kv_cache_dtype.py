"""kv_cache_dtype bfloat16 under a float32 model: K and V rounded to bfloat16 as they are written, widened as
they are read. Its arithmetic differs from float32's on purpose, so the oracle is the torch backend holding
the same bfloat16 cache (reference.write_kv rounds with torch's .to, gather + SDPA widens): the C++ path,
chained or not, batched or not, with speculation or not, gives its greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS

from specserve import LLM, SamplingParams
from specserve.engine.config import EngineConfig
from specserve.kernels import cpu

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def _bf16_cache_llm(path, backend: str, quantization: str) -> LLM:
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_dtype="bfloat16",
        attention_backend=backend,
        quantization=quantization,
    )
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    return llm


@pytest.fixture(scope="module")
def torch_reference(tiny_model_factory):
    """Greedy tokens of the torch attention backend over a bfloat16 cache, per quantization mode."""
    cache: dict[str, list[list[int]]] = {}

    def get(quantization: str) -> list[list[int]]:
        if quantization not in cache:
            llm = _bf16_cache_llm(tiny_model_factory(), "torch", quantization)
            cache[quantization] = [_tokens(llm, [p])[0] for p in PROMPTS]
        return cache[quantization]

    return get


@pytest.mark.parametrize("quantization", ["none", "w4a8"])
def test_cpu_kernels_over_a_bfloat16_cache_give_the_torch_reference_tokens(
    tiny_model_factory, torch_reference, quantization
) -> None:
    if cpu.build.load() is None:
        pytest.skip("no C++ compiler")
    llm = _bf16_cache_llm(tiny_model_factory(), "cpu", quantization)
    model = llm.engine.model
    assert model.chain_runs  # the steps run chained, attention and KV writes inside the library
    chained = _tokens(llm, PROMPTS)
    one_at_a_time = [_tokens(llm, [p])[0] for p in PROMPTS]
    runs = model.chain_runs
    model.chain_runs = []  # the Python loop: rope_write_kv and attention call by call
    try:
        looped = [_tokens(llm, [p])[0] for p in PROMPTS]
    finally:
        model.chain_runs = runs
    assert chained == one_at_a_time == looped == torch_reference(quantization)


def test_speculation_stays_lossless_over_a_bfloat16_cache(tiny_model_factory, torch_reference) -> None:
    llm = LLM(
        str(tiny_model_factory()),
        dtype="float32",
        kv_cache_dtype="bfloat16",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, speculation=4)
    assert [_tokens(llm, [p], params)[0] for p in PROMPTS] == torch_reference("none")


def test_a_bfloat16_cache_holds_twice_the_tokens(tiny_model_factory) -> None:
    budget = 4 << 20
    blocks = {
        kv: LLM(
            str(tiny_model_factory()), dtype="float32", kv_cache_bytes=budget, kv_cache_dtype=kv
        ).engine.block_manager.num_blocks
        for kv in ("auto", "bfloat16")
    }
    assert blocks["bfloat16"] == 2 * blocks["auto"]


def test_kv_cache_dtype_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    config = EngineConfig(kv_cache_dtype="bfloat16")
    cpu_device = torch.device("cpu")
    assert config.torch_kv_dtype(torch.float32, cpu_device) == torch.bfloat16
    assert config.torch_kv_dtype(torch.bfloat16, cpu_device) == torch.bfloat16  # the model's own: as auto
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 is for a float32 model on CPU"):
        config.torch_kv_dtype(torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 is for a float32 model on CPU"):
        config.torch_kv_dtype(torch.float16, cpu_device)
    assert EngineConfig().torch_kv_dtype(torch.float16, cpu_device) == torch.float16
