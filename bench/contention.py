"""Does our speed hold on a shared node? The chat workload quiet, beside a busy loop, and under a CPU quota.

A worker pod rarely has its cores to itself: a noisy neighbour, a sidecar, or a Kubernetes CPU limit (the
cgroup's cpu.max quota) take part of them. This bench runs the same chat traffic (bench/chat_traffic.py's
requests, all greedy, EOS ignored so every request yields exactly max_tokens) at --max-num-seqs in flight,
each engine in a process of its own, in three legs:
- quiet: nothing beside it;
- busy: one busy loop (`python -c "while True: pass"`) running beside it for the whole leg;
- quota: the engine's process in a cgroup whose quota is --quota cores (systemd-run --scope -p CPUQuota, or a
  cgroup of our own under /sys/fs/cgroup when systemd is not the init; the leg is skipped with the reason
  printed when neither can be set up here).
for specserve and for vLLM's CPU build (when its venv exists: --vllm-python, $SPECSERVE_VLLM_PYTHON or
/work/vllm-venv/bin/python). Printed: tok/s per leg and engine, busy/quiet and quota/quiet per engine, and
specserve/vLLM per leg; the whole result is saved as JSON under bench/out/.

    python bench/contention.py                       # 48 requests, 256 tokens each, 64 in flight, bf16
    python bench/contention.py --smoke               # 4 requests of 8 tokens: checks the plumbing only
    python bench/contention.py --legs quiet,busy --engines specserve
    python bench/contention.py --engines specserve --adaptive-threads off   # the team fixed at the budget
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the engine of the tree this bench lives in
from common import (  # noqa: E402
    DEFAULT_OUT,
    Request,
    Workload,
    cpu_line,
    ensure_target_dir,
    run_vllm,
    vllm_python,
)

LEGS = ("quiet", "busy", "quota")
ENGINES = ("specserve", "vllm")
BUSY_LOOP = "while True: pass"
CGROUP_ROOT = Path("/sys/fs/cgroup")


# ---------------------------------------------------------------- what runs beside the engine


class CpuQuota:
    """A cgroup limited to `cores` CPUs' worth of time per period, which a child joins before it execs.

    Tried in order: systemd-run (a transient scope, the way a unit's CPUQuota= is set), then a cgroup
    directory of our own (v2: cpu.max; v1: cpu.cfs_quota_us and cpu.cfs_period_us). `reason` says why neither
    worked, and is None when one did."""

    PERIOD_US = 100_000

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.prefix: list[str] = []
        self.group: Path | None = None
        self.reason: str | None = None
        quota_us = int(cores * self.PERIOD_US)
        systemd = self._try_systemd(cores)
        if systemd is None:
            self.prefix = ["systemd-run", "--scope", "--quiet", "-p", f"CPUQuota={cores * 100:g}%"]
            self.how = f"systemd-run --scope -p CPUQuota={cores * 100:g}%"
            return
        group = self._try_cgroup(quota_us)
        if isinstance(group, Path):
            self.group = group
            self.how = f"cgroup {group} ({quota_us} us per {self.PERIOD_US} us)"
            return
        self.reason = f"systemd-run: {systemd}; own cgroup: {group}"
        self.how = "none"

    @staticmethod
    def _try_systemd(cores: float) -> str | None:
        if shutil.which("systemd-run") is None:
            return "not installed"
        cmd = ["systemd-run", "--scope", "--quiet", "-p", f"CPUQuota={cores * 100:g}%", "true"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["failed"])[-1]

    def _try_cgroup(self, quota_us: int) -> Path | str:
        name = f"specserve-bench-{os.getpid()}"
        try:
            if (CGROUP_ROOT / "cgroup.controllers").is_file():  # unified hierarchy
                if "cpu" not in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
                    return "the cpu controller is not enabled in the unified hierarchy"
                group = CGROUP_ROOT / name
                group.mkdir()
                (group / "cpu.max").write_text(f"{quota_us} {self.PERIOD_US}")
                return group
            for line in Path("/proc/mounts").read_text().splitlines():
                fields = line.split()
                if fields[2] == "cgroup" and "cpu" in fields[3].split(","):
                    group = Path(fields[1]) / name
                    group.mkdir()
                    (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                    (group / "cpu.cfs_quota_us").write_text(str(quota_us))
                    return group
            return "no cgroup cpu controller mounted"
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    def join(self) -> None:
        """preexec_fn: the child moves itself into the group, so everything it starts is limited too."""
        if self.group is not None:
            (self.group / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.rmdir()
            except OSError as exc:  # a straggler still inside: say so rather than leave it silently
                print(f"  could not remove {self.group}: {exc}", flush=True)


class Beside:
    """What a leg runs beside the engine: nothing, a busy loop, or a CPU quota around the engine."""

    def __init__(self, leg: str, quota_cores: float) -> None:
        self.leg = leg
        self.busy: subprocess.Popen | None = None
        self.quota = CpuQuota(quota_cores) if leg == "quota" else None

    @property
    def skip_reason(self) -> str | None:
        return self.quota.reason if self.quota is not None else None

    @property
    def prefix(self) -> list[str]:
        return self.quota.prefix if self.quota is not None else []

    @property
    def preexec(self) -> Callable[[], None] | None:
        return self.quota.join if self.quota is not None and self.quota.group is not None else None

    def __enter__(self) -> Beside:
        if self.leg == "busy":
            self.busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
            time.sleep(0.5)  # running before the engine starts
        return self

    def __exit__(self, *exc: object) -> None:
        if self.busy is not None:
            self.busy.kill()
            self.busy.wait()
        if self.quota is not None:
            self.quota.close()


# ---------------------------------------------------------------- the engines


def child_main(mode: str, spec_path: Path, result_path: Path) -> int:
    """In a process of its own: "ids" writes the traffic's prompt token ids, "run" times our engine."""
    spec = json.loads(spec_path.read_text())
    from specserve import LLM, SamplingParams

    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        adaptive_threads=spec.get("adaptive_threads", True),
    )
    if mode == "ids":
        from chat_traffic import build_traffic

        traffic = build_traffic(spec["requests"], spec["max_tokens"])
        ids = [llm.engine.encode_chat(r.messages) for r in traffic]
        result_path.write_text(json.dumps({"prompt_token_ids": ids}))
        return 0
    prompts = spec["prompt_token_ids"]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    import torch

    team = llm.engine._team
    tuner = {"chosen": team.chosen, "trials": team.trials} if team is not None else None
    result_path.write_text(
        json.dumps(
            {"seconds": seconds, "output_tokens": tokens, "threads": torch.get_num_threads(), "tuner": tuner}
        )
    )
    return 0


