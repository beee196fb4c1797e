"""A model's decoder layers in one library call a step (csrc/chain.cpp: specserve_decoder_layers), calling the
very kernels the model's Python loop calls, with the same arguments: outputs are bit for bit the loop's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.cpu import build
from specserve.kernels.cpu.matmul import Product

# LayerChain's product kinds (the C++ ProductKind), by the library function a Product calls
_CHAIN_KINDS = {
    "f32_matmul": 0,
    "int8_matmul": 1,
    "int8_grouped_matmul": 2,
    "int4_matmul": 3,
    "bf16_matmul": 4,
    "int8_matmul_bf16": 5,
    "int4_matmul_bf16": 6,
    "int4_rows_bf16": 7,
    "int4_tile_rows_bf16": 8,
    # apart from the weight-only kinds, so that either list can grow without renumbering the other
    "w8a8_matmul": 16,
    "w4a8_matmul": 17,
    "w8a8_matmul_bf16": 18,
    "w4a8_matmul_bf16": 19,
    "w4a8h_matmul": 20,
    "w4a8h_matmul_bf16": 21,
}


@dataclass(frozen=True)
class ChainLayer:
    """One decoder layer as LayerChain runs it: RMSNorm, qkv, rope + KV write, attention, o, residual add +
    RMSNorm, gate_up, silu * up, down. Products are bound library products; biases float32 or None."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    rope: int  # which of the call's rotary tables
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


