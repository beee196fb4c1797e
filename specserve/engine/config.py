"""Engine knobs (vLLM's names), validated once, and the choices derived from them and the machine."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from specserve.models.loader import read_chat_template
from specserve.models.quant import check_mode as check_quantization
from specserve.spec.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "bfloat16")


@dataclass
class EngineConfig:
    model: str | None = None  # HF dir, .gguf or Hugging Face id; None serves the demo SmolLM2-135M-Instruct
    revision: str | None = None  # of a Hugging Face id: a branch, tag or commit (None: main)
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None  # None: sized from the device's memory (engine/memory.py)
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device the engine may fill (vLLM's)
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    # Prompt tokens one step computes while other sequences are decoding (0: up to max_num_batched_tokens).
    # A step's time grows with its tokens on a CPU, and every decoding sequence waits for it: a prefill of
    # arrivals is the long tail of inter-token latency (engine/scheduler.py says by how much).
    prefill_tokens_beside_decode: int = 0
    # Share the K/V of prompt prefixes already computed (vLLM's name and default); static batching never does.
    enable_prefix_caching: bool = True
    # fcfs (vLLM's default) or priority: lower `priority` runs sooner and may preempt lower-priority running
    # sequences when slots or KV blocks are short (engine/scheduler.py).
    scheduling_policy: str = "fcfs"
    # Priority policy: tokens per step that sequences of a worse band than the best present share while it
    # runs; the others of them pause, keeping their KV (engine/scheduler.py _background_share). One, not two:
    # at 1-8 rows a step's cost grows with its rows (int4 kernels), and bench/shared_queue.py's interactive
    # p50 with a batch behind it was 1.21x idle with one against 1.29x with two (2-core EPYC, AVX512-BF16,
    # bf16); on the AVX2 EPYC one gave 1.24x against 1.25x and 1.42x. The batch alone runs at full speed.
    background_tokens: int = 1
    static_batching: bool = False  # benchmark baseline only
    # With static_batching: a finished member keeps its slot and is computed on (its output discarded) until
    # the whole batch is done, as in HF generate's padded batches. Off, finished members leave the batch.
    static_padding: bool = False
    # A dict (vLLM's shape, as LLM(...) and the service pass it) becomes a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    attention_backend: str = "auto"
    # The KV cache's dtype (vLLM's name). auto: the model's. bfloat16 under a float32 model: half the bytes a
    # token, so twice the tokens in the same memory and half the reads for attention, K and V rounded to
    # bfloat16 as they are written (what a bfloat16 model's cache holds) and widened to float32 as they are
    # read. CPU only.
    kv_cache_dtype: str = "auto"
    # Weight-only int8/int4 decoder matrices (models/quant.py). auto: a GGUF's quantized matrices stay
    # quantized where torch's packed-int kernels are vectorised (bf16 on AVX-512), and are dequantized
    # elsewhere; none: always dequantized; int8/int4: every decoder matrix quantized on load.
    quantization: str = "auto"
    # A request's tokens and logprobs do not depend on its batch mates, the step's rows, chunking, prefix
    # hits or speculation: each matrix runs one product form at every step size and attention one order of
    # sums per row (models/linear.py, kernels/cpu/csrc/attention.h). Off: forms chosen by the step's rows
    # for speed (a dense copy beside int4 for many rows, oneDNN's AMX tiles, float32 attention's key split).
    # Off by default: on the demo model in bf16 it cost 6.4x on W1 at 64 in flight and 1.5-2.3x at batch 1
    # (`bench/throughput.py --no-batch-invariant` A/B, AMX Xeon): prompts run in int4 passes of a few rows.
    batch_invariant: bool = False
    # Ranks one engine's forward is split over (vLLM's name): processes on CPU (gloo), one GPU each on CUDA
    # (NCCL); engine/parallel.py and models/parallel.py.
    tensor_parallel_size: int = 1
    # Every step eager (vLLM's name): off, CUDA captures the uniform decode and verify steps in graphs at
    # start (engine/cuda_graphs.py); elsewhere there is nothing to turn off.
    enforce_eager: bool = False
    # CPU: the team size chosen by trial among the budget's threads and one fewer (engine/cpu_tuning.py
    # TeamTuner), so a busy neighbour on a core makes the engine drop to whichever size steps run faster at.
    # Never with tensor parallelism, batch_invariant, or an OMP_NUM_THREADS the operator set.
    adaptive_threads: bool = True
    # A Jinja chat template, or a file holding one (vLLM's --chat-template): it replaces the model's own; a
    # model with neither is refused for chat (engine.encode_chat), never given a guessed template.
    chat_template: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, not {getattr(self, name)!r}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {u!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, not {self.dtype!r}")
        check_quantization(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {choices}, not {self.kv_cache_dtype!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, not {tp!r}")
        if tp > 1 and self.quantization in ("int8", "int4", "w8a8", "w4a8"):
            raise ValueError(
                f"quantization {self.quantization} is not supported with tensor_parallel_size {tp}: "
                "the ranks shard dense weights (use quantization auto or none)"
            )
        if not isinstance(self.adaptive_threads, bool):
            raise ValueError(f"adaptive_threads must be true or false, not {self.adaptive_threads!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
        p = self.prefill_tokens_beside_decode
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"prefill_tokens_beside_decode must be a non-negative integer, not {p!r}")
        if not (isinstance(self.background_tokens, int) and self.background_tokens >= 1):
            raise ValueError(f"background_tokens must be a positive integer, not {self.background_tokens!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            build = f"torch {torch.__version__}"
            raise ValueError(
                f"device {self.device}: no CUDA device is visible to {build}"
                if torch.version.cuda
                else f"device {self.device}: {build} is built without CUDA (use device cpu or auto)"
            )
        if self.chat_template is not None:
            if not isinstance(self.chat_template, str) or not self.chat_template.strip():
                raise ValueError(f"chat_template must be a template or a file, not {self.chat_template!r}")
            self.chat_template = read_chat_template(self.chat_template)
        if isinstance(self.speculative_config, dict):
            spec = self.speculative_config
            self.speculative_config = SpeculativeConfig.from_dict(spec) if spec else None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cuda":
            return torch.bfloat16
        # bf16 pays on CPUs with native bf16 matmuls (AVX-512 BF16 / AMX); elsewhere it is emulated and slow.
        return torch.bfloat16 if torch.backends.mkldnn.is_available() and _cpu_has_bf16() else torch.float32

    def torch_kv_dtype(self, dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """The KV cache's dtype under a model of `dtype` on `device`."""
        if self.kv_cache_dtype == "auto" or DTYPES[self.kv_cache_dtype] == dtype:
            return dtype
        if dtype != torch.float32 or device.type != "cpu":
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype} is for a float32 model on CPU, not a "
                f"{str(dtype).removeprefix('torch.')} one on {device.type} (use kv_cache_dtype auto)"
            )
        return DTYPES[self.kv_cache_dtype]


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
