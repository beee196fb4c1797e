"""Greedy outputs equal HF transformers `generate` token for token (fp32), however the engine batches."""

from __future__ import annotations

import asyncio
import sys

import pytest
from conftest import MAX_TOKENS, PROMPTS

from specserve import LLM, SamplingParams
from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.config import EngineConfig
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.errors import InvalidParameter
from specserve.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHAPES = ["llama_gqa_tied", "llama3_untied", "qwen2_bias", "llama_hd64", "mistral"]


@pytest.mark.parametrize("shape", SHAPES)
def test_single_requests_match_hf(shape, tiny_model_factory, hf_reference):
    llm = LLM(str(tiny_model_factory(shape)), dtype="float32")
    for prompt, ref in zip(PROMPTS, hf_reference(shape)):
        assert llm.generate(prompt, GREEDY)[0].token_ids == ref


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunked", [True, False])
def test_batch_with_staggered_arrivals_matches_hf(shape, chunked, tiny_model_factory, hf_reference):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_factory(shape)),
            dtype="float32",
            block_size=4,
            max_num_batched_tokens=16 if chunked else 64,
            enable_chunked_prefill=chunked,
        )
    )
    got: dict[str, list[int]] = {}
    arrivals = {0: [0], 2: [1], 3: [2], 7: [3]}  # step index -> prompts arriving before it
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
            got[f"r{i}"] = []
        for delta in engine.step():
            assert delta.offset == len(got[delta.request_id])  # deltas are contiguous, nothing repeated
            got[delta.request_id].extend(delta.token_ids)
        step += 1
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == hf_reference(shape)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_by_a_tiny_block_pool_keeps_outputs_exact(tiny_model_factory, hf_reference):
    llm = LLM(str(tiny_model_factory("llama_gqa_tied")), dtype="float32", block_size=4, num_kv_blocks=20)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == hf_reference("llama_gqa_tied")
    assert llm.engine.block_manager.num_free_blocks == 20


def test_static_batching_gives_the_same_tokens(tiny_model_factory, hf_reference):
    llm = LLM(str(tiny_model_factory("qwen2_bias")), dtype="float32", static_batching=True, max_num_seqs=2)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_reference("qwen2_bias")


def test_padded_static_batches_compute_finished_rows_on_with_the_same_tokens(tiny_model_dir, hf_reference):
    lengths = [MAX_TOKENS, 5, 9, 17]  # batches of two: (24, 5) and (9, 17)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    want = [ref[:n] for ref, n in zip(hf_reference("llama_gqa_tied"), lengths)]
    times = {}
    for padding in (False, True):
        llm = LLM(
            str(tiny_model_dir), dtype="float32", static_batching=True, static_padding=padding, max_num_seqs=2
        )
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        times[padding] = llm.engine.step_times
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.scheduler.padding
    # the same steps; each finished row went on being computed, one token a step, until its batch ended
    assert times[True].steps == times[False].steps
    assert times[True].tokens - times[False].tokens == (24 - 5) + (17 - 9)
    assert times[True].seqs == times[False].seqs  # padding is not counted as a live sequence


def test_seeded_sampling_does_not_depend_on_batch_mates(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True) for _ in PROMPTS[1:]]
    crowded = llm.generate(PROMPTS, [params, *others])[0].token_ids
    greedy = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    assert alone == crowded
    assert alone != greedy.token_ids  # it really sampled
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed)[0].token_ids != alone


def test_stop_conditions(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    free = llm.generate(PROMPTS[0], GREEDY)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == MAX_TOKENS
    # stop token id: generation ends at (and includes) the 5th token's id
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    # stop string: text is cut before it and never contains it
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text) and len(out.text) < len(free.text)


