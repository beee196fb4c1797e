"""Does one costly request stall its neighbours? A short request's latency alone, then beside each of the red
team's attacks, through `specserve serve` (embedded Redis, one worker) over HTTP.

Attacks (at --scale 1.0, the red team's sizes; a smaller scale shrinks each for a smoke run):
- choice:        structured_outputs.choice of 20,000 strings
- regex:         structured_outputs.regex [a-z]{1,60000}
- tools:         1,500 tools with tool_choice "required" (chat)
- bad_words:     256 long bad_words
- logprobs:      n = 16, logprobs 20, prompt_logprobs 20 on a 2,000-character prompt
- logprobs_max:  the most of that served (max_total_logprobs, 100 by default): n = 5
Each attack may be refused (a 400 naming its field is a good outcome: it cost nobody anything) or run; what is
measured is the short request's median latency while the attack is in flight, over --repeats requests, as a
ratio to its median alone. Target: every ratio within 1.5x.

    python bench/stall.py [--model DIR] [--scale 1.0] [--repeats 5] [--short-tokens 8] [--port 8391]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from common import cpu_line
from service import Service

TARGET = 1.5


def attacks(scale: float, model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (route, body), each sized by `scale` (1.0: the red team's)."""

    def n(full: int) -> int:
        return max(1, int(full * scale))

    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
            },
        }
        for i in range(n(1500))
    ]
    chat = {"model": model, "messages": [{"role": "user", "content": "Pick a tool."}], "max_tokens": 8}
    base = {"model": model, "prompt": "Say something.", "max_tokens": 8}
    return {
        "choice": (
            "completions",
            {**base, "structured_outputs": {"choice": [f"c{i}" for i in range(n(20000))]}},
        ),
        "regex": ("completions", {**base, "structured_outputs": {"regex": f"[a-z]{{1,{n(60000)}}}"}}),
        "tools": ("chat/completions", {**chat, "tools": tools, "tool_choice": "required"}),
        "bad_words": ("completions", {**base, "bad_words": [f"word{i} " * n(40) for i in range(n(256))]}),
        "logprobs": (
            "completions",
            {**base, "prompt": "x " * n(1000), "n": 16, "logprobs": 20, "prompt_logprobs": 20},
        ),
        "logprobs_max": (
            "completions",
            {**base, "prompt": "x " * n(1000), "n": 5, "logprobs": 20, "prompt_logprobs": 20},
        ),
    }


async def short(service: Service, tokens: int) -> float:
    return (await service.one("The quick brown fox", tokens))[0]


async def warm_grammar(service: Service) -> None:
    body = {"model": service.model, "prompt": "Yes or no?", "max_tokens": 2}
    body["structured_outputs"] = {"choice": ["yes", "no"]}
    async with service.http.post(f"{service.base}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def beside(
    service: Service, route: str, body: dict[str, Any], args: argparse.Namespace
) -> tuple[float, str]:
    """The short request's median latency while the attack runs, and how the attack ended."""

    async def attack() -> str:
        async with service.http.post(f"{service.base}/v1/{route}", json=body) as r:
            data = await r.json()
        param = data.get("error", {}).get("param") if isinstance(data, dict) else None
        return f"{r.status}" + (f" ({param})" if param else "")

    task = asyncio.ensure_future(attack())
    await asyncio.sleep(0.05)  # the attack is in the API or the worker
    latencies = [await short(service, args.short_tokens) for _ in range(args.repeats)]
    return statistics.median(latencies), await task


async def run(args: argparse.Namespace) -> dict[str, Any]:
    service = Service(args)
    try:
        await service.start()  # inside the try: a client that fails to start still stops the server
        for _ in range(2):  # warm: the first request loads lazy parts
            await short(service, args.short_tokens)
        # and the first constrained one starts the grammar children (their imports are once a process, not
        # an attack's cost)
        await warm_grammar(service)
        alone = statistics.median([await short(service, args.short_tokens) for _ in range(args.repeats)])
        out: dict[str, Any] = {"alone_s": alone, "attacks": {}}
        for name, (route, body) in attacks(args.scale, service.model).items():
            t0 = time.perf_counter()
            latency, ended = await beside(service, route, body, args)
            out["attacks"][name] = {
                "short_s": latency,
                "ratio": latency / alone,
                "attack": ended,
                "attack_wall_s": time.perf_counter() - t0,
            }
        return out
    finally:
        await service.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the demo model)")
    p.add_argument("--scale", type=float, default=1.0, help="attack sizes as a fraction of the red team's")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--short-tokens", type=int, default=8)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    args.max_tokens, args.kv_cache_bytes, args.max_num_seqs = args.short_tokens, None, None
    result = asyncio.run(run(args))
    print(cpu_line())
    print(f"short request alone: {result['alone_s'] * 1000:.0f} ms (median of {args.repeats})")
    for name, r in result["attacks"].items():
        verdict = "ok" if r["ratio"] <= TARGET else f"over {TARGET}x"
        print(
            f"{name:10s} beside: {r['short_s'] * 1000:6.0f} ms  {r['ratio']:.2f}x  {verdict:8s}"
            f"  attack answered {r['attack']} after {r['attack_wall_s']:.1f} s"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
