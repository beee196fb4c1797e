"""Which steps a model runs as one library call over all its layers (cpu.chain.LayerChain), and the chain
for each run of step sizes: planned once, when the model is built, from the products its matrices call
(models/quant.py: library_products; models/linear.py chooses them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specserve.kernels import cpu
from specserve.models import quant

if TYPE_CHECKING:
    from specserve.models.llama import LlamaModel

MATRICES = ("qkv", "o", "gate_up", "down")

ChainRuns = list[tuple[float, cpu.chain.LayerChain | None]]


def layer_chains(model: LlamaModel) -> ChainRuns:
    """The layers as one library call a step, where every layer is a plain pre-norm one whose work all runs
    in the library: fused rope, norms and silu * up, no sliding window, soft-cap, q/k norm, sandwich norm,
    experts or tensor parallelism. A chain for each run of step sizes whose products are all the library's
    (quant: library_products), as (the most rows of the run, its chain or None), runs in increasing order; a
    step in a run without a chain takes the Python loop. With a dense copy for many rows (auto), bf16 int4
    has two runs and chains only the copy's."""
    cfg = model.cfg
    plain = (
        model.backend.name == "cpu"
        and model._fused_rope
        and model._fused_add_norm is not None
        and model._fused_silu_mul is not None
        and model.tp is None
        and not cfg.attn_softcap
    )
    if not plain:
        return []
    runs: list[dict[str, list[tuple[float, cpu.matmul.Product | None]]]] = []
    for layer in model.layers:
        if layer.router is not None or layer.q_norm is not None or layer.attn_out_norm is not None:
            return []
        if layer.window is not None:  # its attention reads a plan of its own (window_plans)
            return []
        if model.dtype != torch.float32 and any(
            getattr(layer, f"{name}_bias") is not None for name in MATRICES
        ):
            return []
        runs.append(
            {
                name: w.library_products() if isinstance(w, quant.Packed | quant.DensePanels) else []
                for name in MATRICES
                for w in [getattr(layer, name)]
            }
        )
    bounds = sorted({rows for layer in runs for products in layer.values() for rows, _ in products})
    chains: ChainRuns = []
    for most in bounds:  # each matrix's product for the steps of up to `most` rows past the last bound
        chosen = [
            {name: next((p for rows, p in ps if rows >= most), None) for name, ps in products.items()}
            for products in runs
        ]
        whole = all(p is not None for products in chosen for p in products.values())
        chains.append((most, _chain_of(model, chosen) if whole else None))
    return chains if any(chain is not None for _, chain in chains) else []


def _chain_of(model: LlamaModel, products: list[dict[str, cpu.matmul.Product]]) -> cpu.chain.LayerChain:
    layers = [
        cpu.chain.ChainLayer(
            layer.input_norm,
            layer.mlp_norm,
            rope=layer.rope,
            **chosen,
            **{f"{name}_bias": getattr(layer, f"{name}_bias") for name in chosen},
        )
        for layer, chosen in zip(model.layers, products)
    ]
    cfg = model.cfg
    intermediate = layers[0].down.k
    return cpu.chain.LayerChain(
        layers,
        model.dtype,
        cfg.hidden_size,
        intermediate,
        model.num_heads,
        model.num_kv_heads,
        cfg.head_dim,
        invariant=model.batch_invariant,
    )