def test_streamed_text_is_the_full_decode(tiny_model_dir):
    """Incremental detokenisation: the concatenated deltas equal one decode of all output tokens."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request("a", "Ünïcödé: 日本語のテキスト", params)
    text, tokens = "", []
    while engine.has_unfinished():
        for d in engine.step():
            text += d.text
            tokens += d.token_ids
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_detokenizer_never_emits_half_a_character(demo_tokenizer):
    text = "naïve café — 日本語のテキスト, emoji 🎉🚀 end"
    ids = demo_tokenizer.encode(text)
    prompt = demo_tokenizer.encode("Say:")
    assert len(ids) > len(text.split())  # multibyte characters really are split across byte tokens
    detok = IncrementalDetokenizer(demo_tokenizer, prompt)
    out = ""
    for i in range(len(ids)):
        delta = detok.step(prompt + ids[: i + 1])
        assert "\ufffd" not in delta
        out += delta
    assert out == demo_tokenizer.decode(ids)


def test_bad_input_names_the_field(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    with pytest.raises(InvalidParameter) as err:
        llm.generate("x " * 100, GREEDY)
    assert err.value.field == "prompt"
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(max_tokens=-1)
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidParameter) as err:
        SamplingParams.from_dict({"max_tokens": 4, "temprature": 0.5})
    assert err.value.field == "temprature"
    with pytest.raises(InvalidParameter):
        llm.generate([[]], GREEDY)
    with pytest.raises(TypeError):
        LLM(str(tiny_model_dir), not_a_knob=1)


def test_async_engine_streams_and_aborts(tiny_model_dir, hf_reference):
    async def main():
        engine = AsyncLLMEngine.from_args(model=str(tiny_model_dir), dtype="float32")
        await engine.start()
        # the step thread gets the GIL back from the event loop within half a millisecond, not 5
        assert sys.getswitchinterval() <= 0.0005
        try:

            async def collect(i):
                tokens = []
                async for d in engine.add_request(f"r{i}", PROMPTS[i], GREEDY):
                    tokens += d.token_ids
                    last = d
                assert last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
                return tokens

            results = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))
            assert results == hf_reference("llama_gqa_tied")

            long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
            stream = engine.add_request("long", PROMPTS[1], long)
            first = await stream.__anext__()
            engine.abort("long")
            reasons = [d.finish_reason async for d in stream]
            assert reasons[-1] == "abort" and first.token_ids
            assert engine.stats().kv_blocks_used == 0 and engine.num_unfinished() == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_loaded_engine_is_built_and_stepped_on_one_thread(tiny_model_dir, hf_reference, monkeypatch):
    """`load` builds the engine on the thread that then steps it, never on the event loop's or a pool's:
    torch's OpenMP pool is per thread, and a second live one throttles both (async_engine.EngineThread)."""
    import threading

    from specserve.engine import async_engine

    seen: dict[str, set[int]] = {"init": set(), "step": set()}

    class Recording(async_engine.LLMEngine):
        def __init__(self, *args, **kwargs):
            seen["init"].add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def step(self):
            seen["step"].add(threading.get_ident())
            return super().step()

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)

    async def main():
        engine = await AsyncLLMEngine.load(model=str(tiny_model_dir), dtype="float32")
        await engine.start()
        try:
            tokens = [t async for d in engine.add_request("r0", PROMPTS[0], GREEDY) for t in d.token_ids]
            assert tokens == hf_reference("llama_gqa_tied")[0]
        finally:
            await engine.shutdown()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(seen["init"]) == 1 and seen["step"] == seen["init"] and loop_thread not in seen["init"]
    with pytest.raises(FileNotFoundError):  # a failed load is the awaiting caller's exception
        asyncio.run(AsyncLLMEngine.load(model=str(tiny_model_dir / "absent"), dtype="float32"))


