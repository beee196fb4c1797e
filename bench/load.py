"""Model load: wall time and peak host memory per model and dtype, against the model's size in that dtype
(issue 19: peak RSS during load <= 1.3x the model's own size).

Each load runs in a fresh process: it imports torch and specserve, notes its RSS, builds the engine (weights
read one tensor at a time, cast or dequantized to the dtype as they are read; a small fixed KV cache so the
pool does not count), and reports the peak RSS over that baseline (`ru_maxrss`), the load time and the bytes
of the model's weights as served.

    python bench/load.py [--models demo-gguf,demo-hf] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, cpu_line, ensure_target_dir  # noqa: E402

CHILD = r"""
import json, resource, sys, time
import torch
from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.models.loader import demo_model_path

def rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()

model, dtype = sys.argv[1], sys.argv[2]
base = rss_now()
t0 = time.perf_counter()
engine = LLMEngine(EngineConfig(model=model or None, dtype=dtype, kv_cache_bytes=16 << 20, device="cpu"))
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
import functools

def tensors(x, seen, out):
    # every tensor the model holds: dense matrices, packed quantized ones and the dense copies beside them
    if id(x) in seen or isinstance(x, (str, bytes, int, float, type(None))):
        return
    seen.add(id(x))
    if isinstance(x, torch.Tensor):
        try:
            out[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        except NotImplementedError:  # oneDNN's prepacked bf16 weights (OpaqueTensorImpl) expose no storage
            out[("opaque", id(x))] = x.numel() * x.element_size()
    elif isinstance(x, functools.partial):
        for y in (*x.args, *x.keywords.values()):
            tensors(y, seen, out)
    elif isinstance(x, (list, tuple)):
        for y in x:
            tensors(y, seen, out)
    elif hasattr(x, "__dict__") and not callable(x) or hasattr(x, "__dataclass_fields__"):
        for y in vars(x).values():
            tensors(y, seen, out)

m = engine.model
held = {}
tensors([m.embed, m.norm, m.lm_head, m.layers], set(), held)
size = sum(held.values())
after = rss_now() - base
print(json.dumps({"seconds": seconds, "peak_over_base": peak - base, "weights": size, "after": after}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="demo-gguf,demo-hf")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    paths = {"demo-gguf": "", "demo-hf": str(ensure_target_dir(DEFAULT_OUT / "models" / "smollm2-135m"))}
    print(f"CPU: {cpu_line()}", flush=True)
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            out = (
                subprocess.run(
                    [sys.executable, "-c", CHILD, paths.get(name, name), dtype],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            r = json.loads(out)
            mib = 1 << 20
            print(
                f"  {name:<10} {dtype:<9} load {r['seconds']:5.1f} s, weights {r['weights'] / mib:6.0f} MiB, "
                f"peak RSS over start {r['peak_over_base'] / mib:6.0f} MiB = "
                f"{r['peak_over_base'] / r['weights']:.2f}x the weights (target <= 1.3x), "
                f"after load {r['after'] / mib:.0f} MiB (transient peak over that "
                f"{(r['peak_over_base'] - r['after']) / mib:.0f} MiB)",
                flush=True,
            )


if __name__ == "__main__":
    main()
