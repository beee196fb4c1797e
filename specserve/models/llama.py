"""Our own Llama-family forward (Llama 2/3, Mistral, Qwen2, SmolLM) over the paged KV cache.

Tokens of all sequences in a step are packed along dim 0 (no padding): every matmul sees the whole
batch, and only attention knows where one sequence ends and the next begins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import AttentionBackend, select_backend
from specserve.kernels.huge_pages import advise_huge_pages
from specserve.models.config import ModelConfig


@dataclass
class AttentionInputs:
    """Where this step's tokens go in the cache and what each sequence attends to (shared by all layers)."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs] context length including the new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    plan: object | None = None  # the backend's precomputed index tensors, if it uses any


def prepacked_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """bfloat16 on a CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX); float32 keeps F.linear, whose
    results the HF oracle tests compare bit for bit."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _prepacked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused so each is one matmul."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> None:
        def w(name: str) -> torch.Tensor:
            return sd[prefix + name]

        def b(name: str) -> torch.Tensor | None:
            return sd.get(prefix + name)

        self.qkv = torch.cat(
            [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]
        )
        self.qkv_bias = (
            torch.cat([b("self_attn.q_proj.bias"), b("self_attn.k_proj.bias"), b("self_attn.v_proj.bias")])
            if cfg.qkv_bias
            else None
        )
        self.o = w("self_attn.o_proj.weight")
        self.o_bias = b("self_attn.o_proj.bias") if cfg.o_bias else None
        self.gate_up = torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
        self.gate_up_bias = (
            torch.cat([b("mlp.gate_proj.bias"), b("mlp.up_proj.bias")]) if cfg.mlp_bias else None
        )
        self.down = w("mlp.down_proj.weight")
        self.down_bias = b("mlp.down_proj.bias") if cfg.mlp_bias else None
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend: AttentionBackend = select_backend(self.device, attention_backend)
        sd = {k: v.to(device=self.device, dtype=dtype) for k, v in state_dict.items()}
        self.embed = sd["model.embed_tokens.weight"]
        self.layers = [Layer(sd, f"model.layers.{i}.", cfg) for i in range(cfg.num_layers)]
        self.norm = sd["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else sd["lm_head.weight"]
        self.linear = F.linear
        # bit for bit the torch ops in both dtypes (tests/test_kernels.py), so the HF oracle tests still hold
        self._fused_rope = self.backend.rope_write_kv is not None and dtype in (torch.float32, torch.bfloat16)
        if prepacked_linear_available(self.device, dtype):
            self._prepack()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self._inv_freq = cfg.inv_freq().to(self.device)
        self._cos = self._sin = torch.empty(0)
        self._rope_cache(min(cfg.max_position_embeddings, 4096))

    def _prepack(self) -> None:
        """Hand oneDNN its weights once in its own blocked layout, instead of on every call.

        F.linear on a bfloat16 CPU tensor reorders the weight into oneDNN's layout at each call; prepacked,
        the decode-sized matmuls of a step run about 1.5x faster with bit-identical results.
        """
        pack = torch.ops.mkldnn._reorder_linear_weight
        for layer in self.layers:
            layer.qkv, layer.o = pack(layer.qkv), pack(layer.o)
            layer.gate_up, layer.down = pack(layer.gate_up), pack(layer.down)
        self.lm_head = pack(self.lm_head)  # a packed copy: the embedding lookup still needs the dense one
        self.linear = _prepacked_linear

    def _rope_cache(self, length: int) -> None:
        # float32 angles as HF computes them, then cast: bit-identical rotations in fp32.
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(self.dtype)[:, None, :]
        self._sin = emb.sin().to(self.dtype)[:, None, :]

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.cfg.num_layers, 2, num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        advise_huge_pages(cache)  # before the first touch, so the pages fault in huge
        cache.zero_()
        return [(cache[i, 0], cache[i, 1]) for i in range(self.cfg.num_layers)]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionInputs,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the last layer (before the final norm)."""
        cfg = self.cfg
        if int(positions.max()) >= self._cos.shape[0]:
            self._rope_cache(max(int(positions.max()) + 1, 2 * self._cos.shape[0]))
        fused = self._fused_rope
        if not fused:
            cos, sin = self._cos[positions], self._sin[positions]
        n = input_ids.shape[0]
        h = self.embed[input_ids]
        backend = self.backend
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self._rms_norm(h, layer.input_norm)
            qkv = self.linear(x, layer.qkv, layer.qkv_bias)
            if fused:
                backend.rope_write_kv(
                    qkv,
                    positions,
                    self._cos,
                    self._sin,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    k_cache,
                    v_cache,
                    attn.slot_mapping,
                )
                q = qkv[:, : self.q_size].view(n, cfg.num_heads, cfg.head_dim)
            else:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = self._rotate(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
                k = self._rotate(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
                backend.write_kv(
                    k, v.view(n, cfg.num_kv_heads, cfg.head_dim), k_cache, v_cache, attn.slot_mapping
                )
            o = backend.paged_attention(
                q,
                k_cache,
                v_cache,
                attn.block_tables,
                attn.seq_lens,
                attn.query_start_loc,
                self.scale,
                plan=attn.plan,
            )
            h = h + self.linear(o.view(n, self.q_size), layer.o, layer.o_bias)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = self.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + self.linear(F.silu(gate) * up, layer.down, layer.down_bias)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the selected rows only: the vocab projection is the largest matmul we skip."""
        return self.linear(self._rms_norm(hidden, self.norm), self.lm_head).float()