class LayerChain:
    """A model's decoder layers run in one library call a step (specserve_decoder_layers), calling the very
    kernels the model's Python loop calls, with the same arguments: outputs are bit for bit the loop's.

    Why: at batch 1 the loop's ~270 calls a step through ctypes and torch's dispatcher kept one core in
    Python while the other spun at the next barrier (perf of SmolLM2's int8 steps, 2-core Zen 4, avx2
    build: 16 % of samples outside the kernels and libgomp, 22 % in libgomp's waits). Chained, in one
    process ABBA (`bench/profile_step.py --batch 1 --dtype float32 --quantization int8 --chain-ab`, avx2
    build): int8 7.6 against 10.0 ms a step, int4 7.6 against 9.7, dense 21.6 against 24.2; at 16
    sequences dense 61.5 against 64.2. The weights' pointers are taken once, here; a call checks only the
    step's tensors."""

    def __init__(
        self,
        layers: list[ChainLayer],
        dtype: torch.dtype,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        first_layer: int = 0,
        invariant: bool = False,
    ) -> None:
        if build._lib is None:
            raise RuntimeError("LayerChain needs the library: build.load() first")
        self.dtype, self.hidden, self.intermediate = dtype, hidden, intermediate
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.invariant = invariant  # attention's batch-invariant arithmetic (paged_attention_short)
        q_size, qkv_n = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {"qkv": (qkv_n, hidden), "o": (hidden, q_size)}
        shapes |= {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        words: list[int] = []
        keep: list[torch.Tensor] = []
        for i, layer in enumerate(layers):
            for norm in (layer.input_norm, layer.mlp_norm):
                if norm.dtype != dtype or norm.shape != (hidden,) or not norm.is_contiguous():
                    raise ValueError(f"layer {i}: norm weights must be contiguous {dtype} [{hidden}]")
            words += [layer.input_norm.data_ptr(), layer.mlp_norm.data_ptr()]
            keep += [layer.input_norm, layer.mlp_norm]
            for name, (n, k) in shapes.items():
                product: Product = getattr(layer, name)
                bias: torch.Tensor | None = getattr(layer, name + "_bias")
                if product.name not in _CHAIN_KINDS or (product.n, product.k) != (n, k):
                    raise ValueError(f"layer {i}: {name} must be a library product [{n}, {k}]")
                if product.x_dtype != dtype or product.out_dtype != dtype:
                    raise ValueError(f"layer {i}: {name} must take and give {dtype}")
                if bias is not None and (
                    dtype != torch.float32
                    or bias.dtype != dtype
                    or bias.shape != (n,)
                    or not bias.is_contiguous()
                ):
                    raise ValueError(f"layer {i}: {name}'s bias must be contiguous float32 [{n}]")
                weights = [w.data_ptr() for w in product._weights]
                words += [_CHAIN_KINDS[product.name], n, k, *weights, *[0] * (3 - len(weights))]
                words.append(0 if bias is None else bias.data_ptr())
                keep += [*product._weights, *([bias] if bias is not None else [])]
            words.append(layer.rope)
        self.layers = layers
        self.first_layer = first_layer  # a segment's first layer: its KV caches start there in the list
        self._segments: dict[tuple[int, int], LayerChain] = {}
        self.num_layers = len(layers)
        self.num_ropes = 1 + max(layer.rope for layer in layers)
        self._words = torch.tensor(words, dtype=torch.int64)
        self._keep = keep  # the pointers above stay valid while these live
        self._kv: tuple[object, torch.Tensor] | None = None

    def segment(self, start: int, stop: int) -> LayerChain:
        """Layers [start, stop) of this chain as a chain of their own, called with the whole model's KV
        caches: a step that captures hidden states between layers runs the chain in pieces (built once)."""
        key = (start, stop)
        if key not in self._segments:
            self._segments[key] = LayerChain(
                self.layers[start:stop], self.dtype, self.hidden, self.intermediate, self.num_heads,
                self.num_kv_heads, self.head_dim, self.first_layer + start, self.invariant,
            )  # fmt: skip
        return self._segments[key]

    def _kv_pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # the runner allocates its caches once: their pointers are taken on first sight of the list
        if self._kv is None or self._kv[0] is not kv_caches:
            if len(kv_caches) < self.first_layer + self.num_layers:
                raise ValueError(f"LayerChain runs {self.num_layers} layers, given {len(kv_caches)} caches")
            mine = kv_caches[self.first_layer : self.first_layer + self.num_layers]
            heads = (self.num_kv_heads, self.head_dim)
            for k, v in mine:
                if (
                    (self.dtype, k.dtype) not in build.KV_DTYPES
                    or v.dtype != k.dtype
                    or not (k.is_contiguous() and v.is_contiguous())
                    or k.shape[2:] != heads
                    or v.shape != k.shape
                ):
                    raise ValueError(
                        f"KV caches: contiguous {self.dtype} (or bfloat16 under float32) "
                        f"[blocks, size, *{heads}]"
                    )
            self._kv = (
                kv_caches,
                torch.tensor([t.data_ptr() for kv in mine for t in kv], dtype=torch.int64),
            )
        return self._kv[1]

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_ids: torch.Tensor,
        scale: float,
        eps: float,
    ) -> torch.Tensor:
        """Runs every layer over h [rows, hidden] (contiguous, the embeddings; updated in place as the
        residual stream) and returns the last layer's MLP output, which the caller adds to h. Index tensors
        as paged_attention_short and rope_write_kv take them; ropes: each table's (cos, sin)."""
        rows = h.shape[0]
        if h.dtype != self.dtype or h.shape != (rows, self.hidden) or not h.is_contiguous():
            raise ValueError(f"h must be contiguous {self.dtype} [rows, {self.hidden}]")
        for t, dt in ((positions, torch.int64), (slot_mapping, torch.int64), (seq_ids, torch.int64)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError("positions, slot_mapping and seq_ids must be contiguous int64")
        if positions.numel() != rows or slot_mapping.numel() != rows:
            raise ValueError("positions and slot_mapping need one entry per row")
        for t in (block_tables, seq_lens, query_start_loc):
            if t.dtype != torch.int32 or not t.is_contiguous():
                raise ValueError("block_tables, seq_lens and query_start_loc must be contiguous int32")
        if len(ropes) < self.num_ropes:
            raise ValueError(f"the layers read {self.num_ropes} rotary tables, given {len(ropes)}")
        for cos, sin in ropes:
            if (
                cos.dtype != self.dtype
                or sin.dtype != self.dtype
                or not (cos.is_contiguous() and sin.is_contiguous())
            ):
                raise ValueError(f"rotary tables must be contiguous {self.dtype}")
        kv = self._kv_pointers(kv_caches)
        rope_ptrs = torch.tensor([t.data_ptr() for pair in ropes for t in pair], dtype=torch.int64)
        block_size = kv_caches[0][0].shape[1]
        m = torch.empty_like(h)
        rc = build._lib.specserve_decoder_layers(
            self._words.data_ptr(), self.num_layers, kv.data_ptr(), rope_ptrs.data_ptr(), h.data_ptr(),
            m.data_ptr(), rows, self.hidden, self.intermediate, self.num_heads, self.num_kv_heads,
            self.head_dim, block_size, positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), query_start_loc.data_ptr(), seq_ids.data_ptr(),
            seq_ids.numel(), scale, eps, build.DTYPES[self.dtype], torch.get_num_threads(),
            int(self.invariant), build.KV_DTYPES[self.dtype, kv_caches[0][0].dtype],
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"decoder_layers refused its arguments (code {rc})")
        return m
