"""The shape of a supported decoder model, read from an HF config.json dict.

One forward (models/llama.py) serves every family; what sets a family apart is a row of `FAMILIES` (a few
switches) plus per-layer facts read from its config: each layer's attention window, rotary embedding and
whether its MLP is a mixture of experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """What a family's forward does differently from Llama's."""

    qkv_bias: bool = False  # q/k/v projections always carry biases, whatever the config says (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    sandwich_norms: bool = False  # norms after attention and before/after the MLP too (Gemma 3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    moe: bool = False  # sparse MLP layers (Qwen3-MoE, Mixtral)
    always_norm_topk: bool = False  # router top-k weights renormalised whatever the config says (Mixtral)
    window_for_all_layers: bool = False  # a set `sliding_window` applies to every layer (no layer_types)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "smollm": Family(),
    "smollm2": Family(),
    "mistral": Family(window_for_all_layers=True),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True, moe=True),
    "mixtral": Family(moe=True, always_norm_topk=True, window_for_all_layers=True),
    "phi3": Family(window_for_all_layers=True),
    "gemma3_text": Family(qk_norm=True, norm_plus_one=True, sandwich_norms=True, embed_scale=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# HF `architectures` entries per family, for the supported-models listing and error messages.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "llama3", "linear", "longrope")


class UnsupportedModel(ValueError):
    """A checkpoint whose architecture this engine has no forward for."""

    def __init__(self, what: str) -> None:
        supported = ", ".join(sorted(ARCHITECTURES))
        super().__init__(f"{what}; supported architectures: {supported}")


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: a layer type's base and scaling (Gemma 3 has one for local, one for global)."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] | None  # the rope_scaling dict as items (frozen, hashable)
    rotary_dim: int  # dimensions rotated at the front of each head (partial rotary: fewer than head_dim)
    max_position_embeddings: int

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.scaling or ()).get(key, default)

    @property
    def kind(self) -> str:
        return "default" if self.scaling is None else self.param("rope_type", "default")

    def _base_inv_freq(self, ext: torch.Tensor | None = None) -> torch.Tensor:
        dim = self.rotary_dim
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        base = self.theta**shape
        return 1.0 / (base if ext is None else ext * base)

    def angles(self, length: int) -> tuple[torch.Tensor, float]:
        """float32 angles [length, rotary_dim / 2] per position as HF computes them, and the cos/sin scale."""
        pos = torch.arange(length, dtype=torch.float32)
        kind = self.kind
        if kind == "longrope":
            # HF switches to the long factors once a forward's last position passes the original context;
            # generating token by token that is per position, which is what this table does.
            original = self.param("original_max_position_embeddings")
            short = self._base_inv_freq(torch.tensor(self.param("short_factor"), dtype=torch.float32))
            long = self._base_inv_freq(torch.tensor(self.param("long_factor"), dtype=torch.float32))
            inv = torch.where((pos >= original)[:, None], long[None, :], short[None, :])
            factor = self.param("factor") or self.max_position_embeddings / original
            scale = self.param("attention_factor")
            if scale is None:
                scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            return pos[:, None] * inv, float(scale)
        return pos[:, None] * self.inv_freq()[None, :], 1.0

    def inv_freq(self) -> torch.Tensor:
        """Inverse frequencies, with Llama 3's wavelength-dependent scaling or linear scaling when set."""
        inv_freq = self._base_inv_freq()
        kind = self.kind
        if kind == "linear":
            return inv_freq / self.param("factor")
        if kind != "llama3":
            return inv_freq
        factor = self.param("factor")
        low, high = self.param("low_freq_factor", 1.0), self.param("high_freq_factor", 4.0)
        old_len = self.param("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    family: Family = Family()
    hidden_act: str = "silu"
    attn_scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2 style tanh capping of attention scores
    final_softcap: float | None = None  # ... and of the logits
    ropes: tuple[Rope, ...] = ()  # distinct rotary embeddings
    layer_rope: tuple[int, ...] = ()  # per layer: index into ropes
    layer_window: tuple[int | None, ...] = ()  # per layer: sliding window (tokens seen, own included)
    # mixture of experts
    layer_moe: tuple[bool, ...] = ()  # per layer: the MLP is sparse
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        family = FAMILIES.get(model_type)
        if family is None:
            arch = (cfg.get("architectures") or [model_type])[0]
            raise UnsupportedModel(f"unsupported model_type {model_type!r} ({arch})")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        num_layers = cfg["num_hidden_layers"]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {act!r} is not supported (supported: {ACTIVATIONS})")
        layer_types = list(cfg.get("layer_types") or ["full_attention"] * num_layers)
        window = cfg.get("sliding_window")
        if family.window_for_all_layers and window and "sliding_attention" not in layer_types:
            layer_types = ["sliding_attention"] * num_layers
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            layer_types = ["full_attention"] * num_layers
        ropes, layer_rope = _ropes(cfg, layer_types, head_dim)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        attention_bias = bool(cfg.get("attention_bias", False))
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if family.moe else 0
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or ())
        scalar = cfg.get("query_pre_attn_scalar")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=ropes[0].theta,
            rope_scaling=dict(ropes[0].scaling) if ropes[0].scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=not family.qkv_bias and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            family=family,
            hidden_act=act,
            attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            ropes=ropes,
            layer_rope=layer_rope,
            layer_window=tuple(window if t == "sliding_attention" and window else None for t in layer_types),
            layer_moe=tuple(
                num_experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers)
            ),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            norm_topk_prob=family.always_norm_topk or bool(cfg.get("norm_topk_prob", False)),
        )

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the layers (empty when every layer attends to everything)."""
        return tuple(sorted({w for w in self.layer_window if w}))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    def inv_freq(self) -> torch.Tensor:
        """The first rotary embedding's inverse frequencies (every layer's, outside Gemma 3)."""
        return self.ropes[0].inv_freq()


def _rope(params: dict[str, Any], cfg: dict[str, Any], head_dim: int) -> Rope:
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: {ROPE_TYPES})")
    params["rope_type"] = kind
    params.pop("type", None)
    if kind == "longrope":
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"),
        )
    scaling = None if kind == "default" else tuple(sorted((k, _frozen(v)) for k, v in params.items()))
    return Rope(theta, scaling, int(head_dim * partial), cfg.get("max_position_embeddings", 4096))


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _ropes(
    cfg: dict[str, Any], layer_types: list[str], head_dim: int
) -> tuple[tuple[Rope, ...], tuple[int, ...]]:
    """The distinct rotary embeddings and each layer's: transformers 5 nests `rope_parameters` by layer type
    where they differ (Gemma 3: rope_local_base_freq for sliding layers); older configs keep them flat."""
    rp = cfg.get("rope_parameters") or {}
    nested = any(isinstance(v, dict) for v in rp.values())
    if nested:
        per_type = {t: _rope(rp[t], cfg, head_dim) for t in sorted(set(layer_types))}
    else:
        flat = dict(rp)
        if cfg.get("rope_scaling"):
            flat.update(cfg["rope_scaling"])
        if "rope_theta" in cfg and "rope_theta" not in rp:
            flat["rope_theta"] = cfg["rope_theta"]
        one = _rope(flat, cfg, head_dim)
        per_type = {t: one for t in set(layer_types)}
        if cfg.get("rope_local_base_freq") is not None and "sliding_attention" in per_type:
            local = dict(flat, rope_theta=cfg["rope_local_base_freq"])
            local.pop("rope_type", None)
            local.pop("factor", None)
            per_type["sliding_attention"] = _rope(local, cfg, head_dim)
    ropes = tuple(dict.fromkeys(per_type[t] for t in layer_types))
    return ropes, tuple(ropes.index(per_type[t]) for t in layer_types)
