"""Model load: wall time and peak host memory per model and dtype, against the model's size in that dtype
(target: peak RSS during load <= 1.3x the model's own size).

Each load runs in a fresh process, twice: the first run lists the modules the load imports, the second
imports them first (transformers' tokenizer and GGUF code: the same for any model), notes its RSS, builds the
engine (weights read one tensor at a time, cast or dequantized to the dtype as they are read; a small fixed
KV cache, whose bytes are then subtracted), and reports the peak RSS over that baseline (`ru_maxrss`), the
peak of anonymous memory alone (sampled), the load time and the bytes of the model's weights as served.

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

def anon_now() -> int:
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("RssAnon:"))

# The kernel keeps no peak of anonymous memory: a thread samples it every 2 ms while the engine loads
import threading
anon_peak = [0]
loading = threading.Event()
def sample() -> None:
    while not loading.is_set():
        anon_peak[0] = max(anon_peak[0], anon_now())
        time.sleep(0.002)

model, dtype, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
# The modules a load imports (listed by a first run of the same load) are imported before the baseline:
# code, the same for any model size (transformers' tokenizer and GGUF modules load lazily), not memory the
# weights take.
import importlib
for name in modules:
    try:
        importlib.import_module(name)
    except Exception:
        pass
before_modules = set(sys.modules)
base, anon_base = rss_now(), anon_now()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t0 = time.perf_counter()
engine = LLMEngine(EngineConfig(model=model or None, dtype=dtype, kv_cache_bytes=16 << 20, device="cpu"))
seconds = time.perf_counter() - t0
loading.set()
sampler.join()
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
# the KV pool (16 MiB, fixed above) is the pool, not the load: not counted
kv = {}
tensors(engine.runner.kv_caches, set(), kv)
pool = sum(kv.values())
after = rss_now() - base - pool
anon = {"anon_peak": anon_peak[0] - anon_base - pool, "anon_after": anon_now() - anon_base - pool}
imported = sorted(set(sys.modules) - before_modules)
r = {"seconds": seconds, "peak_over_base": peak - base - pool, "weights": size, "after": after, **anon}
print(json.dumps({**r, "imported": imported}))
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
            modules: list[str] = []
            for _ in range(2):  # the first run lists what a load imports; the second imports it up front
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, paths.get(name, name), dtype, *modules],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                r = json.loads(out.strip().splitlines()[-1])
                modules = r["imported"]
            mib = 1 << 20
            print(
                f"  {name:<10} {dtype:<9} load {r['seconds']:5.1f} s, weights {r['weights'] / mib:6.0f} MiB, "
                f"peak RSS over start {r['peak_over_base'] / mib:6.0f} MiB = "
                f"{r['peak_over_base'] / r['weights']:.2f}x the weights (target <= 1.3x), "
                f"after load {r['after'] / mib:.0f} MiB (transient peak over that "
                f"{(r['peak_over_base'] - r['after']) / mib:.0f} MiB)",
                flush=True,
            )
            print(
                f"  {'':<20} anonymous memory only (total RSS also counts library code paged in): peak "
                f"{r['anon_peak'] / mib:.0f} MiB = {r['anon_peak'] / r['weights']:.2f}x the weights, after "
                f"load {r['anon_after'] / mib:.0f} MiB ({len(r['imported'])} modules still imported by it)",
                flush=True,
            )


if __name__ == "__main__":
    main()
