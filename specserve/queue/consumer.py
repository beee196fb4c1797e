"""The worker's side of the request stream: read with the group, claim, heartbeat, reclaim, hand back, trim.

Knows Redis and the wire format only; the service decides what to run.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from specserve.queue import ready, scripts
from specserve.queue.connection import BLOCK_MS, TRANSIENT_ERRORS, Connections
from specserve.queue.keys import DEFAULT_TTL_MS, Keys
from specserve.queue.resp import as_bytes, fields_dict
from specserve.queue.tenants import TenantCounters
from specserve.queue.wire import RequestEntry

log = logging.getLogger(__name__)


def entry_ms(entry_id: str) -> int:
    """Stream ids start with the server's ms clock at XADD time: the enqueue time."""
    return int(entry_id.split("-", 1)[0])


async def ensure_group(redis: Redis, keys: Keys) -> None:
    """Create the workers' consumer group (and the request stream) unless it exists.

    Workers call it before reading; producers (QueueClient, the API) too, so the group and its lag exist
    while no worker runs: a KEDA redis-streams trigger reads that lag to scale workers up from zero.
    """
    # From id 0: requests added before any worker existed are served too.
    try:
        await redis.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


class ClaimVerdict(enum.Enum):
    """The CLAIM script's answer for an entry just read (scripts.CLAIM)."""

    RUN = "run"  # ours to run now
    DUPLICATE = "duplicate"  # another entry of the same id is the request: acknowledge this one
    DONE = "done"  # the request already ended: acknowledge
    CANCEL = "cancel"  # cancelled while queued: end it cancelled
    EXPIRE = "expire"  # its deadline passed before it started: end it expired
    DEAD = "dead"  # delivered too often without finishing: dead-letter it
    NOTMINE = "notmine"  # another worker took it meanwhile: leave it


@dataclass(frozen=True)
class Claim:
    verdict: ClaimVerdict
    now_ms: int  # the server's clock
    run: int = 0  # RUN: the run number (1 for a first run, more for a rerun); 0 otherwise
    deliveries: int = 0  # DEAD: how often the entry was delivered
    status: str | None = None  # DUPLICATE, DONE: the request's status (None: it has none)
    counted: str = ""  # the tenant whose queued requests it left ('' none, or it had left them already)

    @classmethod
    def of_reply(cls, reply: list[str]) -> Claim:
        verdict, detail, now_ms = ClaimVerdict(reply[0]), str(reply[1]), int(reply[2])
        counted = str(reply[3]) if len(reply) > 3 else ""
        if verdict is ClaimVerdict.RUN:
            return cls(verdict, now_ms, run=int(detail), counted=counted)
        if verdict is ClaimVerdict.DEAD:
            return cls(verdict, now_ms, deliveries=int(detail), counted=counted)
        if verdict in (ClaimVerdict.DUPLICATE, ClaimVerdict.DONE):
            return cls(verdict, now_ms, status=detail or None, counted=counted)
        return cls(verdict, now_ms, counted=counted)

    @property
    def detail(self) -> str:
        """The CLAIM script's second value as it answers it: the run number, the delivery count or the
        status, by verdict ('' for the others)."""
        if self.verdict is ClaimVerdict.RUN:
            return str(self.run)
        if self.verdict is ClaimVerdict.DEAD:
            return str(self.deliveries)
        return self.status or ""


@dataclass
class QueueStats:
    depth: int  # requests waiting for a worker: never delivered, or sorted into the ready queue
    pending: int  # held by workers, not yet acknowledged
    lag_seconds: float  # age of the oldest waiting request
    consumers: int  # workers (the ready queue's pseudo-consumer not counted)
    # (band, tenant) -> requests waiting in the ready queue ('' for no tenant)
    waiting: dict[tuple[int, str], int] = field(default_factory=dict)

    @classmethod
    def combine(cls, shards: list[QueueStats]) -> QueueStats:
        """The fleet's queue from each shard's: every worker reads every shard, so the workers are the most
        any shard counts, not their sum."""
        waiting: dict[tuple[int, str], int] = {}
        for s in shards:
            for k, v in s.waiting.items():
                waiting[k] = waiting.get(k, 0) + v
        return cls(
            sum(s.depth for s in shards),
            sum(s.pending for s in shards),
            max((s.lag_seconds for s in shards), default=0.0),
            max((s.consumers for s in shards), default=0),
            waiting,
        )


