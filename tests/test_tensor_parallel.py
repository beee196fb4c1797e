"""Tensor parallelism on CPU (gloo, 2 processes): greedy outputs at tensor_parallel_size=2 equal HF
transformers' (fp32), for each way a matrix is split: GQA with as many KV heads as ranks, fewer KV heads than
ranks (replicated), q/k/v biases, fused Phi-3 projections, sparse MoE layers and Gemma 3's norms, windows and
soft-capping; with speculation and preemption too. The other rank is a real process."""

from __future__ import annotations

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS
from test_families import GREEDY
from test_families import family as family  # noqa: F401  (the module-scoped fixture, reused)

from specserve import LLM, SamplingParams
from specserve.engine.config import EngineConfig
from specserve.models.config import ModelConfig
from specserve.models.loader import read_config
from specserve.models.parallel import check_shardable, shard_state_dict

TP2 = dict(dtype="float32", tensor_parallel_size=2)


def _outputs(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("shape", ["llama_gqa_tied", "qwen2_bias", "llama_bias", "mistral"])
def test_tp2_greedy_matches_hf(shape, tiny_model_factory, hf_reference):
    """mistral has one KV head: both ranks hold it, each with half the query heads."""
    llm = LLM(str(tiny_model_factory(shape)), **TP2)
    assert llm.engine.model.num_heads * 2 == llm.engine.model_config.num_heads
    assert _outputs(llm) == hf_reference(shape)
    other = llm.engine.ranks.procs[0]
    llm.engine.runner.close()
    other.join(timeout=30)
    assert not other.is_alive()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gemma3", "phi3"])
def test_tp2_families_match_hf(name, family):  # noqa: F811
    path, refs = family(name)
    assert _outputs(LLM(str(path), **TP2)) == refs


def test_tp2_with_speculation_small_chunks_and_preemption(tiny_model_factory, hf_reference):
    """Verify steps of k + 1 tokens, prefill in chunks of 6 and a pool that forces recompute: every forward
    shape the engine makes goes through both ranks."""
    llm = LLM(
        str(tiny_model_factory("llama_gqa_tied")),
        **TP2,
        block_size=4,
        num_kv_blocks=20,
        max_num_batched_tokens=6,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    outs = llm.generate(PROMPTS, SamplingParams(**{**GREEDY.__dict__, "speculation": 3}))
    assert [o.token_ids for o in outs] == hf_reference("llama_gqa_tied")
    assert sum(o.usage.draft_proposed for o in outs) > 0
    assert llm.engine.scheduler.num_preemptions > 0


def test_tp2_sampled_equals_tp1(tiny_model_factory):
    """The same seed samples the same tokens: only rank 0 samples, from logits equal to tp=1's."""
    path = str(tiny_model_factory("llama_gqa_tied"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert _outputs(LLM(path, **TP2), params) == _outputs(LLM(path, dtype="float32"), params)


def test_shards_sum_to_the_whole_product(tiny_model_factory):
    """Column-parallel slices stack to the whole matrix and row-parallel partial products sum to it."""
    from safetensors.torch import load_file

    path = tiny_model_factory("qwen2_bias")
    cfg = ModelConfig.from_hf(read_config(path))
    whole = load_file(path / "model.safetensors")
    shards = []
    for rank in range(2):
        sd = dict(whole)
        shard_state_dict(sd, cfg, rank, 2)
        shards.append(sd)
    layer = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.bias", "mlp.up_proj.weight"):
        torch.testing.assert_close(torch.cat([s[layer + name] for s in shards]), whole[layer + name])
    x = torch.randn(3, whole[layer + "mlp.down_proj.weight"].shape[1])
    halves = x.chunk(2, dim=1)
    partial = sum(h @ s[layer + "mlp.down_proj.weight"].T for h, s in zip(halves, shards))
    torch.testing.assert_close(partial, x @ whole[layer + "mlp.down_proj.weight"].T)
    for name in ("input_layernorm.weight", "self_attn.o_proj.weight"):  # whole / split by columns
        assert shards[1][layer + name].shape[-1] == whole[layer + name].shape[-1] // (
            2 if "proj" in name else 1
        )


def test_sizes_that_do_not_divide_are_refused_before_any_process_starts():
    cfg = ModelConfig.from_hf(
        dict(
            model_type="llama",
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=100,
        )
    )
    with pytest.raises(
        ValueError, match="tensor_parallel_size 2 does not divide this model's 9 attention heads"
    ):
        check_shardable(cfg, 2)
    check_shardable(cfg, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="quantization int8 is not supported with tensor_parallel_size 2"):
        EngineConfig(tensor_parallel_size=2, quantization="int8")


def test_a_size_the_model_cannot_take_fails_before_loading_and_starts_no_rank():
    """The demo model (9 heads) cannot split in two: refused from its config alone, before any weight is read
    or any rank process exists."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide this model's 9 attention"):
        LLM(None, **TP2)
    assert set(multiprocessing.active_children()) == before


def test_a_tp2_service_answers_and_leaves_no_rank_behind(tiny_model_factory, tmp_path):
    """`specserve serve --tensor-parallel-size 2`: the OpenAI route answers what LLM(tp=1) generates, and once
    the service is SIGKILLed its other rank exits on its own (its pipe to the engine closed)."""
    import signal

    import aiohttp
    import psutil
    from valkey_helpers import free_port, run, spawn_cli, wait_for

    path = tiny_model_factory("llama_gqa_tied")
    ref = LLM(str(path), dtype="float32").generate(
        ["Hello there"], SamplingParams(max_tokens=8, temperature=0)
    )
    port = free_port()
    env = {
        "SPECSERVE_DTYPE": "float32",
        "SPECSERVE_KV_CACHE_BYTES": str(4 << 20),
        "SPECSERVE_DEVICE": "cpu",
        "SPECSERVE_MODEL": str(path),
        "SPECSERVE_PORT": str(port),
        "REDIS_URL": "",
    }
    log = tmp_path / "serve.log"
    proc = spawn_cli(["serve", "--data-dir", str(tmp_path / "data"), "--tensor-parallel-size", "2"], env, log)
    base = f"http://127.0.0.1:{port}"

    async def ready() -> bool:
        try:
            async with aiohttp.ClientSession() as http, http.get(f"{base}/readyz") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    async def main() -> str:
        await wait_for(ready, timeout=180, what="serve ready")
        async with aiohttp.ClientSession() as http:
            body = {"model": path.name, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
            async with http.post(f"{base}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["choices"][0]["text"]

    try:
        text = run(main(), timeout=300)
        ranks = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "multiprocessing" in " ".join(c.cmdline())
        ]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(ranks, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert text == ref[0].text, log.read_text(errors="replace")[-3000:]
    assert ranks and not alive


@pytest.mark.parametrize("name", ["phi3", "qwen3_moe"])
def test_a_rank_loads_only_its_slices(name, family):  # noqa: F811
    """The loader shards each tensor as it reads it: the same slices as sharding the whole checkpoint,
    without ever holding it (Phi-3's fused projections split on the way in)."""
    from specserve.models.loader import load_checkpoint
    from specserve.models.parallel import Sharder

    path, _ = family(name)
    cfg = ModelConfig.from_hf(read_config(path))
    whole = load_checkpoint(path).state_dict
    shard_state_dict(whole, cfg, 1, 2)
    sliced = load_checkpoint(path, transform=Sharder(cfg, 1, 2)).state_dict
    assert sliced.keys() == whole.keys()
    assert all(torch.equal(sliced[k], whole[k]) for k in whole)
    full = load_checkpoint(path).state_dict
    assert sum(t.numel() for t in sliced.values()) < sum(t.numel() for t in full.values())
