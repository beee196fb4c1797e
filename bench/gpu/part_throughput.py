"""W1 on the device at 1, 64 and 256 in flight: output tok/s and the step's time by phase, against HF
transformers `generate` over static batches on the same device; and the batch-1 decode step against the
weight-read limit (the bytes of weights one step reads over the measured copy bandwidth)."""

from __future__ import annotations

import gc
import time
import traceback

import torch

from bench.common import (
    STEP_KEYS,
    Request,
    Workload,
    breakdown,
    hf_generate,
    load_workload,
    step_delta,
)
from bench.gpu.common import Context, Part, table

# (in flight, requests, output cap): batch 1 takes a prefix of W1 so that it fits its share of the run
LEVELS = ((1, 8, 128), (64, 64, None), (256, 256, None))
SMOKE_LEVELS = ((1, 2, 8), (4, 4, 16))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _workload(ctx: Context, n: int, cap: int | None, tokenizer) -> Workload:
    w = load_workload(ctx.workload, n, cap)
    if len(w.requests) < n:  # a short file: repeat its rows (the report names the workload)
        w = Workload(w.name + f", rows repeated to {n}", [w.requests[i % len(w.requests)] for i in range(n)])
        w.requests = [Request(r.prompt, r.max_tokens) for r in w.requests]
    for r in w.requests:
        r.prompt_token_ids = tokenizer.encode(r.prompt)
    return w


def ours(ctx: Context, w: Workload, in_flight: int) -> dict:
    from specserve import LLM, SamplingParams

    kw = dict(dtype="bfloat16" if ctx.cuda else "float32", device=str(ctx.device))
    if ctx.cuda:
        kw.update(quantization="none", max_num_batched_tokens=4096)
    llm = LLM(str(ctx.model), max_num_seqs=in_flight, **kw)
    ids = [r.prompt_token_ids for r in w.requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in w.requests]
    llm.generate(ids[: min(4, len(ids))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    before = llm.engine.step_times.as_dict()
    ctx.sync()
    t0 = time.perf_counter()
    outs = llm.generate(ids, params)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    steps = breakdown(step_delta(before, llm.engine.step_times.as_dict()))
    del llm
    _free()
    return {
        "seconds": seconds,
        "tokens": produced,
        "tok_s": produced / seconds,
        "steps": steps,
    }


def hf(ctx: Context, model, w: Workload, batch: int, pad_id: int) -> dict:
    def generate(rows: list[list[int]], new_tokens: int) -> None:
        hf_generate(model, rows, new_tokens, pad_id)

    reqs = w.requests
    generate([reqs[0].prompt_token_ids] * 2, 4)  # warm-up
    ctx.sync()
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        generate([r.prompt_token_ids for r in chunk], max(r.max_tokens for r in chunk))
    ctx.sync()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tok_s": w.output_tokens / seconds}


def run(ctx: Context) -> Part:
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import load_tokenizer

    if ctx.model is None:
        return Part("throughput", False, "skipped: the demo GGUF did not travel")
    tokenizer = load_tokenizer(str(ctx.model))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    levels = SMOKE_LEVELS if ctx.smoke else LEVELS
    if (chosen := ctx.option("throughput.levels")) is not None:
        levels = tuple(lv for lv in levels if str(lv[0]) in chosen)
    rows, data, ok = [], {"levels": {}}, True
    hf_model = None
    bw = ctx.bandwidth_gbs
    for in_flight, n, cap in levels:
        if ctx.left() < 15:
            rows.append([in_flight, "skipped: out of time", "", "", "", ""])
            ok = False
            continue
        entry: dict = {}
        try:
            w = _workload(ctx, n, cap, tokenizer)
            entry["workload"] = f"{w.name}: {len(w.requests)} requests, {w.output_tokens} output tokens"
            ctx.log(f"throughput {in_flight}: {entry['workload']}")
            r = ours(ctx, w, in_flight)
            entry["ours"] = r
            if hf_model is None:
                hf_model = AutoModelForCausalLM.from_pretrained(
                    str(ctx.model.parent),
                    gguf_file=ctx.model.name,
                    dtype=torch.bfloat16 if ctx.cuda else torch.float32,
                ).to(ctx.device)
                hf_model.eval()
                hf_model.generation_config.eos_token_id = None
            if ctx.left() > 10:
                entry["hf"] = hf(ctx, hf_model, w, in_flight, pad_id)
            s = r["steps"]
            split = " / ".join(f"{s[f'{k}_ms']:.2f}" for k in STEP_KEYS)
            hf_tok = entry.get("hf", {}).get("tok_s")
            rows.append(
                [
                    in_flight,
                    entry["workload"],
                    f"{r['tok_s']:,.0f}",
                    f"{hf_tok:,.0f}" if hf_tok else "not run",
                    f"{r['tok_s'] / hf_tok:.2f}x" if hf_tok else "",
                    f"{split} (mean batch {s['batch']:.1f})",
                ]
            )
            if in_flight == 1 and bw:
                # what one decode step must read: every weight once (the tied embedding is the head),
                # counted from HF's copy in the same dtype; a read is half of the copy's traffic
                weights = sum(p.numel() * p.element_size() for p in hf_model.parameters())
                entry["decode_step_ms"] = s["forward_ms"]
                entry["weight_read_limit_ms"] = weights / (bw / 2 * 1e9) * 1e3
                entry["weight_bytes"] = weights
        except Exception as exc:  # noqa: BLE001 - the next level still runs
            ok = False
            ctx.log(traceback.format_exc())
            entry["error"] = traceback.format_exc()[-3000:]
            rows.append([in_flight, f"ERROR {exc.__class__.__name__}: {str(exc)[:200]}", "", "", "", ""])
        data["levels"][in_flight] = entry
        _free()
    del hf_model
    _free()
    md = table(
        [
            "in flight",
            "workload",
            "ours tok/s",
            "HF generate tok/s",
            "ours / HF",
            "ms/step: " + " / ".join(STEP_KEYS),
        ],
        rows,
    )
    one = data["levels"].get(1, {})
    if "weight_read_limit_ms" in one:
        md += (
            f"\n\nBatch-1 decode: the forward takes {one['decode_step_ms']:.3f} ms a step; reading the "
            f"{one['weight_bytes'] / 1e6:.0f} MB of weights at the measured {bw / 2:,.0f} GB/s read rate "
            f"(half the copy's read + write) takes {one['weight_read_limit_ms']:.3f} ms: "
            f"{one['decode_step_ms'] / one['weight_read_limit_ms']:.1f}x the limit."
        )
    return Part("throughput", ok, md, data)
