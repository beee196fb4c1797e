"""What can be checked of an engine's configuration against its model before a weight is read: the
model's config (config.json, or a GGUF's header) and the machine. A setting that cannot work fails here,
in one line naming it and the numbers, not after a load of the weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.engine.config import EngineConfig
from specserve.engine.memory import check_max_model_len, kv_pool_bytes
from specserve.models.config import ModelConfig
from specserve.models.linear import invariance_refusal
from specserve.models.loader import demo_model_path, read_config, resolve_model
from specserve.models.parallel import check_shardable


@dataclass(frozen=True)
class Preflight:
    path: Path
    header: ModelConfig  # the model's config, read without its weights
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's (EngineConfig.kv_cache_dtype)


def preflight(config: EngineConfig) -> Preflight:
    path = resolve_model(config.model, config.revision) if config.model else demo_model_path()
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    kv_dtype = config.torch_kv_dtype(dtype, device)
    header = ModelConfig.from_hf(read_config(path))
    if config.batch_invariant and (why := invariance_refusal(dtype, device)) is not None:
        raise ValueError(f"batch_invariant with dtype {str(dtype).removeprefix('torch.')}: {why}")
    tp = config.tensor_parallel_size
    if tp > 1:  # before any rank starts loading: a size that does not divide the heads is refused
        check_shardable(header, tp)
    wanted, own = config.max_model_len, header.max_position_embeddings
    if wanted is not None and wanted > own:
        raise ValueError(
            f"max_model_len {wanted} is above the model's own context of {own} tokens "
            "(max_position_embeddings in its config); lower max_model_len"
        )
    # On CUDA an unsized pool is what the loaded weights leave of the device: known only after the load.
    if wanted is not None and (config.num_kv_blocks or config.kv_cache_bytes or device.type == "cpu"):
        # a rank holds its share of the KV heads (all of one where there are fewer heads than ranks)
        heads = max(1, header.num_kv_heads // tp)
        per_token = header.kv_bytes_per_token(kv_dtype) * heads // header.num_kv_heads
        if config.num_kv_blocks:
            pool, why = config.num_kv_blocks * config.block_size * per_token, "num_kv_blocks"
        else:  # the CPU pool and a given size do not depend on the activations' reserve
            pool, why = kv_pool_bytes(device, config.kv_cache_bytes, config.gpu_memory_utilization, 0)
            share = tp if device.type == "cpu" else 1
            if share > 1:
                pool, why = pool // share, f"{why}, split between {share} ranks"
        check_max_model_len(pool, why, per_token, config.block_size, wanted)
    return Preflight(path, header, device, dtype, kv_dtype)