def test_a_final_only_request_gets_one_delta_with_everything(tiny_model_dir, hf_reference):
    async def main():
        engine = AsyncLLMEngine.from_args(model=str(tiny_model_dir), dtype="float32")
        await engine.start()
        try:
            streamed = [d async for d in engine.add_request("s", PROMPTS[0], GREEDY)]
            final_only = [d async for d in engine.add_request("f", PROMPTS[0], GREEDY, stream=False)]
        finally:
            await engine.shutdown()
        return streamed, final_only

    streamed, final_only = asyncio.run(main())
    assert len(streamed) == MAX_TOKENS and len(final_only) == 1
    (only,) = final_only
    assert only.finished and only.offset == 0 and only.finish_reason == "length"
    assert only.token_ids == hf_reference("llama_gqa_tied")[0] == [t for d in streamed for t in d.token_ids]
    assert only.text == "".join(d.text for d in streamed)
    assert only.usage.completion_tokens == MAX_TOKENS and only.first_token_time is not None


def test_bfloat16_forward_with_fused_rope_equals_the_torch_ops(tiny_model_factory) -> None:
    """The cpu backend's fused rope + KV write changes no bit of a bfloat16 forward (qkv bias, GQA 3:1)."""
    import torch

    from specserve.engine.model_runner import ForwardEntry, ModelRunner
    from specserve.models.config import ModelConfig
    from specserve.models.llama import LlamaModel
    from specserve.models.loader import load_checkpoint

    ckpt = load_checkpoint(tiny_model_factory("qwen2_bias"))
    model = LlamaModel(ModelConfig.from_hf(ckpt.config), ckpt.state_dict, torch.bfloat16, "cpu", "auto")
    if model.backend.rope_write_kv is None:
        pytest.skip("the C++ kernels are not built here")
    assert model._fused_rope
    steps = [
        [ForwardEntry(list(range(5, 45)), 0, [3, 1, 4], 1), ForwardEntry(list(range(7, 19)), 0, [0], 12)],
        [ForwardEntry([11], 40, [3, 1, 4], 1), ForwardEntry([12, 13, 14], 12, [0, 2], 3)],
    ]
    outs = {}
    for fused in (True, False):
        model._fused_rope = fused
        runner = ModelRunner(model, num_blocks=6, block_size=16)
        outs[fused] = [runner.run(entries) for entries in steps]
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype_name, tolerance", [("bfloat16", 0.05), ("float32", 1e-5)])
def test_a_forward_with_fused_norm_and_silu_follows_the_torch_ops(
    tiny_model_factory, dtype_name: str, tolerance: float
) -> None:
    """The cpu backend's fused residual add + RMSNorm and silu * up, in both dtypes: a forward within the
    dtype's rounding of the torch ops' (bfloat16's silu rarely rounds a step apart; float32's norm sums its
    squares in another order and its silu takes another exp, a few ulps), the same greedy tokens."""
    import torch

    from specserve.engine.model_runner import ForwardEntry, ModelRunner
    from specserve.models.config import ModelConfig
    from specserve.models.llama import LlamaModel
    from specserve.models.loader import load_checkpoint

    ckpt = load_checkpoint(tiny_model_factory("llama_gqa_tied"))
    cfg = ModelConfig.from_hf(ckpt.config)
    model = LlamaModel(cfg, ckpt.state_dict, getattr(torch, dtype_name), "cpu", "auto")
    if model.backend.add_rms_norm is None:
        pytest.skip("the C++ kernels are not built here")
    assert model._fused_add_norm is not None and model._fused_silu_mul is not None
    steps = [
        [ForwardEntry(list(range(5, 45)), 0, [3, 1, 4], 1), ForwardEntry(list(range(7, 19)), 0, [0], 12)],
        [ForwardEntry([11], 40, [3, 1, 4], 1), ForwardEntry([12, 13, 14], 12, [0, 2], 3)],
    ]
    fused = (model._fused_add_norm, model._fused_silu_mul)
    outs = {}
    for on in (True, False):
        model._fused_add_norm, model._fused_silu_mul = fused if on else (None, None)
        runner = ModelRunner(model, num_blocks=6, block_size=16)
        outs[on] = [runner.run(entries) for entries in steps]
    for a, b in zip(outs[True], outs[False]):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= tolerance * scale
        assert torch.equal(a.argmax(-1), b.argmax(-1))
