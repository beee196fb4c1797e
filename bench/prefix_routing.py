"""Prefix-aware claiming with two workers on one machine: routing on vs off.

Two `specserve worker` processes (one core each) share an embedded valkey-server. Chat requests over a few
long system prompts (~6k characters of CPython docs each, ~1.5k tokens) arrive in waves through the queue
client. Each worker's KV cache is sized to hold about half the system prompts: without routing both workers
see every prompt and evict each other's, with routing each prompt settles on one worker. Runs off, on, on,
off (a fresh pair of workers and a cold cache each time; the machine is noisy) and reports output tok/s,
mean time to first token (enqueue to first token, seen by the client), the share of prompt tokens served
from cache and how the requests split between the workers.

    python bench/prefix_routing.py [--systems 6] [--waves 5] [--wave-size 8] [--max-tokens 16]
        [--dtype auto] [--kv-cache-bytes N] [--wait-ms N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pydoc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DOC_MODULES, QUESTIONS, cpu_line, on_off_ratios, run_line  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.queue.client import QueueClient  # noqa: E402
from specserve.queue.connection import connect  # noqa: E402
from specserve.queue.embedded import EmbeddedValkey  # noqa: E402
from specserve.queue.keys import Keys  # noqa: E402

WORKERS = ("w0", "w1")


def systems(n: int, chars: int) -> list[str]:
    out = []
    for name in DOC_MODULES[:n]:
        doc = pydoc.render_doc(__import__(name), renderer=pydoc.plaintext)
        out.append("You answer questions about this documentation:\n\n" + doc[:chars])
    return out


def start_workers(url: str, prefix: str, args: argparse.Namespace, routing: bool, logs: Path) -> list:
    procs = []
    for cpu, name in enumerate(WORKERS):
        cmd = [
            sys.executable, "-m", "specserve.service.cli", "worker", "--redis-url", url, "--prefix", prefix,
            "--worker-name", name, "--health-port", "0", "--dtype", args.dtype,
            "--kv-cache-bytes", str(args.kv_cache_bytes),
            "--prefix-routing" if routing else "--no-prefix-routing",
        ]  # fmt: skip
        if args.model:
            cmd += ["--model", args.model]
        if args.wait_ms is not None:
            cmd += ["--prefix-routing-wait-ms", str(args.wait_ms)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(logs / f"{prefix}-{name}.log", "wb")
        pin = ["taskset", "-c", str(cpu % (os.cpu_count() or 1))]
        procs.append(subprocess.Popen(pin + cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


async def wait_ready(client: QueueClient, keys: Keys, procs: list) -> None:
    while True:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a worker exited ({p.returncode}); see its log")
        try:
            consumers = await client.r.xinfo_consumers(keys.requests, keys.group)
        except Exception:
            consumers = []
        if {c["name"] for c in consumers} >= set(WORKERS):
            return
        await asyncio.sleep(0.2)


async def one(client: QueueClient, body: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    rid = (await client.enqueue(body)).id
    ttft = None
    async for delta in client.stream(rid):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft, rid


async def run(url: str, label: str, routing: bool, args: argparse.Namespace, texts: list[str], logs: Path):
    prefix = f"route-{label}"
    keys = Keys(prefix)
    client = QueueClient(connect(url), keys)
    await client.ensure_group()
    procs = start_workers(url, prefix, args, routing, logs)
    try:
        await wait_ready(client, keys, procs)
        await asyncio.sleep(1.0)  # loads published, pass streams read
        ttfts, ids = [], []
        start = time.perf_counter()
        for w in range(args.waves):
            bodies = []
            for i in range(args.wave_size):
                system = texts[(w * args.wave_size + i) % len(texts)]
                question = QUESTIONS[(w + i) % len(QUESTIONS)]
                messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                bodies.append(
                    {
                        "messages": messages,
                        "max_tokens": args.max_tokens,
                        "temperature": 0.0,
                        "ignore_eos": True,
                    }
                )
            for ttft, rid in await asyncio.gather(*(one(client, b) for b in bodies)):
                ttfts.append(ttft)
                ids.append(rid)
        seconds = time.perf_counter() - start
        infos = [await client.info(i) for i in ids]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        await client.aclose()
    tokens = sum(int(i["completion_tokens"]) for i in infos)
    prompt = sum(int(i["prompt_tokens"]) for i in infos)
    cached = sum(int(i.get("cached_tokens", 0)) for i in infos)
    split = collections.Counter(i["worker"] for i in infos)
    return {
        "tok_s": tokens / seconds,
        "seconds": seconds,
        "mean_ttft_s": statistics.fmean(ttfts),
        "cached_share": cached / prompt,
        "split": "/".join(str(split[w]) for w in WORKERS),
        "passed": sum(1 for i in infos if i.get("passed")),
        "taken_back": sum(1 for i in infos if i.get("passed") and i["worker"] != i["passed"]),
    }


async def main_async(args: argparse.Namespace) -> None:
    texts = systems(args.systems, args.system_chars)
    n = args.waves * args.wave_size
    print(
        f"CPU: {cpu_line()} | {args.dtype} | 2 workers x 1 core, KV cache {args.kv_cache_bytes / 1e6:.0f} MB "
        f"each | {n} requests in {args.waves} waves over {args.systems} system prompts of "
        f"{args.system_chars} characters, {args.max_tokens} output tokens each | "
        f"load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedValkey(Path(tmp) / "valkey") as server:
        for i, name in enumerate(("off", "on", "on", "off")):
            r = await run(server.url, f"{i}-{name}", name == "on", args, texts, Path(tmp))
            results[name].append(r)
            extra = f", split {r['split']}, passed {r['passed']} (taken back {r['taken_back']})"
            print(run_line(f"routing {name:<3}", r, extra), flush=True)
    tok_ratio, ttft_ratio = on_off_ratios(results)
    print(f"routing on/off: {tok_ratio:.2f}x tok/s, mean TTFT {ttft_ratio:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model")
    p.add_argument("--systems", type=int, default=6)
    p.add_argument("--system-chars", type=int, default=6000)
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--wave-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--wait-ms", type=int, help="how long a passed request waits (default: the worker's)")
    # SmolLM2-135M keeps 30 layers x 3 KV heads x 64 x 2 values a token: 23 kB in bf16, 46 kB in fp32. The
    # default holds about four 1.5k-token system prompts in bf16 (of the default six); pass twice it in fp32.
    p.add_argument("--kv-cache-bytes", type=int, default=150_000_000)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
