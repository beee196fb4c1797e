"""Speculative decoding: acceptance, accepted length, tok/s off / fixed k / auto, against Leviathan's model.

For each method (n-gram prompt lookup, draft model) one engine is loaded with num_speculative_tokens = k;
each batch size runs three times on it, with SamplingParams(speculation="off" | k | "auto"). Batches:
- batch 1: the first --b1-requests W1 requests one at a time (the peers' batch-1 figure);
- batch B > 1: the first B W1 requests submitted together (B = 64 is the whole of W1). W1's output lengths
  are skewed, so the batch thins out as short requests finish; the mean batch actually run is printed.
Reported per run: output tok/s, acceptance a = accepted / proposed, mean accepted length (tokens per
verifying forward: 1 + accepted / verifications), cost ratio c = one draft step / one target step from the
engine's step times (propose / (steps * k) over forward / steps), the speedup Leviathan et al. predict
E = (1 - a^(k+1)) / ((1 - a)(k c + 1)), the measured speedup over "off", and measured / predicted.

    python bench/speculative.py [--batch-sizes 1,4,16,64] [--methods ngram,draft_model] [--k K]
                                [--max-tokens-cap N] [--workload W.jsonl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_OUT,
    Workload,
    breakdown,
    ensure_draft_dir,
    ensure_target_dir,
    format_breakdown,
    load_workload,
    step_delta,
    tokenize,
)

METHODS = ("ngram", "draft_model")
# n-gram acceptance comes in runs (copied code) and a 9-token verify costs about what a 5-token one does at
# small batch, so prompt lookup proposes further; a draft model pays one draft step per token proposed.
DEFAULT_K = {"ngram": 8, "draft_model": 4}


@dataclass
class Run:
    method: str
    batch: int
    mode: str  # "off", "k=4", "auto"
    seconds: float
    output_tokens: int
    proposed: int
    accepted: int
    verifications: int  # sequence-steps that verified at least one draft token
    steps: dict[str, float]
    k: int
    speedup: float | None = None  # over "off", same method and batch

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.accepted / self.verifications if self.verifications else None

    @property
    def cost_ratio(self) -> float | None:
        """One draft step over one target step, from the per-step phase times."""
        if not self.proposed or not self.steps["forward_ms"]:
            return None
        return self.steps["propose_ms"] / self.k / self.steps["forward_ms"]

    @property
    def predicted(self) -> float | None:
        a, c = self.acceptance, self.cost_ratio
        if a is None or c is None:
            return None
        return leviathan(a, self.k, c)

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "tok_s": self.tok_s,
            "acceptance": self.acceptance,
            "mean_accepted_length": self.mean_accepted_length,
            "cost_ratio": self.cost_ratio,
            "predicted": self.predicted,
        }


def leviathan(a: float, k: int, c: float) -> float:
    a = min(a, 0.999)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


class VerifyCounter:
    """Counts sequences verified with a non-empty draft, wrapping the engine's verify (read-only)."""

    def __init__(self, spec) -> None:
        self.count = 0
        self._verify = spec.verify
        spec.verify = self

    def __call__(self, plan, drafts, logits, generator):
        self.count += sum(1 for i, s in enumerate(plan.scheduled) if s.samples and drafts.num_drafts(i))
        return self._verify(plan, drafts, logits, generator)


def batches_for(workload: Workload, batch: int, b1_requests: int) -> list[list[int]]:
    if batch == 1:
        return [[i] for i in range(min(b1_requests, len(workload.requests)))]
    return [list(range(min(batch, len(workload.requests))))]


def run_mode(llm, counter: VerifyCounter, workload: Workload, groups, method, batch, mode, k) -> Run:
    from specserve import SamplingParams

    speculation = {"off": "off", "auto": "auto"}.get(mode, k)
    before = llm.engine.step_times.as_dict()
    verifications = counter.count
    seconds = 0.0
    produced = proposed = accepted = 0
    for group in groups:
        ids = [workload.requests[i].prompt_token_ids for i in group]
        params = [
            SamplingParams(
                max_tokens=workload.requests[i].max_tokens,
                temperature=0.0,
                ignore_eos=True,
                speculation=speculation,
            )
            for i in group
        ]
        t0 = time.perf_counter()
        outs = llm.generate(ids, params)
        seconds += time.perf_counter() - t0
        for o in outs:
            produced += len(o.token_ids)
            proposed += o.usage.draft_proposed
            accepted += o.usage.draft_accepted
    expected = sum(workload.requests[i].max_tokens for g in groups for i in g)
    if produced != expected:
        raise RuntimeError(f"{method} {mode} batch {batch}: produced {produced} tokens, expected {expected}")
    steps = breakdown(step_delta(before, llm.engine.step_times.as_dict()))
    return Run(
        method, batch, mode, seconds, produced, proposed, accepted, counter.count - verifications, steps, k
    )


def load_engine(method: str, args: argparse.Namespace, draft_dir: Path):
    from specserve import LLM

    args_k = k_for(method, args)
    if method == "ngram":
        cfg = {
            "method": "ngram",
            "num_speculative_tokens": args_k,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
    else:
        cfg = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": args_k}
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        speculative_config=cfg,
        attention_backend=args.attention_backend,
    )
    return llm, VerifyCounter(llm.engine.spec)


def k_for(method: str, args: argparse.Namespace) -> int:
    return args.k if args.k is not None else DEFAULT_K[method]


