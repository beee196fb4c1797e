"""The worker: one asyncio loop between the request stream and the engine (its lifecycle and admission).

Sort what is new in the request stream into the ready queue (queue/ready.py: priority bands, fair share
between tenants, raw XADDs' limits), take only what the engine can admit now from it (work waits in Redis,
not here; with the engine's priority policy, a full worker also takes a request of a better band than the
worst it runs, for the engine to preempt), claim and start each request
(service/running.py runs it; service/outcome.py says how it ends), acknowledge after the final entry is
written, keep in-flight entries fresh so no other worker takes them, take over entries of dead workers,
and on SIGTERM drain: stop pulling, finish or hand back in-flight work within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import orjson
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.errors import InvalidParameter
from specserve.engine.prepare import PreparePool
from specserve.queue import outputs, wire
from specserve.queue.client import agree_on_shards, shard_limits
from specserve.queue.connection import TRANSIENT_ERRORS, Connections, retry_forever, server_keys
from specserve.queue.consumer import Claim, ClaimVerdict, QueueStats, StreamConsumer, entry_ms
from specserve.queue.keys import Keys
from specserve.queue.publisher import Publisher, Reply
from specserve.queue.ready import Admission, ReadyQueue
from specserve.queue.resp import as_bytes
from specserve.queue.routing import Router
from specserve.queue.wire import RequestBody, RequestEntry, WireError
from specserve.service.config import WorkerConfig
from specserve.service.outcome import Ending, Final, Outcome, finalize, reply_fields, unstarted
from specserve.service.routing import PrefixRouting
from specserve.service.running import (
    RequestState,
    Runner,
    ServerClock,
    Shown,
    Started,
    quick_to_prepare,
)
from specserve.service.suffix_fleet import SuffixFleet
from specserve.service.telemetry import Telemetry, access_line, access_log, cache_config_info

log = logging.getLogger(__name__)
FIRST = {"return_when": asyncio.FIRST_COMPLETED}

SORT_BATCH = 256  # most new entries read and sorted into the ready queue in one round
# With the priority policy, a full worker takes at most this many requests beyond its slots, each of a better
# band than the worst it runs: the engine preempts for them, and the rest wait in Redis as usual.
OVERBOOK = 4
# A full worker that may overbook waits for a new entry with XREAD BLOCK (no delivery: a wake-up only) for at
# most this long, and for a slot to free up meanwhile. It slept 0.25 s instead: a better-band arrival waited
# for the next round, 35-47 ms p50 queue wait in bench/shared_queue.py's busy phase against 4 ms idle.
ARRIVAL_WAIT_MS = 250
# Limits as a raw XADD's refusal names them (the API's 429 texts say "this API key").
REFUSED_TEXT = {
    "max_backlog": "the queue holds as many waiting requests as it may",
    "tenant_max_queued": "this tenant has as many requests waiting as it may",
    "tenant_tokens_per_minute": "this tenant has asked for as many tokens this minute as it may",
}


class Worker:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        redis: Any,
        keys: Keys,
        name: str,
        config: WorkerConfig | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.engine = engine
        self.r = redis
        self.keys = keys = server_keys(redis, keys)
        self.name = name
        self.cfg = config or WorkerConfig()
        self.telemetry = telemetry or Telemetry()
        ttl_ms = int(self.cfg.ttl_s * 1000)
        # claims, cancellation checks, outputs: the lean client
        self.conns = Connections(redis, route=keys.requests)
        self.consumer = StreamConsumer(
            self.conns,
            keys,
            name,
            self.cfg.consumer_config(),
        )
        self.publisher = Publisher(self.conns, keys, name, ttl_ms, self.cfg.reply_maxlen)
        # a raw XADD's backlog is counted on this shard's stream: it holds its share of the cap
        limits = shard_limits(self.cfg.limits, keys)
        self.ready_queue = ReadyQueue(self.conns.fast, keys, name, self.cfg.fair_share, limits, ttl_ms)
        self._ready_waiting = 0  # entries in the ready queue, as the last take saw it
        self.clock = ServerClock()
        self.runner = Runner(
            engine,
            self.publisher,
            self.telemetry,
            self.clock,
            keys,
            self.cfg.served_model_names,
            preparer=PreparePool(self.cfg.prepare_workers, self.cfg.prepare_timeout_s),
            max_logprobs=self.cfg.max_logprobs,
        )
        self.telemetry.engine.cache_config = cache_config_info(engine)
        self.routing: PrefixRouting | None = None
        if self.cfg.routing.enabled:
            block_ms = self.consumer.cfg.block_ms
            router = Router(
                self.conns.fast, self.conns.blocking(block_ms), block_ms, keys, name, self.cfg.routing
            )
            self.routing = PrefixRouting(self.consumer, router, self.cfg.routing, ttl_ms)
        self.suffix_fleet: SuffixFleet | None = None
        tree = engine.fleet_tree() if self.cfg.suffix_fleet else None
        if tree is not None:
            key = keys.suffix_outputs(engine.model_name)
            self.suffix_fleet = SuffixFleet(self.conns, key, name, tree, engine.vocab_size)
        self.inflight: dict[str, RequestState] = {}  # claimed here and not yet concluded
        self._admitting = 0  # entries read and not yet claimed
        # request id -> entry id of those whose claim is in flight: a failover to a replica that missed the
        # read delivers the same entries again while the first claim is still retried
        self._claiming: dict[str, str] = {}
        # The workers of the other shards this process serves over the same engine (ShardedWorker): room is
        # the engine's, so what each of them has taken counts against it.
        self.siblings: list[Worker] = [self]
        self._capacity = asyncio.Event()
        self._arrivals = self.conns.blocking(ARRIVAL_WAIT_MS)  # a full worker's wake-up on new entries
        self._arrival: asyncio.Task[None] | None = None
        self._pulling: list[asyncio.Task[None]] = []
        self._background: list[asyncio.Task[None]] = []
        self._detached: set[asyncio.Task[Any]] = set()  # acks, dead letters, aborted early starts
        self._handed_back: set[str] = set()  # entry ids: still pending here, but idle for others to take
        self.draining = False  # stop taking work
        self._closed = False  # stop everything
        self.redis_ok = False
        self.started = False

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        await retry_forever(self.consumer.ensure_group, what="XGROUP CREATE")
        await retry_forever(self._register, what="register model")
        self.redis_ok = True
        spawn = asyncio.create_task
        self._background = [
            spawn(self.publisher.run(), name="publisher"),
            spawn(self._every(self.cfg.heartbeat_s, self._heartbeat), name="heartbeat"),
            spawn(self._every(self.cfg.cancel_poll_s, self._poll_cancellations), name="cancel-poll"),
            spawn(self._every(self.cfg.trim_interval_s, self.consumer.trim), name="trim"),
            spawn(self._every(self.cfg.stats_interval_s, self._refresh_stats), name="stats"),
        ]
        self._pulling = [
            spawn(self._pull_loop(), name="pull"),
            spawn(self._every(self.cfg.reclaim_s, self._reclaim, pulling=True), name="reclaim"),
        ]
        if (fleet := self.suffix_fleet) is not None:
            self._background += [
                spawn(fleet.run_reader(lambda: self._closed), name="suffix-fleet-read"),
                spawn(fleet.run_sender(lambda: self._closed), name="suffix-fleet-send"),
            ]
        if self.routing is not None:
            self._pulling.append(
                spawn(self.routing.receive(self._admit_passed, lambda: self.draining), name="passes")
            )
            load_s = self.cfg.routing.load_every_ms / 1000
            self._background.append(spawn(self._every(load_s, self._publish_load), name="load"))
        self.started = True
        log.info("worker %s serving %s from %s", self.name, self.runner.names[0], self.keys.requests)

    @property
    def ready(self) -> bool:
        return self.started and self.redis_ok and not self.draining and self.engine.error is None

    async def drain(self, timeout: float) -> None:
        """Stop pulling; let in-flight requests finish for up to `timeout` s; hand the rest back."""
        self.draining = True
        await self._stop(self._pulling)
        deadline = time.monotonic() + timeout
        while (self.inflight or self._admitting) and time.monotonic() < deadline:
            self._capacity.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._capacity.wait(), timeout=0.05)
        for state in list(self.inflight.values()):
            self._end(state, Ending.HANDBACK)
        tasks = [s.task for s in self.inflight.values() if s.task is not None] + list(self._detached)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.publisher.wait_idle(), timeout=10)
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await self._hand_back_leftovers()

    async def close(self) -> None:
        self.draining = self._closed = True
        self.publisher.stop()
        self.runner.preparer.close()
        watch = [self._arrival] if self._arrival is not None else []
        await self._stop(self._pulling + self._background + list(self._detached) + watch)
        await self.conns.aclose()

    async def _stop(self, tasks: list[asyncio.Task[Any]]) -> None:
        # The loops also watch the flags: on Python 3.11 a cancel racing a Redis reply can be swallowed
        # (asyncio.wait_for inside redis-py), and then the flag ends them after their current call.
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.consumer.cfg.block_ms / 1000 + 2)

    async def _hand_back_leftovers(self) -> None:
        """Entries delivered to us that never started (a read cut short by the drain): release them now.
        One entry that cannot be handed back (no usable id, a broken key) is dead-lettered, never allowed to
        stop the drain."""
        pending = await self.consumer.pending_mine()
        for entry in pending:
            if entry.entry_id in self._handed_back:
                continue
            try:
                if entry.request_id is None:
                    await self.consumer.dead_letter(entry, "entry has no valid id")
                else:
                    await self.consumer.handback(entry.request_id, entry.entry_id)
            except TRANSIENT_ERRORS:
                raise
            except Exception as err:  # one entry's broken key (a script's error) must not stop the drain
                log.exception("entry %s could not be handed back", entry.entry_id)
                await self.consumer.dead_letter(entry, f"could not be handed back: {err}")
                await self.consumer.ack_mine(entry.entry_id)
        if not pending:  # deleting a consumer drops its pending entries: only when it has none
            await self.r.xgroup_delconsumer(self.keys.requests, self.keys.group, self.name)

    async def _every(self, period: float, fn, pulling: bool = False) -> None:
        while not (self.draining if pulling else self._closed):
            await asyncio.sleep(period)
            try:
                await fn()
                self.redis_ok = True
            except TRANSIENT_ERRORS as e:
                self.redis_ok = False
                log.debug("%s: redis unavailable (%s)", getattr(fn, "__name__", fn), e)
            except Exception:  # a failed round (an error reply, a bug) must not end the job: the next tries
                log.exception("%s failed", getattr(fn, "__name__", fn))

    def _detach(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    # ---- admission ------------------------------------------------------------------------------------

    def _room(self) -> int:
        return self.engine.free_capacity() - sum(w._admitting + w.runner.preparing for w in self.siblings)

    async def _pull_loop(self) -> None:
        while not self.draining:
            try:
                await self._pull()
                self.redis_ok = True
            except asyncio.CancelledError:
                raise
            except TRANSIENT_ERRORS as e:
                self.redis_ok = False
                log.debug("pulling: redis unavailable (%s)", e)
                await asyncio.sleep(0.5)
            except Exception:  # never let one bad reply stop the worker from pulling
                log.exception("pulling requests failed")
                await asyncio.sleep(0.5)

    async def _pull(self) -> None:
        """One round: sort in what is new, take what there is room for (best band first, fair between
        tenants), or block for new entries when the ready queue is empty."""
        room = self._room()
        better = self._overbook_band() if room <= 0 else None
        arrival = None
        if better is not None:
            # Watched from before this round's read, so an entry added at any point after it ends the wait.
            # A watch still running from an earlier round goes on (it started earlier still): cancelling it
            # would leave its XREAD blocking the connection in front of the next one.
            if self._arrival is None or self._arrival.done():
                self._arrival = asyncio.ensure_future(self._next_arrival())
            arrival = self._arrival
        await self._sort_new(wait=False)
        if room > 0 or better is not None:
            taken = await self.ready_queue.take(room if room > 0 else 1, better)
            self._ready_waiting = taken.waiting
            if taken.entries:
                for e in taken.entries:
                    band, tenant = self._band_of(e)
                    self.telemetry.admitted.add(
                        1, {"band": band, "tenant": self.telemetry.tenant_label(tenant)}
                    )
                await self._admit(taken.entries, fresh=True)
                return
        if room > 0 and not self._ready_waiting:
            await self._sort_new(wait=True)  # nothing waits: block until something arrives
            return
        self._capacity.clear()
        freed = asyncio.ensure_future(self._capacity.wait())
        try:
            await asyncio.wait([freed] if arrival is None else [freed, arrival], timeout=0.25, **FIRST)
        finally:
            freed.cancel()

    async def _next_arrival(self) -> None:
        """Return when an entry is added to the request stream (or after ARRIVAL_WAIT_MS). A plain XREAD, not
        the group's read: it delivers nothing, so a worker with room still gets the entry first."""
        try:
            await self._arrivals.execute(
                "XREAD", "COUNT", 1, "BLOCK", ARRIVAL_WAIT_MS, "STREAMS", self.keys.requests, "$"
            )
        except Exception as e:  # only a wake-up: the round after it reads, and reports, the same way
            log.debug("watching for arrivals: %s", e)
            await asyncio.sleep(ARRIVAL_WAIT_MS / 1000)

    def _band_of(self, e: RequestEntry) -> tuple[str, str]:
        """A taken entry's band and tenant, for the admitted counter (its body is decoded again to run)."""
        with contextlib.suppress(orjson.JSONDecodeError):
            data = orjson.loads(e.raw_body)
            return str(wire.priority_of(data)), wire.tenant_of(data) or ""
        return "0", ""

    def _overbook_band(self) -> int | None:
        """With the engine's priority policy: the worst band this worker runs, when a request of a better one
        may still be taken although every slot is full (the engine then preempts the worst for it)."""
        if not self.engine.by_priority or not self.inflight:
            return None
        taken = sum(len(w.inflight) + w._admitting for w in self.siblings)
        if taken >= self.engine.max_num_seqs + OVERBOOK:
            return None
        return max(s.body.priority for s in self.inflight.values())

    async def _sort_new(self, wait: bool) -> None:
        """Read new entries and sort them into the ready queue. An entry that cannot run (no id, a body that
        does not parse, a raw XADD over its tenant's limits) or that the ready queue does not take (a
        duplicate or finished id) is claimed and settled at once instead, as are entries whose sort failed."""
        count = min(SORT_BATCH, self.cfg.fair_share.sort_ahead - self._ready_waiting)
        if count <= 0:
            return
        entries = await self.consumer.read_new(count, wait=wait)
        if self.keys.shards > 1:
            entries = [e for e in entries if not await self._forwarded(e)]
        if not entries:
            return
        direct: list[RequestEntry] = []
        refusals: dict[str, WireError] = {}
        items: list[tuple[RequestEntry, RequestBody]] = []
        for e in entries:
            body = self._decode(e) if e.request_id is not None else None
            if isinstance(body, RequestBody):
                items.append((e, body))
            else:
                direct.append(e)
        for (e, body), verdict in zip(items, await self.ready_queue.sort_in(items) if items else []):
            if isinstance(verdict, Exception):
                log.warning("entry %s could not be sorted in (%s); running it now", e.entry_id, verdict)
                direct.append(e)
            elif verdict.verdict is Admission.READY:
                self._ready_waiting += 1
            elif verdict.verdict is Admission.REFUSED:
                limit = verdict.limit or ""
                self.telemetry.refused.add(
                    1, {"limit": limit, "tenant": self.telemetry.tenant_label(body.tenant)}
                )
                refusals[e.entry_id] = WireError(limit, REFUSED_TEXT.get(limit, "limit reached"))
                direct.append(e)
            elif verdict.verdict is Admission.DIRECT:
                direct.append(e)
            # NOTMINE: it moved on before this sort (a retry's); whoever holds it settles it
        if direct:
            await self._admit(direct, refusals=refusals)

    async def _forwarded(self, e: RequestEntry) -> bool:
        """A raw XADD to a shard its id does not hash to goes on to the one it does, where readers look for
        its status and output; then it is acknowledged here. A crash in between leaves it on both streams:
        the second to be claimed is a duplicate of the first (scripts.CLAIM), so it still runs once."""
        if e.request_id is None or (right := self.keys.of_request(e.request_id)).shard == self.keys.shard:
            return False
        fields = {"id": e.request_id, "body": as_bytes(e.raw_body)}
        for name, value in (("traceparent", e.traceparent), ("tracestate", e.tracestate)):
            if value is not None:
                fields[name] = value
        await self.r.xadd(right.requests, fields)
        await self.consumer.ack_mine(e.entry_id)
        log.info("entry %s (request %s) sent on to shard %d", e.entry_id, e.request_id, right.shard)
        return True

    async def _reclaim(self) -> None:
        n = self._room()
        if n > 0:
            entries = await self.consumer.reclaim(n)
            if entries:
                log.info("reclaimed %d idle entries", len(entries))
                await self._admit(entries)

    async def _taken_back(self, entries: list[RequestEntry]) -> None:
        """A request this worker passed on came back unclaimed: run it here, or hand it back if draining."""
        if not self.draining:
            await self._admit(entries)
            return
        for e in entries:
            if e.request_id is not None:
                await retry_forever(
                    lambda e=e: self.consumer.handback(e.request_id, e.entry_id), what="handback"
                )

    async def _admit_passed(self, entries: list[RequestEntry]) -> None:
        await self._admit(entries, fresh=True, route=False)

    async def _admit(
        self,
        entries: list[RequestEntry],
        fresh: bool = False,
        route: bool = True,
        refusals: dict[str, WireError] | None = None,
    ) -> None:
        """Decode, claim and start a batch of entries. Every step is per entry: whatever one entry holds
        (bytes that are not UTF-8, a body that does not parse, a number out of range, a status key of the
        wrong type), it ends that entry alone, failed or dead-lettered with a reason; so does a refusal (an
        entry id -> the limit that refused it), naming the limit. With prefix routing, fresh entries a warm
        worker should run are passed to it first (service/routing.py)."""
        refusals = refusals or {}
        if self.draining:
            return  # read as the drain began: they stay pending here and are handed back
        self._admitting += len(entries)
        claiming: list[tuple[str, str]] = []  # (request id, entry id) this call registered
        try:
            batch: list[tuple[RequestEntry, RequestBody | WireError]] = []
            for e in entries:
                if e.request_id is None:
                    self._detach(self._dead_letter(e, "entry has no valid id"))
                    continue
                running = self.inflight.get(e.request_id)
                if running is not None and running.entry.entry_id == e.entry_id:
                    continue  # our own entry came back through XAUTOCLAIM; it is still running here
                if self._claiming.get(e.request_id) == e.entry_id:
                    continue  # delivered again while this worker's claim of it is retried: that claim decides
                batch.append((e, refusals.get(e.entry_id) or self._decode(e)))
            route_keys = self.routing.keys_of(batch) if self.routing is not None else {}
            if route_keys and fresh and route and self.routing is not None:
                passed = await self.routing.offer([e for e, _ in batch], route_keys)
                for e, _ in batch:
                    if e.entry_id in passed:
                        self._detach(self.routing.take_back_later(e, passed[e.entry_id], self._taken_back))
                batch = [(e, b) for e, b in batch if e.entry_id not in passed]
            if not batch:
                return
            for e, _ in batch:
                assert e.request_id is not None
                claiming.append((e.request_id, e.entry_id))
                self._claiming[e.request_id] = e.entry_id
            pairs = [(e, b.deadline if isinstance(b, RequestBody) else None) for e, b in batch]
            claiming = asyncio.ensure_future(retry_forever(lambda: self.consumer.claim(pairs), what="claim"))
            early: dict[str, Started] = {}
            if fresh:
                await asyncio.sleep(0)  # the claim goes out first; the engine starts while it is answered
                early = self._start_early(batch)
            try:
                claims = await claiming
            except BaseException:
                for started in early.values():
                    self._detach(self.runner.abort(started))
                raise
            started_keys: list[str] = []
            for (e, body), claim in zip(batch, claims):
                begun = early.pop(e.entry_id, None)
                try:
                    if isinstance(claim, Exception):
                        raise claim
                    self.clock.offset = claim.now_ms / 1000 - time.time()
                    self._on_claim(e, body, claim, begun)
                    if claim.verdict is ClaimVerdict.RUN and e.entry_id in route_keys:
                        started_keys.append(route_keys[e.entry_id])
                except Exception as err:  # its claim's error or its start's ends this entry, not the batch
                    log.exception("entry %s (request %s) could not be taken", e.entry_id, e.request_id)
                    if begun is not None:
                        self._detach(self.runner.abort(begun))
                    self._detach(self._dead_letter(e, f"could not be taken: {err}"))
            if started_keys and (routing := self.routing) is not None:
                self._detach(retry_forever(lambda: routing.started(started_keys), what="advertise"))
        finally:
            self._admitting -= len(entries)
            for rid, entry_id in claiming:
                if self._claiming.get(rid) == entry_id:
                    del self._claiming[rid]

    def _decode(self, e: RequestEntry) -> RequestBody | WireError:
        try:
            return wire.decode_body(e.raw_body, self.cfg.max_prompt_chars, self.cfg.max_body_chars)
        except WireError as err:
            return err
        except Exception as err:  # whatever the parser chokes on is this body's problem, not the batch's
            return WireError("body", f"could not be read ({type(err).__name__}: {err})")

    def _start_early(self, batch: list[tuple[RequestEntry, RequestBody | WireError]]) -> dict[str, Started]:
        """Hand fresh requests to the engine while their claim is in flight: the claim's round trip overlaps
        tokenising and the first step instead of preceding them. Only first deliveries (never a poison
        request's redelivery) with a valid, short body and no past deadline; whatever the claim then says
        other than "run" aborts them before any output is written, within a step."""
        early: dict[str, Started] = {}
        now = self.clock.now()
        started: set[str] = set()
        for e, body in batch:
            rid = e.request_id
            if not isinstance(body, RequestBody) or rid is None or rid in self.inflight or rid in started:
                continue
            if body.deadline is not None and body.deadline <= now:
                continue
            if not quick_to_prepare(body):
                continue
            try:
                early[e.entry_id] = self.runner.start(rid, body)
            except Exception:  # the claim decides, and _run reports the error the usual way
                continue
            started.add(rid)
        return early

    def _on_claim(
        self, e: RequestEntry, body: RequestBody | WireError, claim: Claim, early: Started | None = None
    ) -> None:
        rid = e.request_id
        assert rid is not None
        v = claim.verdict
        if v is ClaimVerdict.RUN and isinstance(body, RequestBody):
            self._start(e, body, claim, early)
            return
        if early is not None:  # the claim said no: what began before it stops within a step
            self._detach(self.runner.abort(early))
        if v is ClaimVerdict.RUN:
            assert isinstance(body, WireError)
            self._finish_unstarted(e, unstarted(wire.FAILED, str(body), body.field, claim.run))
        elif v in (ClaimVerdict.DUPLICATE, ClaimVerdict.DONE):
            self._detach(retry_forever(lambda: self.consumer.ack(e.entry_id), what="XACK"))
        elif v is ClaimVerdict.CANCEL:
            self._finish_unstarted(e, unstarted(wire.CANCELLED))
        elif v is ClaimVerdict.EXPIRE:
            error = "the deadline passed before it started"
            self._finish_unstarted(e, unstarted(wire.EXPIRED, error, "deadline"))
        elif v is ClaimVerdict.DEAD:
            reason = f"delivered {claim.deliveries} times without finishing"
            log.warning("request %s: %s; moving it to %s", rid, reason, self.keys.dead)
            self._detach(self._dead(e, reason, claim.deliveries))
        # NOTMINE: another worker took it meanwhile; it is theirs

    # ---- running --------------------------------------------------------------------------------------

    def _start(self, e: RequestEntry, body: RequestBody, claim: Claim, early: Started | None) -> None:
        rid = e.request_id
        assert rid is not None
        enqueued = entry_ms(e.entry_id)
        ctx = Telemetry.extract(e.traceparent, e.tracestate)
        tracer = self.telemetry.tracer
        span = tracer.start_span(
            "specserve.request",
            context=ctx,
            start_time=self.clock.local_ns(enqueued),
            attributes={
                "specserve.request_id": rid,
                "specserve.run": claim.run,
                "specserve.worker": self.name,
            },
        )
        wait = tracer.start_span(
            "queue_wait", context=trace.set_span_in_context(span), start_time=self.clock.local_ns(enqueued)
        )
        wait.end(end_time=self.clock.local_ns(claim.now_ms))
        self.telemetry.queue_wait.record(max(0.0, (claim.now_ms - enqueued) / 1000))
        state = RequestState(e, rid, body, claim.run, enqueued, span)
        self.inflight[rid] = state
        state.task = asyncio.create_task(self._run(state, early), name=f"request-{rid}")

    async def _run(self, state: RequestState, early: Started | None) -> None:
        try:
            try:
                shown = await self._shown(state) if early is None else None
                started = early or await self.runner.begin(state.request_id, state.body, shown)
            except Exception as err:  # a bad parameter or an engine that refuses fails this request alone
                field = err.field if isinstance(err, (InvalidParameter, WireError)) else None
                if field is None:  # the engine refused it for a reason of its own (e.g. it has failed)
                    log.exception("request %s could not start", state.request_id)
                state.span.set_status(Status(StatusCode.ERROR, str(err)))
                state.span.end()
                final = unstarted(wire.FAILED, str(err) or type(err).__name__, field, state.run)
                self._finish_unstarted(state.entry, final)
                return
            if state.ending is not None:  # cancelled, expired or handed back while it was tokenized
                self.engine.abort(state.request_id)
            await self._conclude(state, await self.runner.drive(state, started))
        finally:
            self.inflight.pop(state.request_id, None)
            for w in self.siblings:  # the engine's room: any shard's full worker may take it
                w._capacity.set()

    async def _shown(self, state: RequestState) -> Shown | None:
        """A rerun's earlier output, which it continues instead of repeating (a first run has none)."""
        if state.run <= 1 or not state.body.stream:  # a final-only request shows nothing until its end
            return None
        ids, text, _final = await retry_forever(
            lambda: outputs.shown(self.conns, self.keys, state.request_id), what="XRANGE"
        )
        return Shown(ids, text)

    def _end(self, state: RequestState, ending: Ending) -> None:
        """Stop a running request for a reason of the worker's; the first reason sticks."""
        if state.ending is None:
            state.ending = ending
            self.engine.abort(state.request_id)

    async def _conclude(self, state: RequestState, outcome: Outcome) -> None:
        rid, entry_id = state.request_id, state.entry.entry_id
        if outcome.ending is Ending.LOST:
            state.span.set_status(Status(StatusCode.ERROR, "taken over by another worker"))
            state.span.end()
            return
        if outcome.ending is Ending.HANDBACK:
            await self.publisher.wait_idle()
            await retry_forever(lambda: self.consumer.handback(rid, entry_id), what="hand back")
            self._handed_back.add(entry_id)
            state.span.set_attribute("specserve.handed_back", True)
            state.span.end()
            return
        final = finalize(outcome)
        finish_span = self.telemetry.tracer.start_span(
            "finish", context=trace.set_span_in_context(state.span)
        )
        reply = None
        if state.body.reply_to is not None:
            fields = reply_fields(rid, final, outcome.token_ids or [], outcome.text or "")
            reply = Reply(self.keys.reply(state.body.reply_to), fields)
        written = await self.publisher.finish(rid, entry_id, final.entry, final.hash_fields, reply)
        finish_span.end()
        if not written:
            log.warning("request %s was taken over by another worker before it finished here", rid)
        self._record(state, final)

    def _record(self, state: RequestState, final: Final) -> None:
        now = self.clock.now()
        e2e = max(0.0, now - state.enqueued_ms / 1000)
        usage = final.entry.usage
        n = usage["completion_tokens"] if usage else 0
        ttft = tpot = None
        if state.first_token_at is not None:
            ttft = max(0.0, now - (time.monotonic() - state.first_token_at) - state.enqueued_ms / 1000)
            if state.last_token_at is not None and n > 1:
                tpot = (state.last_token_at - state.first_token_at) / (n - 1)
        reason = final.entry.finish_reason
        phases = state.phases(now)
        self.telemetry.request_ended(
            self.runner.names[0], final.status, reason, usage, e2e, ttft, tpot, phases
        )
        if self.cfg.access_log:
            self._detach(self._access_log(state.request_id, final, e2e))
        state.span.set_attribute("specserve.status", final.status)
        if usage:
            state.span.set_attribute("specserve.completion_tokens", n)
        if final.status == wire.FAILED:
            state.span.set_status(Status(StatusCode.ERROR))
        state.span.end()

    async def _access_log(self, request_id: str, final: Final, latency: float) -> None:
        tenant = None
        with contextlib.suppress(*TRANSIENT_ERRORS):  # the tenant is a nicety; the line goes out without it
            tenant = await self.r.hget(self.keys.req(request_id), "tenant")
        u, reason = final.entry.usage, final.entry.finish_reason
        access_log.info("%s", access_line(request_id, tenant, final.status, reason, u, latency))

    def _finish_unstarted(self, e: RequestEntry, final: Final) -> asyncio.Future[bool]:
        """Write the final entry of a request that never ran (and its reply, if its body names a reply
        stream, even a body refused for another field); the future says whether it was written."""
        assert e.request_id is not None
        self.telemetry.requests.add(1, {"status": final.status})
        if self.cfg.access_log:
            latency = max(0.0, self.clock.now() - entry_ms(e.entry_id) / 1000)
            self._detach(self._access_log(e.request_id, final, latency))
        reply = None
        with contextlib.suppress(Exception):  # best effort: a body that does not parse names no reply stream
            if (name := wire.reply_to_of(orjson.loads(e.raw_body))) is not None:
                reply = Reply(self.keys.reply(name), reply_fields(e.request_id, final, [], ""))
        return self.publisher.finish(e.request_id, e.entry_id, final.entry, final.hash_fields, reply)

    async def _dead(self, e: RequestEntry, reason: str, deliveries: int) -> None:
        await retry_forever(lambda: self.consumer.dead_letter(e, reason, deliveries), what="dead letter")
        self._finish_unstarted(e, unstarted(wire.FAILED, reason))

    async def _dead_letter(self, e: RequestEntry, reason: str) -> None:
        """Dead-letter an entry that cannot be taken at all; a request behind it is told why, if its status
        can be written, and its entry acknowledged either way (or each reclaim would dead-letter it again)."""
        log.warning(
            "entry %s (request %s): %s; moving it to %s", e.entry_id, e.request_id, reason, self.keys.dead
        )
        try:
            await retry_forever(lambda: self.consumer.dead_letter(e, reason), what="dead letter")
            if e.request_id is not None:
                if not await self._finish_unstarted(e, unstarted(wire.FAILED, reason)):
                    await retry_forever(lambda: self.consumer.ack_mine(e.entry_id), what="XACK")
        except Exception:  # nothing more can be done here; it stays pending and a reclaim tries again
            log.exception("entry %s could not be dead-lettered", e.entry_id)

    # ---- periodic work --------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        ids = {state.entry.entry_id: state for state in self.inflight.values()}
        for entry_id in await self.consumer.heartbeat(list(ids)):
            state = ids[entry_id]
            if state.ending is None:
                log.warning("request %s was taken over by another worker; stopping it here", state.request_id)
            self._end(state, Ending.LOST)
        await self._register()

    async def _publish_load(self) -> None:
        assert self.routing is not None
        room = 0 if self.draining else self._room()
        await self.routing.router.publish_load(len(self.inflight) + self._admitting, room)

    async def _register(self) -> None:
        info = {
            "max_model_len": self.engine.max_model_len,
            "root": self.engine.model_name,
            "has_chat_template": self.engine.has_chat_template,
        }
        await self.consumer.register_models(self.runner.names, info, self.cfg.model_ttl_s)

    async def _poll_cancellations(self) -> None:
        live = [state for state in self.inflight.values() if state.ending is None]
        if not live:
            return
        now = self.clock.now()
        for state in live:
            if state.deadline is not None and now > state.deadline:
                self._end(state, Ending.EXPIRED)
        live = [state for state in live if state.ending is None]
        flags = await self.consumer.cancel_flags([state.request_id for state in live])
        for state, cancelled in zip(live, flags):
            if cancelled:
                self._end(state, Ending.CANCELLED)

    async def _refresh_stats(self) -> None:
        s = self.engine.stats()
        g = self.telemetry.engine
        g.num_running, g.num_waiting = s.num_running, s.num_waiting
        g.kv_blocks_used, g.kv_blocks_total = s.kv_blocks_used, s.kv_blocks_total
        g.num_preemptions, g.last_batch_size = s.num_preemptions, s.last_batch_size
        g.draft_proposed, g.draft_accepted = s.draft_proposed, s.draft_accepted
        g.draft_by_method = dict(s.draft_by_method)
        g.prefix_cache_queries, g.prefix_cache_hits = s.prefix_cache_queries, s.prefix_cache_hits
        g.model_name = self.runner.names[0]
        if (routing := self.routing) is not None:
            g.routing_passed, g.routing_received = routing.passed, routing.received
            g.routing_taken_back = routing.taken_back
        if (fleet := self.suffix_fleet) is not None:
            c = fleet.counters
            g.suffix_fleet_received, g.suffix_fleet_junk = c.received, c.junk
            g.suffix_fleet_dropped = c.dropped
        if self is not self.siblings[0]:  # one of them reports the queue, every shard's together
            return
        self.telemetry.queue = QueueStats.combine([await w.consumer.stats() for w in self.siblings])
        g.dead_letters = sum([await self.r.xlen(w.keys.dead) for w in self.siblings])


