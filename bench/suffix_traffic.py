"""Does suffix decoding pay on agentic traffic? Speculation off vs n-gram vs suffix, one request at a time.

Agentic clients send the same shapes again and again: tool calls in a fixed JSON form, a transcript that
grows by a turn each request, code given back whole after a small edit, records rendered through one
template. Prompt lookup (n-gram) copies from the request's own text; suffix decoding also copies from the
outputs of requests that finished before it (spec/suffix.py). This bench builds such traffic and serves it on
three engines, a request at a time (an agent waits for each answer):

- agent turns: a coding agent's transcript (tools described in the system prompt, Hermes-style
  <tool_call> / <tool_response> turns reading, searching and testing CPython stdlib code); each request is
  the transcript so far, the model writes the next turn;
- code edits: rename a parameter of a stdlib function and give back the whole function;
- records to JSON: a few records as `key=value` lines, rendered as a JSON array by a fixed template.

Everything is built deterministically from the stdlib. Requests are greedy unless --temperature is given, so
every engine produces the same tokens (verification is lossless) and tok/s compare like for like. Each run
starts a fresh engine (the suffix engine's shared tree then holds only what that run served, after two
warm-up requests of other traffic), in the order off, ngram, suffix, suffix, ngram, off; ratios are taken
from the adjacent pairs (the machine is noisy).

--vllm also serves the same token ids, a request at a time, on vLLM's CPU build (its venv: --vllm-python,
$SPECSERVE_VLLM_PYTHON or /work/vllm-venv) with speculation off, its n-gram and its suffix method (which needs
`arctic-inference` in that venv; where it fails, its log's end is printed and the other two stand), on the
demo model exported to --target-dir; vLLM's ratios are its own runs against each other.

    python bench/suffix_traffic.py [--requests 24] [--k 4] [--max-tokens 192] [--dtype float32] [--model M]
        [--quantization auto] [--vllm] [--vllm-only]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    DEFAULT_OUT,
    VLLM_NGRAM,
    Request,
    Workload,
    cpu_line,
    ensure_target_dir,
    vllm_systems,
)

KINDS = ("agent", "edit", "records")
TOOLS = [
    {"name": "read_file", "description": "Read a source file", "parameters": {"path": "string"}},
    {"name": "search", "description": "Find a name in the repository", "parameters": {"query": "string"}},
    {"name": "run_tests", "description": "Run the tests of a module", "parameters": {"path": "string"}},
    {
        "name": "write_file",
        "description": "Replace a file's content",
        "parameters": {"path": "string", "content": "string"},
    },
]
AGENT_SYSTEM = (
    "You are a coding agent. Call one tool per turn, as <tool_call>{json}</tool_call>, or answer when done."
    "\n<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>"
)
RECORD_KEYS = ("name", "age", "city", "email", "plan")
NAMES = ("Ada", "Grace", "Linus", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances", "John")
CITIES = ("Paris", "Oslo", "Lisbon", "Kyoto", "Austin", "Nairobi", "Lima", "Perth")


@dataclass
class AgentRequest:
    kind: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    seed: int


def _functions(rng: random.Random) -> list[tuple[str, str, str, int]]:
    """(module path, function name, source, first line) of small stdlib functions with a parameter."""
    import difflib
    import json.decoder
    import json.encoder
    import textwrap

    found = []
    for mod in (textwrap, difflib, json.encoder, json.decoder):
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__:
                continue
            src = inspect.getsource(fn)
            params = [p for p in inspect.signature(fn).parameters if p not in ("self", "cls")]
            if 200 < len(src) < 1400 and params:
                line = inspect.getsourcelines(fn)[1]
                found.append((mod.__name__.replace(".", "/") + ".py", name, src, line))
    rng.shuffle(found)
    return found


def _call(name: str, **arguments: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _result(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


def _agent_turns(path: str, name: str, src: str, line: int) -> list[list[dict[str, str]]]:
    """The transcript after each of an agent's turns on one task, ending where the model speaks next."""
    chat = [
        {"role": "system", "content": AGENT_SYSTEM},
        {"role": "user", "content": f"The tests of {path} fail in `{name}`. Find out why and fix it."},
    ]
    steps = [
        (_call("search", query=name), f"{path}:{line}: def {name}("),
        (_call("read_file", path=path), src),
        (
            _call("run_tests", path=path),
            f"FAILED tests/test_{name}.py::test_{name}_edge_case - AssertionError\n1 failed, 11 passed",
        ),
    ]
    transcripts = [list(chat)]
    for call, result in steps:
        chat = [*chat, {"role": "assistant", "content": call}, {"role": "user", "content": _result(result)}]
        transcripts.append(list(chat))
    return transcripts