def _fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def print_table(runs: list[Run]) -> None:
    head = f"{'method':<12}{'batch':>6}{'mode':>6}{'tok/s':>8}{'accept':>8}{'acc.len':>8}{'c':>7}"
    print("\n" + head + f"{'pred E':>8}{'speedup':>9}{'meas/pred':>10}{'mean batch':>11}")
    for r in runs:
        ratio = r.speedup / r.predicted if r.speedup is not None and r.predicted else None
        print(
            f"{r.method:<12}{r.batch:>6}{r.mode:>6}{r.tok_s:>8.1f}{_fmt(r.acceptance, '.3f'):>8}"
            f"{_fmt(r.mean_accepted_length, '.2f'):>8}{_fmt(r.cost_ratio, '.3f'):>7}"
            f"{_fmt(r.predicted, '.2f'):>8}"
            f"{_fmt(r.speedup, '.2f'):>9}{_fmt(ratio, '.2f'):>10}{r.steps['batch']:>11.1f}"
        )


def verdicts(runs: list[Run]) -> list[str]:
    lines = []
    for r in runs:
        fixed = f"k={r.k}"
        if r.mode == fixed and r.batch == 1 and r.speedup is not None and r.predicted:
            x = r.speedup / r.predicted
            lines.append(f"{r.method} batch 1: measured/predicted {x:.2f} (target >= 0.85: {_ok(x >= 0.85)})")
        if r.mode == "auto" and r.speedup is not None:
            lines.append(
                f"{r.method} batch {r.batch}: auto / off {r.speedup:.2f}x "
                f"(target >= 0.97: {_ok(r.speedup >= 0.97)})"
            )
        if r.method == "ngram" and r.mode == fixed and r.speedup is not None and r.batch == 1:
            lines.append(
                f"ngram batch 1: {r.speedup:.2f}x over off (target >= 2.5x: {_ok(r.speedup >= 2.5)})"
            )
        if r.method == "ngram" and r.mode == fixed and r.speedup is not None and r.batch == 64:
            lines.append(f"ngram batch 64: {r.speedup:.2f}x over off (target > 1x: {_ok(r.speedup > 1)})")
    return lines


def _ok(ok: bool) -> str:
    return "met" if ok else "NOT met"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", type=Path, help="JSONL of {prompt, max_tokens} rows (default: W1)")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--modes", default="off,k,auto", help="subset of off,k,auto")
    p.add_argument("--k", type=int, help=f"draft tokens per step for every method (default {DEFAULT_K})")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--b1-requests", type=int, default=8, help="requests run one at a time for batch 1")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's output length (shorter runs)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--attention-backend", default="auto", help="our engine's: auto, torch or cpu")
    p.add_argument("--draft-dir", type=Path, default=DEFAULT_OUT / "models" / "smollm2-135m-draft")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="smoke run: batch 1 and 4, 2 requests, 32 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes = "1,4"
        args.b1_requests = 2
        args.max_tokens_cap = args.max_tokens_cap or 32
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(args.methods) - set(METHODS) or set(args.modes) - {"off", "k", "auto"}:
        raise SystemExit(f"methods must be in {METHODS}, modes in off,k,auto")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    from specserve.models.loader import demo_model_path, load_tokenizer

    workload = load_workload(args.workload, max(max(args.batch_sizes), args.b1_requests), args.max_tokens_cap)
    tokenize(workload, load_tokenizer(demo_model_path()))
    draft_dir = args.draft_dir
    if "draft_model" in args.methods:
        ensure_draft_dir(draft_dir, ensure_target_dir(DEFAULT_OUT / "models" / "smollm2-135m"))
    load_start = os.getloadavg()
    print(
        f"workload: {workload.name} | k={ {m: k_for(m, args) for m in args.methods} } | {args.dtype} | "
        f"load average {load_start[0]:.1f}",
        flush=True,
    )
    if "draft_model" in args.methods:
        layers = json.loads((draft_dir / "config.json").read_text())["num_hidden_layers"]
        print(f"draft model: {draft_dir} ({layers} layers of the target + its final norm and tied head)")

    runs: list[Run] = []
    for method in args.methods:
        k = k_for(method, args)
        modes = [f"k={k}" if m == "k" else m for m in args.modes]
        llm, counter = load_engine(method, args, draft_dir)
        warm = [workload.requests[0].prompt_token_ids]
        from specserve import SamplingParams

        llm.generate(warm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, speculation=k))
        for batch in args.batch_sizes:
            groups = batches_for(workload, batch, args.b1_requests)
            off = None
            for mode in modes:
                r = run_mode(llm, counter, workload, groups, method, batch, mode, k)
                if mode == "off":
                    off = r
                elif off is not None:
                    r.speedup = r.tok_s / off.tok_s
                runs.append(r)
                print(
                    f"  {method} batch {batch} {mode}: {r.tok_s:.1f} tok/s, "
                    f"acceptance {_fmt(r.acceptance, '.3f')}",
                    flush=True,
                )
        del llm, counter

    print_table(runs)
    print("\nper-step breakdown:")
    for r in runs:
        print(format_breakdown(f"{r.method} b{r.batch} {r.mode}", r.steps))
    lines = verdicts(runs)
    print("\n" + "\n".join(lines))
    load_end = os.getloadavg()
    print(f"\nload average {load_start[0]:.1f} -> {load_end[0]:.1f} (2 cores, shared: ratios matter)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out_dir / f"speculative-{stamp}.json"
    payload = {
        "workload": workload.name,
        "k": {m: k_for(m, args) for m in args.methods},
        "dtype": args.dtype,
        "draft_dir": str(draft_dir),
        "load_average": [load_start[0], load_end[0]],
        "runs": [r.to_json() for r in runs],
        "verdicts": lines,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
