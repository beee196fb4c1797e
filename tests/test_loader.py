"""Checkpoint loaders: HF safetensors dirs and GGUF files against the models transformers builds from them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specserve.models.loader import Checkpoint, demo_model_path, load_checkpoint, load_tokenizer

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama_untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
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
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=1, sliding_window=None)),
}
SAME_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
]


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = MODELS[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, **extra})).eval()
    with torch.no_grad():
        # Random init leaves norms at 1 and biases at 0; make every tensor distinct so a mix-up shows.
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def assert_matches(ck: Checkpoint, model: torch.nn.Module) -> None:
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert ck.state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert ck.state_dict[name].dtype == torch.float32
        assert torch.equal(ck.state_dict[name], tensor), name
    for field in SAME_FIELDS:
        assert ck.config[field] == getattr(model.config, field), field
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert ck.config["head_dim"] == head_dim
    rope = dict(model.config.rope_parameters)
    assert ck.config["rope_theta"] == rope.pop("rope_theta")
    assert ck.config["rope_scaling"] == (None if rope["rope_type"] == "default" else rope)
    assert ck.config["attention_bias"] == (model.config.model_type == "qwen2")


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("sharded", [False, True])
def test_hf_dir_matches_model(tmp_path: Path, kind: str, sharded: bool) -> None:
    model = tiny_model(kind)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    ck = load_checkpoint(tmp_path)
    assert ck.source == tmp_path
    assert ck.config["architectures"] == [type(model).__name__]
    assert_matches(ck, model)


def test_hf_dir_casts_dtype(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path)
    ck = load_checkpoint(str(tmp_path), dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        # matrices in the target dtype as they are read; vectors (norms, biases) stay float32, small
        want = tensor.to(torch.bfloat16) if tensor.dim() >= 2 else tensor.float()
        assert ck.state_dict[name].dtype == want.dtype and torch.equal(ck.state_dict[name], want), name


def test_generation_config_stop_tokens_win(tmp_path: Path) -> None:
    model = tiny_model("llama_untied")
    model.generation_config.eos_token_id = [2, 7]
    model.save_pretrained(tmp_path)
    assert load_checkpoint(tmp_path).config["eos_token_id"] == [2, 7]


# ---------------------------------------------------------------- GGUF written from tiny HF models


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute, applied to q (n_head) and k (n_kv_head) of llama archs.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_gguf(model: torch.nn.Module, arch: str, path: Path) -> Path:
    """What llama.cpp's converter writes for `model`, F32, including the llama q/k permutation."""
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    tied = cfg.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        t = tensor.numpy()
        if name == "lm_head.weight":
            if tied:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, *module, suffix = name.split(".")
            gname = f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{suffix}"
            if arch == "llama" and module[-1] == "q_proj":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif arch == "llama" and module[-1] == "k_proj":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("kind", "arch"), [("llama_tied", "llama"), ("llama_untied", "llama"), ("qwen2", "qwen2")]
)
def test_gguf_roundtrip_of_tiny_model(tmp_path: Path, kind: str, arch: str) -> None:
    model = tiny_model(kind)
    ck = load_checkpoint(write_gguf(model, arch, tmp_path / "tiny.gguf"))
    assert ck.config["architectures"] == [type(model).__name__]
    assert_matches(ck, model)


# ---------------------------------------------------------------- the demo SmolLM2 GGUF


@pytest.fixture(scope="module")
def demo_checkpoint() -> Checkpoint:
    return load_checkpoint(demo_model_path())


@pytest.mark.slow
def test_demo_gguf_config(demo_checkpoint: Checkpoint) -> None:
    cfg = demo_checkpoint.config
    assert demo_checkpoint.source == demo_model_path()
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["vocab_size"], cfg["intermediate_size"]) == (49152, 1536)
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in demo_checkpoint.state_dict
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["rope_scaling"]) == (1e-5, 100000.0, None)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["attention_bias"]) == (1, 2, False)
    assert demo_checkpoint.state_dict["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)


@pytest.mark.slow
def test_demo_gguf_matches_transformers(demo_checkpoint: Checkpoint) -> None:
    path = demo_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = model.state_dict()
    expected.pop("lm_head.weight")  # tied: transformers exposes the embedding under both names
    assert demo_checkpoint.state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(demo_checkpoint.state_dict[name], tensor, rtol=0, atol=0, msg=name)
    for field in ["vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim"]:
        assert demo_checkpoint.config[field] == getattr(model.config, field), field


def test_demo_tokenizer_roundtrip_and_chat_template(demo_tokenizer) -> None:
    text = "Paged attention, 123 tokens — naïve café!"
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    assert 0 < len(ids) < len(text) and max(ids) < 49152
    assert demo_tokenizer.decode(ids) == text
    assert demo_tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = demo_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turns = ["system\nBe brief.<|im_end|>\n", "user\nHi there<|im_end|>\n", "assistant\n"]
    assert rendered == "".join("<|im_start|>" + turn for turn in turns)
    prompt_ids = demo_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert demo_tokenizer.decode(prompt_ids) == rendered


def test_hf_dir_tokenizer_keeps_chat_template(tmp_path: Path, demo_tokenizer) -> None:
    demo_tokenizer.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == demo_tokenizer.chat_template
    assert tok.encode("hello world") == demo_tokenizer.encode("hello world")


# ---------------------------------------------------------------- refusals


def test_refuses_pickle_file(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="refusing pickle checkpoint"):
        load_checkpoint(tmp_path / "pytorch_model.bin")


def test_refuses_dir_with_only_pickle_weights(tmp_path: Path) -> None:
    tiny_model("llama_tied").config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match=r"only pickle weights \['pytorch_model.bin'\]"):
        load_checkpoint(tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_refuses_other_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(path)


def test_refuses_other_hf_model_type(tmp_path: Path) -> None:
    model = tiny_model("llama_tied")
    model.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*supported architectures: .*Gemma3"):
        load_checkpoint(tmp_path)


def test_refuses_missing_tensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_model("llama_untied")
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['lm_head.weight'\]"):
        load_checkpoint(tmp_path)
