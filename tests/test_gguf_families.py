"""GGUF files of the newer families (Qwen3, Qwen3-MoE, Phi-3 with partial rotary and longrope) load into the
same weights and the same model shape as their HF checkpoints.

Each file is written from a tiny HF model the way llama.cpp's converter lays it out (experts as 3-D
ffn_*_exps tensors with gate and up apart, Phi-3's fused attn_qkv and ffn_up, its rope factors as tensors),
and transformers' own GGUF reader of the same file is the check that the layout is llama.cpp's, not ours.
The forwards themselves are held to HF by tests/test_families.py.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from specserve.models.config import ModelConfig
from specserve.models.loader import load_checkpoint

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    # head_dim 128 as in real Qwen3: transformers' GGUF reader ignores qwen3.attention.key_length and takes
    # Qwen3Config's default 128 (ours reads the key)
    "qwen3": ("Qwen3", dict(head_dim=128)),
    # moe_intermediate_size 768 as in Qwen3-30B-A3B: transformers' reader takes that default, not the key
    "qwen3moe": (
        "Qwen3Moe",
        dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True
        ),
    ),
    "phi3": (
        "Phi3",
        dict(
            pad_token_id=0,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(4)],
                "long_factor": [2.0 + 0.2 * i for i in range(4)],
            },
        ),
    ),
}
BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: llama.cpp keeps the fused tensor under ffn_up
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _hf_model(arch: str) -> torch.nn.Module:
    prefix, extra = MODELS[arch]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra})
    torch.manual_seed(3)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def _write(model: torch.nn.Module, arch: str, path: Path) -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "phi3":
        rope = cfg.rope_parameters
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(0)  # Phi3Config's default (32000) would be past this vocabulary
    for name, tensor in model.state_dict().items():
        t = tensor.numpy()
        if name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
            g = {"lm_head": "output", "model.embed_tokens": "token_embd", "model.norm": "output_norm"}
            w.add_tensor(g[name.removesuffix(".weight")] + ".weight", t)
            continue
        _, _, layer, *module = name.split(".")
        if module[-1] == "gate_up_proj" and t.ndim == 3:  # experts: llama.cpp keeps gate and up apart
            half = t.shape[1] // 2
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, :half]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(t[:, half:]))
        elif module[-1] == "down_proj" and t.ndim == 3:
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", t)
        else:
            w.add_tensor(f"blk.{layer}.{BLOCK['.'.join(module[:-1])]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _shape(cfg: ModelConfig) -> tuple:
    return (
        cfg.model_type,
        cfg.head_dim,
        cfg.ropes,
        cfg.layer_window,
        cfg.layer_moe,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.norm_topk_prob,
        cfg.family,
    )


@pytest.mark.parametrize("arch", list(MODELS))
def test_gguf_loads_as_its_hf_checkpoint(tmp_path: Path, arch: str) -> None:
    model = _hf_model(arch)
    model.save_pretrained(tmp_path / "hf")
    path = _write(model, arch, tmp_path / f"{arch}.gguf")
    ours = load_checkpoint(path)
    hf_dir = load_checkpoint(tmp_path / "hf")
    assert _shape(ModelConfig.from_hf(ours.config)) == _shape(ModelConfig.from_hf(hf_dir.config))
    reference = model.state_dict()
    assert ours.state_dict.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(ours.state_dict[name], tensor, rtol=0, atol=0, msg=name)
    # transformers reads the same file into the same weights: the layout is llama.cpp's
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(theirs[name].float(), tensor, rtol=0, atol=0, msg=name)
