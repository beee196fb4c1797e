"""What the benchmarks share: the workload, the exported target, step-time deltas, and the vLLM peer.

The workload is, in order of preference: a JSONL file given on the command line ({"prompt", "max_tokens"}
rows), the public W1 workload from ../shared/bench/workload.py, or a built-in synthetic skewed workload built
the same way (slices of the Python stdlib, outputs of 32 / 128 / 512 tokens) for clones without ../shared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED_W1 = REPO.parent / "shared" / "bench" / "workload.py"
DEFAULT_OUT = REPO / "bench" / "out"
DEFAULT_VLLM_PYTHON = Path("/work/vllm-venv/bin/python")
# vLLM's n-gram proposer set as ours is by default (specserve/spec/config.py), k given per run
VLLM_NGRAM: dict[str, Any] = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}
STEP_KEYS = ("schedule", "propose", "forward", "sample", "update")


@dataclass
class Request:
    prompt: str
    max_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    # sampling, for the peers that take it per request (vLLM); temperature 0 is greedy
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Workload:
    name: str  # where it came from, printed with every result
    requests: list[Request]

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)


def synthetic_rows(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """A skewed code-continuation workload from the local stdlib: half 32, 30% 128, 20% 512 output tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = rng.choice(files).read_text(encoding="utf-8", errors="replace")
        want = rng.randint(200, 2400)
        start = rng.randint(0, max(0, len(text) - want - 1))
        start = text.rfind("\n", 0, start) + 1
        r = rng.random()
        max_tokens = 32 if r < 0.5 else 128 if r < 0.8 else 512
        rows.append({"prompt": text[start : start + want], "max_tokens": max_tokens})
    return rows


def load_workload(path: Path | None, num_requests: int | None, max_tokens_cap: int | None = None) -> Workload:
    if path is not None:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        name = str(path)
    elif SHARED_W1.is_file():
        n = max(num_requests or 64, 64)  # W1 is the first 64 rows; more rows extend it, fewer take a prefix
        out = subprocess.run(
            [sys.executable, str(SHARED_W1), str(n)], capture_output=True, text=True, check=True
        )
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        name = "W1 (../shared/bench/workload.py)"
    else:
        rows = synthetic_rows(num_requests or 64)
        name = "built-in synthetic skewed workload (../shared/bench/workload.py not found)"
    if num_requests is not None:
        rows = rows[:num_requests]
    for i, r in enumerate(rows):
        if not isinstance(r.get("prompt"), str) or not isinstance(r.get("max_tokens"), int):
            raise ValueError(f"workload row {i}: needs a string prompt and an integer max_tokens")
    requests = [Request(r["prompt"], min(r["max_tokens"], max_tokens_cap or r["max_tokens"])) for r in rows]
    if max_tokens_cap:
        name += f", outputs capped at {max_tokens_cap} tokens"
    return Workload(name, requests)


def tokenize(workload: Workload, tokenizer) -> None:
    """Every system gets the same token ids (ours tokenizes once; HF and vLLM take ids)."""
    for r in workload.requests:
        r.prompt_token_ids = tokenizer.encode(r.prompt)


def ensure_target_dir(path: Path) -> Path:
    """The demo GGUF dequantized into an HF directory (once): what HF transformers and vLLM load."""
    if not (path / "model.safetensors").is_file():
        sys.path.insert(0, str(REPO / "tools"))
        from export_hf import export

        print(f"exporting the demo model to {path} (once) ...", flush=True)
        export(path)
    return path