def run_child(mode: str, spec: dict, beside: Beside | None = None, timeout: float = 3600.0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            mode,
            str(spec_path),
            str(result_path),
        ]
        prefix = beside.prefix if beside else []
        subprocess.run(
            [*prefix, *cmd], check=True, timeout=timeout, preexec_fn=beside.preexec if beside else None
        )
        return json.loads(result_path.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=256, help="per request, EOS ignored")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in flight (both engines)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--model", help="default: the demo model (vLLM reads its exported HF directory)")
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated, of {', '.join(LEGS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument(
        "--adaptive-threads",
        default="on",
        choices=("on", "off"),
        help="specserve's team size by trial (the engine's adaptive_threads); off: the budget's team",
    )
    p.add_argument("--quota", type=float, default=1.5, help="CPU cores the quota leg allows")
    p.add_argument("--vllm-python", help="vLLM's interpreter (default: $SPECSERVE_VLLM_PYTHON or the venv)")
    p.add_argument("--vllm-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND ('' for vLLM's default)")
    p.add_argument("--target-dir", type=Path, default=DEFAULT_OUT / "target-hf", help="vLLM's model dir")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--smoke", action="store_true", help="4 requests of 8 tokens: the plumbing, not a figure")
    p.add_argument("--child", nargs=3, metavar=("MODE", "SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.max_tokens = 4, 8
    for name, allowed in (("legs", LEGS), ("engines", ENGINES)):
        chosen = [x for x in getattr(args, name).split(",") if x]
        if not chosen or any(x not in allowed for x in chosen):
            p.error(f"--{name}: choose from {', '.join(allowed)}")
        setattr(args, name, chosen)
    if args.quota <= 0:
        p.error("--quota: must be a positive number of cores")
    return args


def run_leg(engine: str, leg: str, args: argparse.Namespace, spec: dict, vllm: Path | None) -> dict:
    with Beside(leg, args.quota) as beside:
        if beside.skip_reason:
            return {"skipped": f"no CPU quota could be set here ({beside.skip_reason})"}
        if engine == "specserve":
            r = run_child("run", spec, beside)
        else:
            if vllm is None:
                return {"skipped": "no vLLM interpreter (--vllm-python, $SPECSERVE_VLLM_PYTHON)"}
            workload = Workload(
                "chat",
                [Request("", spec["max_tokens"], ids) for ids in spec["prompt_token_ids"]],
            )
            peer = run_vllm(
                vllm,
                ensure_target_dir(args.target_dir),
                workload,
                args.out_dir,
                f"contention-{leg}",
                dtype=args.dtype,
                max_num_seqs=args.max_num_seqs,
                bind=args.vllm_bind,
                wrap=beside.prefix,
                preexec_fn=beside.preexec,
            )
            r = {"seconds": peer.runs[0]["seconds"], "output_tokens": peer.runs[0]["output_tokens"]}
        if beside.quota is not None:
            r["quota"] = beside.quota.how
    r["tok_s"] = r["output_tokens"] / r["seconds"]
    r["load"] = os.getloadavg()[0]
    return r


def ratio(a: dict, b: dict) -> float | None:
    return a["tok_s"] / b["tok_s"] if "tok_s" in a and "tok_s" in b else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child[0], Path(args.child[1]), Path(args.child[2]))
    vllm = vllm_python(args.vllm_python) if "vllm" in args.engines else None
    spec = {
        "model": args.model,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "adaptive_threads": args.adaptive_threads == "on",
    }
    spec["prompt_token_ids"] = run_child("ids", spec)["prompt_token_ids"]
    print(
        f"CPU: {cpu_line()}, {os.cpu_count()} CPUs | {args.dtype} | {args.requests} chat requests x"
        f" {args.max_tokens} tokens, {args.max_num_seqs} in flight | load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, dict[str, dict]] = {e: {} for e in args.engines}
    for leg in args.legs:
        for engine in args.engines:
            r = run_leg(engine, leg, args, spec, vllm)
            results[engine][leg] = r
            shown = r.get("skipped") or f"{r['tok_s']:7.1f} tok/s ({r['seconds']:.1f} s)"
            if "threads" in r:
                shown += f", {r['threads']} threads"
            if r.get("tuner"):
                shown += f" (team by trial: {r['tuner']['trials']} trials)"
            print(f"  {leg:<6} {engine:<10} {shown}", flush=True)
    ratios: dict[str, float | None] = {}
    for engine, legs in results.items():
        for leg in ("busy", "quota"):
            if leg in legs and "quiet" in legs:
                ratios[f"{engine} {leg}/quiet"] = ratio(legs[leg], legs["quiet"])
    if len(results) == 2:
        for leg in args.legs:
            ratios[f"specserve/vLLM {leg}"] = ratio(results["specserve"][leg], results["vllm"][leg])
    for name, value in ratios.items():
        print(f"  {name:<28} {'n/a' if value is None else f'{value:.2f}x'}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"contention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    payload = {"cpu": cpu_line(), "spec": {k: v for k, v in spec.items() if k != "prompt_token_ids"}}
    payload.update(results=results, ratios=ratios, smoke=args.smoke)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
