"""Make a draft model for speculative decoding from the demo target: its first N layers and its own head.

A truncated copy of the target shares the tokenizer by construction (the engine checks that) and needs no
training. Which N pays is measured, not guessed: for each candidate N,
- acceptance a: greedy speculative decoding is decided by teacher forcing alone (draft token j only matters
  when drafts 1..j-1 were accepted, i.e. equal the target's tokens), so one draft forward over prompt + the
  target's greedy continuation gives the exact accept/reject trace for any k;
- cost ratio c: one batch-1 decode step of the draft over one of the target, on our engine's forward;
then the Leviathan speedup E = (1 - a^(k+1)) / ((1 - a)(k c + 1)) picks N. Optionally each candidate's top
layer is a copy of the target's last layer (--top-from-last) and/or it is distilled (--distill-steps,
tools/distill_draft.py) before it is measured.

    python tools/make_draft.py [--out DIR] [--num-layers N] [--candidates 2,4,6,8,10,12]
                               [--top-from-last] [--distill-steps S] [--prompts 4] [--gen-tokens 96] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_hf import export  # noqa: E402

from specserve.models.loader import Checkpoint, demo_model_path, load_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET_DIR = REPO / "bench" / "out" / "models" / "smollm2-135m"
DEFAULT_DRAFT_DIR = REPO / "bench" / "out" / "models" / "smollm2-135m-draft"
# Picked by this script's own measurement on W1: the best predicted speedup at k=4. Undistilled truncations
# of this model agree with it on ~1-5% of tokens whatever N (2..12), so the cheapest draft is the least bad.
DEFAULT_NUM_LAYERS = 2
W1 = REPO.parent / "shared" / "bench" / "workload.py"


@dataclass
class Candidate:
    num_layers: int
    acceptance: float  # accepted / proposed drafts in the simulated greedy run
    mean_accepted_length: float  # tokens per target forward (accepted drafts + the bonus token)
    agreement: float  # per-position top-1 agreement with the target
    cost_ratio: float  # draft decode step / target decode step
    predicted_speedup: float


def speedup(a: float, k: int, c: float) -> float:
    """Leviathan et al.: expected tokens per step over the step's cost, relative to plain decoding."""
    a = min(a, 0.999)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def simulate(agree: list[bool], k: int) -> tuple[int, int, int]:
    """(steps, proposed, accepted) of greedy speculative decoding with k drafts over an agreement trace."""
    steps = proposed = accepted = 0
    i, n = 0, len(agree)
    while i < n:
        room = min(k, n - i - 1)  # the last token of the continuation is always the target's own
        run = 0
        while run < room and agree[i + run]:
            run += 1
        steps += 1
        proposed += room
        accepted += run
        i += run + 1
    return steps, proposed, accepted


def workload_prompts(path: Path | None, n: int) -> list[str]:
    if path is not None:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif W1.is_file():
        import subprocess

        out = subprocess.run([sys.executable, str(W1), str(max(n, 8))], capture_output=True, text=True)
        rows = [json.loads(line) for line in out.stdout.splitlines()]
    else:
        raise FileNotFoundError(f"no --workload given and {W1} is missing")
    return [r["prompt"] for r in rows[:n]]


@dataclass
class EvalSet:
    """Prompt + the target's greedy continuation per prompt, and the target's argmax at every row that
    predicts a continuation token (teacher forced: what greedy verification compares drafts against)."""

    sequences: list[torch.Tensor]  # [1, prompt + gen]
    starts: list[int]  # row predicting the first generated token
    target_argmax: list[torch.Tensor]


