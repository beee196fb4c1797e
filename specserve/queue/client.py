"""The producer's and reader's side: enqueue, status, results, streaming, cancellation."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from specserve.queue import scripts
from specserve.queue.connection import Connections, NotReplicated, connect, server_keys
from specserve.queue.consumer import ensure_group
from specserve.queue.keys import DEFAULT_PREFIX, DEFAULT_TTL_MS, Keys, valid_request_id
from specserve.queue.outputs import OutputReader
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
        self.conns = Connections(redis, route=self.keys.requests)
        self.fast = self.conns.fast  # enqueue and the reader's wake-ups: a round trip each per request
        self.durable = durable or Durability()
        # WAIT holds its connection until the replicas answer: durable enqueues get one of their own, so the
        # readers' wake-ups never queue behind it. WAIT counts the writes of the connection it is sent on,
        # so each enqueue and its WAIT go out together on this one.
        self._durable_conn = (
            self.conns.blocking(self.durable.timeout_ms) if self.durable.replicas > 0 else None
        )
        self.reader = OutputReader(self.conns, self.keys)
        self._reader_task: asyncio.Task[None] | None = None
        # The workers' group is created once per client, not on every enqueue; should the server lose it
        # later (restart without persistence), the ENQUEUE script recreates it with the stream.
        self._group_ready = False

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, **kw: Any) -> QueueClient:
        return cls(connect(url), Keys(prefix), **kw)

    async def __aenter__(self) -> QueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _ensure_reader(self) -> None:
        if self._reader_task is None or self._reader_task.done():
            self._reader_task = asyncio.create_task(self.reader.run(), name="specserve-output-reader")

    async def ensure_group(self) -> None:
        """Create the workers' consumer group unless it exists, so its lag counts requests with no worker."""
        await ensure_group(self.r, self.keys)
        self._group_ready = True

    async def aclose(self, close_redis: bool = True) -> None:
        if self._reader_task is not None:
            await self.reader.close(self._reader_task)
            self._reader_task = None
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
        (`tokens` each), and QuotaExceeded means none was added. Ids already known are left as they are."""
        ids: list[str] = []
        args: list[str] = []
        for body, request_id in requests:
            if request_id is None:
                request_id = new_request_id()
            elif not valid_request_id(request_id):
                raise WireError("id", "must be 1-200 characters of letters, digits, '_', '.', ':' or '-'")
            parsed = body if isinstance(body, RequestBody) else parse_body(body)
            tenant = tenant or parsed.tenant
            ids.append(request_id)
            args += [request_id, parsed.to_json()]
        if not self._group_ready:
            await self.ensure_group()
        command = (
            "EVAL",
            scripts.ENQUEUE,
            1 + len(ids),
            self.keys.requests,
            *(self.keys.req(i) for i in ids),
            self.ttl_ms,
            traceparent or "",
            tracestate or "",
            self.keys.group,
            tenant or "",
            self.keys.quota,
            self.limits.max_backlog,
            self.limits.tenant_max_queued,
            self.limits.tenant_tokens_per_minute,
            tokens,
            *args,
        )
        if self._durable_conn is None:
            # idempotent by id, so a retry after a lost connection adds nothing twice
            reply = await self.fast.execute(*command, retries=2)
        else:
            reply = await self._enqueue_durably(command)
        if reply and reply[0] == -1:
            _, limit, *rest = reply
            raise QuotaExceeded(str(limit), int(rest[0]) if rest else 1)
        return [
            Enqueued(i, True, "queued", detail) if created else Enqueued(i, False, detail)
            for i, (created, detail) in zip(ids, reply)
        ]

    async def _enqueue_durably(self, command: tuple[str | int, ...]) -> list:
        """ENQUEUE, then WAIT for the replicas. Too few in time raises NotReplicated: the requests stay
        queued on the master (they run if it lives), and a retry with the same ids adds nothing and waits
        again, so a producer that retries until accepted gets each request exactly once."""
        assert self._durable_conn is not None
        d = self.durable
        reply, acked = await self._durable_conn.pipeline([command, ("WAIT", d.replicas, d.timeout_ms)])
        if int(acked) < d.replicas:
            raise NotReplicated(
                f"{acked} of {d.replicas} replicas acknowledged the enqueue within {d.timeout_ms} ms"
            )
        return reply

    async def info(self, request_id: str) -> dict[str, str]:
        """The raw status hash ({} when unknown or expired)."""
        return await self.r.hgetall(self.keys.req(request_id))

    async def result(self, request_id: str) -> Result | None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.keys.req(request_id))
        pipe.xrange(self.keys.out(request_id))
        info, items = await pipe.execute()
        if not info and not items:
            return None
        return assemble(request_id, info, [OutputEntry.from_fields(f) for _, f in items])

    async def cancel(self, request_id: str, tenant: str | None = None) -> tuple[str, str]:
        """Returns (outcome, status): missing | terminal | cancelled (was queued) | cancelling (running).
        With `tenant`, another tenant's request is missing."""
        outcome, status = await self.r.eval(
            scripts.CANCEL,
            2,
            self.keys.req(request_id),
            self.keys.out(request_id),
            self.ttl_ms,
            tenant or "",
            self.keys.quota,
            request_id,
        )
        return str(outcome), str(status)

    async def stream(self, request_id: str, tokens: int = 0, chars: int = 0) -> AsyncIterator[Delta]:
        """New tokens as they are produced, each once, reruns included; resumes after `tokens`/`chars`."""
        self._ensure_reader()
        cursor = OutputCursor(tokens=tokens, chars=chars)
        async with aclosing(self.reader.follow(request_id)) as entries:
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
