"""One forward for every supported family (Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Phi-3/4,
Gemma 3) over the paged KV cache.

Tokens of all sequences in a step are packed along dim 0 (no padding): every matmul sees the whole
batch, and only attention knows where one sequence ends and the next begins. What a family does differently
is a switch of `cfg.family` (models/config.py) or a per-layer fact (window, rotary embedding, sparse MLP);
every matmul with a weight goes through `self.linear(x, weight, bias)`, the one place a quantized linear
plugs in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from specserve.kernels import AttentionBackend, cpu, select_backend
from specserve.kernels.huge_pages import advise_huge_pages
from specserve.kernels.tree import TreeRows
from specserve.models import chain_plan, linear, quant
from specserve.models.config import ModelConfig
from specserve.models.parallel import TensorParallel, check_shardable, local_heads


@dataclass
class AttentionInputs:
    """Where this step's tokens go in the cache and what each sequence attends to (shared by all layers)."""

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # [num_seqs] context length including the new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    plan: object | None = None  # the backend's precomputed index tensors, if it uses any
    # The plan per sliding window, for backends whose plans depend on what a query sees (the torch reference)
    window_plans: dict[int, object] = field(default_factory=dict)
    # Draft trees' rows (kernels/tree.py) for a backend without plans (Triton); plans carry their own
    trees: TreeRows | None = None


def prepacked_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """bfloat16 on a CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX), for the matrices our panel
    products do not take (quant.dense_panels_pay); float32 keeps F.linear for those."""
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


Quantize = Callable[[Any], Any]


@dataclass(frozen=True)
class Capture:
    """Which hidden states a forward hands back beside its output (EAGLE-3's auxiliary states): the residual
    stream entering each of `layers` (vLLM's convention: layer i's input, which is HF's
    `output_hidden_states[i]`; `num_layers` names the last layer's output, before the final norm), at the
    packed token rows `rows` only, so a step copies those rows and nothing else."""

    layers: tuple[int, ...]
    rows: torch.Tensor  # [n] int64 indices into the step's packed tokens

    def check(self, num_layers: int) -> None:
        if not self.layers or any(not 0 <= i <= num_layers for i in self.layers):
            raise ValueError(f"capture layers {self.layers} must lie in [0, {num_layers}]")

    def gather(self, taken: dict[int, torch.Tensor], last: torch.Tensor) -> torch.Tensor:
        """The captured rows, in `layers` order; `last` is the forward's output (layer num_layers)."""
        return torch.cat([taken[i] if i in taken else last[self.rows] for i in self.layers], dim=-1)


class Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused so each is one matmul. Matrices may be
    dense tensors or quantized (models/quant.py); `quantize` says what each becomes as it is taken."""

    def __init__(
        self, sd: dict[str, Any], prefix: str, cfg: ModelConfig, index: int, quantize: Quantize
    ) -> None:
        # Taken out of `sd` as used: a loaded tensor is released once its fused copy exists (bench/load.py).
        def w(name: str) -> torch.Tensor:
            return sd.pop(prefix + name)

        def m(name: str) -> Any:  # a matrix
            return quantize(sd.pop(prefix + name))

        def b(name: str) -> torch.Tensor | None:
            return sd.pop(prefix + name, None)

        fam = cfg.family
        att = "self_attn."
        if prefix + "self_attn.qkv_proj.weight" in sd:  # Phi-3 stores them fused already
            self.qkv = m("self_attn.qkv_proj.weight")
            self.qkv_bias = b("self_attn.qkv_proj.bias")
        else:
            self.qkv = quant.cat(
                [m(att + "q_proj.weight"), m(att + "k_proj.weight"), m(att + "v_proj.weight")]
            )
            self.qkv_bias = (
                torch.cat([b(att + "q_proj.bias"), b(att + "k_proj.bias"), b(att + "v_proj.bias")])
                if cfg.qkv_bias
                else None
            )
        self.o = m("self_attn.o_proj.weight")
        self.o_bias = b("self_attn.o_proj.bias") if cfg.o_bias else None
        self.q_norm = b("self_attn.q_norm.weight") if fam.qk_norm else None
        self.k_norm = b("self_attn.k_norm.weight") if fam.qk_norm else None
        self.input_norm = w("input_layernorm.weight")
        if fam.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output
            self.attn_out_norm = w("post_attention_layernorm.weight")
            self.mlp_norm = w("pre_feedforward_layernorm.weight")
            self.mlp_out_norm = w("post_feedforward_layernorm.weight")
        else:
            self.attn_out_norm = self.mlp_out_norm = None
            self.mlp_norm = w("post_attention_layernorm.weight")
        self.window = cfg.layer_window[index]
        self.rope = cfg.layer_rope[index]
        self.router: torch.Tensor | None = None
        self.experts: list[tuple[Any, Any]] = []  # (gate_up, down) per expert
        if cfg.layer_moe[index]:
            self.router, self.experts = _experts(sd, prefix, cfg.num_experts, quantize)
            self.gate_up = self.down = None
            self.gate_up_bias = self.down_bias = None
            return
        if prefix + "mlp.gate_up_proj.weight" in sd:  # Phi-3
            self.gate_up = m("mlp.gate_up_proj.weight")
        else:
            self.gate_up = quant.cat([m("mlp.gate_proj.weight"), m("mlp.up_proj.weight")])
        self.gate_up_bias = (
            torch.cat([b("mlp.gate_proj.bias"), b("mlp.up_proj.bias")]) if cfg.mlp_bias else None
        )
        self.down = m("mlp.down_proj.weight")
        self.down_bias = b("mlp.down_proj.bias") if cfg.mlp_bias else None


def _experts(
    sd: dict[str, Any], prefix: str, num_experts: int, quantize: Quantize
) -> tuple[torch.Tensor, list[tuple[Any, Any]]]:
    """Router and per-expert (gate_up, down) weights from Qwen3-MoE's names (mlp.experts.E.gate_proj),
    Mixtral's (block_sparse_moe.experts.E.w1/w3/w2) or transformers 5's fused 3-D tensors."""
    if prefix + "block_sparse_moe.gate.weight" in sd:
        moe = prefix + "block_sparse_moe."
        names = ("w1", "w3", "w2")
    else:
        moe = prefix + "mlp."
        names = ("gate_proj", "up_proj", "down_proj")
    if moe + "experts.gate_up_proj" in sd:
        gate_up, down = sd[moe + "experts.gate_up_proj"], sd[moe + "experts.down_proj"]
        experts = [(quantize(gate_up[e]), quantize(down[e])) for e in range(num_experts)]
        return sd[moe + "gate.weight"], experts
    gate, up, down = names
    experts = [
        (
            quantize(torch.cat([sd[f"{moe}experts.{e}.{gate}.weight"], sd[f"{moe}experts.{e}.{up}.weight"]])),
            quantize(sd[f"{moe}experts.{e}.{down}.weight"]),
        )
        for e in range(num_experts)
    ]
    return sd[moe + "gate.weight"], experts


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
        quantization: str = "none",
        tp: TensorParallel | None = None,
        batch_invariant: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        # every row's arithmetic the same whatever its step holds (models/linear.py, Args::invariant)
        self.batch_invariant = batch_invariant
        self.tp = tp
        # with tensor parallelism `state_dict` holds this rank's slices already (models/parallel.py: Sharder,
        # applied by the loader); the model needs the head counts they make
        if tp is not None:
            check_shardable(cfg, tp.size)
        self.num_heads, self.num_kv_heads = local_heads(cfg, tp.size if tp else 1)
        self.dtype = dtype
        # the KV cache's: the model's, or bfloat16 under float32 (EngineConfig.kv_cache_dtype)
        self.kv_dtype = kv_cache_dtype or dtype
        self.device = torch.device(device)
        self.backend: AttentionBackend = select_backend(self.device, attention_backend, batch_invariant)
        fam = cfg.family
        # The model takes the tensors out of `state_dict` (it is left empty): loaded in the serving dtype, a
        # weight is then never held twice.
        sd = {}
        for k in list(state_dict):
            v = state_dict.pop(k)
            # Gemma's RMSNorm scales by (1 + w): folded into the weight once, in float32.
            if fam.norm_plus_one and k.endswith("norm.weight"):
                v = v.float() + 1.0
            # quantized matrices stay as the loader gave them until packed for the device below
            sd[k] = v.to(device=self.device, dtype=dtype) if isinstance(v, torch.Tensor) else v
        self.embed = sd["model.embed_tokens.weight"]
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model's dtype, as HF does.
        self.embed_scale = (
            torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device=self.device) if fam.embed_scale else None
        )
        quantize = quant.quantizer(quantization)
        self.layers = [Layer(sd, f"model.layers.{i}.", cfg, i, quantize) for i in range(cfg.num_layers)]
        self.norm = sd["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else sd["lm_head.weight"]
        # a GGUF's Q8_0 head as its blocks, where the dtype rounds them (quant.head_form; packed below)
        head_name = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        head_q8_0 = sd.get(head_name + quant.HEAD_Q8_0)
        self.linear = F.linear
        self.act = F.silu if cfg.hidden_act == "silu" else lambda x: F.gelu(x, approximate="tanh")
        # bit for bit the torch ops in both dtypes (tests/test_kernels.py), so the HF oracle tests still hold;
        # partial rotary (Phi) rotates only part of each head, which the fused kernel does not do
        self._fused_rope = (
            self.backend.rope_write_kv is not None
            and dtype in (torch.float32, torch.bfloat16)
            and all(r.rotary_dim == cfg.head_dim for r in cfg.ropes)
        )
        # The fused residual add + RMSNorm and silu * up (2-core Zen 4, bf16: 21.5 -> 9.4 us and 25 -> 18 us
        # at 16 rows, 91 -> 27 us and 97 -> 68 us at 144; a 64-row decode step under cProfile 1.28 -> 1.15 s
        # over 10 steps). In float32 too: torch's F.rms_norm there is eight ops, ~1 ms a batch-1 step over
        # 61 norms (bench/profile_step.py --batch 1 --dtype float32, avx2 paths: int4 10.9 / 11.1 -> 9.9 /
        # 10.5 ms, 64 rows 181 / 185 -> 177 / 177 ms). Its sums of squares and silu's exp differ from torch's
        # in the last bits; the HF oracle tests compare greedy tokens, which hold.
        fused_elementwise = dtype in (torch.bfloat16, torch.float32)
        self._fused_add_norm = self.backend.add_rms_norm if fused_elementwise else None
        self._fused_silu_mul = (
            self.backend.silu_mul if fused_elementwise and cfg.hidden_act == "silu" else None
        )
        # Gemma's GeGLU, its sandwich norms (after attention, after the MLP) and q/k norms likewise: Gemma 3
        # 270M over the first 32 W1 requests capped at 128 tokens, 64 in flight (bf16, 2-core Zen 4, under
        # cProfile), torch's norms took 1.03 s of 16.2 and its gelu 0.58 (and then the product), the fused
        # ones 0.25 and 0.30 of 14.8
        self._fused_gelu_mul = (
            self.backend.gelu_tanh_mul if fused_elementwise and cfg.hidden_act != "silu" else None
        )
        self._fused_head_norm = self.backend.rms_norm_heads if fused_elementwise else None
        # auto serves batch-1 steps from the quantized matrices and larger ones from a dense copy where that
        # is faster (quant.dense_copy_pays: not int8 in bf16 without AMX, nor float32 on our widened panels,
        # which run as fast as dense at every step size); int8/int4 asked for outright hold them quantized.
        keep_dense = quantization == "auto" and not batch_invariant
        self._pack_weights(prepacked_linear_available(self.device, dtype), keep_dense, head_q8_0)
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        if tp is not None:  # row-parallel biases are added once, to the sum of the ranks' partial products
            for layer in self.layers:
                layer.o_bias_after, layer.o_bias = layer.o_bias, None
                layer.down_bias_after, layer.down_bias = layer.down_bias, None
        self.scale = cfg.scale
        self.windows = cfg.windows  # distinct sliding windows: the runner builds a plan for each
        # Steps a chain takes run all their layers in one library call; the rest run the Python loop below,
        # which tests and benchmarks compare the chains with (chain_runs emptied).
        self.chain_runs = chain_plan.layer_chains(self)
        self._cos: list[torch.Tensor] = []
        self._sin: list[torch.Tensor] = []
        self._rope_len = 0
        self._rope_cache(min(cfg.max_position_embeddings, 4096))

    def _pack_weights(self, prepack: bool, keep_dense: bool, head_q8_0: quant.Int8Weight | None) -> None:
        """Quantized matrices into their kernels' layouts, with a dense copy beside them when `keep_dense`
        and the copy pays (quant.dense_copy_pays); dense ones into the form models/linear.py chooses: our
        panel products' layout (linear.DENSE_PANELS), or with `prepack` oneDNN's own blocked layout, once
        instead of on every call.

        F.linear on a bfloat16 CPU tensor reorders the weight into oneDNN's layout at each call; prepacked,
        the decode-sized matmuls of a step run about 1.5x faster with bit-identical results.
        """

        dense = _prepacked_linear if prepack else F.linear
        panels = False
        invariant = self.batch_invariant
        isa = linear.Isa.here(self.device, onednn_bf16=prepack, batch_invariant=invariant)

        def dense_form(w: torch.Tensor) -> Any:
            nonlocal panels
            form = linear.choose(quant.matrix(w), 1, self.dtype, isa)
            if form is linear.DENSE_PANELS:
                panels = True
                return quant.DensePanels(w)
            return torch.ops.mkldnn._reorder_linear_weight(w) if form is linear.ONEDNN_PREPACKED else w

        def dense_mm(w: Any) -> quant.DenseMatmul:
            return w.mm if isinstance(w, quant.DensePanels) else partial(dense, weight=w)

        def pack(w: Any) -> Any:
            if not isinstance(w, quant.Int8Weight | quant.Int4Weight | quant.A8Weight):
                return dense_form(w)
            copy_mm = None
            # steps of many rows read a dense copy (quant.KERNEL_MAX_ROWS) where it beats the kernels
            if keep_dense and quant.dense_copy_pays(w, self.dtype, self.device):
                copy = dense_form(quant.dequantize(w).to(device=self.device, dtype=self.dtype))
                copy_mm = copy if isinstance(copy, quant.DensePanels) else dense_mm(copy)
            return quant.pack(w, self.dtype, self.device, copy_mm, invariant)

        quantized = a8 = False
        for layer in self.layers:
            weights = [layer.qkv, layer.o, layer.gate_up, layer.down, *sum(layer.experts, ())]
            quantized |= any(isinstance(w, quant.QuantizedWeight) for w in weights)
            a8 |= any(isinstance(w, quant.A8Weight) for w in weights)
            layer.qkv, layer.o = pack(layer.qkv), pack(layer.o)
            if layer.router is None:
                layer.gate_up, layer.down = pack(layer.gate_up), pack(layer.down)
            else:
                layer.router = pack(layer.router)
                layer.experts = [(pack(gu), pack(d)) for gu, d in layer.experts]
        self.quantized = quantized
        # a packed copy (prepacked or panels): the embedding lookup still needs the dense one. It serves the
        # many-row steps of an int8 head too: SmolLM2's fp32 head at 18 rows took 22 ms a decode step in
        # MKL's sgemm, a third of the step (bench/profile_step.py --dtype float32, Zen 4).
        head = dense_form(self.lm_head)
        # few-row logits from an int8 copy where our float32 kernels run (quant.head_form); a w*a8 model's
        # Q8_0 head on int8 activations (quant.a8_head)
        if quantized:
            int8_head = quant.pack_head(
                self.lm_head, dense_mm(head), self.dtype, self.device, head_q8_0, invariant, a8
            )
            head = int8_head if isinstance(int8_head, quant.PackedInt8 | quant.PackedA8) else head
        self.lm_head = head
        self.linear = quant.with_packed(dense) if quantized or panels else dense

    def _chain(
        self, rows: int, attn: AttentionInputs, kv_caches: list
    ) -> tuple[cpu.chain.LayerChain, torch.Tensor] | None:
        """The chain this step takes and the sequences its attention runs, or None where the step needs the
        Python loop: no chain for its size, or attention the library does not run
        (NativeShort.kernel_takes_all, which the backend's paged_attention asks too)."""
        plan = attn.plan
        native = getattr(plan, "native", None)
        chain = next((c for most, c in self.chain_runs if rows <= most), None)
        if chain is None or native is None or native.tree_rows is not None:
            return None  # a draft tree's rows run the tree kernel, which the chain does not call
        block_size = kv_caches[0][0].shape[1]
        if not cpu.attention.supports(self.dtype, block_size, kv_caches[0][0].dtype):
            return None
        if not native.kernel_takes_all(self.dtype, self.cfg.head_dim, block_size):
            return None
        return chain, native.all_ids

    def _rope_cache(self, length: int) -> None:
        # float32 angles as HF computes them, then cast: bit-identical rotations in fp32.
        self._cos, self._sin = [], []
        for rope in self.cfg.ropes:
            freqs, scale = rope.angles(length)
            emb = torch.cat([freqs, freqs], dim=-1).to(self.device)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:  # longrope's attention factor, applied to cos/sin as HF does
                cos, sin = cos * scale, sin * scale
            self._cos.append(cos.to(self.dtype)[:, None, :])
            self._sin.append(sin.to(self.dtype)[:, None, :])
        self._rope_len = length

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (self.cfg.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.cfg.head_dim)
        cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        advise_huge_pages(cache)  # before the first touch, so the pages fault in huge
        cache.zero_()
        return [(cache[i, 0], cache[i, 1]) for i in range(self.cfg.num_layers)]

    def _sum_ranks(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.tp.all_reduce(partial)
        return out if bias is None else out + bias

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._fused_add_norm is not None and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype:
            return self._fused_add_norm(x, None, weight, self.cfg.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)

    def _add_norm(
        self, h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + add, rms_norm(h + add)); the fused kernel adds into h in place (h is this forward's own)."""
        if self._fused_add_norm is not None and weight.dtype == h.dtype:
            return h, self._fused_add_norm(h, add, weight, self.cfg.rms_norm_eps)
        if add is not None:
            h = h + add
        return h, self._rms_norm(h, weight)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        if rot != x.shape[-1]:  # partial rotary: the tail of each head passes through
            return torch.cat([self._rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _mlp(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        if layer.router is not None:
            return self._moe(x, layer)
        gate_up = self.linear(x, layer.gate_up, layer.gate_up_bias)
        fused = self._fused_silu_mul or self._fused_gelu_mul
        if fused is not None:
            return self.linear(fused(gate_up), layer.down, layer.down_bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(self.act(gate) * up, layer.down, layer.down_bias)

    def _moe(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        """Top-k experts per token, computed grouped: the (token, expert) pairs sorted by expert, then one
        gate_up and one down matmul per expert that any token chose. Python loops over experts, not tokens."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        probs = torch.softmax(self.linear(x, layer.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=cfg.num_experts).tolist()  # one host sync per layer
        token = order // k
        xs = x[token]
        outs = []
        start = 0
        for e, c in enumerate(counts):
            if c:
                gate_up, down = layer.experts[e]
                gate, up = self.linear(xs[start : start + c], gate_up).chunk(2, dim=-1)
                outs.append(self.linear(self.act(gate) * up, down))
                start += c
        ys = torch.cat(outs) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, ys)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionInputs,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the last layer (before the final norm). max_position:
        the step's largest position (or a bound on it) where the caller knows it on the host."""
        return self._forward(input_ids, positions, kv_caches, attn, None, max_position)[0]

    def forward_capturing(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionInputs,
        capture: Capture,
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's hidden states, and the residual stream entering each of `capture.layers` at
        `capture.rows`: [len(rows), len(layers) * hidden], layer by layer along the last dimension."""
        h, aux = self._forward(input_ids, positions, kv_caches, attn, capture, max_position)
        assert aux is not None
        return h, aux

    @torch.inference_mode()
    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionInputs,
        capture: Capture | None,
        max_position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.cfg
        if capture is not None:
            capture.check(cfg.num_layers)
        taken: dict[int, torch.Tensor] = {}
        # reading the largest position off a device tensor waits for the device, and a CUDA graph cannot
        # hold a wait: callers that know it on the host pass it
        top = int(positions.max()) if max_position is None else max_position
        if top >= self._rope_len:
            self._rope_cache(max(top + 1, 2 * self._rope_len))
        fused = self._fused_rope
        if not fused:
            cos = [c[positions] for c in self._cos]
            sin = [s[positions] for s in self._sin]
        n = input_ids.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, cfg.head_dim
        h = self.embed[input_ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        chained = self._chain(n, attn, kv_caches)
        if chained is not None:
            chain, seq_ids = chained
            nat = attn.plan.native
            h = h.contiguous()  # the chain adds into it in place
            args = (
                positions.contiguous(),
                attn.slot_mapping.contiguous(),
                list(zip(self._cos, self._sin)),
                kv_caches,
                nat.block_tables,
                nat.seq_lens,
                nat.query_start_loc,
                seq_ids,
                self.scale,
                cfg.rms_norm_eps,
            )
            if capture is None:
                return h + chain(h, *args), None
            # in pieces, split where a captured layer starts: each piece's MLP output is added to the
            # residual stream before the capture (as the next layer's fused add would)
            start = 0
            for stop in (*sorted(set(capture.layers)), cfg.num_layers):
                if stop > start:
                    h.add_(chain.segment(start, stop)(h, *args))
                    start = stop
                if stop < cfg.num_layers:
                    taken[stop] = h[capture.rows]
            return h, capture.gather(taken, h)
        backend = self.backend
        softcap = {"softcap": cfg.attn_softcap} if cfg.attn_softcap else {}
        pending = None  # the last layer's MLP output: added to h by the next layer's norm, in one pass
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h, x = self._add_norm(h, pending, layer.input_norm)
            if capture is not None and i in capture.layers:  # h is now the stream entering layer i
                taken[i] = h[capture.rows]
            qkv = self.linear(x, layer.qkv, layer.qkv_bias)
            if layer.q_norm is not None:  # per-head RMSNorm of q and k, before rope
                qk = qkv[:, : self.q_size + self.kv_size].view(n, nh + nkv, hd)
                if self._fused_head_norm is not None and layer.q_norm.dtype == qkv.dtype:
                    self._fused_head_norm(qk[:, :nh], layer.q_norm, cfg.rms_norm_eps)
                    self._fused_head_norm(qk[:, nh:], layer.k_norm, cfg.rms_norm_eps)
                else:
                    qk[:, :nh] = self._rms_norm(qk[:, :nh], layer.q_norm)
                    qk[:, nh:] = self._rms_norm(qk[:, nh:], layer.k_norm)
            if fused:
                backend.rope_write_kv(
                    qkv,
                    positions,
                    self._cos[layer.rope],
                    self._sin[layer.rope],
                    nh,
                    nkv,
                    k_cache,
                    v_cache,
                    attn.slot_mapping,
                )
                q = qkv[:, : self.q_size].view(n, nh, hd)
            else:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                c, s = cos[layer.rope], sin[layer.rope]
                q = self._rotate(q.view(n, nh, hd), c, s)
                k = self._rotate(k.view(n, nkv, hd), c, s)
                backend.write_kv(k, v.view(n, nkv, hd), k_cache, v_cache, attn.slot_mapping)
            window = {} if layer.window is None else {"window": layer.window}
            o = backend.paged_attention(
                q,
                k_cache,
                v_cache,
                attn.block_tables,
                attn.seq_lens,
                attn.query_start_loc,
                self.scale,
                plan=attn.plan if layer.window is None else attn.window_plans.get(layer.window),
                **window,
                **softcap,
                **({} if attn.trees is None else {"trees": attn.trees}),
            )
            o = self.linear(o.view(n, self.q_size), layer.o, layer.o_bias)
            if self.tp is not None:
                o = self._sum_ranks(o, layer.o_bias_after)
            if layer.attn_out_norm is not None:
                o = self._rms_norm(o, layer.attn_out_norm)
            h, x = self._add_norm(h, o, layer.mlp_norm)
            m = self._mlp(x, layer)
            if self.tp is not None:
                m = self._sum_ranks(m, layer.down_bias_after)
            if layer.mlp_out_norm is not None:
                m = self._rms_norm(m, layer.mlp_out_norm)
            pending = m
        h = h if pending is None else h + pending
        return h, None if capture is None else capture.gather(taken, h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the selected rows only: the vocab projection is the largest matmul we skip."""
        # the fused norm where the layers use it: torch's float32 rms_norm is eight ops, 115 us a batch-1 step
        # right after the layers (their weights have pushed its code and data out of cache), the fused ~50 us
        logits = self.linear(self._add_norm(hidden, None, self.norm)[1], self.lm_head)
        cap = self.cfg.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
