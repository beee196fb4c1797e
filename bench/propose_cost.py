"""What proposing costs a step: each priced proposer's propose() for a batch of decoding sequences.

`auto` on an engine holding suffix and n-gram drafts with both for every request each step, so both
proposers' time is on every step. The contexts are Python stdlib source, a token per word (words
repeat as code does); each timed step appends one token to every sequence, as decoding does.

    python bench/propose_cost.py [--seqs 32] [--tokens 600] [--k 16] [--steps 50]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_line  # noqa: E402


def contexts(seqs: int, tokens: int) -> list[list[int]]:
    import collections
    import email.message
    import json as json_module

    words = re.findall(
        r"\w+|[^\w\s]", "".join(inspect.getsource(m) for m in (collections, email.message, json_module))
    )
    ids: dict[str, int] = {}
    stream = [ids.setdefault(w, 100 + len(ids)) for w in words]
    step = max(1, (len(stream) - tokens - 1) // max(seqs, 1))
    return [stream[i * step : i * step + tokens + 1] for i in range(seqs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=32, help="decoding sequences in the batch")
    p.add_argument("--tokens", type=int, default=600, help="context tokens each")
    p.add_argument("--k", type=int, default=16, help="draft tokens asked of each")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    args = p.parse_args(argv)

    from specserve.engine.sampling_params import SamplingParams
    from specserve.engine.sequence import SeqStatus, Sequence
    from specserve.spec.ngram import NgramProposer
    from specserve.spec.suffix import SuffixProposer

    load0 = os.getloadavg()[0]
    texts = contexts(args.seqs, args.tokens + args.steps)
    result = {}
    for name, proposer in (("ngram", NgramProposer()), ("suffix", SuffixProposer(args.k))):
        seqs = []
        for i, text in enumerate(texts):
            seq = Sequence(
                i, f"r{i}", text[: args.tokens], SamplingParams(), detokenizer=None, arrival_time=0.0
            )
            seq.num_computed_tokens = seq.num_tokens - 1
            seq.status = SeqStatus.RUNNING
            seqs.append(seq)
        requests = [(s, args.k) for s in seqs]
        proposer.propose(requests)  # suffix builds each request's tree on its first proposal
        times = []
        for step in range(args.steps):
            for seq, text in zip(seqs, texts):
                seq.token_ids.append(text[args.tokens + step])
            t0 = time.perf_counter()
            drafts = proposer.propose(requests)
            times.append(time.perf_counter() - t0)
        drafted = sum(len(d.token_ids) for d in drafts.values())
        result[name] = {
            "median_ms": round(statistics.median(times) * 1e3, 3),
            "last_step_draft_tokens": drafted,
        }
    load1 = os.getloadavg()[0]
    print(
        f"CPU: {cpu_line()} | {args.seqs} sequences x {args.tokens} tokens, k={args.k}"
        f" | load {load0:.1f} -> {load1:.1f}"
    )
    for name, r in result.items():
        print(
            f"  {name}: {r['median_ms']} ms a step (median of {args.steps}),"
            f" {r['last_step_draft_tokens']} draft tokens"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