def eval_set(target, tokenizer, prompts: list[str], gen_tokens: int) -> EvalSet:
    seqs, starts, argmax = [], [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = target.generate(
                ids,
                max_new_tokens=gen_tokens,
                min_new_tokens=gen_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            start = ids.shape[1] - 1
            seqs.append(out)
            starts.append(start)
            argmax.append(target(out).logits[0, start:-1].argmax(-1))
    return EvalSet(seqs, starts, argmax)


def agreement_trace(draft, ev: EvalSet) -> list[bool]:
    """Per-position top-1 agreement of the draft with the target along the target's continuations."""
    trace: list[bool] = []
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for seq, start, want in zip(ev.sequences, ev.starts, ev.target_argmax):
            got = draft(seq).logits[0, start:-1].argmax(-1)
            trace.extend((got == want).tolist())
    return trace


def decode_step_seconds(ckpt: Checkpoint, layers: list[int], context: int = 512, rounds: int = 60) -> dict:
    """Seconds of one batch-1 decode step of our engine's forward with the first n layers, for each n.

    Interleaved rounds and the minimum over them: on a shared machine the minimum is the stable statistic.
    """
    from specserve.engine.model_runner import ForwardEntry, ModelRunner
    from specserve.models.config import ModelConfig
    from specserve.models.llama import LlamaModel

    block = 16
    table = list(range(context // block + 1))
    runners = {}
    for n in layers:
        cfg = ModelConfig.from_hf({**ckpt.config, "num_hidden_layers": n})
        state = {k: v for k, v in ckpt.state_dict.items() if not _layer_at_least(k, n)}
        runner = ModelRunner(LlamaModel(cfg, state, torch.bfloat16), context // block + 2, block)
        runner.run([ForwardEntry(list(range(1, context + 1)), 0, table, 1)])
        runners[n] = runner
    best = {n: float("inf") for n in layers}
    for i in range(rounds):
        for n, runner in runners.items():
            t0 = time.perf_counter()
            runner.run([ForwardEntry([7], context + (i % block), table, 1)])
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


def _layer_at_least(name: str, n: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= n


def draft_checkpoint(ckpt: Checkpoint, draft) -> Checkpoint:
    """The HF draft's weights under the target's config, ready for export()."""
    state = {k: v.detach().float() for k, v in draft.state_dict().items() if k != "lm_head.weight"}
    config = {**ckpt.config, "num_hidden_layers": draft.config.num_hidden_layers}
    return Checkpoint(config=config, state_dict=state, source=ckpt.source)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_DRAFT_DIR)
    p.add_argument("--target-dir", type=Path, default=DEFAULT_TARGET_DIR, help="the exported target")
    p.add_argument("--num-layers", type=int, help="skip the measurement and keep this many layers")
    p.add_argument("--candidates", default="2,4,6,8,10,12")
    p.add_argument("--top-from-last", action="store_true", help="the draft's top layer is the target's last")
    p.add_argument("--distill-steps", type=int, default=0, help="distil each candidate this many steps")
    p.add_argument("--prompts", type=int, default=4, help="W1 prompts to measure acceptance on")
    p.add_argument("--gen-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--workload", type=Path, help="JSONL of {prompt} rows (default: W1 from ../shared)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args(argv)

    from distill_draft import DistillConfig, build_draft, distill, training_text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = load_checkpoint(demo_model_path())
    if not (args.target_dir / "model.safetensors").is_file():
        export(args.target_dir, ckpt=ckpt, dtype=args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target_dir)
    layers = [args.num_layers] if args.num_layers else [int(x) for x in args.candidates.split(",")]
    tokens = None
    if args.distill_steps:
        cfg = DistillConfig(steps=args.distill_steps)
        tokens = training_text(tokenizer, cfg.num_seqs, cfg.seq_len, cfg.seed)

    def make(n: int):
        draft = build_draft(target, n, args.top_from_last)
        if tokens is not None:
            print(f"  distilling the {n}-layer draft ({args.distill_steps} steps)", flush=True)
            distill(target, draft, tokens, DistillConfig(steps=args.distill_steps))
        return draft

    if args.num_layers:
        chosen = make(args.num_layers)
    else:
        prompts = workload_prompts(args.workload, args.prompts)
        ev = eval_set(target, tokenizer, prompts, args.gen_tokens)
        seconds = decode_step_seconds(ckpt, [*layers, ckpt.config["num_hidden_layers"]])
        t_target = seconds[ckpt.config["num_hidden_layers"]]
        cands, drafts = [], {}
        for n in layers:
            drafts[n] = make(n)
            trace = agreement_trace(drafts[n], ev)
            steps, proposed, accepted = simulate(trace, args.k)
            a = accepted / max(proposed, 1)
            c = seconds[n] / t_target
            mean_len = 1 + accepted / max(steps, 1)
            cands.append(Candidate(n, a, mean_len, sum(trace) / max(len(trace), 1), c, speedup(a, args.k, c)))
        print(f"{len(prompts)} W1 prompts x {args.gen_tokens} greedy tokens of the target, k={args.k}")
        print(f"{'layers':>6} {'agree':>6} {'accept':>7} {'mean len':>8} {'cost c':>7} {'pred E':>7}")
        for c in cands:
            print(
                f"{c.num_layers:>6} {c.agreement:>6.3f} {c.acceptance:>7.3f} {c.mean_accepted_length:>8.2f}"
                f" {c.cost_ratio:>7.3f} {c.predicted_speedup:>7.2f}"
            )
        best = max(cands, key=lambda c: c.predicted_speedup)
        print(f"best: {best.num_layers} layers (predicted {best.predicted_speedup:.2f}x at k={args.k})")
        chosen = drafts[best.num_layers]
    path = export(args.out, ckpt=draft_checkpoint(ckpt, chosen), dtype=args.dtype)
    print(f"wrote draft ({chosen.config.num_hidden_layers} layers) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
