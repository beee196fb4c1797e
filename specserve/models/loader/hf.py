"""HF model directories: config.json (normalised to the fields the model reads) and safetensors weights,
read without a memory map. Pickle checkpoints (.bin/.pt) are refused: unpickling runs arbitrary code."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specserve.models.config import FAMILIES, UnsupportedModel
from specserve.models.loader.state import Transform, cast, keep

HF_MODEL_TYPES = set(FAMILIES)
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl"}


def load_hf_dir(
    d: Path, dtype: torch.dtype, transform: Transform | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not (d / "config.json").is_file():
        raise ValueError(f"{d}: no config.json, not an HF model directory")
    config = normalize_hf_config(json.loads((d / "config.json").read_text()), d)
    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(d):
        for name, tensor in _read_safetensors(f, dtype):
            # Old checkpoints carry the rotary inverse frequencies; they are derived from the config.
            if not name.endswith("rotary_emb.inv_freq"):
                keep(state, name, tensor, transform)
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


def normalize_hf_config(raw: dict[str, Any], d: Path) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        arch = (raw.get("architectures") or [model_type])[0]
        raise UnsupportedModel(f"{d}: unsupported model_type {model_type!r} ({arch})")
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


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _read_safetensors(f: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a .safetensors file, read into memory of its own and cast (matrices) to `dtype`.

    Read with plain reads rather than through a memory map (safetensors' safe_open): a mapped file's pages
    count in the process's resident set for as long as the map lives, and an fp32 file served in bf16
    peaked at 3.0x the served weights that way (bench/load.py); read, the file passes through the page
    cache only, and the peak is the weights plus one tensor in the file's dtype."""
    with open(f, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
        base = 8 + header_len
        header.pop("__metadata__", None)
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            source = SAFETENSORS_DTYPES.get(entry["dtype"])
            if source is None:
                raise ValueError(
                    f"{f}: tensor {name} has dtype {entry['dtype']}, which this loader cannot read"
                )
            begin, end = entry["data_offsets"]
            t = torch.empty(entry["shape"], dtype=source)
            fh.seek(base + begin)
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            if end - begin != len(view) or fh.readinto(view) != len(view):
                raise ValueError(f"{f}: tensor {name} is truncated or its offsets disagree with its shape")
            yield name, cast(t, dtype)
