"""What every part of the GPU report shares: the run's context, a part's result, and timing.

A part is a module `bench/gpu/part_<name>.py` with `run(ctx: Context) -> Part`. The driver (run.py) calls
each in turn, catches what it raises, and writes every part's section into one report, so one run on a lent
GPU yields every answer it can even where one part fails. With `--smoke` the same parts run at tiny sizes on
the CPU (Triton under its interpreter), which is how the script itself is tested before it meets a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Context:
    device: torch.device
    smoke: bool  # tiny sizes on whatever device there is: checks the script, measures nothing
    out: Path  # where parts may write files of their own (the report goes beside them)
    model: Path | None  # the demo SmolLM2 GGUF, where one travelled with the run
    tokenizer: Path | None  # an HF tokenizer dir for that model (tokenizer.json, chat template)
    deadline: float  # time.monotonic() by which the part should have returned
    log: Callable[[str], None] = print
    bandwidth_gbs: float | None = None  # measured device-to-device copy rate (read + write), once known
    workload: Path | None = None  # W1 as JSONL rows {prompt, max_tokens} (the GPU machine's stdlib differs)
    options: dict[str, str] = field(default_factory=dict)  # --opt part.key=value: a rerun of part of a part

    def option(self, key: str) -> list[str] | None:
        """A comma-separated --opt value as a list, or None where it was not given."""
        value = self.options.get(key)
        return None if value is None else [v.strip() for v in value.split(",") if v.strip()]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class Part:
    name: str
    ok: bool  # every check in it held (a figure below its goal is not a failure: the report says so)
    markdown: str  # the part's section of the report, headed by the driver
    data: dict[str, Any] = field(default_factory=dict)  # JSON-able figures


def median_ms(ctx: Context, fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of fn in milliseconds: CUDA events around each call on a GPU, the host clock after a
    synchronize elsewhere."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    times = []
    for _ in range(iters):
        if ctx.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so that it never passes."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom else 1.0)


def table(header: list[str], rows: list[list[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
