"""A queue many teams share: interactive latency while a Batch API job runs behind it, and the
batch's own throughput against the same requests sent plainly.

    python bench/shared_queue.py [--model PATH] [--dtype auto] [--batch-lines 500] [--interactive 24]

One real `specserve serve` (embedded valkey-server, one worker), driven from here with the official `openai`
client for files and batches and aiohttp for the interactive requests. Phases, on the same server:

1. idle: `--interactive` short chat requests, `--concurrency` at a time; latency p50 (and TTFT, streamed)
2. busy: a `--batch-lines` Batch API job is submitted (its lines run in band 10, behind interactive
   requests in band 0), and once its lines fill the worker the same interactive requests run again
   (A B A B: idle, busy, idle, busy, so a drift of the machine's speed favours neither); ratio busy/idle
3. throughput: the first 64 W1 rows as a batch alone, against the same 64 rows as plain concurrent
   completions (ABBA); ratio batch/plain.

Targets: interactive p50 latency with the batch behind it <= 1.25x idle; batch throughput >= 0.9x
plain. Every figure is printed with the CPU (lscpu model and flags).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from pathlib import Path

from common import REPO, cpu_line, load_workload
from service import Service

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colours.",
    "Give me a synonym for happy.",
    "What does CPU stand for?",
    "How many days are in a leap year?",
    "Say hello in Spanish.",
]


def batch_jsonl(rows: list[tuple[str, int]], chat: bool, model: str) -> bytes:
    lines = []
    for i, (prompt, max_tokens) in enumerate(rows):
        body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        url = "/v1/chat/completions" if chat else "/v1/completions"
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(lines) + "\n").encode()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.service = Service(args)

    async def start(self) -> None:
        import openai

        await self.service.start()
        self.model = self.service.model
        self.http = self.service.http
        self.client = openai.AsyncOpenAI(base_url=f"{self.service.base}/v1", api_key="none", max_retries=0)

    async def interactive_one(self, i: int) -> tuple[float, float, str]:
        """Latency, time to first token and request id of one streamed chat request."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
            "max_tokens": self.args.interactive_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        ttft = None
        rid = ""
        async with self.http.post(f"{self.service.base}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not rid and line.startswith(b"data: {"):
                    rid = json.loads(line[6:])["id"]
                if ttft is None and line.startswith(b"data: {") and b'"content":"' in line:
                    ttft = time.perf_counter() - t0
        return time.perf_counter() - t0, ttft or 0.0, rid

    async def queue_wait_ms(self, rid: str) -> float | None:
        """Enqueue (the entry id's time) to the worker's claim, server clock, 1 ms grain."""
        info = await self.service.redis.hmget(f"specserve:req:{rid}", ["created", "started"])
        return float(info[1]) - float(info[0]) if info[0] and info[1] else None

    async def interactive(self) -> dict[str, float]:
        sem = asyncio.Semaphore(self.args.concurrency)

        async def one(i: int) -> tuple[float, float, str]:
            async with sem:
                return await self.interactive_one(i)

        res = await asyncio.gather(*(one(i) for i in range(self.args.interactive)))
        waits = [w for w in [await self.queue_wait_ms(r[2]) for r in res] if w is not None]
        n = self.args.interactive_tokens
        # Where the latency goes: queue wait (enqueue to claim) is part of TTFT; the rest of the request is
        # its decode, one token per step after the first.
        return {
            "p50_ms": 1000 * statistics.median(r[0] for r in res),
            "ttft_p50_ms": 1000 * statistics.median(r[1] for r in res),
            "queue_wait_p50_ms": statistics.median(waits) if waits else -1.0,
            "tpot_p50_ms": 1000 * statistics.median((r[0] - r[1]) / max(1, n - 1) for r in res),
        }

    async def submit_batch(self, rows: list[tuple[str, int]], chat: bool) -> str:
        f = await self.client.files.create(
            file=("batch.jsonl", io.BytesIO(batch_jsonl(rows, chat, self.model))), purpose="batch"
        )
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        b = await self.client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
        return b.id

    async def wait_batch(self, batch_id: str, poll_s: float = 0.25):
        while True:
            b = await self.client.batches.retrieve(batch_id)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                return b
            await asyncio.sleep(poll_s)

    async def running(self) -> int:
        async with self.http.get(f"{self.service.base}/metrics") as r:
            text = await r.text()
        for line in text.splitlines():
            if line.startswith("specserve:num_requests_running"):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    async def latency_phase(self) -> dict:
        rounds: dict[str, list[dict[str, float]]] = {"idle": [], "busy": []}
        lines = [
            (QUESTIONS[i % len(QUESTIONS)] + f" [batch {i}]", self.args.batch_tokens)
            for i in range(self.args.batch_lines)
        ]
        await self.interactive()  # warm-up
        for r in range(self.args.rounds):
            rounds["idle"].append(await self.interactive())
            batch_id = await self.submit_batch(lines, chat=True)
            deadline = time.monotonic() + 120
            while await self.running() < self.args.busy_min_running and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            rounds["busy"].append(await self.interactive())
            await self.client.batches.cancel(batch_id)
            b = await self.wait_batch(batch_id)
            print(
                f"round {r}: idle {rounds['idle'][-1]}, busy {rounds['busy'][-1]}; batch {b.status} "
                f"{b.request_counts}",
                flush=True,
            )
        pairs = [b["p50_ms"] / i["p50_ms"] for i, b in zip(rounds["idle"], rounds["busy"])]
        return {"rounds": rounds, "busy_over_idle_p50": statistics.median(pairs)}

    async def plain(self, rows: list[tuple[str, int]]) -> float:
        async def one(prompt: str, max_tokens: int) -> int:
            body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens}
            body.update(temperature=0, ignore_eos=True)
            async with self.http.post(f"{self.service.base}/v1/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                return data["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p, m) for p, m in rows)))
        return tokens / (time.perf_counter() - t0)

    async def as_batch(self, rows: list[tuple[str, int]]) -> float:
        t0 = time.perf_counter()
        b = await self.wait_batch(await self.submit_batch(rows, chat=False), poll_s=0.1)
        wall = time.perf_counter() - t0
        assert b.status == "completed" and b.request_counts.failed == 0, b
        return sum(m for _, m in rows) / wall

    async def throughput_phase(self) -> dict:
        workload = load_workload(Path(self.args.workload) if self.args.workload else None, 64)
        rows = [(r.prompt, r.max_tokens) for r in workload.requests]
        runs: dict[str, list[float]] = {"plain": [], "batch": []}
        for r in range(self.args.throughput_rounds):
            order = [("plain", self.plain), ("batch", self.as_batch)]
            for name, run in order if r % 2 == 0 else order[::-1]:
                runs[name].append(await run(rows))
                print(f"throughput round {r} {name}: {runs[name][-1]:.1f} tok/s", flush=True)
        pairs = [b / p for p, b in zip(runs["plain"], runs["batch"])]
        return {"workload": workload.name, "tok_s": runs, "batch_over_plain": statistics.median(pairs)}

    async def run(self) -> dict:
        await self.start()
        try:
            out: dict = {"cpu": cpu_line(), "args": vars(self.args)}
            if self.args.rounds:
                out["latency"] = await self.latency_phase()
            if self.args.throughput_rounds:
                out["throughput"] = await self.throughput_phase()
            return out
        finally:
            await self.client.close()
            await self.service.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or GGUF (default: the demo SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=32, help="(the service helper's default)")
    p.add_argument("--interactive", type=int, default=24, help="interactive requests per measurement")
    p.add_argument("--interactive-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2, help="interactive requests in flight at once")
    p.add_argument("--batch-lines", type=int, default=500)
    p.add_argument("--batch-tokens", type=int, default=64, help="max_tokens of each background batch line")
    p.add_argument("--busy-min-running", type=int, default=16, help="wait for this many running first")
    p.add_argument("--rounds", type=int, default=2, help="idle/busy pairs (0: skip)")
    p.add_argument("--throughput-rounds", type=int, default=2, help="plain/batch pairs, ABBA (0: skip)")
    p.add_argument("--workload", default=None, help="JSONL of {prompt, max_tokens} rows (default: W1)")
    p.add_argument("--port", type=int, default=8797)
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "shared_queue.json"))
    args = p.parse_args()
    from specserve.service.cli import run_loop

    result = run_loop(Bench(args).run())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(result["cpu"])
    if "latency" in result:
        r = result["latency"]["busy_over_idle_p50"]
        print(f"interactive p50, {args.batch_lines}-line batch behind it / idle: {r:.2f}x (target <= 1.25)")
    if "throughput" in result:
        r = result["throughput"]["batch_over_plain"]
        print(f"batch throughput / plain, {result['throughput']['workload']}: {r:.2f}x (target >= 0.9)")


if __name__ == "__main__":
    main()
