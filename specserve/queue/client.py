"""The producer's and reader's side: enqueue, status, results, streaming, cancellation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from redis.asyncio import Redis

from specserve.queue import scripts
from specserve.queue.connection import Connections, NotReplicated, connect, server_keys
from specserve.queue.consumer import ensure_group
from specserve.queue.keys import DEFAULT_PREFIX, DEFAULT_TTL_MS, Keys, valid_request_id
from specserve.queue.outputs import OutputReader
from specserve.queue.resp import RespClient
from specserve.queue.tenants import Reservation, TenantCounters
from specserve.queue.wire import (
    Delta,
    OutputCursor,
    OutputEntry,
    RequestBody,
    Result,
    WireError,
    assemble,
    parse_body,
)


@dataclass
class Enqueued:
    id: str
    created: bool  # False: the id was already known and nothing was added
    status: str
    entry_id: str | None = None


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Limits:
    """Admission limits checked atomically as a request is enqueued (scripts.ENQUEUE); 0 turns one off."""

    max_backlog: int = 0  # requests waiting for any worker, all tenants together
    tenant_max_queued: int = 0  # requests one tenant may have waiting
    tenant_tokens_per_minute: int = 0  # tokens (max_tokens asked) one tenant may ask for per minute
    # What a raw XADD naming no tenant counts against (its per-tenant limits; "": none). "~" is a name no API
    # key's tenant can have, so by default such entries share one quota of their own.
    default_tenant: str = "~"


@dataclass(frozen=True)
class Durability:
    """How many replicas must hold an enqueue before it is accepted (WAIT), and for how long to wait for
    them; 0 replicas: accepted once the master has it (a failover may lose it)."""

    replicas: int = 0
    timeout_ms: int = 1000


FAILOVER_RETRIES = 8  # backoff 0.02 s doubling: 5.1 s in all


class ShardMismatch(ValueError):
    """This process was given another shard count than the fleet already on this Redis uses."""


async def agree_on_shards(redis: Any, keys: Keys) -> None:
    """Every worker and producer of a fleet must split requests over the same number of streams, or a request
    lands on a stream no worker reads (or a reader looks for it on the wrong shard). The first process to
    start records its count; any other count is refused."""
    await redis.hsetnx(keys.config, "queue_shards", keys.shards)
    theirs = await redis.hget(keys.config, "queue_shards")
    if theirs is not None and int(theirs) != keys.shards:
        raise ShardMismatch(
            f"SPECSERVE_QUEUE_SHARDS (--queue-shards) is {keys.shards} here, but the fleet on this Redis "
            f"uses {theirs} (recorded in {keys.config}): give every worker and producer the same value"
        )


def shard_limits(limits: Limits, keys: Keys) -> Limits:
    """The limits one shard's scripts check: the backlog cap is counted on each shard's own stream, so each
    holds its share of it (requests spread evenly over shards by id hash); tenant limits kept apart from the
    shards (`Keys.split_quota`, queue/tenants.py) are none of theirs."""
    if keys.split_quota:
        limits = replace(limits, tenant_max_queued=0, tenant_tokens_per_minute=0)
    if keys.shards <= 1 or not limits.max_backlog:
        return limits
    return replace(limits, max_backlog=-(-limits.max_backlog // keys.shards))


@dataclass
class _Lane:
    """One shard's side of a client: its names, its lean connections (on a cluster, to the master of its
    slot) and the reader of its output streams."""

    keys: Keys
    conns: Connections
    durable_conn: RespClient | None
    reader: OutputReader
    reader_task: asyncio.Task[None] | None = None
    # The workers' group is created once per client, not on every enqueue; should the server lose it later
    # (restart without persistence), the ENQUEUE script recreates it with the stream.
    group_ready: bool = False
    fast: RespClient = field(init=False)

    def __post_init__(self) -> None:
        self.fast = self.conns.fast


class QuotaExceeded(Exception):
    """A limit refused the request; nothing was added. `limit` names it; retry after `retry_after` s."""

    def __init__(self, limit: str, retry_after: int) -> None:
        super().__init__(f"{limit}: limit reached; retry after {retry_after} s")
        self.limit = limit
        self.retry_after = retry_after


class QueueClient:
    def __init__(
        self,
        redis: Redis,
        keys: Keys | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        limits: Limits | None = None,
        durable: Durability | None = None,
    ) -> None:
        self.r = redis
        self.keys = server_keys(redis, keys or Keys())
        self.ttl_ms = ttl_ms
        self.limits = limits or Limits()
        self.tenants = TenantCounters(redis, self.keys, ttl_ms) if self.keys.split_quota else None
        # The fleet's own keys (models, batches, the shard count); with one shard, its stream's slot too.
        self.conns = Connections(redis, route=self.keys.config)
        self.fast = self.conns.fast
        self.durable = durable or Durability()
        self._lanes = [self._lane(k) for k in self.keys.every_shard()]
        self._agreed = False

    def _lane(self, keys: Keys) -> _Lane:
        conns = self.conns if keys.base == self.keys.fleet_base else Connections(self.r, route=keys.requests)
        # WAIT holds its connection until the replicas answer: durable enqueues get one of their own, so the
        # readers' wake-ups never queue behind it. WAIT counts the writes of the connection it is sent on,
        # so each enqueue and its WAIT go out together on this one.
        durable = conns.blocking(self.durable.timeout_ms) if self.durable.replicas > 0 else None
        return _Lane(keys, conns, durable, OutputReader(conns, keys))

    def lane_of(self, request_id: str) -> _Lane:
        return self._lanes[self.keys.of_request(request_id).shard]

    def shards(self) -> list[tuple[Connections, Keys]]:
        """Each shard's connections and names, shard 0 first."""
        return [(lane.conns, lane.keys) for lane in self._lanes]

    def keys_of(self, request_id: str) -> Keys:
        """The names of the shard `request_id` belongs to."""
        return self.keys.of_request(request_id)

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, shards: int = 1, **kw: Any) -> QueueClient:
        return cls(connect(url), Keys(prefix, shards=shards), **kw)

    async def __aenter__(self) -> QueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @staticmethod
    def _ensure_reader(lane: _Lane) -> None:
        if lane.reader_task is None or lane.reader_task.done():
            name = f"specserve-output-reader-{lane.keys.shard}"
            lane.reader_task = asyncio.create_task(lane.reader.run(), name=name)

    async def ensure_group(self) -> None:
        """Create every shard's consumer group unless it exists, so its lag counts requests with no worker;
        refuses a shard count other than the fleet's (ShardMismatch)."""
        if not self._agreed:
            await agree_on_shards(self.r, self.keys)
            self._agreed = True
        for lane in self._lanes:
            await ensure_group(self.r, lane.keys)
            lane.group_ready = True

    async def aclose(self, close_redis: bool = True) -> None:
        for lane in self._lanes:
            if lane.reader_task is not None:
                await lane.reader.close(lane.reader_task)
                lane.reader_task = None
            if lane.conns is not self.conns:
                await lane.conns.aclose()
        await self.conns.aclose(close_redis)

    async def enqueue(
        self,
        body: dict[str, Any] | RequestBody,
        request_id: str | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
        tenant: str | None = None,
        tokens: int = 0,
    ) -> Enqueued:
        """Add a request; adding an id that is already known changes nothing (idempotent). `tenant` is
        recorded with it (the API's key owner, else the body's own `tenant`; see cancel), and the limits
        are checked for it, `tokens` being what it asks for (QuotaExceeded: nothing was added). The id is
        used as given: the API qualifies ids with their tenant itself (docs/wire-format.md, Tenants)."""
        (result,) = await self.enqueue_all([(body, request_id)], traceparent, tracestate, tenant, tokens)
        return result

    async def enqueue_all(
        self,
        requests: list[tuple[dict[str, Any] | RequestBody, str | None]],
        traceparent: str | None = None,
        tracestate: str | None = None,
        tenant: str | None = None,
        tokens: int = 0,
    ) -> list[Enqueued]:
        """Add requests of one tenant together, all or none: the limits are checked for all of them at once
        (`tokens` each), and QuotaExceeded means none will run (none was added, or with shards, those a shard
        had already taken are cancelled while still queued). Ids already known are left as they are."""
        ids: list[str] = []
        bodies: list[str] = []
        for body, request_id in requests:
            if request_id is None:
                request_id = new_request_id()
            elif not valid_request_id(request_id):
                raise WireError("id", "must be 1-200 characters of letters, digits, '_', '.', ':' or '-'")
            parsed = body if isinstance(body, RequestBody) else parse_body(body)
            tenant = tenant or parsed.tenant
            ids.append(request_id)
            bodies.append(parsed.to_json())
        if not self._agreed or not all(lane.group_ready for lane in self._lanes):
            await self.ensure_group()
        reservation = await self._reserve(tenant, ids, tokens)
        try:
            results = await self._enqueue_shards(ids, bodies, traceparent, tracestate, tenant, tokens)
        except QuotaExceeded:  # refused by a shard: nothing of it runs, so nothing of it counts
            if reservation is not None and self.tenants is not None:
                await self.tenants.release(reservation, reservation.ids, tokens * len(reservation.ids))
            raise
        if reservation is not None and self.tenants is not None:
            # Ids a shard already knew: counted before, or ended; either way not queued by this call.
            known = [r.id for r in results if not r.created and r.id in reservation.ids]
            await self.tenants.release(reservation, known, tokens * len(known))
        return results

    async def _reserve(self, tenant: str | None, ids: list[str], tokens: int) -> Reservation | None:
        """Where tenant counters live in a slot of their own, count the requests there first
        (queue/tenants.py); QuotaExceeded when a limit refuses them."""
        lim = self.limits
        if self.tenants is None or not tenant or not (lim.tenant_max_queued or lim.tenant_tokens_per_minute):
            return None
        got = await self.tenants.reserve(
            tenant, ids, tokens, lim.tenant_max_queued, lim.tenant_tokens_per_minute
        )
        if isinstance(got, tuple):
            raise QuotaExceeded(*got)
        return got

    async def _enqueue_shards(
        self,
        ids: list[str],
        bodies: list[str],
        traceparent: str | None,
        tracestate: str | None,
        tenant: str | None,
        tokens: int,
    ) -> list[Enqueued]:
        by_lane: dict[int, list[int]] = {}
        for i, request_id in enumerate(ids):
            by_lane.setdefault(self.keys.of_request(request_id).shard, []).append(i)
        results: list[Enqueued | None] = [None] * len(ids)
        for shard, positions in by_lane.items():
            try:
                got = await self._enqueue_on(
                    self._lanes[shard], [(ids[i], bodies[i]) for i in positions],
                    traceparent, tracestate, tenant, tokens,
                )  # fmt: skip
            except QuotaExceeded:
                # All or none: the choices another shard already took are cancelled before any runs.
                for done in results:
                    if done is not None and done.created:
                        await self.cancel(done.id)
                raise
            for i, result in zip(positions, got):
                results[i] = result
        return [r for r in results if r is not None]

    async def _enqueue_on(
        self,
        lane: _Lane,
        requests: list[tuple[str, str]],
        traceparent: str | None,
        tracestate: str | None,
        tenant: str | None,
        tokens: int,
    ) -> list[Enqueued]:
        keys, limits = lane.keys, shard_limits(self.limits, self.keys)
        command = (
            "EVAL",
            scripts.ENQUEUE,
            1 + len(requests),
            keys.requests,
            *(keys.req(i) for i, _ in requests),
            self.ttl_ms,
            traceparent or "",
            tracestate or "",
            keys.group,
            tenant or "",
            keys.quota,
            limits.max_backlog,
            limits.tenant_max_queued,
            limits.tenant_tokens_per_minute,
            tokens,
            *(x for pair in requests for x in pair),
        )
        if lane.durable_conn is None:
            # Idempotent by id, so a retry after a lost connection adds nothing twice. On a cluster the
            # retries span a failover (about 5 s of backoff: a replica takes over within the node timeout).
            reply = await lane.fast.execute(*command, retries=FAILOVER_RETRIES if keys.cluster else 2)
        else:
            reply = await self._enqueue_durably(lane.durable_conn, command)
        if reply and reply[0] == -1:
            _, limit, *rest = reply
            raise QuotaExceeded(str(limit), int(rest[0]) if rest else 1)
        return [
            Enqueued(i, True, "queued", detail) if created else Enqueued(i, False, detail)
            for (i, _), (created, detail) in zip(requests, reply)
        ]

    async def _enqueue_durably(self, conn: RespClient, command: tuple[str | int, ...]) -> list:
        """ENQUEUE, then WAIT for the replicas. Too few in time raises NotReplicated: the requests stay
        queued on the master (they run if it lives), and a retry with the same ids adds nothing and waits
        again, so a producer that retries until accepted gets each request exactly once."""
        d = self.durable
        retried: list[int] = []
        reply, acked = await conn.pipeline([command, ("WAIT", d.replicas, d.timeout_ms)], retried=retried)
        if retried:  # turned away first (a failover, a slot moving), the ENQUEUE ran after that WAIT
            acked = await conn.execute("WAIT", d.replicas, d.timeout_ms)
        if int(acked) < d.replicas:
            raise NotReplicated(
                f"{acked} of {d.replicas} replicas acknowledged the enqueue within {d.timeout_ms} ms"
            )
        return reply

    async def info(self, request_id: str) -> dict[str, str]:
        """The raw status hash ({} when unknown or expired)."""
        return await self.r.hgetall(self.keys_of(request_id).req(request_id))

    async def result(self, request_id: str) -> Result | None:
        keys = self.keys_of(request_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.req(request_id))
        pipe.xrange(keys.out(request_id))
        info, items = await pipe.execute()
        if not info and not items:
            return None
        return assemble(request_id, info, [OutputEntry.from_fields(f) for _, f in items])

    async def cancel(self, request_id: str, tenant: str | None = None) -> tuple[str, str]:
        """Returns (outcome, status): missing | terminal | cancelled (was queued) | cancelling (running).
        With `tenant`, another tenant's request is missing."""
        keys = self.keys_of(request_id)
        outcome, status, *counted = await self.r.eval(
            scripts.CANCEL,
            2,
            keys.req(request_id),
            keys.out(request_id),
            self.ttl_ms,
            tenant or "",
            keys.quota,
            request_id,
        )
        if self.tenants is not None and counted and counted[0]:
            await self.tenants.forget([(str(counted[0]), request_id)])
        return str(outcome), str(status)

    async def stream(self, request_id: str, tokens: int = 0, chars: int = 0) -> AsyncIterator[Delta]:
        """New tokens as they are produced, each once, reruns included; resumes after `tokens`/`chars`."""
        lane = self.lane_of(request_id)
        self._ensure_reader(lane)
        cursor = OutputCursor(tokens=tokens, chars=chars)
        async with aclosing(lane.reader.follow(request_id)) as entries:
            async for _, entry in entries:
                d = cursor.feed(entry)
                if d is not None:
                    yield d
                if cursor.done:
                    return

    async def wait(self, request_id: str) -> Result:
        """Wait for the final entry and return the whole result."""
        ids: list[int] = []
        parts: list[str] = []
        logprobs: list[dict[str, Any]] | None = None
        prompt_logprobs: list[dict[str, Any] | None] | None = None
        final: OutputEntry | None = None
        async with aclosing(self.stream(request_id)) as deltas:
            async for d in deltas:
                ids.extend(d.token_ids)
                parts.append(d.text)
                if d.logprobs is not None:
                    logprobs = (logprobs or []) + d.logprobs
                prompt_logprobs = prompt_logprobs or d.prompt_logprobs
                final = d.final or final
        assert final is not None
        return Result(
            id=request_id,
            status=final.status or "finished",
            text="".join(parts),
            token_ids=ids,
            finish_reason=final.finish_reason,
            usage=final.usage,
            error=final.error,
            error_field=final.error_field,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
