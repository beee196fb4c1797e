"""Prefix caching on chat traffic over shared long system prompts.

A few long system prompts (~1.5k tokens each, from CPython's stdlib docs) with short questions behind them,
arriving in waves (a wave is submitted whole and runs to completion before the next): the first wave of a
system prompt computes it, later waves should find it cached. Runs specserve with prefix caching on and
off (order on, off, off, on: the machine is noisy) and vLLM's CPU build (its prefix caching is on by
default) on the same token ids, demo model, native dtype. Reports output tok/s over the whole run and, for
specserve, mean time to first token.

    python bench/prefix.py [--systems 3] [--waves 4] [--wave-size 8] [--max-tokens 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import pydoc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_OUT,
    DOC_MODULES,
    QUESTIONS,
    Request,
    Workload,
    cpu_line,
    ensure_target_dir,
    on_off_ratios,
    run_line,
    run_vllm,
    vllm_python,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve import LLM, SamplingParams  # noqa: E402


def build(llm: LLM, args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of every request, and the waves (lists of request indices) in arrival order."""
    tok = llm.engine.tokenizer
    systems = []
    for name in DOC_MODULES[: args.systems]:
        doc = pydoc.render_doc(__import__(name), renderer=pydoc.plaintext)
        ids = tok.encode(doc)[: args.system_tokens]
        systems.append("You answer questions about this documentation:\n\n" + tok.decode(ids))
    prompts, waves = [], []
    for w in range(args.waves):
        wave = []
        for i in range(args.wave_size):
            system = systems[(w * args.wave_size + i) % len(systems)]
            question = QUESTIONS[(w + i) % len(QUESTIONS)]
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            wave.append(len(prompts))
            prompts.append(llm.engine.encode_chat(messages))
        waves.append(wave)
    return prompts, waves


def run(llm: LLM, prompts: list[list[int]], waves: list[list[int]], max_tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttfts, tokens, cached = [], 0, 0
    start = time.perf_counter()
    for wave in waves:
        for out in llm.generate([prompts[i] for i in wave], params):
            ttfts.append(out.metrics["ttft"])
            tokens += len(out.token_ids)
            cached += out.usage.cached_tokens
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(prompts[i]) for w in waves for i in w)
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "mean_ttft_s": statistics.fmean(ttfts),
        "cached_share": cached / prompt_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--wave-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-python")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    llms = {
        "on": LLM(None, dtype=args.dtype, enable_prefix_caching=True),
        "off": LLM(None, dtype=args.dtype, enable_prefix_caching=False),
    }
    prompts, waves = build(llms["on"], args)
    n = sum(len(w) for w in waves)
    print(
        f"CPU: {cpu_line()} | {args.dtype} | {n} requests in {len(waves)} waves over {args.systems} system "
        f"prompts of ~{args.system_tokens} tokens, {args.max_tokens} output tokens each | "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for llm in llms.values():  # warm-up on a prompt no wave shares
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for name in ("on", "off", "off", "on"):
        llms[name].engine.block_manager.reset_prefix_cache()  # each run starts cold
        r = run(llms[name], prompts, waves, args.max_tokens)
        results[name].append(r)
        print(run_line(f"caching {name:<3}", r), flush=True)
    tok_ratio, ttft_ratio = on_off_ratios(results)
    print(f"caching on/off: {tok_ratio:.2f}x tok/s (target >= 2), mean TTFT {ttft_ratio:.2f}x")
    on = statistics.fmean(r["tok_s"] for r in results["on"])
    ttft_on = statistics.fmean(r["mean_ttft_s"] for r in results["on"])
    python = vllm_python(args.vllm_python)
    if python is None:
        print("vLLM: no venv found (--vllm-python); skipped")
        return
    model_dir = ensure_target_dir(DEFAULT_OUT / "models" / "smollm2-135m")
    workload = Workload(
        "prefix waves", [Request("", args.max_tokens, prompt_token_ids=ids) for ids in prompts]
    )
    print("  vLLM (prefix caching on, its default): starting (start-up takes minutes) ...", flush=True)
    peer = run_vllm(
        python, model_dir, workload, args.out_dir, "prefix", dtype=args.dtype, batches=waves, ttft=True
    )
    run0 = peer.runs[0]
    vllm = run0["output_tokens"] / run0["seconds"]
    ttft = run0.get("mean_ttft_s")
    ttft_text = "n/a" if ttft is None else f"{ttft * 1e3:7.1f} ms"
    print(
        f"  vLLM: {vllm:6.1f} tok/s ({run0['seconds']:.1f} s), mean TTFT {ttft_text} | "
        f"load {os.getloadavg()[0]:.1f}"
    )
    print(f"specserve caching on / vLLM: {on / vllm:.2f}x tok/s (target >= 1.0)")
    if ttft:
        print(f"specserve caching on / vLLM mean TTFT: {ttft_on / ttft:.2f}x (lower is better)")


if __name__ == "__main__":
    main()
