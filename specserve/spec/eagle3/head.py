"""The EAGLE-3 head in the speculators checkpoint format (vllm-project/speculators, read by vLLM's
`llama_eagle3.py`): its config, its weights, and its reference forward.

One step of the head at row i (vLLM's layout; the proposer and the training tool both keep it):

    input_ids[i] = the token at position i + 1     hidden[i] = fc(target aux states at position i)
    positions[i] = i                               -> logits over the draft vocabulary for position i + 2
                                                      and hidden_out[i], fed back as the next step's hidden

The decoder layer reads [input_layernorm(embed(token)) ; hidden_norm(hidden)] through q/k/v (2 * hidden
inputs), adds the attention output to the residual (the hidden before its norm, or after it with
`norm_before_residual`), then a Llama MLP; `norm` and `lm_head` turn hidden_out into draft logits, and
`d2t` maps a draft id to the target's (`target = draft + d2t[draft]`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Layer configs whose decoder layer is the plain Llama one this head computes (no q/k norms, no biases).
LAYER_MODEL_TYPES = ("llama",)
# speculators' own flags for variants of the head; each changes the arithmetic, so a head that sets one is
# refused by name rather than run wrong.
UNSUPPORTED_FLAGS = ("fc_norm", "norm_output")


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default aux layers for EAGLE-3: (2, L // 2, L - 3).

    vLLM records `hidden_states + residual` *before* decoder layer `i` runs, so id `i` is the output of
    layer `i - 1`, which is HF's `output_hidden_states[i]` (index 0 there is the embeddings)."""
    if num_layers < 4:
        raise ValueError(f"num_layers: EAGLE-3's default layer ids need at least 4 layers, not {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    # vLLM's ids (see default_layer_ids); None: the verifier's defaults, known once its depth is
    target_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the three concatenated aux states (`input_norm`)
    hidden_act: str = "silu"
    # transformers' rope description (`rope_type`, `rope_theta`, and a scaling's own fields)
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"}, hash=False)
    verifier_name: str | None = None
    verifier_architectures: tuple[str, ...] = ()
    speculative_tokens: int = 3

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        """The aux layer ids for a target `num_layers` deep (the configured ones, or vLLM's defaults)."""
        return self.target_layer_ids if self.target_layer_ids is not None else default_layer_ids(num_layers)

    def layer_config(self) -> Any:
        """The decoder layer as transformers' LlamaConfig (rope and the speculators file take it)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Eagle3Config:
        file = Path(path) / CONFIG_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file}: no config.json (an EAGLE-3 head is a directory in speculators' layout)"
            )
        return cls.from_dict(json.loads(file.read_text(encoding="utf-8")))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Eagle3Config:
        """A speculators `config.json` (or SpecForge's, which keeps the layer ids under `eagle_config`)."""
        kind = raw.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"speculators_model_type: expected 'eagle3', got {kind!r}")
        spec = raw.get("speculators_config") or {}
        if spec.get("algorithm", "eagle3") != "eagle3":
            raise ValueError(
                f"speculators_config.algorithm: expected 'eagle3', got {spec.get('algorithm')!r}"
            )
        for flag in UNSUPPORTED_FLAGS:
            if raw.get(flag):
                raise ValueError(f"{flag}: this EAGLE-3 variant is not supported (only {flag}=false)")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError("transformer_layer_config: missing (the head's decoder layer config)")
        model_type = layer.get("model_type", "llama")
        if model_type not in LAYER_MODEL_TYPES:
            raise ValueError(
                f"transformer_layer_config.model_type: {model_type!r} is not supported ({LAYER_MODEL_TYPES})"
            )
        if layer.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                "transformer_layer_config.num_hidden_layers: only one-layer heads are supported, "
                f"not {layer.get('num_hidden_layers')}"
            )
        for bias in ("attention_bias", "mlp_bias"):
            if layer.get(bias):
                raise ValueError(f"transformer_layer_config.{bias}: heads with biases are not supported")
        from transformers import LlamaConfig

        # transformers reads the legacy spellings (rope_theta, rope_scaling) into rope_parameters
        parsed = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("model_type", "architectures")})
        hidden = int(parsed.hidden_size)
        heads = int(parsed.num_attention_heads)
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (len(ids) != 3 or not all(isinstance(i, int) for i in ids)):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: expected 3 integers, got {ids!r}")
        methods = spec.get("proposal_methods") or [{}]
        verifier = spec.get("verifier") or {}
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(parsed.num_key_value_heads or heads),
            head_dim=int(getattr(parsed, "head_dim", None) or hidden // heads),
            intermediate_size=int(parsed.intermediate_size),
            rms_norm_eps=float(parsed.rms_norm_eps),
            max_position_embeddings=int(parsed.max_position_embeddings),
            draft_vocab_size=int(raw.get("draft_vocab_size") or parsed.vocab_size),
            target_vocab_size=int(parsed.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            target_layer_ids=tuple(ids) if ids is not None else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            hidden_act=str(parsed.hidden_act),
            rope_parameters=dict(parsed.rope_parameters or {"rope_type": "default"}),
            verifier_name=verifier.get("name_or_path"),
            verifier_architectures=tuple(verifier.get("architectures") or ()),
            speculative_tokens=int(methods[0].get("speculative_tokens", 3)),
        )

    def to_dict(self) -> dict[str, Any]:
        layer = self.layer_config().to_diff_dict()
        layer.pop("transformers_version", None)
        layer["model_type"] = "llama"
        out: dict[str, Any] = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids)
            if self.target_layer_ids is not None
            else None,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": self.verifier_name,
                    "architectures": list(self.verifier_architectures),
                },
            },
        }
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm: statistics in float32, the weight applied in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        inputs = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(inputs, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        from transformers.activations import ACT2FN

        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)