def _records(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(3, 5)):
        who = rng.choice(NAMES)
        values = (who, str(rng.randint(20, 70)), rng.choice(CITIES), f"{who.lower()}@example.org")
        lines.append(
            "; ".join(f"{k}={v}" for k, v in zip(RECORD_KEYS, (*values, rng.choice(("free", "pro")))))
        )
    return "\n".join(lines)


def build_traffic(n: int, max_tokens: int, temperature: float, seed: int = 0) -> list[AgentRequest]:
    """n requests, the kinds in turn; agent turns in transcript order, a task's turns one after another."""
    rng = random.Random(seed)
    funcs = _functions(rng)
    agent_turns = [t for f in funcs for t in _agent_turns(*f)]
    out: list[AgentRequest] = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        j = i // len(KINDS)
        if kind == "agent":
            messages = agent_turns[j % len(agent_turns)]
        elif kind == "edit":
            path, name, src, _ = funcs[j % len(funcs)]
            param = next(
                p for p in inspect.signature(_resolve(path, name)).parameters if p not in ("self", "cls")
            )
            user = (
                f"Rename the parameter `{param}` of `{name}` to `{param}_value` everywhere in it and give "
                f"back the whole function, nothing else:\n\n```python\n{src}```"
            )
            messages = [{"role": "user", "content": user}]
        else:
            keys = ", ".join(RECORD_KEYS)
            user = (
                f"Convert these records to a JSON array of objects with the keys {keys} (age as a number). "
                f"Reply with the JSON only.\n\n{_records(rng)}"
            )
            messages = [
                {"role": "system", "content": "You convert data to JSON."},
                {"role": "user", "content": user},
            ]
        out.append(AgentRequest(kind, messages, max_tokens, temperature, 1000 + i))
    return out


def _resolve(path: str, name: str):
    import importlib

    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


@dataclass
class Run:
    system: str
    seconds: float
    output_tokens: int
    proposed: int
    accepted: int
    outputs: list[list[int]]
    by_kind: dict[str, tuple[int, float]]  # kind -> (output tokens, seconds)
    # target forwards the run took: with the drafts verified, what its time follows from, less noisy than
    # the time itself on a shared machine
    steps: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict:
        return {
            "system": self.system,
            "seconds": round(self.seconds, 2),
            "output_tokens": self.output_tokens,
            "tok_s": round(self.tok_s, 2),
            "acceptance": round(self.accepted / self.proposed, 3) if self.proposed else None,
            "proposed": self.proposed,
            "steps": self.steps,
            "tok_s_by_kind": {k: round(t / s, 2) for k, (t, s) in self.by_kind.items()},
        }


def serve_one_at_a_time(llm, prompts: list[list[int]], traffic: list[AgentRequest], system: str) -> Run:
    from specserve import SamplingParams

    outputs: list[list[int]] = []
    produced = proposed = accepted = 0
    by_kind: dict[str, tuple[int, float]] = {}
    for prompt, r in zip(prompts, traffic):
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        seconds = time.perf_counter() - t0
        outputs.append(list(out.token_ids))
        produced += len(out.token_ids)
        proposed += out.usage.draft_proposed
        accepted += out.usage.draft_accepted
        tokens, spent = by_kind.get(r.kind, (0, 0.0))
        by_kind[r.kind] = (tokens + len(out.token_ids), spent + seconds)
    return Run(system, sum(s for _, s in by_kind.values()), produced, proposed, accepted, outputs, by_kind)


def make_engine(system: str, args: argparse.Namespace):
    from specserve import LLM

    spec = None
    if system == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k}
    elif system == "suffix":
        spec = {"method": "suffix", "num_speculative_tokens": args.k}
    return LLM(
        args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=1, speculative_config=spec
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=24, help="requests per run (the kinds in turn)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of both methods")
    p.add_argument("--max-tokens", type=int, default=192, help="per request; EOS may end it sooner")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs comparable)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="auto", help="of our engines (auto, none, w4a8, ...)")
    p.add_argument("--model", help="default: the demo model")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--vllm", action="store_true", help="also run vLLM's CPU build: off, ngram, suffix")
    p.add_argument("--vllm-only", action="store_true", help="vLLM's runs alone (implies --vllm)")
    p.add_argument("--vllm-python", help="vLLM's interpreter (default: $SPECSERVE_VLLM_PYTHON or the venv)")
    p.add_argument("--target-dir", type=Path, default=DEFAULT_OUT / "target-hf", help="vLLM's model dir")
    args = p.parse_args(argv)
    args.vllm = args.vllm or args.vllm_only
    return args