def ensure_draft_dir(path: Path, target_dir: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        sys.path.insert(0, str(REPO / "tools"))
        from make_draft import DEFAULT_NUM_LAYERS
        from make_draft import main as make_draft

        print(f"writing the {DEFAULT_NUM_LAYERS}-layer draft to {path} (once) ...", flush=True)
        make_draft(
            ["--out", str(path), "--target-dir", str(target_dir), "--num-layers", str(DEFAULT_NUM_LAYERS)]
        )
    return path


# ---------------------------------------------------------------- HF transformers


def hf_generate(model, rows: list[list[int]], new_tokens: int, pad_id: int):
    """HF `generate` over one static batch, left-padded, exactly `new_tokens` a row (EOS cannot end a row
    early), on the model's own device: the baseline every throughput benchmark compares with."""
    import torch

    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    if out.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens per row, asked for {new_tokens}")
    return out


# ---------------------------------------------------------------- step times


def step_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def breakdown(delta: dict[str, float]) -> dict[str, float]:
    """Per-step means: milliseconds per phase, sequences and query tokens per step."""
    steps = max(delta["steps"], 1)
    out = {f"{k}_ms": 1e3 * delta[k] / steps for k in STEP_KEYS}
    out.update(steps=delta["steps"], batch=delta["seqs"] / steps, tokens_per_step=delta["tokens"] / steps)
    return out


def format_breakdown(label: str, b: dict[str, float]) -> str:
    phases = " ".join(f"{k} {b[f'{k}_ms']:.2f}" for k in STEP_KEYS)
    return (
        f"  {label:<28} ms/step: {phases} | steps {int(b['steps'])}, "
        f"mean batch {b['batch']:.1f} seqs, {b['tokens_per_step']:.1f} tokens/step"
    )


# ---------------------------------------------------------------- vLLM peer


def vllm_python(flag: str | None) -> Path | None:
    candidate = flag or os.environ.get("SPECSERVE_VLLM_PYTHON")
    if candidate:
        p = Path(candidate)
        if not p.is_file():
            raise FileNotFoundError(f"vLLM interpreter {p} does not exist")
        return p
    return DEFAULT_VLLM_PYTHON if DEFAULT_VLLM_PYTHON.is_file() else None


@dataclass
class PeerResult:
    runs: list[dict[str, float]]
    load_seconds: float
    log: Path


def run_vllm(
    python: Path,
    model_dir: Path,
    workload: Workload,
    out_dir: Path,
    label: str,
    *,
    dtype: str = "bfloat16",
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    speculative_config: dict[str, Any] | None = None,
    batches: list[list[int]] | None = None,
    repeats: int = 1,
    bind: str = "0-1",
    timeout: float = 1800.0,
    ttft: bool = False,
    structured_outputs: dict[str, Any] | None = None,
    return_outputs: bool = False,
    wrap: list[str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    ignore_eos: bool | None = None,
    iomp: bool = False,
) -> PeerResult:
    """One vLLM process: load, warm up, run the workload `repeats` times; its log goes to out_dir.

    structured_outputs: a JSON schema every request is generated under (EOS then ends them, not max_tokens);
    return_outputs: each run also carries "outputs", [{token_ids, text}] in request order; ignore_eos: None
    for vllm_peer's default (true unless a schema is given); wrap: a command
    prefix (e.g. systemd-run's) and preexec_fn: run in the child before it execs (e.g. joining a cgroup), both
    for constraining the peer as our engine is constrained; iomp: preload Intel OpenMP from vLLM's venv
    (where it has one), as vLLM's CPU install guide asks: its speculative decoding warns of a large loss
    without it."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "speculative_config": speculative_config,
        "repeats": repeats,
        "batches": batches,
        "ttft": ttft,
        "structured_outputs": structured_outputs,
        "return_outputs": return_outputs,
        "requests": [_peer_request(r) for r in workload.requests],
    }
    if ignore_eos is not None:
        spec["ignore_eos"] = ignore_eos
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"vllm-{label}.log"
    env = dict(os.environ)
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    iomp_lib = python.parent.parent / "lib" / "libiomp5.so"
    if iomp and iomp_lib.is_file():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp_lib), env.get("LD_PRELOAD")]))
    if emulating_avx2():  # every process vLLM starts sees an AVX2-only CPU (sitecustomize runs in each)
        site = Path(tempfile.mkdtemp(prefix="avx2-site-"))
        (site / "sitecustomize.py").write_text(_AVX2_SITECUSTOMIZE)
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
        spec_path = fh.name
    result_path = spec_path + ".result"
    try:
        t0 = time.monotonic()
        with open(log, "w") as log_fh:
            proc = subprocess.run(
                [
                    *(wrap or []),
                    str(python),
                    str(Path(__file__).with_name("vllm_peer.py")),
                    spec_path,
                    result_path,
                ],
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tempfile.gettempdir(),  # keep vLLM from importing this repo's modules by accident
                timeout=timeout,
                preexec_fn=preexec_fn,
            )
        if proc.returncode != 0:
            raise RuntimeError(
                f"vLLM peer failed (exit {proc.returncode}) after {time.monotonic() - t0:.0f}s; see {log}"
            )
        result = json.loads(Path(result_path).read_text())
    finally:
        for f in (spec_path, result_path):
            if os.path.exists(f):
                os.unlink(f)
    return PeerResult(result["runs"], result["load_seconds"], log)


def _peer_request(r: Request) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
    if r.temperature:
        out.update(temperature=r.temperature, top_p=r.top_p, seed=r.seed)
    return out


def vllm_systems(
    python_flag: str | None,
    model_dir: Path,
    workload: Workload,
    out_dir: Path,
    label: str,
    specs: dict[str, dict[str, Any] | None],
    k: int,
    one_at_a_time: bool = False,
    **kwargs: Any,
) -> dict[str, dict[str, Any]]:
    """Each of `specs` (name -> vLLM speculative_config less num_speculative_tokens, which is k; None for
    speculation off) in its own vLLM process, in order, over `workload` (kwargs go to run_vllm); with
    `one_at_a_time`, a request at a time, each ending at EOS or its max_tokens (chat traffic).

    {name: its first run with tok_s, acceptance (accepted / proposed draft tokens), acceptance_per_position
    (accepted through draft position j per verify step with drafts) and mean_acceptance_length (tokens per
    such step, the bonus token included) where vLLM counted them, or {"failed": the error's line, "log": the
    log's end}}: a method the build cannot run is said, and the others stand."""
    try:
        python = vllm_python(python_flag)
    except FileNotFoundError as e:
        return {name: {"failed": str(e)} for name in specs}
    if python is None:
        return {
            name: {"failed": "no vLLM interpreter (--vllm-python, $SPECSERVE_VLLM_PYTHON)"} for name in specs
        }
    if one_at_a_time:
        kwargs |= {"max_num_seqs": 1, "batches": [[i] for i in range(len(workload.requests))]}
        kwargs |= {"ignore_eos": False}
    out: dict[str, dict[str, Any]] = {}
    for name, spec in specs.items():
        config = None if spec is None else {**spec, "num_speculative_tokens": k}
        try:
            peer = run_vllm(
                python, model_dir, workload, out_dir, f"{label}-{name}", speculative_config=config, **kwargs
            )
        except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as e:
            log = out_dir / f"vllm-{label}-{name}.log"
            out[name] = {"failed": log_error(log) or str(e), "log": log_tail(log)}
            print(f"  vllm {name}: failed: {out[name]['failed']}", flush=True)
            continue
        r = peer.runs[0]
        result = {**r, "tok_s": r["output_tokens"] / r["seconds"], "load_seconds": peer.load_seconds}
        result["acceptance"] = round(r["accepted"] / r["proposed"], 3) if r.get("proposed") else None
        drafts = r.get("drafts")
        if drafts:
            result["acceptance_per_position"] = [round(n / drafts, 3) for n in r["accepted_per_position"]]
            result["mean_acceptance_length"] = round(1 + r["accepted"] / drafts, 3)
        out[name] = result
        extra = f", per position {result['acceptance_per_position']}" if drafts else ""
        print(
            f"  vllm {name}: {result['tok_s']:.1f} tok/s (acceptance {result['acceptance']}{extra})",
            flush=True,
        )
    return out


# vLLM's processes tag their lines, "(EngineCore pid=12) ..."
_PROCESS_TAG = re.compile(r"^\(\S+ pid=\d+\) ")
# A traceback's last line, `SomeError: why`
_ERROR_LINE = re.compile(r"^\s*(\w+\.)*\w*(Error|Exception): ")


def log_error(path: Path) -> str:
    """The first exception a failed peer's log names ('' if none): the root cause, where the later ones
    (the engine's "initialization failed" and the like) only report that it happened. Indented lines right
    after it are its message too (pydantic puts the reason there) and are joined to it."""
    try:
        lines = [_PROCESS_TAG.sub("", ln) for ln in path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    at = next((i for i, ln in enumerate(lines) if _ERROR_LINE.match(ln)), None)
    if at is None:
        return ""
    found = [lines[at].strip()]
    for ln in lines[at + 1 : at + 4]:
        if not ln.startswith((" ", "\t")) or ln.strip().startswith(("File ", "For further information")):
            break
        found.append(ln.strip())
    return " | ".join(found)


def log_tail(path: Path, lines: int = 12) -> str:
    """The end of a peer's log: what a failure message quotes."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# An AVX2-only CPU's paths on a CPU with more (--emulate-avx2): torch's kernels, oneDNN's, MKL's and our C++
# kernels' avx2-only build each limited to AVX2 + FMA, and vLLM's import of its AVX2 build (_C_AVX2, which it
# picks by torch.cpu._is_avx512_supported). The instructions are an AVX2 machine's; the caches, memory and
# core are still this machine's, so such figures stand in for an AVX2 machine, they do not replace it.
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "SPECSERVE_KERNEL_ISA": "avx2",
}
_AVX2_SITECUSTOMIZE = """\
import torch.cpu

for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""


def emulating_avx2() -> bool:
    return all(os.environ.get(k) == v for k, v in AVX2_ENV.items())


def emulate_avx2() -> None:
    """Run this script again with AVX2_ENV set, which torch and the libraries read when they start."""
    if not emulating_avx2():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})


def cpu_line() -> str:
    """The CPU's model name and the SIMD flags that pick our kernels' paths: printed with every figure."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        import platform

        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    isa = [f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")]
    emulated = "; emulating AVX2 only (bench/common.py: AVX2_ENV)" if emulating_avx2() else ""
    return f"{model} ({' '.join(isa)}){emulated}"


def on_off_ratios(results: dict[str, list[dict[str, float]]]) -> tuple[float, float]:
    """(on / off mean output tok/s, on / off mean TTFT) of an on/off A/B's runs."""

    def mean(name: str, key: str) -> float:
        return statistics.fmean(r[key] for r in results[name])

    return mean("on", "tok_s") / mean("off", "tok_s"), mean("on", "mean_ttft_s") / mean("off", "mean_ttft_s")


def run_line(label: str, r: dict[str, float], extra: str = "") -> str:
    """One run of an A/B: throughput, wall time, mean TTFT, cache share, whatever else, the load."""
    speed = f"{r['tok_s']:6.1f} tok/s ({r['seconds']:.1f} s)"
    ttft = f"mean TTFT {r['mean_ttft_s'] * 1e3:7.1f} ms"
    cache = f"prompt tokens from cache {r['cached_share']:.0%}"
    return f"  {label}: {speed}, {ttft}, {cache}{extra} | load {os.getloadavg()[0]:.1f}"


# The prefix benches' chat traffic: system prompts from these modules' pydoc text, and short questions.
DOC_MODULES = ("json", "argparse", "collections", "pathlib", "itertools", "functools", "logging", "re")
QUESTIONS = (
    "Which function should I use to read a file?",
    "Summarise the module in one sentence.",
    "Give one example call.",
    "What is the most common mistake with it?",
    "Name two related modules.",
    "Is it thread-safe?",
    "What changed in recent versions?",
    "How do I test code that uses it?",
)


def concurrency_levels(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--concurrency and --requests as lists of ints, one request count per level."""
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.requests = [int(x) for x in args.requests.split(",")]
    if len(args.requests) != len(args.concurrency):
        p.error("--requests needs one count per --concurrency level")