class Eagle3Head(nn.Module):
    """The head's tensors under speculators' names, and its forwards on plain tensors."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        # kept off the module's state: the cos/sin tables stay float32 whatever dtype the weights take
        self.__dict__["_rotary"] = LlamaRotaryEmbedding(cfg.layer_config())

    # -- pieces -----------------------------------------------------------------------------------------

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[N, 3 * target_hidden] (the three aux states concatenated in layer-id order) -> [N, hidden]."""
        if self.cfg.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        return self.fc(aux_hidden)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, draft_vocab] -> [N, target_vocab]: each draft logit at its target id, -inf elsewhere."""
        ids = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=draft_logits.device))
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.target_vocab_size), float("-inf"))
        out[..., ids] = draft_logits
        return out

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_out))

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self.__dict__["_rotary"]
        if rotary.inv_freq.device != positions.device:
            rotary.to(positions.device)
        return rotary(x, positions)  # [B, T, head_dim] each

    def layer_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's input [..., 2 * hidden] (the token's normed embedding beside the normed hidden
        state) and the residual it adds its attention to (normed or not, as `norm_before_residual` says)."""
        layer = self.layers[0]
        embeds = layer.input_layernorm(self.embed_tokens(input_ids))
        if self.cfg.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = layer.hidden_norm(hidden)
        return torch.cat([embeds, hidden], dim=-1), residual

    def _qkv(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k and v [B, Hkv, T, D] (rotated), and the residual [B, T, hidden]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cfg, layer = self.cfg, self.layers[0]
        x, residual = self.layer_input(input_ids, hidden)
        b, t, _ = x.shape
        attn = layer.self_attn
        q = attn.q_proj(x).view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self._cos_sin(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype))
        return q, k, v, residual

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out [B, H, T, D] -> the layer's output [B, T, hidden] (pre-final-norm)."""
        layer = self.layers[0]
        b, _, t, _ = attn_out.shape
        h = residual + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _groups(self) -> int:
        return self.cfg.num_attention_heads // self.cfg.num_key_value_heads

    # -- forwards ---------------------------------------------------------------------------------------

    def forward_dense(
        self, input_ids: torch.Tensor, fused_or_prev_hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain causal attention over the T rows: (logits [B, T, draft_vocab], hidden_out [B, T, hidden])."""
        q, k, v, residual = self._qkv(input_ids, fused_or_prev_hidden, positions)
        g = self._groups()
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), is_causal=True
        )
        hidden_out = self._finish(out, residual)
        return self.logits(hidden_out), hidden_out

    def forward_chain(
        self,
        input_ids: torch.Tensor,
        fused: torch.Tensor,
        positions: torch.Tensor,
        steps: int,
        first_row: int = 0,
    ) -> list[torch.Tensor]:
        """Chain drafting of `steps` tokens from every row at once (EAGLE-3's training-time test).

        Step 0 is forward_dense. At step s > 0 row i stands for the draft at position i + s when the target
        has verified up to row i: it reads the argmax of step s - 1 at row i (through d2t) and that step's
        hidden_out, and attends to rows 0..i of step 0 and to its own row at steps 1..s, which is what a
        dense forward over [rows 0..i ; the s drafts] computes. Rows before `first_row` are context only
        (their keys and values; no drafts from them). Returns each step's draft logits
        [B, T - first_row, draft_vocab]."""
        g = self._groups()
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        q, k0, v0, residual = self._qkv(input_ids, fused, positions)
        k0, v0 = k0.repeat_interleave(g, dim=1), v0.repeat_interleave(g, dim=1)
        t = k0.shape[2]
        q, residual, positions = q[:, :, first_row:], residual[:, first_row:], positions[:, first_row:]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)[first_row:]
        prev_k: list[torch.Tensor] = []
        prev_v: list[torch.Tensor] = []
        all_logits: list[torch.Tensor] = []
        hidden_out = fused
        for step in range(steps):
            if step > 0:
                tokens = self.draft_to_target(all_logits[-1].argmax(-1))
                q, k, v, residual = self._qkv(tokens, hidden_out, positions + step)
                prev_k.append(k.repeat_interleave(g, dim=1))
                prev_v.append(v.repeat_interleave(g, dim=1))
            scores = (q @ k0.transpose(-1, -2)).float() * scale
            scores = scores.masked_fill(future, float("-inf"))
            diag = [(q * k).sum(-1, keepdim=True).float() * scale for k in prev_k]  # [B, H, rows, 1] each
            probs = torch.cat([scores, *diag], dim=-1).softmax(-1).to(q.dtype)
            out = probs[..., :t] @ v0
            for j, v in enumerate(prev_v):
                out = out + probs[..., t + j : t + j + 1] * v
            hidden_out = self._finish(out, residual)
            all_logits.append(self.logits(hidden_out))
        return all_logits


def _weights_from(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            # SpecForge / the EAGLE authors' name for the one decoder layer, as vLLM maps it
            weights[name.replace("midlayer.", "layers.0.", 1)] = tensor
    return weights


def load_eagle3(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    target_embed: torch.Tensor | None = None,
) -> Eagle3Head:
    """A speculators-format head. Without `embed_tokens.weight` in the checkpoint the target's embedding
    (`target_embed`, [target_vocab, hidden]) is used, as vLLM does; without `d2t` the draft vocabulary must
    be the target's."""
    path = Path(path)
    cfg = Eagle3Config.from_dir(path)
    weights = _weights_from(path)
    head = Eagle3Head(cfg)
    expected = head.state_dict()
    if "embed_tokens.weight" not in weights:
        if target_embed is None:
            raise ValueError("embed_tokens.weight: not in the checkpoint and no target embedding was given")
        weights["embed_tokens.weight"] = target_embed
    if "d2t" not in weights:
        if cfg.draft_vocab_size != cfg.target_vocab_size:
            raise ValueError(
                f"d2t: missing, and draft_vocab_size {cfg.draft_vocab_size} differs from the target's "
                f"vocabulary {cfg.target_vocab_size}"
            )
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in weights:
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + weights["d2t"].long()] = True
        weights["t2d"] = t2d
    unexpected = sorted(n for n in weights if n not in expected and not n.startswith("verifier_"))
    if unexpected:
        raise ValueError(f"{unexpected[0]}: not a tensor of an EAGLE-3 head ({len(unexpected)} unexpected)")
    for name, want in expected.items():
        if name not in weights:
            raise ValueError(f"{name}: missing from the checkpoint")
        got = weights[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(
                f"{name}: shape {tuple(got.shape)} in the checkpoint, the config implies {tuple(want.shape)}"
            )
    state = {n: weights[n].to(expected[n].dtype) for n in expected}
    _check_vocab_map(state["d2t"], cfg)
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype)


def _check_vocab_map(d2t: torch.Tensor, cfg: Eagle3Config) -> None:
    targets = torch.arange(cfg.draft_vocab_size) + d2t
    if targets.min() < 0 or targets.max() >= cfg.target_vocab_size:
        raise ValueError(f"d2t: maps draft ids outside the target vocabulary [0, {cfg.target_vocab_size})")


def save_eagle3(
    head: Eagle3Head,
    path: str | Path,
    verifier_name: str,
    verifier_architectures: tuple[str, ...] = (),
    with_embed: bool = True,
) -> Path:
    """config.json and model.safetensors in speculators' layout (the embedding left out with `with_embed`
    False: vLLM then takes the target's)."""
    from dataclasses import replace

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = replace(head.cfg, verifier_name=verifier_name, verifier_architectures=tuple(verifier_architectures))
    state = {n: t.detach().contiguous().cpu() for n, t in head.state_dict().items()}
    if not with_embed:
        state.pop("embed_tokens.weight")
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(cfg.to_json(), encoding="utf-8")
    return path


def vocab_maps(draft_ids: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t and t2d for a draft vocabulary given as target ids (sorted here, as speculators keeps them)."""
    ids = torch.as_tensor(draft_ids, dtype=torch.long).sort().values
    if ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= target_vocab_size:
        raise ValueError(f"draft_ids: must be distinct target ids in [0, {target_vocab_size})")
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def random_eagle3(cfg: Eagle3Config, seed: int = 0, vocab: str = "random") -> Eagle3Head:
    """A head with random weights (tests), its draft vocabulary a random subset of the target's
    (`vocab="random"`) or its first draft_vocab_size ids (`"first"`)."""
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        if vocab == "random":
            ids = torch.randperm(cfg.target_vocab_size, generator=gen)[: cfg.draft_vocab_size]
        elif vocab == "first":
            ids = torch.arange(cfg.draft_vocab_size)
        else:
            raise ValueError(f"vocab: 'random' or 'first', not {vocab!r}")
        d2t, t2d = vocab_maps(ids, cfg.target_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head


def check_target(cfg: Eagle3Config, num_layers: int, hidden_size: int, vocab_size: int) -> None:
    """ValueError naming the field when the head was not made for a target of this shape."""
    if cfg.target_hidden_size != hidden_size:
        raise ValueError(
            f"target_hidden_size: the head reads hidden states of size {cfg.target_hidden_size}, "
            f"the model's hidden size is {hidden_size}"
        )
    if cfg.target_vocab_size != vocab_size:
        raise ValueError(
            f"transformer_layer_config.vocab_size: the head maps to a vocabulary of {cfg.target_vocab_size}, "
            f"the model's vocabulary is {vocab_size}"
        )
    ids = cfg.layer_ids(num_layers)
    if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids: the head reads layers {list(ids)}, "
            f"the model has {num_layers} layers (ids 0..{num_layers - 1})"
        )