class ShardedWorker:
    """One worker process serving every shard of the request stream (--queue-shards): a Worker per shard,
    each reading its own shard's consumer group (on a cluster its lean clients talk to the master of that
    shard's slot), all over the one engine. Each blocks on its own stream, so a busy shard never starves a
    quiet one, and they share the engine's room (Worker.siblings)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        redis: Any,
        keys: Keys,
        name: str,
        config: WorkerConfig | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.engine = engine
        self.r = redis
        self.keys = server_keys(redis, keys)
        config = config or WorkerConfig()
        self.telemetry = telemetry = telemetry or Telemetry()
        self.shards = [Worker(engine, redis, k, name, config, telemetry) for k in self.keys.every_shard()]
        for w in self.shards:
            w.siblings = self.shards
        for w in self.shards[1:]:  # one fleet feed a process: every shard's worker drafts from one engine
            w.suffix_fleet = None

    @property
    def ready(self) -> bool:
        return all(w.ready for w in self.shards)

    @property
    def inflight(self) -> dict[str, RequestState]:
        return {rid: s for w in self.shards for rid, s in w.inflight.items()}

    async def start(self) -> None:
        await retry_forever(lambda: agree_on_shards(self.r, self.keys), what="agree on the shard count")
        for w in self.shards:
            await w.start()

    async def drain(self, timeout: float) -> None:
        await asyncio.gather(*(w.drain(timeout) for w in self.shards))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.shards))
