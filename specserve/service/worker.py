"""The worker: one asyncio loop between the request stream and the engine.

Pull only what the engine can admit now (work waits in Redis, not here), start each request, publish its
tokens as they come (batched), acknowledge after the final entry is written, keep in-flight entries fresh so
no other worker takes them, take over entries of dead workers, and on SIGTERM drain: stop pulling, finish
or hand back in-flight work within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.outputs import StepDelta
from specserve.engine.sampling_params import InvalidParameter, SamplingParams
from specserve.queue import wire
from specserve.queue.connection import TRANSIENT_ERRORS, retry_forever
from specserve.queue.consumer import Claim, ConsumerConfig, StreamConsumer, entry_ms
from specserve.queue.keys import Keys
from specserve.queue.publisher import Publisher
from specserve.queue.resp import RespClient
from specserve.queue.wire import OutputEntry, RequestBody, RequestEntry, WireError
from specserve.service.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    ttl_s: float = 86400.0
    claim_timeout_s: float = 30.0
    max_deliveries: int = 3
    cancel_poll_s: float = 0.1
    trim_interval_s: float = 30.0
    stats_interval_s: float = 1.0
    # Raw XADDs skip the API's limits, so the worker applies the same ones (the API's defaults) before it
    # parses or tokenizes anything.
    max_body_chars: int = 1 << 20
    max_prompt_chars: int = 200_000
    dead_letter_maxlen: int = 100_000
    dead_letter_ttl_s: float = 7 * 86400.0

    @property
    def heartbeat_s(self) -> float:
        return self.claim_timeout_s / 4

    @property
    def reclaim_s(self) -> float:
        return min(5.0, self.claim_timeout_s / 2)


@dataclass
class InFlight:
    entry: RequestEntry
    request_id: str
    run: int
    enqueued_ms: int
    deadline: float | None
    span: Span
    ended_by: str | None = None  # cancelled | expired | lost | handback: why we aborted it
    first_token_at: float | None = None
    last_token_at: float | None = None
    task: asyncio.Task[None] | None = None
    engine_start: float = 0.0  # time.monotonic() when the engine took it
    engine_end: float | None = None  # ... and when its final output came back


@dataclass
class Early:
    """A fresh request handed to the engine before its claim came back."""

    request_id: str
    deltas: AsyncIterator[StepDelta]
    started: float  # time.monotonic()


def stable_seed(request_id: str) -> int:
    """Seed for a sampled request that gave none, so a rerun after a crash draws the same tokens."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") >> 1


