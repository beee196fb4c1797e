"""Constrained decoding cost and speed: a JSON-extraction workload, with and without a strict schema, with and
without speculation, on the demo model (SmolLM2-135M-Instruct) in one process.

Workload (deterministic): N short paragraphs about made-up people, each asking for their record as JSON; the
schema is strict (7 required fields, additionalProperties false, string lengths bounded). Greedy.
Configurations, each over the same prompts:
- free:          no constraint, speculation off  (the same max_tokens; tokens/s is the comparable figure)
- schema:        response schema, speculation off
- schema+spec:   response schema, speculation "auto" (n-gram lookup + grammar-forced drafts)
at batch 1 (one request at a time) and at batch B (B requests in flight, max_num_seqs = B).
Targets (issue 14): schema >= 0.9x free tokens/s at batch 1 and B; schema+spec >= 1.5x schema at batch 1.

The machine is shared and noisy: configurations run in the order A B C C B A (ABBA) and the ratios are taken
per pass from adjacent runs; the load average and the CPU are printed with the figures.

    python bench/structured.py [--requests 16] [--batch-requests 64] [--batch 32] [--max-tokens 96]
        [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, cpu_line  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "city", "country", "occupation", "employed"],
    "additionalProperties": False,
}
FIRST = (
    "Maria",
    "John",
    "Aiko",
    "Pierre",
    "Fatima",
    "Lars",
    "Chen",
    "Olga",
    "Diego",
    "Amara",
    "Noah",
    "Sofia",
)
LAST = ("Lopez", "Smith", "Tanaka", "Martin", "Haddad", "Nilsson", "Wei", "Ivanova", "Garcia", "Okafor")
PLACES = (
    ("Madrid", "Spain"), ("Boston", "USA"), ("Osaka", "Japan"), ("Lyon", "France"), ("Cairo", "Egypt"),
    ("Oslo", "Norway"), ("Chengdu", "China"), ("Kazan", "Russia"), ("Lima", "Peru"), ("Lagos", "Nigeria"),
)  # fmt: skip
JOBS = ("teacher", "nurse", "software engineer", "baker", "pilot", "accountant", "architect", "farmer")


def prompts(n: int, seed: int = 7) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        city, country = rng.choice(PLACES)
        job, age = rng.choice(JOBS), rng.randint(19, 80)
        works = rng.random() < 0.7
        text = (
            f"{first} {last} is {age} years old and lives in {city}, {country}. "
            f"{'She' if rng.random() < 0.5 else 'He'} {'works' if works else 'used to work'} as a {job}. "
            f"Contact: {first.lower()}.{last.lower()}@example.com."
        )
        ask = (
            "Extract the person's record from this text as a JSON object with the fields name, age, email, "
            f"city, country, occupation and employed.\n\n{text}"
        )
        out.append([{"role": "user", "content": ask}])
    return out


def run_config(llm, chats, max_tokens: int, batch: int, schema: bool, spec: str) -> dict:
    from specserve import SamplingParams
    from specserve.engine.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if schema else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculation=spec, structured_outputs=so)
    ids = [llm.engine.encode_chat(c) for c in chats]
    times = llm.engine.step_times
    before = times.as_dict()
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(ids), batch):
        outs += llm.generate(ids[i : i + batch], params)
    wall = time.perf_counter() - t0
    after = times.as_dict()
    tokens = sum(len(o.token_ids) for o in outs)
    valid = 0
    if schema:
        import jsonschema

        for o in outs:
            try:
                jsonschema.validate(json.loads(o.text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    steps = after["steps"] - before["steps"]
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "valid": valid,
        "n": len(outs),
        "proposed": sum(o.usage.draft_proposed for o in outs),
        "accepted": sum(o.usage.draft_accepted for o in outs),
        "steps": steps,
        "ms_per_step": {
            k: 1000 * (after[k] - before[k]) / max(1, steps) for k in ("propose", "forward", "sample")
        },
        "text0": outs[0].text,
        "token_ids": [o.token_ids for o in outs],
    }


def machine() -> dict:
    return {"cpu": cpu_line(), "cores": os.cpu_count(), "python": platform.python_version()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests at batch 1")
    ap.add_argument("--batch-requests", type=int, default=64, help="requests at batch B")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (n-gram)")
    ap.add_argument("--model", default=None, help="default: the demo SmolLM2-135M-Instruct GGUF")
    ap.add_argument(
        "--dtype", default="auto", help="auto: the CPU's fast dtype (bf16 where native, else fp32)"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "structured.json")
    args = ap.parse_args()

    from specserve.engine.llm import LLM

    torch_threads = os.environ.get("OMP_NUM_THREADS", "default")
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch,
        speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
    )
    info = {**machine(), "dtype": str(llm.engine.dtype), "torch_threads": torch_threads}
    info["load_before"] = os.getloadavg()
    print(json.dumps(info))
    warm = prompts(2, seed=99)
    run_config(llm, warm, 16, 1, True, "auto")  # tokenizer info, compile, first forwards
    results: dict[str, list] = {}
    plans = [
        (
            "b1",
            prompts(args.requests),
            1,
            [("free", False, "off"), ("schema", True, "off"), ("spec", True, "auto")],
        ),
        (
            "bB",
            prompts(args.batch_requests, seed=8),
            args.batch,
            [("free", False, "off"), ("schema", True, "off")],
        ),
    ]
    for name, chats, batch, configs in plans:
        order = configs + configs[::-1]  # ABC CBA
        runs: dict[str, list[dict]] = {c[0]: [] for c in configs}
        for label, schema, spec in order:
            r = run_config(llm, chats, args.max_tokens, batch, schema, spec)
            runs[label].append(r)
            print(
                f"{name} {label:6s} tok/s {r['tok_s']:7.1f}  tokens {r['tokens']:5d}  "
                f"wall {r['wall_s']:6.1f}s  "
                f"valid {r['valid']}/{r['n']}  drafts {r['accepted']}/{r['proposed']}  "
                f"ms/step {json.dumps({k: round(v, 2) for k, v in r['ms_per_step'].items()})}  "
                f"load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        ratios = {
            "schema/free": [s["tok_s"] / f["tok_s"] for s, f in zip(runs["schema"], runs["free"])],
        }
        if "spec" in runs:
            ratios["spec/schema"] = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["spec"], runs["schema"])]
            same = all(a["token_ids"] == b["token_ids"] for a, b in zip(runs["spec"], runs["schema"]))
            ratios["spec_equals_off"] = same
        print(
            name,
            "batch",
            batch,
            json.dumps(
                {k: v if isinstance(v, bool) else [round(x, 3) for x in v] for k, v in ratios.items()}
            ),
        )
        for rs in runs.values():
            for r in rs:
                r.pop("token_ids")
        results[name] = {"batch": batch, "runs": runs, "ratios": ratios}
    info["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": info, "max_tokens": args.max_tokens, "results": results}, indent=1)
    )
    print("sample outputs:", results["b1"]["runs"]["schema"][0]["text0"])
    print("written", args.out)


if __name__ == "__main__":
    main()
