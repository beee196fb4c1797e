"""The engine on the device: greedy equal to HF transformers token for token in float32 (the tiny random
models of every family, and the demo SmolLM2; speculation off, n-gram and a draft model), bfloat16's
log-probabilities against float32's beside HF's own bfloat16, the KV pool sized by the profile run, and
preemption under a small pool."""

from __future__ import annotations

import gc
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from bench.gpu.common import Context, Part, table

TESTS = Path(__file__).resolve().parents[2] / "tests"
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Hello",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
]
CHAT = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a job interview.",
]


def _spec(method: str, path: str) -> dict | None:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    if method == "draft":
        return {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    return None


def _hf_greedy(model, ids_list: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    refs = []
    for ids in ids_list:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        refs.append(out[0, len(ids) :].tolist())
    return refs


def _ours(path: str, ids_list, new_tokens: int, device: torch.device, dtype: str, method: str, **kw):
    from specserve import LLM, SamplingParams

    if device.type == "cuda":  # a pool of its own size: the part builds many engines in one process
        kw.setdefault("kv_cache_bytes", 1 << 30)
    # CUDA graphs stay on (what users run) for the batch sizes these prompts need: 1, 2, 4, 8
    kw.setdefault("max_num_seqs", 8)
    llm = LLM(path, dtype=dtype, device=str(device), speculative_config=_spec(method, path), **kw)
    params = SamplingParams(
        max_tokens=new_tokens, temperature=0.0, ignore_eos=True, speculation=4 if method != "off" else "off"
    )
    outs = llm.generate(ids_list, params)
    return llm, outs


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def families(ctx: Context, rows: list, data: dict) -> bool:
    """Every family's tiny random model: HF on the device in float32 against ours, three speculation modes."""
    sys.path.insert(0, str(TESTS))
    from conftest import build_tiny_model
    from test_families import FAMILIES, _build
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(ctx.model)) if ctx.model else None
    if tokenizer is None:
        from specserve.models.loader import demo_model_path

        tokenizer = load_tokenizer(demo_model_path())
    new_tokens = 8 if ctx.smoke else 24
    names = list(FAMILIES) + ["llama_gqa_tied", "qwen2_bias", "llama_bias"]
    if ctx.smoke:
        names = ["qwen3", "gemma3", "llama_gqa_tied"]
    names = ctx.option("engine.families") or names
    ok = True
    tmp = Path(tempfile.mkdtemp(prefix="gpu-families-"))
    for name in names:
        if ctx.left() < 10:
            rows.append([name, "skipped: out of time", "", ""])
            ok = False
            continue
        try:
            path = (
                _build(name, tokenizer, tmp / name)
                if name in FAMILIES
                else build_tiny_model(name, tokenizer, tmp / name)
            )
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(ctx.device).eval()
            hf.generation_config.eos_token_id = None
            ids_list = [tokenizer.encode(p) for p in PROMPTS]
            refs = _hf_greedy(hf, ids_list, new_tokens, ctx.device)
            del hf
            results = []
            for method in ("off", "ngram", "draft"):
                kw = {"block_size": 16}
                llm, outs = _ours(str(path), ids_list, new_tokens, ctx.device, "float32", method, **kw)
                same = [o.token_ids for o in outs] == refs
                graphs = getattr(llm.engine.runner, "graphs", None)
                served = sum(graphs.steps_run.values()) if graphs is not None else 0
                results.append(f"{method} {'equal' if same else 'DIFFERS'} ({served} steps from graphs)")
                ok &= same
                data.setdefault("families", {})[f"{name}/{method}"] = same
                del llm
                _free()
            rows.append([name, ", ".join(results), "", ""])
        except Exception as exc:  # noqa: BLE001 - one family's failure is a row, the others still run
            ok = False
            data.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            rows.append([name, f"ERROR {exc.__class__.__name__}: {str(exc)[:120]}", "", ""])
            ctx.log(traceback.format_exc())
    return ok


def demo_model(ctx: Context, rows: list, data: dict) -> bool:
    """SmolLM2 from its GGUF: ours (dequantized) against HF's own GGUF loading, float32, on the device."""
    from transformers import AutoModelForCausalLM

    from specserve.models.loader import load_tokenizer

    gguf = ctx.model
    tokenizer = load_tokenizer(str(gguf))
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).to(
        ctx.device
    )
    hf.eval()
    hf.generation_config.eos_token_id = None
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in CHAT
    ]
    ids_list = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    new_tokens = 8 if ctx.smoke else 48
    if ctx.smoke:
        ids_list = ids_list[:2]
    refs = _hf_greedy(hf, ids_list, new_tokens, ctx.device)
    ok = True
    for method in ("off", "ngram", "draft"):
        if ctx.left() < 15:
            rows.append([f"SmolLM2 {method}", "skipped: out of time", "", ""])
            return False
        llm, outs = _ours(str(gguf), ids_list, new_tokens, ctx.device, "float32", method, quantization="none")
        same = [o.token_ids for o in outs] == refs
        data.setdefault("smollm2_fp32", {})[method] = same
        ok &= same
        graphs = getattr(llm.engine.runner, "graphs", None)
        served = sum(graphs.steps_run.values()) if graphs is not None else 0
        rows.append(
            [
                f"SmolLM2-135M (GGUF) {method}",
                f"{'equal' if same else 'DIFFERS'} ({served} steps from graphs)",
                "",
                "",
            ]
        )
        del llm
        _free()
    # bfloat16: the log-probabilities of a prompt's tokens against HF's float32, beside HF's own bfloat16
    text = (
        "The history of the city begins in the Roman era, when a small settlement grew up at a crossing of"
        " the river. Over the centuries it became a centre of trade, and its markets drew merchants from"
        " across the region. Today it is known for its old town, its university and its museums."
    )
    ids = tokenizer.encode(text)
    x = torch.tensor([ids], device=ctx.device)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(x).logits[0].double(), -1)
        hf16 = hf.to(torch.bfloat16)
        lp16 = torch.log_softmax(hf16(x).logits[0].double(), -1)
    del hf, hf16
    _free()
    target = torch.tensor(ids[1:], device=ctx.device)
    ref_tok = ref[:-1].gather(1, target[:, None])[:, 0]
    hf_err = (lp16[:-1].gather(1, target[:, None])[:, 0] - ref_tok).abs()
    from specserve import LLM, SamplingParams

    llm = LLM(str(gguf), dtype="bfloat16", device=str(ctx.device), quantization="none")
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    ours = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]], dtype=torch.float64, device=ctx.device)
    our_err = (ours - ref_tok).abs()
    del llm
    _free()
    tol = 0.15  # nats: bfloat16's 8-bit mantissa over 30 layers; HF's own bf16 lands in the same range
    fine = float(our_err.max()) <= max(tol, 2 * float(hf_err.max()))
    ok &= fine
    data["bf16_logprob_err"] = {
        "ours_max": float(our_err.max()),
        "ours_mean": float(our_err.mean()),
        "hf_bf16_max": float(hf_err.max()),
        "hf_bf16_mean": float(hf_err.mean()),
        "tolerance": tol,
        "tokens": len(ids) - 1,
    }
    rows.append(
        [
            "SmolLM2 bf16 prompt log-probs vs HF fp32",
            f"ours max {float(our_err.max()):.3f} / mean {float(our_err.mean()):.4f} nats; "
            f"HF bf16 max {float(hf_err.max()):.3f} / mean {float(hf_err.mean()):.4f}",
            f"max <= max({tol}, 2x HF's)",
            "ok" if fine else "FAILED",
        ]
    )
    return ok


