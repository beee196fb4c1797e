"""How big the KV cache is, and how long a sequence may be (no fixed 2 GiB, no silent cut).

- `kv_cache_bytes` given: that.
- CUDA: vLLM's rule, `gpu_memory_utilization` (default 0.9) of the device's memory, less what is already in
  use once the weights are loaded (by us and by anyone else on the device) and the activation peak of the
  largest step (`max_num_batched_tokens`), measured by running that step once (vLLM's profile run); the
  estimate `activation_reserve_bytes` stands in where it cannot be measured (CPU, tensor-parallel ranks).
- CPU: CPU_KV_SHARE of the memory this process may use (the cgroup limit in a container, else physical RAM),
  within [CPU_KV_MIN, CPU_KV_MAX]: 2.4 GiB on a 24 GiB machine, the old fixed figure's neighbourhood.

A max_model_len that was asked for and does not fit in the pool is an error naming both numbers; one taken
from the model (its max_position_embeddings) is lowered to what fits, with a warning saying so.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CPU_KV_SHARE = 0.10
CPU_KV_MIN = 256 << 20
CPU_KV_MAX = 8 << 30
GIB = float(1 << 30)


@dataclass(frozen=True)
class KvPlan:
    num_blocks: int
    max_model_len: int
    pool_bytes: int
    why: str  # how the pool size was chosen, for the start-up log line


def memory_limit_bytes() -> int:
    """What this process may use: a cgroup v2 (or v1) limit when one is set, else physical RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or v1's huge number: no limit
            return int(text)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_reserve_bytes(
    max_num_batched_tokens: int, hidden_size: int, intermediate_size: int, vocab_size: int, dtype_bytes: int
) -> int:
    """An upper estimate of one step's transient memory: a layer's activations for every token of the step
    (MLP up/gate and down, attention projections, residuals) and a batch of fp32 logits."""
    per_token = (3 * intermediate_size + 6 * hidden_size) * dtype_bytes
    logits = min(max_num_batched_tokens, 512) * vocab_size * 4
    return 2 * max_num_batched_tokens * per_token + logits


def largest_step(
    max_num_batched_tokens: int, max_num_seqs: int, block_size: int, logit_rows: int
) -> tuple[list[Any], int]:
    """The largest step the scheduler may plan, as ForwardEntry's over a KV cache of their own: every token
    budgeted, spread over up to `max_num_seqs` prompts, `logit_rows` logits among them. Also the blocks they
    use."""
    from specserve.engine.model_runner import ForwardEntry

    seqs = max(1, min(max_num_seqs, max_num_batched_tokens, logit_rows))
    lengths = [max_num_batched_tokens // seqs + (i < max_num_batched_tokens % seqs) for i in range(seqs)]
    wanted = [logit_rows // seqs + (i < logit_rows % seqs) for i in range(seqs)]
    entries, next_block = [], 0
    for i, (n, w) in enumerate(zip(lengths, wanted)):
        table = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(table)
        entries.append(ForwardEntry([i % 100 + 1] * n, 0, table, min(n, w)))
    return entries, next_block


def profile_activation_bytes(
    model: Any, max_num_batched_tokens: int, max_num_seqs: int, block_size: int, logit_rows: int
) -> int:
    """The activation peak of the largest step, measured (vLLM's profile run): `largest_step` run once on a
    KV cache just big enough for it, freed again. CUDA only: it reads the caching allocator's peak;
    elsewhere it returns 0 and the estimate above stands."""
    from specserve.engine.model_runner import ModelRunner

    device = model.device
    if device.type != "cuda":
        return 0
    entries, blocks = largest_step(max_num_batched_tokens, max_num_seqs, block_size, logit_rows)
    runner = ModelRunner(model, blocks, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.run(entries)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    return peak


def kv_pool_bytes(
    device: torch.device,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float,
    activation_reserve: int,
) -> tuple[int, str]:
    if kv_cache_bytes:
        return kv_cache_bytes, "kv_cache_bytes"
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free  # the weights just loaded, the CUDA context, other processes
        budget = int(total * gpu_memory_utilization) - in_use - activation_reserve
        why = (
            f"gpu_memory_utilization {gpu_memory_utilization:g} of {total / GIB:.1f} GiB, less "
            f"{in_use / GIB:.2f} GiB in use and {activation_reserve / GIB:.2f} GiB for activations"
        )
        if budget <= 0:
            raise ValueError(
                f"no room for a KV cache on {device}: {why} leaves {budget / GIB:.2f} GiB; raise "
                "gpu_memory_utilization or free the device"
            )
        return budget, why
    limit = memory_limit_bytes()
    budget = int(min(CPU_KV_MAX, max(CPU_KV_MIN, CPU_KV_SHARE * limit)))
    return budget, f"{CPU_KV_SHARE:.0%} of {limit / GIB:.1f} GiB of memory (within 0.25-8 GiB)"


def check_max_model_len(
    pool_bytes: int, why: str, bytes_per_token: int, block_size: int, wanted: int
) -> None:
    """The longest sequence must fit in the pool on its own, or preemption could never make room for it."""
    capacity = max(1, pool_bytes // (bytes_per_token * block_size)) * block_size
    if wanted > capacity:
        raise ValueError(
            f"max_model_len {wanted} does not fit in the KV cache: it holds {capacity} tokens "
            f"({pool_bytes / GIB:.2f} GiB, {why}); lower max_model_len or raise kv_cache_bytes"
            + (" / gpu_memory_utilization" if "gpu" in why else "")
        )


def plan_kv_cache(
    pool_bytes: int,
    why: str,
    bytes_per_token: int,
    block_size: int,
    requested_max_model_len: int | None,
    model_max_len: int,
) -> KvPlan:
    """Blocks for `pool_bytes`, and the longest sequence: it must fit in the pool on its own, or preemption
    could never make room for it."""
    num_blocks = max(1, pool_bytes // (bytes_per_token * block_size))
    capacity = num_blocks * block_size
    if requested_max_model_len is not None:
        # above the model's own it was refused before the load (engine/preflight.py)
        max_len = min(requested_max_model_len, model_max_len)
        check_max_model_len(pool_bytes, why, bytes_per_token, block_size, max_len)
    else:
        max_len = min(model_max_len, capacity)
        if max_len < model_max_len:
            log.warning(
                "the model's context is %d tokens, the KV cache holds %d (%.2f GiB, %s): serving at most %d "
                "tokens a sequence; raise kv_cache_bytes to serve more",
                model_max_len,
                capacity,
                pool_bytes / GIB,
                why,
                max_len,
            )
    log.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB (%s); max_model_len %d",
        num_blocks,
        block_size,
        capacity,
        num_blocks * block_size * bytes_per_token / GIB,
        why,
        max_len,
    )
    return KvPlan(num_blocks, max_len, pool_bytes, why)