@dataclass
class ConsumerConfig:
    ttl_ms: int = DEFAULT_TTL_MS  # lifetime of everything per request
    max_deliveries: int = 3  # beyond this, the dead-letter stream
    claim_timeout_ms: int = 30_000  # an in-flight entry idle this long belongs to a dead worker
    block_ms: int = BLOCK_MS
    dead_maxlen: int = 100_000
    dead_ttl_ms: int = 7 * 24 * 3600 * 1000  # dead letters older than this are trimmed as new ones arrive
    dead_body_chars: int = 65_536  # a dead letter keeps this much of the body, for a look, not a replay


class StreamConsumer:
    """Reads, claims and cancellation checks (each request's own round trips) go through the lean clients
    of `conns` (its blocking read through one of its own); the rest through redis-py."""

    def __init__(
        self, conns: Connections, keys: Keys, name: str, config: ConsumerConfig | None = None
    ) -> None:
        self.r = conns.redis
        self.keys = keys
        self.name = name
        self.cfg = config or ConsumerConfig()
        self._fast = conns.fast
        self._blocking = conns.blocking(self.cfg.block_ms)
        # Tenant counters in slots of their own (a sharded cluster): CLAIM cannot release them in-script.
        self.tenants = TenantCounters(self.r, keys, self.cfg.ttl_ms) if keys.split_quota else None

    async def ensure_group(self) -> None:
        await ensure_group(self.r, self.keys)

    async def read_new(self, count: int, wait: bool = True) -> list[RequestEntry]:
        """Up to `count` entries never delivered before; with `wait`, blocks up to block_ms when there are
        none."""
        block = ("BLOCK", self.cfg.block_ms) if wait else ()
        client = self._blocking if wait else self._fast
        try:
            resp = await client.execute(
                "XREADGROUP", "GROUP", self.keys.group, self.name, "COUNT", count, *block,
                "STREAMS", self.keys.requests, ">",
            )  # fmt: skip
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # The server lost the group (restart without persistence, flushed): recreate and read again.
            log.warning("consumer group missing; recreating it")
            await self.ensure_group()
            return []
        items = [item for _, stream_items in resp or [] for item in stream_items]
        return [RequestEntry.from_fields(eid, fields_dict(fields)) for eid, fields in items]

    async def reclaim(self, count: int) -> list[RequestEntry]:
        """Take over up to `count` entries idle past the claim timeout (dead worker, or handed back), never
        those waiting in the ready queue (queue/ready.py RECLAIM).

        Through the binary-safe client: one entry with bytes that are not UTF-8 failed redis-py's whole
        reply, every time, so nothing behind it was ever reclaimed."""
        try:
            items = await self._fast.execute(
                "EVAL", ready.RECLAIM, 1, self.keys.requests, self.keys.group, self.name,
                self.cfg.claim_timeout_ms, count,
            )  # fmt: skip
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()
            return []
        return [RequestEntry.from_fields(eid, fields_dict(f)) for eid, f in items if f is not None]

    async def pending_mine(self, count: int = 10_000) -> list[RequestEntry]:
        """Entries delivered to this consumer and not yet acknowledged, with their fields."""
        pending = await self._fast.execute(
            "XPENDING", self.keys.requests, self.keys.group, "-", "+", count, self.name
        )
        if not pending:
            return []
        found = await self._fast.pipeline(
            [("XRANGE", self.keys.requests, p[0], p[0]) for p in pending], raise_on_error=False
        )
        entries = []
        for p, items in zip(pending, found):
            fields = fields_dict(items[0][1]) if isinstance(items, list) and items else {}
            entries.append(RequestEntry.from_fields(p[0], fields))
        return entries

    async def entries(self, entry_ids: list[str]) -> list[RequestEntry]:
        """The entries with these ids that are still in the stream, with their fields."""
        found = await self._fast.pipeline(
            [("XRANGE", self.keys.requests, i, i) for i in entry_ids], raise_on_error=False
        )
        return [
            RequestEntry.from_fields(items[0][0], fields_dict(items[0][1]))
            for items in found
            if isinstance(items, list) and items
        ]

    async def claim(self, entries: list[tuple[RequestEntry, float | None]]) -> list[Claim | Exception]:
        """Run CLAIM for each (entry, deadline) in one round trip. Entries must carry a request id, and
        deadlines must be bounded (wire.parse_body does it). An entry whose script fails (its status key
        holds something else, say) gets its error back in its place; its batch-mates are claimed as usual.
        A lost connection raises, for the caller to retry the whole batch."""
        commands = []
        for e, deadline in entries:
            assert e.request_id is not None
            commands.append(
                (
                    "EVAL",
                    scripts.CLAIM,
                    2,
                    self.keys.req(e.request_id),
                    self.keys.requests,
                    e.entry_id,
                    self.keys.group,
                    self.name,
                    self.cfg.ttl_ms,
                    self.cfg.max_deliveries,
                    "" if deadline is None else str(int(deadline * 1000)),
                    entry_ms(e.entry_id),
                    self.keys.quota,
                    e.request_id,
                )
            )
        replies = await self._fast.pipeline(commands, raise_on_error=False)
        for r in replies:
            if isinstance(r, TRANSIENT_ERRORS):  # the server's state, not the entry's: retry the batch
                raise r
        claims = [r if isinstance(r, Exception) else Claim.of_reply(r) for r in replies]
        if self.tenants is not None:
            await self.tenants.forget(
                [
                    (c.counted, e.request_id)
                    for c, (e, _) in zip(claims, entries)
                    if isinstance(c, Claim) and c.counted
                ]
            )
        return claims

    async def heartbeat(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of our in-flight entries; returns those another worker has taken."""
        if not entry_ids:
            return []
        lost = await self.r.eval(
            scripts.HEARTBEAT, 1, self.keys.requests, self.keys.group, self.name, *entry_ids
        )
        return list(lost)

    async def handback(self, request_id: str, entry_id: str) -> bool:
        idle = self.cfg.claim_timeout_ms * 2
        ok = await self.r.eval(
            scripts.HANDBACK,
            2,
            self.keys.requests,
            self.keys.req(request_id),
            self.keys.group,
            self.name,
            entry_id,
            idle,
            self.keys.quota,
            request_id,
        )
        return bool(ok)

    async def cancel_flags(self, request_ids: list[str]) -> list[bool]:
        if not request_ids:
            return []
        keys = [self.keys.req(rid) for rid in request_ids]
        asked = {int(i) for i in await self._fast.execute("EVAL", scripts.CANCELLED, len(keys), *keys)}
        return [i + 1 in asked for i in range(len(request_ids))]

    async def ack(self, entry_id: str) -> None:
        await self.r.xack(self.keys.requests, self.keys.group, entry_id)

    async def ack_mine(self, entry_id: str) -> bool:
        """Acknowledge an entry if this consumer still owns it."""
        ok = await self._fast.execute(
            "EVAL", scripts.ACK_MINE, 1, self.keys.requests, self.keys.group, self.name, entry_id
        )
        return bool(ok)

    async def dead_letter(self, entry: RequestEntry, reason: str, deliveries: int = 0) -> None:
        """Record an entry in the dead-letter stream; acknowledge it when it has no usable id (otherwise
        its final status, written by the caller, acknowledges it).

        The body is written back byte for byte (bytes that are not UTF-8 included), cut at dead_body_chars;
        the stream is capped and its old letters trimmed, so a flood of bad entries cannot fill Redis."""
        body = entry.raw_body
        if len(body) > self.cfg.dead_body_chars:
            body = body[: self.cfg.dead_body_chars]
            reason += f" (body cut to {self.cfg.dead_body_chars} of {len(entry.raw_body)} characters)"
        oldest = max(0, int(time.time() * 1000) - self.cfg.dead_ttl_ms)
        commands: list[tuple[str | bytes | int, ...]] = [
            ("MULTI",),
            (
                "XADD", self.keys.dead, "MAXLEN", self.cfg.dead_maxlen, "*",
                "entry", entry.entry_id, "id", entry.request_id or "", "body", as_bytes(body),
                "reason", reason, "deliveries", deliveries, "worker", self.name,
            ),
            ("XTRIM", self.keys.dead, "MINID", oldest),  # exact: dead letters are rare
            ("PEXPIRE", self.keys.dead, self.cfg.dead_ttl_ms),
        ]  # fmt: skip
        if entry.request_id is None:
            commands.append(("XACK", self.keys.requests, self.keys.group, entry.entry_id))
        commands.append(("EXEC",))
        replies = await self._fast.pipeline(commands, raise_on_error=False)
        if isinstance(replies[-1], Exception):
            raise replies[-1]

    async def trim(self) -> int:
        """Drop request entries no group still needs (never pending ones)."""
        return int(await self.r.eval(scripts.TRIM, 1, self.keys.requests))

    async def stats(self) -> QueueStats:
        pipe = self.r.pipeline(transaction=False)
        pipe.xinfo_groups(self.keys.requests)
        pipe.xinfo_consumers(self.keys.requests, self.keys.group)
        try:
            groups, consumers = await pipe.execute()
        except ResponseError:  # no stream (or no group) yet
            return QueueStats(0, 0, 0.0, 0)
        # the server's clock, from the master holding the stream: a cluster's pipeline takes no TIME
        sec, usec = (int(x) for x in await self._fast.execute("TIME"))
        g = next((g for g in groups if g["name"] == self.keys.group), None)
        if g is None:
            return QueueStats(0, 0, 0.0, 0)
        ready_held = [int(c["pending"]) for c in consumers if c["name"] == scripts.READY_CONSUMER]
        undelivered = int(g.get("lag") or 0)
        waiting_ms = []
        if undelivered:
            # binary-safe: the oldest undelivered entry may be one that is not UTF-8
            first = await self._fast.execute(
                "XRANGE", self.keys.requests, f"({g['last-delivered-id']}", "+", "COUNT", 1
            )
            if first:
                waiting_ms.append(entry_ms(first[0][0]))
        waiting: dict[tuple[int, str], int] = {}
        if ready_held:
            waiting = await ready.waiting_by_band(self._fast, self.keys)
            if (oldest := await ready.oldest_ms(self._fast, self.keys)) is not None:
                waiting_ms.append(oldest)
        held = sum(ready_held)
        lag = max(0.0, sec + usec / 1e6 - min(waiting_ms) / 1000) if waiting_ms else 0.0
        workers = len(consumers) - len(ready_held)
        return QueueStats(undelivered + held, int(g["pending"]) - held, lag, workers, waiting)

    async def register_models(self, names: Sequence[str], info: dict, ttl_s: float) -> None:
        """Advertise the served model under each of its names so APIs can list and check it (GET
        /v1/models) for the next `ttl_s` seconds; a worker that stops refreshing it stops vouching for it."""
        info = {**info, "worker": self.name, "seen": time.time(), "ttl_s": ttl_s}
        value = orjson.dumps(info).decode()
        await self.r.hset(self.keys.models, mapping=dict.fromkeys(names, value))
