"""What both formats' loaders produce: HF-named tensors kept one at a time (through a tensor-parallel
transform), and the check that a checkpoint holds every tensor its config names and nothing else."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specserve.models import quant

# What the loader does with each tensor as it is read: the (name, tensor) pairs to keep (a tensor-parallel
# rank's slice of it, models/parallel.py: Sharder); None keeps every tensor whole.
Transform = Callable[[str, Any], list[tuple[str, Any]]]

_HF_LAYER_RE = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.([qkvo]|qkv)_proj|self_attn\.[qk]_norm|mlp\.(gate|up|down|gate_up)_proj"
    r"|(input|post_attention|pre_feedforward|post_feedforward)_layernorm|(mlp|block_sparse_moe)\.gate"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123]"
    r"|mlp\.experts\.(gate_up|down)_proj)(\.(weight|bias))?"
)


def keep(state: dict[str, Any], name: str, tensor: Any, transform: Transform | None) -> None:
    state.update(transform(name, tensor) if transform is not None else [(name, tensor)])


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.dim() >= 2 else t.float()


def check_names(config: dict[str, Any], state: dict[str, torch.Tensor], p: Path) -> None:
    from specserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf(config)
    required = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        required.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        required.update(_layer_names(cfg, state, f"model.layers.{i}.", i))
        if config["attention_bias"] and f"model.layers.{i}.self_attn.qkv_proj.weight" not in state:
            required.update(f"model.layers.{i}.self_attn.{x}_proj.bias" for x in "qkv")
    missing = sorted(required - state.keys())
    if missing:
        raise ValueError(f"{p}: checkpoint is missing tensors {_some(missing)}")
    heads = {"model.embed_tokens" + quant.HEAD_Q8_0, "lm_head" + quant.HEAD_Q8_0}
    unknown = sorted(n for n in state.keys() - required - heads if not _HF_LAYER_RE.fullmatch(n))
    if unknown:
        raise ValueError(f"{p}: unexpected tensors {_some(unknown)}")


def _layer_names(cfg: Any, state: dict[str, torch.Tensor], prefix: str, i: int) -> set[str]:
    """The weights layer i must have, given the family and which of the equivalent layouts it uses."""
    fam = cfg.family
    names = ["input_layernorm", "post_attention_layernorm", "self_attn.o_proj"]
    if prefix + "self_attn.qkv_proj.weight" in state:  # Phi-3
        names.append("self_attn.qkv_proj")
    else:
        names += ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    if fam.qk_norm:
        names += ["self_attn.q_norm", "self_attn.k_norm"]
    if fam.sandwich_norms:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if cfg.layer_moe[i]:
        moe = "block_sparse_moe" if prefix + "block_sparse_moe.gate.weight" in state else "mlp"
        names.append(f"{moe}.gate")
        if prefix + "mlp.experts.gate_up_proj" in state:
            return {prefix + n + ".weight" for n in names} | {
                prefix + "mlp.experts.gate_up_proj",
                prefix + "mlp.experts.down_proj",
            }
        parts = ("w1", "w3", "w2") if moe == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
        names += [f"{moe}.experts.{e}.{w}" for e in range(cfg.num_experts) for w in parts]
    elif prefix + "mlp.gate_up_proj.weight" in state:  # Phi-3
        names += ["mlp.gate_up_proj", "mlp.down_proj"]
    else:
        names += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return {prefix + n + ".weight" for n in names}


def _some(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
