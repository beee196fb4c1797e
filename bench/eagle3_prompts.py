"""How an EAGLE-3 head drafts on different kinds of prompts: the traffic its training prompts prepare it for.

Three prompt sets, each answered greedily by the target (specserve's engine, up to --max-tokens):
- `open chat`: bench/eagle3.py's prompts (questions, advice, stories, emails; what that benchmark serves);
- `package prose`: the trainer's prompts built from installed packages' prose, its held-out ones
  (--package-prompts FILE: a file --export-prompts wrote, e.g. the one the head was trained on);
- `self-written`: user turns the target writes itself from its chat template (tools/eagle3_train/
  self_prompts.py, a seed no trainer run uses by default).
For each set, the trainer's held-out figure (tools/train_eagle.py: chain drafting of --k tokens from every
answer position, against the target's greedy continuation): acceptance per draft position and mean acceptance
length. No timing: the figures depend on the head and the prompts only.

    python bench/eagle3_prompts.py --head DIR [--package-prompts FILE] [--per-set 48] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_eagle  # noqa: E402
from common import cpu_line  # noqa: E402
from eagle3 import PROMPTS  # noqa: E402
from eagle3_train.answers import AnswerCache, answer_with_engine  # noqa: E402
from eagle3_train.features import compute_features  # noqa: E402
from eagle3_train.prompts import Prompt, build_prompts, read_prompts  # noqa: E402
from eagle3_train.self_prompts import write_with_engine  # noqa: E402

from specserve.spec.eagle3.head import Eagle3Config, load_eagle3  # noqa: E402

SELF_SEED = 101  # not the trainer's default seed: these turns are not among a default run's prompts


def prompt_sets(args, target: Path) -> dict[str, list[str]]:
    if args.package_prompts:
        package = [p.text for p in read_prompts(Path(args.package_prompts)) if p.holdout]
    else:
        package = [p.text for p in build_prompts(10 * args.per_set, seed=0, scan_s=60.0) if p.holdout]
    written = write_with_engine(
        str(target), args.per_set, time.monotonic() + 900, in_flight=48, dtype=args.dtype, seed=SELF_SEED
    )
    return {
        "open chat": list(PROMPTS)[: args.per_set],
        "package prose": package[: args.per_set],
        "self-written": written,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, type=Path)
    p.add_argument("--package-prompts", default=None)
    p.add_argument("--per-set", type=int, default=48)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", help="the target's, for its answers and features")
    p.add_argument("--work", type=Path, default=Path("/tmp/eagle3_prompts"), help="answers cached here")
    args = p.parse_args(argv)

    target = train_eagle.target_path(None)
    model, _ = train_eagle.load_target(target, "cpu", getattr(torch, args.dtype))
    cfg = Eagle3Config.from_dir(args.head)
    layer_ids = cfg.layer_ids(len(train_eagle.decoder_layers(model)))
    head = load_eagle3(args.head, target_embed=model.get_input_embeddings().weight.detach()).float()
    print(f"# {cpu_line()}; head {args.head}, aux layers {list(layer_ids)}, k = {args.k}")
    result = {}
    for name, texts in prompt_sets(args, target).items():
        prompts = [Prompt(t, True) for t in texts]  # every one held out, answered greedily
        cache = AnswerCache(args.work / f"{name.replace(' ', '_')}-{len(texts)}.jsonl")
        todo = [i for i in range(len(prompts)) if i not in cache.answers]
        if todo:
            answer_with_engine(
                str(target), prompts, todo, cache, time.monotonic() + 1800, in_flight=48, dtype=args.dtype,
                max_tokens=args.max_tokens, temperature=0.0, sampled_fraction=0.0, seed=0,
            )  # fmt: skip
        cache.close()
        answers = cache.ordered()
        samples = compute_features(
            model, layer_ids, answers, time.monotonic() + 1800, batch_tokens=4096, shard_dir=None
        )
        figure = train_eagle.evaluate(head, samples, args.k, 512)
        result[name] = {"prompts": len(texts), "answer_tokens": sum(len(a.answer_ids) for a in answers)}
        result[name].update(figure)
        print(
            f"{name:>14}: {len(texts)} prompts, {result[name]['answer_tokens']} answer tokens; acceptance by "
            f"position {figure.get('acceptance_per_position')}, mean acceptance length "
            f"{figure.get('mean_acceptance_length')}",
            flush=True,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
