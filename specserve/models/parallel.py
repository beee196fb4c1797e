"""Tensor parallelism (Megatron's split, as vLLM does it): each of `size` ranks holds a slice of every
decoder matrix and a slice of the KV cache, and the ranks sum their partial outputs twice a layer.

- q/k/v, gate/up (and each expert's): column-parallel, split by output rows (whole heads, whole slices of the
  intermediate size); a rank's attention runs on its own heads, reading its own KV heads.
- o and down (and each expert's down): row-parallel, split by input columns; each rank's product is a partial
  sum, all-reduced (one after attention, one after the MLP), and their biases are added once, after it.
- Embeddings, norms, the router and the LM head are whole on every rank (the LM head is read on rank 0
  only, which samples).
- Fewer KV heads than ranks (GQA 4:1 on 2 ranks, Gemma 3's single KV head): each KV head is held by the
  size / num_kv_heads ranks whose query heads read it, as vLLM replicates them.

Sharding works on the checkpoint's own tensor names before the model fuses them, so every family's loader
path stays as it is; the model sees a smaller config (`local_heads`).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from specserve.models.config import ModelConfig

# A collective waits this long for a peer (gloo's and NCCL's own default is 30 minutes); a rank that died
# mid-step is seen sooner, by its closed connection.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the group and the group's process group (made without torch.distributed's
    global default group, so several engines can live in one process)."""

    rank: int
    size: int
    group: Any  # a torch.distributed ProcessGroup (gloo on CPU, NCCL on CUDA)
    store: Any = None  # the TCP store the group met through (rank 0 serves it: kept alive with the group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x


def serve_store(host: str = "127.0.0.1") -> Any:
    """Rank 0's TCP store on a free port (`.port`), before the other ranks are started."""
    return dist.TCPStore(host, 0, None, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def join_group(
    store: Any, rank: int, size: int, device: torch.device, host: str = "127.0.0.1"
) -> TensorParallel:
    """Join the group: rank 0 passes its store, the others the store's port. Blocks until all have joined."""
    if isinstance(store, int):
        store = dist.TCPStore(host, store, None, False, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, size)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, group, store)


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """A ValueError naming tensor_parallel_size when this model's heads or MLP do not split `size` ways."""
    if size == 1:
        return
    nkv = cfg.num_kv_heads
    reasons = []
    if cfg.num_heads % size:
        reasons.append(f"{cfg.num_heads} attention heads")
    if nkv % size and size % nkv:
        reasons.append(f"{nkv} KV heads")
    inter = [cfg.intermediate_size] + ([cfg.moe_intermediate_size] if cfg.num_experts else [])
    reasons += [f"an MLP of {n}" for n in inter if n % size]
    if reasons:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide this model's {' and '.join(reasons)}; "
            "use a size that does (vLLM's rule), or 1"
        )


def local_heads(cfg: ModelConfig, size: int) -> tuple[int, int]:
    """(query heads, KV heads) a rank holds."""
    return cfg.num_heads // size, max(1, cfg.num_kv_heads // size)


COLUMN_PARALLEL_MLP = (
    "gate_proj.weight",
    "up_proj.weight",
    "gate_proj.bias",
    "up_proj.bias",
    ".w1.weight",
    ".w3.weight",
)


def _rows(t: torch.Tensor, start: int, count: int, dim: int = 0) -> torch.Tensor:
    # a copy, so the whole tensor's storage is freed once the checkpoint lets go of it
    return t.narrow(dim, start, count).clone()


class Sharder:
    """Rank `rank`'s slice of each decoder tensor, one tensor at a time: the loader applies it to every
    tensor as it is read, so a rank never holds more than its share plus the tensor in hand (a rank that
    loaded the whole checkpoint first would need the whole model's host memory, on every rank at once)."""

    def __init__(self, cfg: ModelConfig, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        hd = cfg.head_dim
        self.nh, self.nkv = local_heads(cfg, size)
        self.nh, self.nkv = self.nh * hd, self.nkv * hd  # rows, from here on
        self.q_start = rank * self.nh
        # with fewer KV heads than ranks, rank r's query heads read KV head r * num_kv_heads // size
        kv_head = rank * cfg.num_kv_heads // size if cfg.num_kv_heads < size else rank * self.nkv // hd
        self.kv_start = kv_head * hd
        self.q_full, self.kv_full = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def _q(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return _rows(t, self.q_start, self.nh, dim)

    def _kv(self, t: torch.Tensor) -> torch.Tensor:
        return _rows(t, self.kv_start, self.nkv)

    def _inter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        n = t.shape[dim] // self.size
        return _rows(t, self.rank * n, n, dim)

    def _halves(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:  # fused gate/up: each half alike
        gate, up = t.chunk(2, dim=dim)
        return torch.cat([self._inter(gate, dim), self._inter(up, dim)], dim=dim)

    def __call__(self, key: str, t: Any) -> list[tuple[str, Any]]:
        """The (name, tensor) pairs this rank keeps of checkpoint tensor `key` (HF names)."""
        if ".layers." not in key or self.size == 1:
            return [(key, t)]  # embeddings, the final norm and the LM head are whole
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{key}: tensor parallelism shards dense weights only (use quantization none)")
        name = key.rsplit(".layers.", 1)[1].split(".", 1)[1]  # "self_attn.q_proj.weight", ...
        if t.dim() == 1 and ("norm" in name or name.endswith(("o_proj.bias", "down_proj.bias"))):
            return [(key, t)]  # norms are whole; the row-parallel biases are added once, after the sum
        if name.startswith("self_attn.q_proj"):
            return [(key, self._q(t))]
        if name.startswith(("self_attn.k_proj", "self_attn.v_proj")):
            return [(key, self._kv(t))]
        if name.startswith("self_attn.qkv_proj"):  # Phi-3: fused, split into the three it stands for
            base = key.removesuffix(name) + "self_attn."
            suffix = name.rsplit(".", 1)[1]
            wq, wk, wv = t.split([self.q_full, self.kv_full, self.kv_full])
            return [
                (f"{base}q_proj.{suffix}", self._q(wq)),
                (f"{base}k_proj.{suffix}", self._kv(wk)),
                (f"{base}v_proj.{suffix}", self._kv(wv)),
            ]
        if name == "self_attn.o_proj.weight":
            return [(key, self._q(t, dim=1))]
        if name.endswith("gate_up_proj.weight"):  # Phi-3's fused MLP (before the up_proj match below)
            return [(key, self._halves(t))]
        if name.endswith(COLUMN_PARALLEL_MLP):
            return [(key, self._inter(t))]
        if name.endswith(("down_proj.weight", ".w2.weight")):
            return [(key, self._inter(t, dim=1))]
        if name.endswith("experts.gate_up_proj"):  # transformers 5: [experts, 2 x inter, hidden]
            return [(key, self._halves(t, dim=1))]
        if name.endswith(("experts.gate_proj", "experts.up_proj")):  # a GGUF's, joined after loading
            return [(key, self._inter(t, dim=1))]
        if name.endswith("experts.down_proj"):  # [experts, hidden, inter]
            return [(key, self._inter(t, dim=2))]
        return [(key, t)]  # anything else (the MoE router) is whole on every rank


def shard_state_dict(sd: dict[str, Any], cfg: ModelConfig, rank: int, size: int) -> None:
    """Replace each decoder matrix of an HF-named state dict by rank `rank`'s slice, in place."""
    sharder = Sharder(cfg, rank, size)
    for key in list(sd):
        t = sd.pop(key)
        sd.update(sharder(key, t))