def kv_sizing(ctx: Context, rows: list, data: dict) -> bool:
    """The pool from gpu_memory_utilization (profile run), and preemption in a pool too small for a batch."""
    from specserve import LLM, SamplingParams

    model = str(ctx.model) if ctx.model else None
    ok = True
    if ctx.cuda:
        util = 0.5
        free0, total = torch.cuda.mem_get_info(ctx.device)
        llm = LLM(
            model, dtype="bfloat16", device=str(ctx.device), quantization="none", gpu_memory_utilization=util
        )
        free1, _ = torch.cuda.mem_get_info(ctx.device)
        used = (total - free1) / total
        blocks = llm.engine.block_manager.num_blocks
        fits = used <= util + 0.02
        ok &= fits
        data["kv_sizing"] = {
            "gpu_memory_utilization": util,
            "num_blocks": blocks,
            "max_model_len": llm.engine.max_model_len,
            "device_used_fraction": used,
            "in_use_before_gib": (total - free0) / 2**30,
        }
        rows.append(
            [
                f"KV pool at gpu_memory_utilization {util}",
                f"{blocks:,} blocks of 16; device {used:.1%} used after start",
                f"<= {util:.0%} + 2 %",
                "ok" if fits else "FAILED",
            ]
        )
        del llm
        _free()
    # preemption: 16 requests of 64 tokens in 24 blocks of 16 must all finish, equal to a roomy pool's
    n, tokens = (16, 64) if not ctx.smoke else (6, 16)
    prompts = [f"Story number {i}: once upon a time, in a land far away," for i in range(n)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device=str(ctx.device), quantization="none")
    roomy = LLM(model, **kw).generate(prompts, params)
    _free()
    small = LLM(model, num_kv_blocks=24 if not ctx.smoke else 8, max_num_seqs=n, **kw)
    outs = small.generate(prompts, params)
    same = [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    pre = small.engine.scheduler.num_preemptions
    free_after = small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks
    good = same and pre > 0 and free_after
    ok &= good
    data["preemption"] = {"preemptions": pre, "equal": same, "blocks_freed": free_after}
    rows.append(
        [
            f"preemption: {n} x {tokens} tokens in a tiny pool",
            f"{pre} preemptions, outputs {'equal' if same else 'DIFFER'}, blocks freed {free_after}",
            "equal, > 0 preemptions",
            "ok" if good else "FAILED",
        ]
    )
    del small
    _free()
    return ok


def run(ctx: Context) -> Part:
    rows: list[list[object]] = []
    data: dict = {}
    ok = True
    # the demo model first: its comparison is the one a user's output depends on
    steps = ctx.option("engine.steps") or ["demo_model", "kv_sizing", "families"]
    for step in [{"families": families, "demo_model": demo_model, "kv_sizing": kv_sizing}[n] for n in steps]:
        if step is demo_model and ctx.model is None:
            rows.append(["SmolLM2", "skipped: the demo GGUF did not travel", "", ""])
            ok = False
            continue
        if ctx.left() < 5:
            rows.append([step.__name__, "skipped: out of time", "", ""])
            ok = False
            continue
        try:
            ok &= step(ctx, rows, data)
        except Exception as exc:  # noqa: BLE001 - the next check still runs
            ok = False
            ctx.log(traceback.format_exc())
            data.setdefault("errors", {})[step.__name__] = traceback.format_exc()[-3000:]
            rows.append([step.__name__, f"ERROR {exc.__class__.__name__}: {str(exc)[:200]}", "", "FAILED"])
        _free()
    md = table(["check", "result", "goal", "verdict"], rows)
    if "errors" in data:
        md += "\n\n" + "\n".join(
            f"<details><summary>{k}</summary>\n\n```\n{v}\n```\n</details>" for k, v in data["errors"].items()
        )
    return Part("engine", ok, md, data)
