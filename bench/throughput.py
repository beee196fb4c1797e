"""Throughput on a skewed-length workload: continuous vs static batching vs HF transformers (vs vLLM).

Every system runs the same requests (same prompt token ids), greedy, EOS ignored, each request producing
exactly its max_tokens; output tokens/s counts only those tokens, over the whole run (prefill included).
- specserve continuous and specserve static (a new batch starts only when the previous one is done), at the
  same number of sequences in flight (--max-num-seqs). Static runs twice: padded (a finished row is
  computed on until its batch ends, as in HF generate) and shrinking (a finished row leaves, so later steps
  are cheaper; on a GPU a row costs next to nothing and the two agree, on this CPU a step's cost grows with
  its rows);
- HF transformers `generate` on left-padded static batches (--hf-batch-sizes, the best is reported, and our
  continuous engine is also run at that batch size so the ratio compares equal sequences in flight);
- vLLM's CPU build as a peer when its venv exists (--vllm-python, $SPECSERVE_VLLM_PYTHON or
  /work/vllm-venv/bin/python), at --vllm-max-num-seqs with our continuous engine at the same setting.
Slot utilisation = live sequence-steps / (steps x slots): how full the batch is on average.

    python bench/throughput.py                       # W1 from ../shared, or the built-in workload
    python bench/throughput.py --workload my.jsonl   # replay {"prompt", "max_tokens"} rows
    python bench/throughput.py --quick               # smoke run: 8 requests, short outputs, no peers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_OUT,
    Workload,
    breakdown,
    cpu_line,
    emulate_avx2,
    ensure_target_dir,
    format_breakdown,
    hf_generate,
    load_workload,
    run_vllm,
    step_delta,
    tokenize,
    vllm_python,
)

SYSTEMS = ("continuous", "static", "hf", "vllm")


@dataclass
class Result:
    system: str
    in_flight: int
    seconds: float
    output_tokens: int
    utilisation: float | None = None
    steps: dict[str, float] | None = None  # per-step breakdown (our engine only)
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def to_json(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s}


# ---------------------------------------------------------------- our engine


# Our batching modes: name -> (static_batching, static_padding)
MODES = {
    "specserve continuous": (False, False),
    # static batching as HF generate and FasterTransformer do it: a finished row is computed on to the end
    "specserve static (padded)": (True, True),
    # the same batches, but a finished row leaves and steps get cheaper (on CPU a row costs; on GPU hardly)
    "specserve static (shrinking)": (True, False),
}


def serve_speculation() -> tuple[dict, dict]:
    """(ours, vLLM's) speculative configs: `serve`'s own default (n-gram, requests `auto`: drafts only
    while they pay), read from its config rather than restated, and vLLM's n-gram at the same k and
    n-gram lengths."""
    from specserve.service.config import ServiceConfig
    from specserve.spec.config import SpeculativeConfig

    ours = ServiceConfig().speculative_config()
    if ours is None or ours["method"] != "ngram":
        raise SystemExit("--speculation ngram: serve's default speculation is not n-gram in this environment")
    spec = SpeculativeConfig.from_dict(ours)
    vllm = {
        "method": "ngram",
        "num_speculative_tokens": spec.num_speculative_tokens,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "prompt_lookup_min": spec.prompt_lookup_min,
    }
    return ours, vllm


SPECULATION = ("off", "ngram")
NGRAM_SUFFIX = " + n-gram"


def run_ours(
    workload: Workload, name: str, max_num_seqs: int, args: argparse.Namespace, speculation: str = "off"
) -> Result:
    from specserve import LLM, SamplingParams

    static, padding = MODES[name]
    ngram = speculation == "ngram"
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        static_batching=static,
        static_padding=padding,
        attention_backend=args.attention_backend,
        speculative_config=serve_speculation()[0] if ngram else None,
        batch_invariant=args.batch_invariant,
    )
    ids = [r.prompt_token_ids for r in workload.requests]
    params = [
        SamplingParams(
            max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, speculation="auto" if ngram else "off"
        )
        for r in workload.requests
    ]
    llm.generate(ids[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    best: tuple[float, dict[str, float]] | None = None
    for _ in range(args.repeats):
        before = llm.engine.step_times.as_dict()
        t0 = time.perf_counter()
        outs = llm.generate(ids, params)
        seconds = time.perf_counter() - t0
        produced = sum(len(o.token_ids) for o in outs)
        if produced != workload.output_tokens:
            raise RuntimeError(f"specserve produced {produced} tokens, expected {workload.output_tokens}")
        if best is None or seconds < best[0]:
            best = (seconds, step_delta(before, llm.engine.step_times.as_dict()))
    steps = breakdown(best[1])
    label = name + (NGRAM_SUFFIX if ngram else "")
    return Result(label, max_num_seqs, best[0], workload.output_tokens, steps["batch"] / max_num_seqs, steps)


# ---------------------------------------------------------------- HF transformers


def load_hf(model_dir: Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: every row runs to max_new_tokens
    return model


def run_hf(model, workload: Workload, batch_size: int, pad_id: int, repeats: int = 1) -> Result:
    def generate(rows: list[list[int]], new_tokens: int):
        return hf_generate(model, rows, new_tokens, pad_id)

    reqs = workload.requests
    generate([reqs[0].prompt_token_ids] * 2, 4)  # warm-up
    chunks = [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    slot_steps = sum(batch_size * max(r.max_tokens for r in c) for c in chunks)
    seconds = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for chunk in chunks:
            generate([r.prompt_token_ids for r in chunk], max(r.max_tokens for r in chunk))
        seconds = min(seconds, time.perf_counter() - t0)
    useful = workload.output_tokens
    return Result("HF transformers generate", batch_size, seconds, useful, useful / slot_steps)


# ---------------------------------------------------------------- report


def print_table(results: list[Result], reference: dict[int, Result]) -> None:
    print(
        f"\n{'system':<30}{'in flight':>10}{'out tok/s':>11}{'seconds':>9}{'slot util':>10}{'ours/this':>10}"
    )
    for r in results:
        ref = reference.get(r.in_flight)
        ratio = f"{ref.tok_s / r.tok_s:>9.2f}x" if ref is not None else f"{'n/a':>10}"
        util = f"{r.utilisation:>10.0%}" if r.utilisation is not None else f"{'n/a':>10}"
        print(f"{r.system:<30}{r.in_flight:>10}{r.tok_s:>11.1f}{r.seconds:>9.1f}{util}{ratio}")
        if r.note:
            print(f"{'':<30}{r.note}")


def verdicts(results: list[Result], reference: dict[int, Result], hf_best: Result | None) -> list[str]:
    lines = []

    def find(system: str, in_flight: int) -> Result | None:
        return next((r for r in results if r.system == system and r.in_flight == in_flight), None)

    for n, ours in sorted(reference.items()):
        for name in MODES:
            static = find(name, n) if "static" in name else None
            if static:
                x = ours.tok_s / static.tok_s
                what = name.removeprefix("specserve ")
                lines.append(f"continuous / {what} at {n} in flight: {x:.2f}x (target >= 2x: {_ok(x >= 2)})")
        vllm = find("vLLM CPU (peer)", n)
        if vllm:
            x = ours.tok_s / vllm.tok_s
            lines.append(f"continuous / vLLM at {n} in flight: {x:.2f}x (target >= 1.2x: {_ok(x >= 1.2)})")
        spec = find("specserve continuous" + NGRAM_SUFFIX, n)
        if spec:
            lines.append(f"continuous + n-gram / continuous at {n} in flight: {spec.tok_s / ours.tok_s:.2f}x")
            for peer in (vllm, find("vLLM CPU" + NGRAM_SUFFIX + " (peer)", n)):
                if peer:
                    x = spec.tok_s / peer.tok_s
                    lines.append(
                        f"continuous + n-gram / {peer.system.removesuffix(' (peer)')} at {n} in flight: "
                        f"{x:.2f}x (target >= 1.2x: {_ok(x >= 1.2)})"
                    )
    if hf_best and hf_best.in_flight in reference:
        x = reference[hf_best.in_flight].tok_s / hf_best.tok_s
        lines.append(
            f"continuous / HF best static batch ({hf_best.in_flight}): {x:.2f}x (target >= 3x: {_ok(x >= 3)})"
        )
    return lines


def _ok(ok: bool) -> str:
    return "met" if ok else "NOT met"


def save_chart(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.system}\n({r.in_flight} in flight)" for r in results]
    values = [r.tok_s for r in results]
    colors = ["#1f77b4" if r.system.startswith("specserve continuous") else "#7f7f7f" for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(results)), 4.5))
    bars = ax.bar(range(len(results)), values, color=colors)
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=2)
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", type=Path, help="JSONL of {prompt, max_tokens} rows (default: W1)")
    p.add_argument("--num-requests", type=int, help="use the first N requests")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's output length")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument(
        "--speculation",
        default="off",
        help=f"comma-separated subset of {SPECULATION}: off, and/or n-gram as `serve` runs it by default "
        "(requests `auto`), with vLLM's n-gram at the same k beside it (continuous and vllm systems)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences in flight, ours and HF")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-sizes", default="8,16,32")
    p.add_argument("--vllm-max-num-seqs", type=int, default=64, help="in flight for the vLLM comparison")
    p.add_argument(
        "--vllm-python", help="vLLM's interpreter (default $SPECSERVE_VLLM_PYTHON or /work/vllm-venv)"
    )
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND ('' for vLLM's default)")
    p.add_argument("--model", help="our engine's model (default: the demo GGUF)")
    p.add_argument("--attention-backend", default="auto", help="our engine's: auto, torch or cpu")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system; the best is kept")
    p.add_argument(
        "--hf-dir", type=Path, help="HF dir of the same model for HF/vLLM (default: exported demo)"
    )
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="our engine's batch-invariant decoding (off, as the engine's default; on for the A/B)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 8 requests, <= 32 tokens, no vLLM")
    p.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="both engines on an AVX2-only CPU's paths (bench/common.py: AVX2_ENV), on a CPU with more",
    )
    p.add_argument(
        "--int4-rows-beside-copy",
        type=int,
        help="our int4 rows product takes steps of up to this many rows beside the dense copy "
        "(as built: 32 on AMX tiles)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = args.num_requests or 8
        args.max_tokens_cap = args.max_tokens_cap or 32
        args.max_num_seqs = min(args.max_num_seqs, 4)
        args.hf_batch_sizes = "4"
        args.vllm_max_num_seqs = 8
        if "--systems" not in " ".join(argv or sys.argv):
            args.systems = "continuous,static,hf"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emulate_avx2:
        emulate_avx2()
    if args.int4_rows_beside_copy is not None:
        from specserve.models import linear

        linear.OwnInt4RowsBf16.BESIDE_COPY_MAX_ROWS = args.int4_rows_beside_copy
        linear.OwnInt4RowsBf16.AMX_BESIDE_COPY_MAX_ROWS = args.int4_rows_beside_copy
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    speculations = [s.strip() for s in args.speculation.split(",") if s.strip()]
    if not speculations or set(speculations) - set(SPECULATION):
        raise SystemExit(f"--speculation: a comma-separated subset of {SPECULATION}")
    if args.model and ("hf" in systems or "vllm" in systems) and not args.hf_dir:
        raise SystemExit("--model needs --hf-dir (the same weights as an HF dir) for the hf and vllm systems")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # absolute: the vLLM peer runs in its own process and directory, and took a relative path for a hub id
    hf_dir = (args.hf_dir or DEFAULT_OUT / "models" / "smollm2-135m").resolve()

    from specserve.models.loader import demo_model_path, load_tokenizer

    workload = load_workload(args.workload, args.num_requests, args.max_tokens_cap)
    tokenizer = load_tokenizer(args.model or demo_model_path())
    tokenize(workload, tokenizer)
    load_start = os.getloadavg()
    print(f"CPU: {cpu_line()}", flush=True)
    print(
        f"workload: {workload.name}: {len(workload.requests)} requests, "
        f"{workload.prompt_tokens} prompt tokens, "
        f"{workload.output_tokens} output tokens | {args.dtype} | load average {load_start[0]:.1f}",
        flush=True,
    )

    results: list[Result] = []
    reference: dict[int, Result] = {}  # our continuous engine, by sequences in flight
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = args.out_dir / f"throughput-{stamp}.json"
    payload = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
        "dtype": args.dtype,
        "load_average": [load_start[0]],
        "results": [],
        "failures": [],
    }

    def save() -> None:
        # after every system: a run that dies late (a peer, say) still leaves what it measured
        payload["results"] = [r.to_json() for r in results]
        json_path.write_text(json.dumps(payload, indent=2) + "\n")

    def ours(name: str, n: int, speculation: str = "off") -> None:
        r = run_ours(workload, name, n, args, speculation)
        results.append(r)
        if not MODES[name][0] and speculation == "off":
            reference[n] = r
        save()
        print(f"  {r.system} @ {n}: {r.tok_s:.1f} tok/s ({r.seconds:.1f} s)", flush=True)
        print(format_breakdown("", r.steps), flush=True)

    def run_peer(n: int, speculation: str) -> None:
        label = "vLLM CPU" + (NGRAM_SUFFIX if speculation == "ngram" else "") + " (peer)"
        print(f"  {label} ({python}) @ {n}: starting (start-up takes minutes) ...", flush=True)
        try:
            peer = run_vllm(
                python,
                hf_dir,
                workload,
                args.out_dir,
                f"throughput-{speculation}",
                dtype=args.dtype,
                max_num_seqs=n,
                max_num_batched_tokens=args.max_num_batched_tokens,
                speculative_config=serve_speculation()[1] if speculation == "ngram" else None,
                bind=args.vllm_bind,
                repeats=args.repeats,
            )
            run = min(peer.runs, key=lambda r: r["seconds"])
            if run["output_tokens"] != workload.output_tokens:
                got, want = run["output_tokens"], workload.output_tokens
                raise RuntimeError(f"vLLM produced {got} tokens, expected {want}")
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
            payload["failures"].append(f"{label}: {e}")
            save()
            print(f"  {label} failed: {e}", flush=True)
            return
        note = f"VLLM_CPU_OMP_THREADS_BIND={args.vllm_bind}" if args.vllm_bind else "default binding"
        if run["proposed"]:
            note += f"; draft acceptance {run['accepted'] / run['proposed']:.2f}"
        results.append(Result(label, n, run["seconds"], run["output_tokens"], note=note))
        save()
        print(f"  {label} @ {n}: {results[-1].tok_s:.1f} tok/s; log {peer.log}", flush=True)

    if "continuous" in systems:
        for speculation in speculations:
            ours("specserve continuous", args.max_num_seqs, speculation)
    if "static" in systems:
        ours("specserve static (padded)", args.max_num_seqs)
        ours("specserve static (shrinking)", args.max_num_seqs)

    hf_best = None
    if "hf" in systems:
        ensure_target_dir(hf_dir)
        model = load_hf(hf_dir, args.dtype)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for b in [int(x) for x in args.hf_batch_sizes.split(",")]:
            r = run_hf(model, workload, b, pad_id, args.repeats)
            results.append(r)
            save()
            print(f"  HF batch {b}: {r.tok_s:.1f} tok/s ({r.seconds:.1f} s)", flush=True)
            if hf_best is None or r.tok_s > hf_best.tok_s:
                hf_best = r
        del model
        if "continuous" in systems and hf_best.in_flight not in reference:
            ours("specserve continuous", hf_best.in_flight)

    python = vllm_python(args.vllm_python) if "vllm" in systems else None
    if "vllm" in systems:
        if python is None:
            print("  vLLM: no venv found (--vllm-python / $SPECSERVE_VLLM_PYTHON); skipped", flush=True)
        else:
            ensure_target_dir(hf_dir)
            n = args.vllm_max_num_seqs
            if "continuous" in systems and n not in reference:
                for speculation in speculations:
                    ours("specserve continuous", n, speculation)
            for speculation in speculations:
                run_peer(n, speculation)

    print_table(results, reference)
    ours_runs = [r for r in results if r.steps is not None]
    if ours_runs:
        print("\nper-step breakdown (specserve):")
        for r in ours_runs:
            print(format_breakdown(f"{r.system} @ {r.in_flight}", r.steps))
    lines = verdicts(results, reference, hf_best)
    if lines:
        print("\n" + "\n".join(lines))
    load_end = os.getloadavg()
    print(f"\nload average {load_start[0]:.1f} -> {load_end[0]:.1f} (2 cores, shared: ratios matter)")

    payload["load_average"].append(load_end[0])
    payload["verdicts"] = lines
    save()
    png_path = args.out_dir / f"throughput-{stamp}.png"
    save_chart(results, png_path, f"{workload.name}, {args.dtype}")
    print(f"saved {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
