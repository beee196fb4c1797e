"""The same workload through the engine directly and through the whole service
(HTTP API -> Redis -> worker -> Redis -> HTTP client): throughput ratio and the latency the service adds.

    python bench/service.py [--model PATH] [--dtype auto] [--requests 32] [--max-tokens 32] [--rounds 6]

The engine runs in this process; the service is a real `specserve serve` subprocess (embedded valkey-server)
driven over HTTP (POST /v1/completions) from here. Both are loaded side by side and the runs alternate, so a
busy machine slows both alike; medians are reported. Targets:
- throughput ratio >= 0.95: service tok/s over engine tok/s, the median over back-to-back pairs of runs, for
  bursts of short concurrent requests and for the benchmark workload (W1, 64 requests at once);
- added latency p50 < 5 ms: single requests one at a time, back to back; the client's latency minus the time
  the worker's engine spent on the request (`engine_ms` in its status hash). Pairs of single requests,
  service and direct in ABBA order, give the plain difference against a direct run of the same prompt (on a
  shared machine it carries the run-to-run noise of a whole generation) and the added latency after each kind
  of run: after this process's engine ran, the service starts cold and adds ~1.5 ms more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from common import load_workload

REPO = Path(__file__).resolve().parent.parent


def prompts(n: int, salt: str = "") -> list[str]:
    topics = [
        "the sea",
        "a city at night",
        "mountains",
        "an old library",
        "the first snow",
        "a train journey",
    ]
    return [f"Write a short paragraph about {topics[i % len(topics)]} ({salt}{i})." for i in range(n)]


class Direct:
    """The engine in this process, used the way the worker uses it."""

    def __init__(self, args: argparse.Namespace) -> None:
        from specserve.engine.async_engine import AsyncLLMEngine

        kw = {"model": args.model, "dtype": args.dtype}
        if args.kv_cache_bytes:
            kw["kv_cache_bytes"] = args.kv_cache_bytes
        if args.max_num_seqs:
            kw["max_num_seqs"] = args.max_num_seqs
        self.engine = AsyncLLMEngine.from_args(**kw)
        self.max_tokens = args.max_tokens
        self.n = 0

    async def one(self, prompt: str, max_tokens: int | None = None) -> tuple[float, int]:
        from specserve import SamplingParams

        self.n += 1
        params = SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        tokens = 0
        async for d in self.engine.add_request(f"direct-{self.n}", prompt, params):
            tokens += len(d.token_ids)
        return time.perf_counter() - t0, tokens


class Service:
    """`specserve serve` in a subprocess, over HTTP."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.data = tempfile.mkdtemp(prefix="specserve-bench-")
        self.base = f"http://127.0.0.1:{args.port}"
        self.max_tokens = args.max_tokens
        env = {
            **os.environ,
            "REDIS_URL": "",
            "SPECSERVE_PORT": str(args.port),
            "SPECSERVE_DATA_DIR": self.data,
            "SPECSERVE_DTYPE": args.dtype,
        }
        if args.kv_cache_bytes:
            env["SPECSERVE_KV_CACHE_BYTES"] = str(args.kv_cache_bytes)
        if args.model:
            env["SPECSERVE_MODEL"] = args.model
        if args.max_num_seqs:
            env["SPECSERVE_MAX_NUM_SEQS"] = str(args.max_num_seqs)
        cmd = [sys.executable, "-m", "specserve.service.cli", "--log-level", "WARNING", "serve"]
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO)

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))
        while True:
            try:
                async with self.http.get(f"{self.base}/readyz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit("specserve serve exited")
            await asyncio.sleep(0.2)
        async with self.http.get(f"{self.base}/v1/models") as r:
            self.model = (await r.json())["data"][0]["id"]
        from specserve.queue.connection import connect

        self.redis = connect(Path(self.data, "url").read_text().strip())

    async def one(self, prompt: str, max_tokens: int | None = None) -> tuple[float, int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens or self.max_tokens}
        body["temperature"] = 0
        body["ignore_eos"] = True
        t0 = time.perf_counter()
        async with self.http.post(f"{self.base}/v1/completions", json=body) as r:
            data = await r.json()
        elapsed = time.perf_counter() - t0
        assert r.status == 200, data
        self.last_id = data["id"]
        return elapsed, data["usage"]["completion_tokens"]

    async def timestamps(self, request_id: str) -> dict[str, float]:
        info = await self.redis.hgetall(f"specserve:req:{request_id}")
        return {k: float(info[k]) for k in ("created", "started", "finished", "engine_ms")}

    async def stop(self) -> None:
        await self.http.close()
        await self.redis.aclose()
        self.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(self.proc.wait, 60)


async def burst(runner, ps: list[str], max_tokens: list[int] | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*(runner.one(p, m) for p, m in zip(ps, max_tokens or [None] * len(ps))))
    wall = time.perf_counter() - t0
    return {"tok_s": sum(r[1] for r in res) / wall, "p50_ms": 1000 * statistics.median(r[0] for r in res)}


async def bench(args: argparse.Namespace) -> dict:
    service = Service(args)  # loads while the engine below loads
    direct = Direct(args)
    await direct.engine.start()
    await service.start()
    await direct.one("warm up")
    await service.one("warm up")

    rounds: dict[str, list[dict[str, float]]] = {"engine": [], "service": []}
    for r in range(args.rounds):
        order = [("engine", direct), ("service", service)]
        for name, runner in order if r % 2 == 0 else order[::-1]:
            rounds[name].append(await burst(runner, prompts(args.requests, f"{name}{r}-")))

    # The benchmark workload (W1: 64 requests of skewed lengths) in one go, alternating.
    workload = load_workload(Path(args.workload) if args.workload else None, None)
    w_prompts = [r.prompt for r in workload.requests]
    w_tokens = [r.max_tokens for r in workload.requests]
    w_rounds: dict[str, list[dict[str, float]]] = {"engine": [], "service": []}
    for r in range(args.workload_rounds):
        order = [("engine", direct), ("service", service)]
        for name, runner in order if r % 2 == 0 else order[::-1]:
            w_rounds[name].append(await burst(runner, w_prompts, w_tokens))

    # Added latency: single service requests back to back. Each follows the previous one's generation on the
    # service's own engine, as requests do in a deployment; no other process's engine runs in between.
    added, outside_worker, queue_wait = [], [], []
    for p in prompts(args.sequential, "seq-"):
        s, _ = await service.one(p)
        ts = await service.timestamps(service.last_id)
        added.append(1000 * s - ts["engine_ms"])
        outside_worker.append(1000 * s - (ts["finished"] - ts["started"]))
        queue_wait.append(ts["started"] - ts["created"])

    # Paired against the engine directly, ABBA so that a drift of the machine's speed favours neither side.
    paired, added_after_direct, added_after_service = [], [], []
    for i, p in enumerate(prompts(args.paired, "pair-")):
        if i % 2:
            s, _ = await service.one(p)
            d, _ = await direct.one(p)
        else:
            d, _ = await direct.one(p)
            s, _ = await service.one(p)
        ts = await service.timestamps(service.last_id)
        paired.append(1000 * (s - d))
        # After this process's engine ran, the service's loop and valkey start cold (a shared 2-core machine)
        (added_after_service if i % 2 else added_after_direct).append(1000 * s - ts["engine_ms"])

    await service.stop()
    await direct.engine.shutdown()

    def med(name: str, key: str) -> float | None:
        return statistics.median(x[key] for x in rounds[name]) if rounds[name] else None

    def ratio(of: dict) -> float | None:
        """Median over rounds of service/engine, each pair run back to back: the machine's speed drifts by
        more than the effect measured, and a pair shares the drift."""
        pairs = [s["tok_s"] / e["tok_s"] for e, s in zip(of["engine"], of["service"])]
        return statistics.median(pairs) if pairs else None

    return {
        "args": vars(args),
        "rounds": rounds,
        "engine_tok_s": med("engine", "tok_s"),
        "service_tok_s": med("service", "tok_s"),
        "throughput_ratio": ratio(rounds),
        "burst_p50_ms": {"engine": med("engine", "p50_ms"), "service": med("service", "p50_ms")},
        "workload": workload.name,
        "workload_rounds": w_rounds,
        "workload_throughput_ratio": ratio(w_rounds),
        # Client-measured latency minus the time the worker's engine spent on the request (engine_ms in the
        # status hash): HTTP, validation, enqueue, the worker's read and claim, result write and delivery.
        "added_latency_ms": {"p50": statistics.median(added), "all": [round(x, 2) for x in added]},
        # The same in the paired phase, by what ran just before: another request of the service, or this
        # process's direct engine (whose sweep of its weights leaves the service's caches cold).
        "added_latency_interleaved_ms": {
            "after_service_p50": _median(added_after_service),
            "after_direct_p50": _median(added_after_direct),
        },
        # Service minus direct for the same prompt, back to back. The same quantity plus whatever the service
        # slows the engine by, but a single request's time varies by tens of ms on a shared 2-core machine,
        # so its median carries that noise (spread: the interquartile range of the pairs).
        "paired_difference_ms": {
            "p50": _median(paired),
            "iqr": _iqr(paired),
            "all": [round(x, 2) for x in paired],
        },
        # Client-measured latency minus the worker's own start-to-final-write time (server clock, 1 ms grain):
        # HTTP, validation, enqueue, queue wait, result delivery.
        "outside_worker_ms_p50": statistics.median(outside_worker),
        "queue_wait_ms_p50": statistics.median(queue_wait),
    }


def _iqr(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="as `specserve serve` (auto: bf16 where the CPU has it)")
    p.add_argument("--requests", type=int, default=32, help="concurrent requests per burst")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6, help="bursts per mode, alternating (0: skip)")
    p.add_argument("--workload", default=None, help="JSONL of {prompt, max_tokens} rows (default: W1)")
    p.add_argument("--workload-rounds", type=int, default=4, help="whole-workload runs per mode (0: skip)")
    p.add_argument("--sequential", type=int, default=30, help="single service requests, back to back")
    p.add_argument("--paired", type=int, default=20, help="service/direct pairs of single requests (ABBA)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="default: the engine's (as served)")
    p.add_argument("--port", type=int, default=8799)
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "service.json"))
    args = p.parse_args()
    # The same event loop as `specserve serve` (uvloop where installed): both the direct engine and the HTTP
    # client run on it, so the client's own Python weighs on the measured latency as little as it can.
    from specserve.service.cli import run_loop

    result = run_loop(bench(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "workload_rounds")}, indent=2))

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    ratio, added = result["throughput_ratio"], result["added_latency_ms"]["p50"]
    if ratio is not None:
        print(f"throughput ratio, bursts of {args.requests}: {ratio:.3f} (>= 0.95: {verdict(ratio >= 0.95)})")
    w = result["workload_throughput_ratio"]
    if w is not None:
        print(f"throughput ratio, {result['workload']}: {w:.3f} (>= 0.95: {verdict(w >= 0.95)})")
    print(f"added latency p50 {added:.2f} ms, requests back to back (target < 5 ms: {verdict(added < 5)})")
    inter = result["added_latency_interleaved_ms"]
    if inter["after_direct_p50"] is not None:
        print(
            f"  interleaved with direct runs: {inter['after_service_p50']:.2f} ms after a service request, "
            f"{inter['after_direct_p50']:.2f} ms after a direct run"
        )


if __name__ == "__main__":
    main()
