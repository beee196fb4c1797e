"""Tensor parallelism inside one engine: rank 0 is the engine (scheduler, sampling, speculation), ranks 1..n-1
are processes that hold the rest of each matrix and of the KV cache and run the same forward beside it.

Each step rank 0 sends the step's ForwardEntry list down a pipe to every other rank; each builds its own
attention plan from it (plans are per-rank tensors, cheap to make), and the ranks meet in the forward's
all-reduces (models/parallel.py). Only rank 0 computes logits. A pipe rather than a broadcast on the
process group because a rank waiting for the next step must notice its engine is gone: the pipe ends with
the engine's process, however it ends (SIGKILL included), so the other ranks never outlive it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from specserve.engine.cpu_tuning import (
    keep_freed_memory_in_heap,
    release_freed_memory,
    return_freed_memory_at_once,
    size_thread_team,
)
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.models.config import ModelConfig
from specserve.models.llama import LlamaModel
from specserve.models.loader import load_checkpoint, read_config
from specserve.models.parallel import Sharder, TensorParallel, join_group, serve_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What every rank needs to build its share of the model."""

    path: Path
    dtype: torch.dtype
    device: str  # the device type: rank r takes cuda:r
    attention_backend: str
    quantization: str
    batch_invariant: bool = False
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype


def rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")


def build_model(spec: ModelSpec, tp: TensorParallel | None) -> tuple[LlamaModel, dict[str, Any]]:
    """Load the checkpoint and build this rank's model; also the checkpoint's HF config."""
    device = rank_device(spec.device, tp.rank if tp else 0)
    # a rank keeps its slice of each tensor as it is read, never the whole model
    shard = Sharder(ModelConfig.from_hf(read_config(spec.path)), tp.rank, tp.size) if tp else None
    ckpt = load_checkpoint(spec.path, dtype=spec.dtype, quantization=spec.quantization, transform=shard)
    model = LlamaModel(
        ModelConfig.from_hf(ckpt.config),
        ckpt.state_dict,
        spec.dtype,
        device,
        spec.attention_backend,
        spec.quantization,
        tp,
        spec.batch_invariant,
        spec.kv_cache_dtype,
    )
    return model, ckpt.config


def _rank_main(rank: int, size: int, port: int, spec: ModelSpec, conn: Connection) -> None:
    """A rank other than 0: join, build, allocate its cache, then run every step rank 0 sends."""
    try:
        if spec.device != "cuda":
            size_thread_team(ranks=size)  # the ranks share the CPUs: each takes its part
            return_freed_memory_at_once()
        tp = join_group(port, rank, size, rank_device(spec.device, rank))
        model, _ = build_model(spec, tp)
        if spec.device != "cuda":
            release_freed_memory()
            keep_freed_memory_in_heap()
        conn.send(("ready", None))
        num_blocks, block_size = conn.recv()
        runner = ModelRunner(model, num_blocks, block_size)
        conn.send(("ready", None))
    except EOFError:
        return
    except Exception as exc:  # reported to rank 0, which raises it where the engine is being made
        conn.send(("error", f"tensor-parallel rank {rank}: {type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            entries = conn.recv()
        except EOFError:  # the engine is gone
            return
        if entries is None:
            return
        runner.forward(entries)


def _stop(procs: list[Any], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except OSError:
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


class RankGroup:
    """Ranks 1..size-1 as child processes, and rank 0's place in the group."""

    def __init__(self, size: int, spec: ModelSpec) -> None:
        self.size = size
        store = serve_store()
        ctx = mp.get_context("spawn")  # CUDA and a loaded torch do not survive fork
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, size, store.port, spec, child),
                name=f"specserve-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        if spec.device != "cuda":
            size_thread_team(ranks=size)  # the ranks share the CPUs: each takes its part
        self.tp = join_group(store, 0, size, rank_device(spec.device, 0))

    def _await_ready(self) -> None:
        for conn in self.conns:
            try:
                status, message = conn.recv()
            except EOFError:
                status, message = "error", "a tensor-parallel rank exited while loading"
            if status == "error":
                self.close()
                raise RuntimeError(message)

    def models_built(self) -> None:
        """Wait until every other rank has built its model (raising what failed there)."""
        self._await_ready()

    def allocate(self, num_blocks: int, block_size: int) -> None:
        for conn in self.conns:
            conn.send((num_blocks, block_size))
        self._await_ready()

    def send_step(self, entries: list[ForwardEntry]) -> None:
        for conn in self.conns:
            conn.send(entries)

    def close(self) -> None:
        self._finalizer()


class ParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step to the other ranks, then runs its own share."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, group: RankGroup) -> None:
        super().__init__(model, num_blocks, block_size)
        self.group = group
        group.allocate(num_blocks, block_size)

    def forward(self, entries: list[ForwardEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        self.group.send_step(entries)
        return super().forward(entries)

    def close(self) -> None:
        self.group.close()
