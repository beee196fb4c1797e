"""The GPU report: kernels, engine, CUDA graphs, throughput and the worker, proven on one lent GPU.

    python bench/gpu/run.py --out DIR [--parts env,kernels,...] [--budget-s 360]
    python bench/gpu/run.py --out /tmp/gpu-smoke --smoke       # the same script at tiny sizes on the CPU

Each part (bench/gpu/part_<name>.py) gets a share of the budget and runs in turn; one that raises is recorded
as failed with its traceback and the run goes on, so a single run on a GPU answers everything it can. The
report is rewritten after every part (DIR/report.md, DIR/report.json), so a run cut short still leaves what it
measured. bench/gpu/pack.sh gathers what the GPU machine lacks (wheels, the demo model, the workload).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# part name -> share of the budget (seconds on a GPU); the order is the run's order
PARTS = {
    "env": 20,
    "kernels": 100,
    "engine": 150,
    "graphs": 50,
    "throughput": 150,
    "worker": 120,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from: " + ", ".join(PARTS))
    p.add_argument("--budget-s", type=float, default=None, help="scales every part's share (default: sum)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: tests the script")
    p.add_argument("--model", type=Path, default=None, help="the demo GGUF (default: .gpu/ or the wheel)")
    p.add_argument(
        "--opt", action="append", default=[], help="part.key=value (e.g. engine.families=qwen3,gemma3)"
    )
    p.add_argument("--workload", type=Path, default=None, help="W1 as JSONL (default: .gpu/w1_256.jsonl)")
    return p.parse_args(argv)


def header() -> dict[str, str]:
    import torch

    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "host_cpus": str(os.cpu_count()),
    }
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - a missing module is a line of the report
            info[mod] = f"missing ({exc.__class__.__name__})"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["gpu"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["gpu"] = f"no nvidia-smi ({exc.__class__.__name__})"
    try:
        # "-dirty" where the tree that ran is not the commit: the lent machine gets the working tree, whose
        # .git may name an older HEAD than the files beside it
        info["commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=7"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        info["commit"] = "unknown"
    return info


def default_model() -> Path | None:
    here = ROOT / ".gpu" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if here.is_file():
        return here
    try:
        from specserve.models.loader import demo_model_path

        return Path(demo_model_path())
    except Exception:  # noqa: BLE001 - no model: the parts that need one say so
        return None


def write_report(out: Path, info: dict[str, str], parts: list, started: float) -> None:
    lines = ["# specserve on a GPU", ""]
    lines += [f"- **{k}**: {v}" for k, v in info.items()]
    lines += [f"- **wall time so far**: {time.monotonic() - started:.0f} s", ""]
    lines += ["| part | result | seconds |", "|---|---|---|"]
    lines += [f"| {p.name} | {'ok' if p.ok else 'FAILED'} | {p.data.get('seconds', 0):.0f} |" for p in parts]
    for p in parts:
        lines += ["", f"## {p.name}", "", p.markdown]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    blob = {"header": info, "parts": {p.name: {"ok": p.ok, **p.data} for p in parts}}
    (out / "report.json").write_text(json.dumps(blob, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import torch

    from bench.gpu.common import Context, Part

    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "log.txt", "a", buffering=1)  # noqa: SIM115 - open for the whole run

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")

    started = time.monotonic()
    info = header()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    info["device"] = str(device)
    log(f"header: {info}")
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s): {unknown}; choose from {list(PARTS)}")
    scale = 1.0 if args.budget_s is None else args.budget_s / sum(PARTS[n] for n in names)
    model = args.model or default_model()
    workload = args.workload or (ROOT / ".gpu" / "w1_256.jsonl")
    ctx = Context(
        device=device,
        smoke=args.smoke,
        out=args.out,
        model=model if model and model.is_file() else None,
        tokenizer=None,
        deadline=0.0,
        log=log,
        workload=workload if workload.is_file() else None,
        options=dict(o.split("=", 1) for o in args.opt),
    )
    results: list[Part] = []
    for name in names:
        t0 = time.monotonic()
        share = float(ctx.options.get(f"budget.{name}", PARTS[name] * scale))
        ctx.deadline = t0 + share * (3.0 if args.smoke else 1.0)
        log(f"part {name}: {share:.0f} s")
        try:
            module = __import__(f"bench.gpu.part_{name}", fromlist=["run"])
            part = module.run(ctx)
        except BaseException as exc:  # noqa: BLE001 - a failing part is a section of the report
            if isinstance(exc, KeyboardInterrupt):
                raise
            tb = traceback.format_exc()
            log(f"part {name} FAILED:\n{tb}")
            part = Part(name, False, f"FAILED:\n\n```\n{tb[-4000:]}\n```")
        part.data["seconds"] = time.monotonic() - t0
        log(f"part {name}: {'ok' if part.ok else 'FAILED'} in {part.data['seconds']:.0f} s")
        results.append(part)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_report(args.out, info, results, started)
    log(f"done in {time.monotonic() - started:.0f} s: " + ", ".join(f"{p.name} {p.ok}" for p in results))
    return 0 if all(p.ok for p in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