def _wall_ns(monotonic: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds that spans take."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


# Prompts longer than this are tokenized in a thread, inside their own request's task: tokenizing takes a
# while, and on the loop that does every request's Redis I/O it held up the pull loop and its batch-mates.
LONG_PROMPT_CHARS = 8192


def prompt_chars(body: RequestBody) -> int:
    if body.messages is not None:
        return sum(len(m["content"]) for m in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0


def model_aliases(name: str) -> set[str]:
    base = os.path.basename(name.rstrip("/"))
    return {name, base, base.removesuffix(".gguf")}


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
        self.keys = keys
        self.name = name
        self.cfg = config or WorkerConfig()
        self.telemetry = telemetry or Telemetry()
        ttl_ms = int(self.cfg.ttl_s * 1000)
        self.fast = RespClient(redis)  # the per-request commands: claims, cancellation checks, outputs
        self.consumer = StreamConsumer(
            redis,
            keys,
            name,
            ConsumerConfig(
                ttl_ms=ttl_ms,
                max_deliveries=self.cfg.max_deliveries,
                claim_timeout_ms=int(self.cfg.claim_timeout_s * 1000),
                dead_maxlen=self.cfg.dead_letter_maxlen,
                dead_ttl_ms=int(self.cfg.dead_letter_ttl_s * 1000),
            ),
            fast=self.fast,
        )
        self.publisher = Publisher(redis, keys, name, ttl_ms, fast=self.fast)
        self.models = model_aliases(engine.model_name)
        self.inflight: dict[str, InFlight] = {}
        self._admitting = 0  # entries read and not yet claimed
        self._preparing = 0  # requests claimed and being tokenized, not yet in the engine
        self._capacity = asyncio.Event()
        self._pulling: list[asyncio.Task[None]] = []
        self._background: list[asyncio.Task[None]] = []
        self._detached: set[asyncio.Task[Any]] = set()
        self._handed_back: set[str] = set()  # entry ids: still pending here, but idle for others to take
        self._clock_offset = 0.0  # server clock - local clock, from claim replies
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
        self.started = True
        log.info("worker %s serving %s from %s", self.name, self.engine.model_name, self.keys.requests)

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
        for inf in list(self.inflight.values()):
            if inf.ended_by is None:
                inf.ended_by = "handback"
                self.engine.abort(inf.request_id)
        tasks = [inf.task for inf in self.inflight.values() if inf.task is not None] + list(self._detached)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.publisher.wait_idle(), timeout=10)
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await self._hand_back_leftovers()

    async def close(self) -> None:
        self.draining = self._closed = True
        self.publisher.stop()
        await self._stop(self._pulling + self._background + list(self._detached))
        await self.consumer.aclose()
        await self.fast.aclose()

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
            except Exception as err:
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
            except Exception:
                log.exception("%s failed", getattr(fn, "__name__", fn))

    # ---- taking work ----------------------------------------------------------------------------------

    def _room(self) -> int:
        return self.engine.free_capacity() - self._admitting - self._preparing

    async def _pull_loop(self) -> None:
        while not self.draining:
            n = self._room()
            if n <= 0:
                self._capacity.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._capacity.wait(), timeout=0.25)
                continue
            try:
                entries = await retry_forever(
                    lambda n=n: self.consumer.read_new(n), what="XREADGROUP", stop=lambda: self.draining
                )
                self.redis_ok = True
                if entries:
                    await self._admit(entries, fresh=True)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad reply stop the worker from pulling
                log.exception("pulling requests failed")
                await asyncio.sleep(0.5)

    async def _reclaim(self) -> None:
        n = self._room()
        if n > 0:
            entries = await self.consumer.reclaim(n)
            if entries:
                log.info("reclaimed %d idle entries", len(entries))
                await self._admit(entries)

    async def _admit(self, entries: list[RequestEntry], fresh: bool = False) -> None:
        """Decode, claim and start a batch of entries. Every step is per entry: whatever one entry holds
        (bytes that are not UTF-8, a body that does not parse, a number out of range, a status key of the
        wrong type), it ends that entry alone, failed or dead-lettered with a reason."""
        if self.draining:
            return  # read as the drain began: they stay pending here and are handed back
        self._admitting += len(entries)
        try:
            batch: list[tuple[RequestEntry, RequestBody | WireError]] = []
            for e in entries:
                if e.request_id is None:
                    self._detach(self._dead_letter(e, "entry has no valid id"))
                    continue
                running = self.inflight.get(e.request_id)
                if running is not None and running.entry.entry_id == e.entry_id:
                    continue  # our own entry came back through XAUTOCLAIM; it is still running here
                batch.append((e, self._decode(e)))
            if not batch:
                return
            pairs = [(e, b.deadline if isinstance(b, RequestBody) else None) for e, b in batch]
            claiming = asyncio.ensure_future(retry_forever(lambda: self.consumer.claim(pairs), what="claim"))
            early: dict[str, Early] = {}
            if fresh:
                await asyncio.sleep(0)  # the claim goes out first; the engine starts while it is answered
                early = self._start_early(batch)
            try:
                claims = await claiming
            except BaseException:
                for started in early.values():
                    self._drop_early(started)
                raise
            for (e, body), claim in zip(batch, claims):
                begun = early.pop(e.entry_id, None)
                try:
                    if isinstance(claim, Exception):
                        raise claim
                    self._clock_offset = claim.now_ms / 1000 - time.time()
                    self._on_claim(e, body, claim, begun)
                except Exception as err:
                    log.exception("entry %s (request %s) could not be taken", e.entry_id, e.request_id)
                    if begun is not None:
                        self._drop_early(begun)
                    self._detach(self._dead_letter(e, f"could not be taken: {err}"))
        finally:
            self._admitting -= len(entries)

    def _decode(self, e: RequestEntry) -> RequestBody | WireError:
        try:
            return wire.decode_body(e.raw_body, self.cfg.max_prompt_chars, self.cfg.max_body_chars)
        except WireError as err:
            return err
        except Exception as err:  # whatever the parser chokes on is this body's problem, not the batch's
            return WireError("body", f"could not be read ({type(err).__name__}: {err})")

    def _start_early(self, batch: list[tuple[RequestEntry, RequestBody | WireError]]) -> dict[str, Early]:
        """Hand fresh requests to the engine while their claim is in flight: the claim's round trip overlaps
        tokenising and the first step instead of preceding them. Only first deliveries (never a poison
        request's redelivery) with a valid, short body and no past deadline; whatever the claim then says
        other than "run" aborts them before any output is written, within a step."""
        early: dict[str, Early] = {}
        now = time.time() + self._clock_offset
        started: set[str] = set()
        for e, body in batch:
            rid = e.request_id
            if not isinstance(body, RequestBody) or rid is None or rid in self.inflight or rid in started:
                continue
            if body.deadline is not None and body.deadline <= now:
                continue
            if prompt_chars(body) > LONG_PROMPT_CHARS:
                continue
            try:
                early[e.entry_id] = self._hand_to_engine(rid, body)
            except Exception:  # the claim decides, and _start reports the error the usual way
                continue
            started.add(rid)
        return early

    def _drop_early(self, started: Early) -> None:
        self.engine.abort(started.request_id)

        async def drain() -> None:  # the abort's final delta ends the stream and frees its queue
            async for _ in started.deltas:
                pass

        self._detach(drain())

    def _on_claim(
        self, e: RequestEntry, body: RequestBody | WireError, claim: Claim, early: Early | None = None
    ) -> None:
        rid = e.request_id
        assert rid is not None
        act = claim.action
        if act == "notmine":
            pass
        elif act in ("duplicate", "done"):
            self._detach(retry_forever(lambda: self.consumer.ack(e.entry_id), what="XACK"))
        elif act == "cancel":
            self._finish_unstarted(e, wire.CANCELLED, "abort")
        elif act == "expire":
            self._finish_unstarted(
                e, wire.EXPIRED, "abort", "the deadline passed before it started", "deadline"
            )
        elif act == "dead":
            reason = f"delivered {claim.detail} times without finishing"
            log.warning("request %s: %s; moving it to %s", rid, reason, self.keys.dead)
            self._detach(self._dead(e, reason, int(claim.detail)))
        elif isinstance(body, WireError):
            self._finish_unstarted(e, wire.FAILED, "error", str(body), body.field, claim.run)
        else:
            self._start(e, body, claim, early)
            return
        if early is not None:  # the claim said no: what began before it stops within a step
            self._drop_early(early)

    def _start(self, e: RequestEntry, body: RequestBody, claim: Claim, early: Early | None = None) -> None:
        rid = e.request_id
        assert rid is not None
        enqueued = entry_ms(e.entry_id)
        ctx = Telemetry.extract(e.traceparent, e.tracestate)
        tracer = self.telemetry.tracer
        span = tracer.start_span(
            "specserve.request",
            context=ctx,
            start_time=self._local_ns(enqueued),
            attributes={
                "specserve.request_id": rid,
                "specserve.run": claim.run,
                "specserve.worker": self.name,
            },
        )
        wait = tracer.start_span(
            "queue_wait", context=trace.set_span_in_context(span), start_time=self._local_ns(enqueued)
        )
        wait.end(end_time=self._local_ns(claim.now_ms))
        self.telemetry.queue_wait.record(max(0.0, (claim.now_ms - enqueued) / 1000))
        inf = InFlight(e, rid, claim.run, enqueued, body.deadline, span, engine_start=time.monotonic())
        self.inflight[rid] = inf
        inf.task = asyncio.create_task(self._run(inf, body, early), name=f"request-{rid}")

    async def _run(self, inf: InFlight, body: RequestBody, early: Early | None) -> None:
        rid = inf.request_id
        try:
            begun = early or await self._begin(rid, body)
        except Exception as err:
            field = err.field if isinstance(err, (InvalidParameter, WireError)) else None
            if field is None:  # the engine refused it for a reason of its own (e.g. it has failed)
                log.exception("request %s could not start", rid)
            inf.span.set_status(Status(StatusCode.ERROR, str(err)))
            inf.span.end()
            self.inflight.pop(rid, None)
            self._capacity.set()
            self._finish_unstarted(
                inf.entry, wire.FAILED, "error", str(err) or type(err).__name__, field, inf.run
            )
            return
        inf.engine_start = begun.started
        if inf.ended_by is not None:  # cancelled, expired or handed back while it was being tokenized
            self.engine.abort(rid)
        await self._drive(inf, begun.deltas)

    async def _begin(self, rid: str, body: RequestBody) -> Early:
        if prompt_chars(body) <= LONG_PROMPT_CHARS:
            return self._hand_to_engine(rid, body)
        self._params(rid, body)  # a bad field fails before the tokenizer runs
        self._preparing += 1
        try:
            if body.messages is not None:
                prompt = await asyncio.to_thread(self.engine.encode_chat, body.messages)
            else:
                # the engine's own encode of text is the same call, so results do not change
                prompt = await asyncio.to_thread(self.engine.tokenizer.encode, body.prompt)
        finally:
            self._preparing -= 1
        return self._hand_to_engine(rid, body, prompt)

    def _hand_to_engine(self, rid: str, body: RequestBody, prompt: str | list[int] | None = None) -> Early:
        params, until_full = self._params(rid, body)
        try:
            if prompt is None:
                prompt = self.engine.encode_chat(body.messages) if body.messages is not None else body.prompt
            assert prompt is not None
            if until_full:
                if isinstance(prompt, str):
                    prompt = self.engine.tokenizer.encode(prompt)  # as the engine would; we need the length
                params.max_tokens = max(1, self.engine.max_model_len - len(prompt))
            started = time.monotonic()
            return Early(rid, self.engine.add_request(rid, prompt, params, stream=body.stream), started)
        except InvalidParameter as err:
            if err.field == "prompt" and body.messages is not None:
                raise InvalidParameter("messages", err.message) from None  # the field the client sent
            raise

    def _params(self, rid: str, body: RequestBody) -> tuple[SamplingParams, bool]:
        """The request's sampling parameters, and whether max_tokens is to fill the context."""
        if body.model is not None and body.model not in self.models:
            raise WireError(
                "model", f"unknown model {body.model!r}; this worker serves {self.engine.model_name!r}"
            )
        sampling = dict(body.sampling)
        until_full = "max_tokens" in sampling and sampling["max_tokens"] is None
        if until_full:
            del sampling["max_tokens"]
        params = SamplingParams.from_dict(sampling)
        limit = self.engine.max_model_len
        if not until_full and params.max_tokens > limit:
            raise InvalidParameter(
                "max_tokens", f"is {params.max_tokens}; this model's context is {limit} tokens"
            )
        if params.seed is None and not params.greedy:
            params.seed = stable_seed(rid)
        return params, until_full

    # ---- one request ----------------------------------------------------------------------------------

    async def _drive(self, inf: InFlight, deltas) -> None:
        rid = inf.request_id
        tracer = self.telemetry.tracer
        in_request = trace.set_span_in_context(inf.span)
        phase = tracer.start_span("prefill", context=in_request)
        text_offset = 0
        last: StepDelta | None = None
        error: str | None = None
        try:
            async with contextlib.aclosing(deltas):
                async for d in deltas:
                    if d.token_ids:
                        inf.last_token_at = time.monotonic()
                        if inf.first_token_at is None:
                            # A final-only request's one delta says when its first token really came.
                            inf.first_token_at = d.first_token_time or inf.last_token_at
                            phase.end(end_time=_wall_ns(inf.first_token_at))
                            phase = tracer.start_span(
                                "decode", context=in_request, start_time=_wall_ns(inf.first_token_at)
                            )
                            since_first = time.monotonic() - inf.first_token_at
                            ttft = self._server_now() - since_first - inf.enqueued_ms / 1000
                            self.telemetry.ttft.record(max(0.0, ttft))
                    if d.finished:
                        last = d  # its tokens go out with the final entry
                        inf.engine_end = time.monotonic()
                    elif d.token_ids or d.text:
                        self.publisher.push(
                            rid, OutputEntry(inf.run, d.offset, text_offset, d.token_ids, d.text)
                        )
                        text_offset += len(d.text)
        except Exception as err:
            log.exception("request %s failed in the engine", rid)
            error = str(err) or type(err).__name__
        phase.end()
        try:
            await self._conclude(inf, last, text_offset, error)
        finally:
            self.inflight.pop(rid, None)
            self._capacity.set()

    async def _conclude(
        self, inf: InFlight, last: StepDelta | None, text_offset: int, error: str | None
    ) -> None:
        rid, entry = inf.request_id, inf.entry
        if self.engine.error is not None and inf.ended_by is None:
            inf.ended_by = "handback"  # the engine died, not the request: let a healthy worker run it
        if inf.ended_by == "lost":
            inf.span.set_status(Status(StatusCode.ERROR, "taken over by another worker"))
            inf.span.end()
            return
        if inf.ended_by == "handback":
            await self.publisher.wait_idle()
            await retry_forever(lambda: self.consumer.handback(rid, entry.entry_id), what="hand back")
            self._handed_back.add(entry.entry_id)
            inf.span.set_attribute("specserve.handed_back", True)
            inf.span.end()
            return
        reason = last.finish_reason if last else None
        status = wire.FINISHED
        err_msg = None
        if error is not None or reason == "error" or last is None:
            status, reason, err_msg = wire.FAILED, "error", error or "the engine failed"
        elif reason == "abort":  # we stopped it (a request that finished first keeps its own reason)
            if inf.ended_by == "cancelled":
                status = wire.CANCELLED
            elif inf.ended_by == "expired":
                status, err_msg = wire.EXPIRED, "the deadline passed while it was running"
            else:
                status, err_msg = wire.FAILED, "aborted by the engine"
        usage = None
        if last is not None and last.usage is not None:
            u = last.usage
            usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "draft_proposed": u.draft_proposed,
                "draft_accepted": u.draft_accepted,
            }
        ids = last.token_ids if last else []
        final = OutputEntry(
            inf.run,
            last.offset if last else 0,
            text_offset,
            ids,
            last.text if last else "",
            finish_reason=reason or "stop",
            status=status,
            usage=usage,
            error=err_msg,
            error_field="deadline" if status == wire.EXPIRED else None,
        )
        hash_fields = {"finish_reason": final.finish_reason or ""}
        if usage:
            hash_fields.update({k: str(v) for k, v in usage.items()})
        if err_msg:
            hash_fields["error"] = err_msg
        if inf.engine_end is not None:
            # the engine's share of the latency (tokenising, waiting for a batch slot, prefill, decode), so a
            # client can tell it from what the queue and the transport add
            hash_fields["engine_ms"] = f"{1000 * (inf.engine_end - inf.engine_start):.2f}"
        finish_span = self.telemetry.tracer.start_span("finish", context=trace.set_span_in_context(inf.span))
        written = await self.publisher.finish(rid, entry.entry_id, final, hash_fields)
        finish_span.end()
        if not written:
            log.warning("request %s was taken over by another worker before it finished here", rid)
        self._record(inf, status, usage)

    def _record(self, inf: InFlight, status: str, usage: dict[str, int] | None) -> None:
        t = self.telemetry
        t.requests.add(1, {"status": status})
        t.e2e.record(max(0.0, self._server_now() - inf.enqueued_ms / 1000))
        n = usage["completion_tokens"] if usage else 0
        if inf.first_token_at is not None and inf.last_token_at is not None and n > 1:
            t.tpot.record((inf.last_token_at - inf.first_token_at) / (n - 1))
        inf.span.set_attribute("specserve.status", status)
        if usage:
            inf.span.set_attribute("specserve.completion_tokens", n)
        if status == wire.FAILED:
            inf.span.set_status(Status(StatusCode.ERROR))
        inf.span.end()

    def _finish_unstarted(
        self,
        e: RequestEntry,
        status: str,
        reason: str,
        error: str | None = None,
        error_field: str | None = None,
        run: int = 0,
    ) -> asyncio.Future[bool]:
        """Write the final entry of a request that never ran; the future says whether it was written."""
        assert e.request_id is not None
        final = OutputEntry(run, 0, 0, [], "", reason, status, None, error, error_field)
        fields = {"finish_reason": reason}
        if error:
            fields["error"] = error
        if error_field:
            fields["error_field"] = error_field
        self.telemetry.requests.add(1, {"status": status})
        return self.publisher.finish(e.request_id, e.entry_id, final, fields)

    async def _dead(self, e: RequestEntry, reason: str, deliveries: int) -> None:
        await retry_forever(lambda: self.consumer.dead_letter(e, reason, deliveries), what="dead letter")
        self._finish_unstarted(e, wire.FAILED, "error", reason)

    async def _dead_letter(self, e: RequestEntry, reason: str) -> None:
        """Dead-letter an entry that cannot be taken at all; a request behind it is told why, if its status
        can be written, and its entry acknowledged either way (or each reclaim would dead-letter it again)."""
        log.warning(
            "entry %s (request %s): %s; moving it to %s", e.entry_id, e.request_id, reason, self.keys.dead
        )
        try:
            await retry_forever(lambda: self.consumer.dead_letter(e, reason), what="dead letter")
            if e.request_id is not None and not await self._finish_unstarted(e, wire.FAILED, "error", reason):
                await retry_forever(lambda: self.consumer.ack_mine(e.entry_id), what="XACK")
        except Exception:  # nothing more can be done here; it stays pending and a reclaim tries again
            log.exception("entry %s could not be dead-lettered", e.entry_id)

    def _detach(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    # ---- periodic work --------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        ids = {inf.entry.entry_id: inf for inf in self.inflight.values()}
        for entry_id in await self.consumer.heartbeat(list(ids)):
            inf = ids[entry_id]
            if inf.ended_by is None:
                log.warning("request %s was taken over by another worker; stopping it here", inf.request_id)
                inf.ended_by = "lost"
                self.engine.abort(inf.request_id)
        await self._register()

    async def _register(self) -> None:
        await self.consumer.register_model(
            self.engine.model_name, {"max_model_len": self.engine.max_model_len}
        )

    async def _poll_cancellations(self) -> None:
        live = [inf for inf in self.inflight.values() if inf.ended_by is None]
        if not live:
            return
        now = time.time()
        for inf in live:
            if inf.deadline is not None and now + self._clock_offset > inf.deadline:
                inf.ended_by = "expired"
                self.engine.abort(inf.request_id)
        live = [inf for inf in live if inf.ended_by is None]
        flags = await self.consumer.cancel_flags([inf.request_id for inf in live])
        for inf, cancelled in zip(live, flags):
            if cancelled and inf.ended_by is None:
                inf.ended_by = "cancelled"
                self.engine.abort(inf.request_id)

    async def _refresh_stats(self) -> None:
        s = self.engine.stats()
        g = self.telemetry.engine
        g.num_running, g.num_waiting = s.num_running, s.num_waiting
        g.kv_blocks_used, g.kv_blocks_total = s.kv_blocks_used, s.kv_blocks_total
        g.num_preemptions, g.last_batch_size = s.num_preemptions, s.last_batch_size
        g.draft_proposed, g.draft_accepted = s.draft_proposed, s.draft_accepted
        self.telemetry.queue = await self.consumer.stats()

    # ---- clocks ---------------------------------------------------------------------------------------

    def _server_now(self) -> float:
        return time.time() + self._clock_offset

    def _local_ns(self, server_ms: int) -> int:
        return int((server_ms / 1000 - self._clock_offset) * 1e9)
