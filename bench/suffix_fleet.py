"""Does the fleet-wide suffix tree pay? Two workers, templated traffic, repeats first seen by the other.

Pipelines send the same kinds of request again and again, and the answers take a fixed shape the prompt does
not spell out (a record rendered as JSON in the house style, a status report in its usual sections). Suffix
decoding copies from earlier outputs (spec/suffix.py); with one tree per worker, a worker copies only from
what it answered itself, and with the fleet-wide tree (service/suffix_fleet.py) from what any worker
answered. Here worker A answers the first request of each template and worker B its repeats (other slot
values, the same shape): B drafts them from A's outputs only if the outputs cross over through Redis.

Both workers are engines of their own with `--speculative-method suffix`, on one embedded valkey, each with
its feed (reading and sending as the worker runs them); requests go to an engine directly (the queue's
routing cannot pin a request to a worker). A repeat is sent once A's output has reached B's tree or after
--wait-s, whichever first, as a repeat that comes later would be. Two runs, fleet then per-worker, then the
same again in reverse (the machine is noisy); each on fresh engines. Greedy: both runs give the same tokens.

The step side's cost is measured apart (`micro`): a proposal for a batch of sequences against the fleet
tree empty, holding N outputs, and while the builder inserts (its lock then mostly busy, so a proposal
skips it). It runs twice: as the worker runs, and with Python's cyclic garbage collector off: trees of one
object a node had a collection that a proposal's (or the builder's) allocations set off walk them all, on
the step's thread; the trees are flat now (spec/suffix.py), and the two runs should price the same.

    python bench/suffix_fleet.py [--templates 6] [--repeats 3] [--max-tokens 96] [--k 4] [--model M]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_OUT, cpu_line  # noqa: E402

NAMES = ("Ada", "Grace", "Linus", "Guido", "Barbara", "Ken", "Margaret", "Dennis", "Frances", "John")
CITIES = ("Paris", "Oslo", "Lisbon", "Kyoto", "Austin", "Nairobi", "Lima", "Perth")
SERVICES = ("billing", "search", "login", "checkout", "uploads", "mail")
# Each template's request names a task, never the answer's layout: the model settles on one, and its repeats
# follow it.
TEMPLATES = (
    lambda r: f"Turn this record into JSON: {r.choice(NAMES)}, {r.randint(20, 70)}, {r.choice(CITIES)}.",
    lambda r: f"Write today's status report for the {r.choice(SERVICES)} service: {r.randint(1, 9)} alerts.",
    lambda r: f"Summarise the order of {r.choice(NAMES)}: {r.randint(1, 5)} items to {r.choice(CITIES)}.",
    lambda r: f"Draft the on-call handover note for {r.choice(SERVICES)}, owner {r.choice(NAMES)}.",
    lambda r: f"List the steps to rotate the keys of the {r.choice(SERVICES)} service.",
    lambda r: f"Write a changelog entry: {r.choice(SERVICES)} now supports {r.choice(CITIES)} region.",
)


@dataclass
class Request:
    template: int
    first: bool  # the template's first request (worker A), else a repeat (worker B)
    prompt: str


def build_traffic(templates: int, repeats: int, seed: int = 0) -> list[Request]:
    """Per template: its first request, then `repeats` repeats; templates one after another."""
    rng = random.Random(seed)
    out = []
    for t in range(templates):
        make = TEMPLATES[t % len(TEMPLATES)]
        out.append(Request(t, True, make(rng)))
        out.extend(Request(t, False, make(rng)) for _ in range(repeats))
    return out


@dataclass
class Served:
    seconds: float
    tokens: list[int]
    proposed: int
    accepted: int


@dataclass
class Run:
    system: str  # "fleet" or "per-worker"
    served: list[tuple[Request, Served]]
    fed: int  # outputs B's tree took from A

    def part(self, first: bool) -> dict[str, Any]:
        rows = [s for r, s in self.served if r.first == first]
        seconds = sum(s.seconds for s in rows)
        tokens = sum(len(s.tokens) for s in rows)
        proposed = sum(s.proposed for s in rows)
        accepted = sum(s.accepted for s in rows)
        return {
            "requests": len(rows),
            "output_tokens": tokens,
            "seconds": round(seconds, 3),
            "tok_s": round(tokens / seconds, 2) if seconds else None,
            "acceptance": round(accepted / proposed, 3) if proposed else None,
            "proposed": proposed,
            "accepted": accepted,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "fed": self.fed,
            "a_first": self.part(True),
            "b_repeats": self.part(False),
        }


class FleetWorker:
    """An engine and, with the fleet on, its feed's reader and sender on this loop (as a worker runs them)."""

    def __init__(self, name: str, args: argparse.Namespace, url: str, fleet: bool) -> None:
        self.name, self.args, self.url, self.fleet_on = name, args, url, fleet
        self.feed: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = False

    async def start(self) -> None:
        from specserve.engine.async_engine import AsyncLLMEngine
        from specserve.engine.config import EngineConfig
        from specserve.engine.llm_engine import LLMEngine
        from specserve.queue.connection import Connections, open_redis
        from specserve.queue.keys import Keys
        from specserve.service.suffix_fleet import SuffixFleet

        spec = {"method": "suffix", "num_speculative_tokens": self.args.k}
        config = EngineConfig(model=self.args.model, dtype=self.args.dtype, speculative_config=spec)
        self.engine = AsyncLLMEngine(await asyncio.to_thread(LLMEngine, config))
        await self.engine.start()
        self.redis = await open_redis(self.url)
        self.conns = Connections(self.redis)
        tree = self.engine.fleet_tree() if self.fleet_on else None
        if tree is not None:
            key = Keys(f"bench-{os.getpid()}").suffix_outputs(self.engine.model_name)
            self.feed = SuffixFleet(self.conns, key, self.name, tree, self.engine.vocab_size, block_ms=500)
            self._tasks = [
                asyncio.create_task(self.feed.run_reader(lambda: self._stop)),
                asyncio.create_task(self.feed.run_sender(lambda: self._stop)),
            ]

    async def serve(self, rid: str, prompt: str) -> Served:
        from specserve import SamplingParams

        ids = self.engine.encode_chat([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=self.args.max_tokens, temperature=0.0, speculation=self.args.k)
        t0 = time.perf_counter()
        deltas = [d async for d in self.engine.add_request(rid, ids, params, stream=False)]
        seconds = time.perf_counter() - t0
        last = deltas[-1]
        usage = last.usage
        return Served(seconds, list(last.token_ids), usage.draft_proposed, usage.draft_accepted)

    async def close(self) -> None:
        self._stop = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self.feed is not None:
            self.feed.tree.close()
        await self.engine.shutdown()
        await self.conns.aclose(close_redis=True)


async def run_once(system: str, traffic: list[Request], args: argparse.Namespace, url: str) -> Run:
    fleet = system == "fleet"
    a, b = FleetWorker("a", args, url, fleet), FleetWorker("b", args, url, fleet)
    await a.start()
    await b.start()
    served: list[tuple[Request, Served]] = []
    try:
        for i, r in enumerate(traffic):
            if not r.first and b.feed is not None:
                deadline = time.monotonic() + args.wait_s
                while time.monotonic() < deadline and (
                    b.feed.counters.received < a.feed.counters.sent or b.feed.tree.pending
                ):
                    await asyncio.sleep(0.01)
            worker = a if r.first else b
            served.append((r, await worker.serve(f"{system}-{i}", r.prompt)))
        fed = b.feed.counters.received if b.feed is not None else 0
    finally:
        await a.close()
        await b.close()
    return Run(system, served, fed)


def micro(batch: int, outputs: int, length: int, rounds: int, forward_s: float) -> dict[str, Any]:
    """Seconds per proposal for `batch` sequences: no fleet tree, the fleet tree empty, holding `outputs`
    outputs, and while the builder inserts more (a forward of `forward_s` between proposals, which holds no
    GIL); and what share() of a finished output costs the step."""
    from specserve import SamplingParams
    from specserve.engine.async_engine import SWITCH_INTERVAL_S
    from specserve.engine.sequence import Sequence
    from specserve.spec.suffix import SuffixProposer

    rng = random.Random(0)
    texts = [[rng.randrange(2000) for _ in range(length)] for _ in range(outputs)]

    def seqs() -> list[tuple[Sequence, int]]:
        out = []
        for i in range(batch):
            s = Sequence(i, f"r{i}", texts[i % outputs][: length // 2], SamplingParams(), None, 0.0)
            out.append((s, 4))
        return out

    def timed(proposer: SuffixProposer, requests: list[tuple[Sequence, int]]) -> float:
        proposer.propose(requests)  # builds the sequences' own trees: not a step's cost
        spent = 0.0
        for j in range(rounds):
            for s, _ in requests:  # a token per step, as decoding appends
                s.token_ids.append(texts[(s.seq_id + j) % outputs][len(s.token_ids) % length])
            t0 = time.perf_counter()
            proposer.propose(requests)
            spent += time.perf_counter() - t0
            time.sleep(forward_s)  # the target's forward, torch's, without the GIL
        return spent / rounds

    # What the imports left is collected and old, as in a worker long past its start: else its full
    # collection (~100 ms here) lands in whichever case comes first.
    gc.collect()
    # as the worker runs the engine (engine/async_engine.py): the builder's thread gives the GIL back soon
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    result: dict[str, Any] = {"batch": batch, "outputs": outputs, "output_tokens": length, "rounds": rounds}
    result["forward_ms"] = forward_s * 1000
    proposer = SuffixProposer(4)
    result["no_fleet_tree_s"] = timed(proposer, seqs())
    fleet = proposer.fleet_tree()
    assert fleet is not None
    result["fleet_tree_empty_s"] = timed(proposer, seqs())
    for i, t in enumerate(texts):
        fleet.offer(("w", i), t)
    while fleet.pending:
        time.sleep(0.01)
    result["fleet_tree_full_s"] = timed(proposer, seqs())
    for i, t in enumerate(texts):
        fleet.offer(("w2", i), t[::-1])
    before = fleet.num_built
    result["while_building_s"] = timed(proposer, seqs())
    result["built_meanwhile"] = fleet.num_built - before
    t0 = time.perf_counter()
    for t in texts:
        fleet.share(t)
    result["share_s"] = (time.perf_counter() - t0) / outputs
    fleet.close()
    return {k: (round(v * 1e6, 1) if k.endswith("_s") else v) for k, v in result.items()} | {"unit": "us"}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from specserve.queue.embedded import EmbeddedValkey

    traffic = build_traffic(args.templates, args.repeats)
    runs: dict[str, list[Run]] = {"fleet": [], "per-worker": []}
    with tempfile.TemporaryDirectory() as tmp:
        valkey = EmbeddedValkey(Path(tmp) / "valkey", appendonly=False).start()
        try:
            for system in ("fleet", "per-worker", "per-worker", "fleet")[: 2 * args.pairs]:
                run = await run_once(system, traffic, args, valkey.url)
                runs[system].append(run)
                s = run.summary()
                print(
                    f"  {system}: B repeats {s['b_repeats']['tok_s']} tok/s, acceptance "
                    f"{s['b_repeats']['acceptance']} (A first {s['a_first']['tok_s']} tok/s), fed {run.fed}",
                    flush=True,
                )
                gc.collect()
        finally:
            valkey.stop()
    ratios = [
        f.part(False)["tok_s"] / p.part(False)["tok_s"]
        for f, p in zip(runs["fleet"], runs["per-worker"])
        if f.part(False)["tok_s"] and p.part(False)["tok_s"]
    ]
    outputs = [[s.tokens for _, s in r.served] for rs in runs.values() for r in rs]
    return {
        "fleet_over_per_worker_tok_s": [round(x, 3) for x in ratios],
        "greedy_outputs_identical": all(o == outputs[0] for o in outputs),
        "runs": [r.summary() for rs in runs.values() for r in rs],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--templates", type=int, default=6, help="templates (each: a first request, then repeats)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of each template (worker B)")
    p.add_argument("--max-tokens", type=int, default=96, help="per request; EOS may end it sooner")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--wait-s", type=float, default=2.0, help="longest wait for A's output to reach B")
    p.add_argument("--pairs", type=int, default=2, choices=(1, 2), help="fleet/per-worker pairs of runs")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--model", help="default: the demo model")
    p.add_argument("--micro-batch", type=int, default=32, help="sequences per proposal in the micro part")
    p.add_argument("--micro-outputs", type=int, default=200, help="outputs in the fleet tree (micro)")
    p.add_argument("--micro-rounds", type=int, default=50, help="proposals timed per case (micro)")
    p.add_argument("--micro-forward-ms", type=float, default=20.0, help="a forward between proposals")
    p.add_argument("--skip-serving", action="store_true", help="the micro part alone")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu_line()} | {args.dtype} | k={args.k} | load {load0:.1f}", flush=True)
    payload: dict[str, Any] = {
        "cpu": cpu_line(),
        "dtype": args.dtype,
        "k": args.k,
        "templates": args.templates,
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
    }
    forward_s = args.micro_forward_ms / 1000
    sizes = (args.micro_batch, args.micro_outputs, 128, args.micro_rounds, forward_s)
    payload["micro"] = micro(*sizes)
    print(f"step side (us per proposal of {args.micro_batch} sequences): {payload['micro']}", flush=True)
    gc.disable()
    try:
        payload["micro_no_gc"] = micro(*sizes)
    finally:
        gc.enable()
    print(f"the same, the cyclic collector off: {payload['micro_no_gc']}", flush=True)
    if not args.skip_serving:
        payload |= asyncio.run(main_async(args))
        print(f"fleet / per-worker tok/s on B's repeats: {payload['fleet_over_per_worker_tok_s']}")
        print(f"greedy outputs identical: {payload['greedy_outputs_identical']}")
    load1 = os.getloadavg()[0]
    payload["load"] = [load0, load1]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"suffix-fleet-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {path}")
    return 0 if payload.get("greedy_outputs_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