# suffix first: where its build cannot run it, that shows before the other two runs
VLLM_SPECS: dict[str, dict | None] = {
    "suffix": {"method": "suffix"},
    "ngram": VLLM_NGRAM,
    "off": None,
}


def run_vllm_systems(args: argparse.Namespace, traffic: list[AgentRequest]) -> dict[str, dict]:
    """vLLM serving `traffic` a request at a time with each of VLLM_SPECS (k = --k), greedy, EOS ending a
    request as on our engine; {system: its run, or {"failed": why}}."""
    from specserve import LLM

    tokenizer = LLM(args.model, dtype=args.dtype, max_num_seqs=1).engine  # the same prompt ids as ours
    workload = Workload(
        "agentic", [Request("", r.max_tokens, tokenizer.encode_chat(r.messages)) for r in traffic]
    )
    del tokenizer
    gc.collect()
    out = vllm_systems(
        args.vllm_python,
        ensure_target_dir(args.target_dir),
        workload,
        args.out_dir,
        "suffix-traffic",
        VLLM_SPECS,
        args.k,
        one_at_a_time=True,
        dtype=args.dtype,
    )
    for a, b in (("suffix", "off"), ("ngram", "off"), ("suffix", "ngram")):
        if "tok_s" in out[a] and "tok_s" in out[b]:
            print(f"vllm {a}/{b} tok/s: {out[a]['tok_s'] / out[b]['tok_s']:.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    traffic = build_traffic(args.requests, args.max_tokens, args.temperature)
    warm_traffic = build_traffic(2, 16, args.temperature, seed=1)
    order = ("off", "ngram", "suffix", "suffix", "ngram", "off")
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_line()} | {args.dtype} {args.quantization} | k={args.k} | load {load0:.1f}", flush=True)
    if args.vllm_only:
        vllm = run_vllm_systems(args, traffic)
        head = {"cpu": cpu_line(), "dtype": args.dtype, "k": args.k, "requests": args.requests}
        return _save(args, {**head, "max_tokens": args.max_tokens, "vllm": vllm})
    runs: dict[str, list[Run]] = {s: [] for s in order}
    for system in order:
        llm = make_engine(system, args)
        prompts = [llm.engine.encode_chat(r.messages) for r in traffic]
        warm = [llm.engine.encode_chat(r.messages) for r in warm_traffic]
        serve_one_at_a_time(llm, warm, warm_traffic, "warm")
        steps = llm.engine.stats().steps
        run = serve_one_at_a_time(llm, prompts, traffic, system)
        run.steps = llm.engine.stats().steps - steps
        runs[system].append(run)
        acc = run.summary()["acceptance"]
        print(
            f"  {system}: {run.tok_s:.1f} tok/s ({run.seconds:.1f} s, acceptance {acc},"
            f" {run.steps} steps verifying {run.proposed} drafts)",
            flush=True,
        )
        del llm
        gc.collect()
    # the first and the second run of each system pair up (off, ngram, suffix | suffix, ngram, off)
    pairs = {
        "ngram/off": [runs["ngram"][j].tok_s / runs["off"][j].tok_s for j in (0, 1)],
        "suffix/off": [runs["suffix"][j].tok_s / runs["off"][j].tok_s for j in (0, 1)],
        "suffix/ngram": [runs["suffix"][j].tok_s / runs["ngram"][j].tok_s for j in (0, 1)],
    }
    for name, ratios in pairs.items():
        print(f"{name} tok/s: {ratios[0]:.2f}, {ratios[1]:.2f}")
    kinds = {
        k: [runs[s][0].summary()["tok_s_by_kind"].get(k) for s in ("off", "ngram", "suffix")] for k in KINDS
    }
    for kind, (off, ngram, suffix) in kinds.items():
        print(f"  {kind}: off {off} | ngram {ngram} | suffix {suffix} tok/s")
    identical = args.temperature > 0 or all(
        r.outputs == runs["off"][0].outputs for system in order for r in runs[system]
    )
    vllm = run_vllm_systems(args, traffic) if args.vllm else None
    load1 = os.getloadavg()[0]
    print(f"greedy outputs identical: {identical} | load {load0:.1f} -> {load1:.1f}")
    payload = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "k": args.k,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ratios": {k: [round(x, 3) for x in v] for k, v in pairs.items()},
        "greedy_outputs_identical": identical,
        "load": [load0, load1],
        "runs": [r.summary() for s in ("off", "ngram", "suffix") for r in runs[s]],
        "vllm": vllm,
    }
    _save(args, payload)
    return 0 if identical else 1


def _save(args: argparse.Namespace, payload: dict) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"suffix-traffic-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
