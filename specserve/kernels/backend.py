"""Choose the attention implementation for a device: Triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kernels import cpu, reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # Builds per-step index tensors shared by all layers (None where the kernel needs none).
    build_plan: Callable[..., object] | None
    # Rotary embedding + KV write fused (cpu.elementwise.rope_write_kv), where available.
    rope_write_kv: Callable[..., None] | None = None
    # The layer's elementwise steps in one pass each (residual add + RMSNorm, silu(gate) * up, Gemma's
    # gelu(gate) * up), where the backend has them (cpu.elementwise.add_rms_norm / silu_mul /
    # gelu_tanh_mul).
    add_rms_norm: Callable[..., torch.Tensor] | None = None
    silu_mul: Callable[..., torch.Tensor] | None = None
    gelu_tanh_mul: Callable[..., torch.Tensor] | None = None
    rms_norm_heads: Callable[..., None] | None = None  # q and k norms, in place


def select_backend(
    device: torch.device | str, prefer: str = "auto", batch_invariant: bool = False
) -> AttentionBackend:
    """prefer: "auto" (Triton on CUDA; on CPU the C++ kernel when it builds here, else the torch reference),
    "torch", "triton", or "cpu" (the C++ kernel for decode/verify queries, built on first use).
    batch_invariant: the C++ kernel's arithmetic per row whatever the step holds (cpu.attention)."""
    device = torch.device(device)
    if prefer not in ("auto", "cpu", "torch", "triton"):
        raise ValueError(f"attention backend must be auto, cpu, torch or triton, not {prefer!r}")
    use_triton = prefer == "triton" or (prefer == "auto" and device.type == "cuda")
    if use_triton:
        try:
            from specserve.kernels import triton_attention
        except ImportError as exc:  # triton comes with the gpu extra, which CPU installs leave out
            raise ValueError(
                "the triton attention backend needs Triton: pip install 'specserve[gpu]'"
            ) from exc

        # Compiled Triton kernels launched on CPU tensors fail deep inside Triton; say what is wrong here.
        if device.type != "cuda" and not triton_attention.interpreted():
            raise ValueError(
                f"the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1), not {device}"
            )
        return AttentionBackend("triton", triton_attention.write_kv, triton_attention.paged_attention, None)
    if prefer == "auto" and device.type == "cpu" and cpu.build.load() is not None:
        prefer = "cpu"
    if prefer == "cpu":
        if device.type != "cpu" or cpu.build.load() is None:
            raise ValueError("the cpu attention backend needs a CPU device and a C++ compiler for its kernel")
        # reference.paged_attention runs the C++ kernel first for a plan cpu.attention built (plan.native)
        return AttentionBackend(
            "cpu",
            reference.write_kv,
            reference.paged_attention,
            functools.partial(cpu.attention.build_plan, invariant=batch_invariant),
            cpu.elementwise.rope_write_kv,
            cpu.elementwise.add_rms_norm,
            cpu.elementwise.silu_mul,
            cpu.elementwise.gelu_tanh_mul,
            cpu.elementwise.rms_norm_heads,
        )
    return AttentionBackend("torch", reference.write_kv, reference.paged_attention, reference.build_plan)
