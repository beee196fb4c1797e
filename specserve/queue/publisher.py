"""Batched, pipelined writes of output entries and final results.

Deltas pushed while a flush is in flight are merged per request and go out together in the next one, so the
number of round trips follows the engine's step rate, not the number of requests. A failed flush (server
restart) is kept and retried: consumers skip duplicated offsets, and the final step is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

from specserve.queue import scripts
from specserve.queue.connection import TRANSIENT_ERRORS, Connections
from specserve.queue.keys import Keys
from specserve.queue.wire import FAILED, OutputEntry

log = logging.getLogger(__name__)


@dataclass
class _Final:
    request_id: str
    entry_id: str
    entry: OutputEntry
    hash_fields: dict[str, str]
    done: asyncio.Future[bool] = field(repr=False, default=None)  # type: ignore[assignment]
    reply: Reply | None = None


@dataclass(frozen=True)
class Reply:
    """A final result for a request's reply stream: its key and the entry's fields."""

    key: str
    fields: dict[str, str]


def _merge(buf: list[OutputEntry], e: OutputEntry) -> None:
    last = buf[-1] if buf else None
    if (
        last is not None
        and last.run == e.run
        and last.offset + len(last.token_ids) == e.offset
        and last.text_offset + len(last.text) == e.text_offset
    ):
        last.token_ids = last.token_ids + e.token_ids
        last.text += e.text
        if last.logprobs is not None or e.logprobs is not None:
            last.logprobs = (last.logprobs or []) + (e.logprobs or [])
        last.prompt_logprobs = last.prompt_logprobs or e.prompt_logprobs
    else:
        logprobs = None if e.logprobs is None else list(e.logprobs)
        entry = OutputEntry(e.run, e.offset, e.text_offset, list(e.token_ids), e.text, logprobs=logprobs)
        entry.prompt_logprobs = e.prompt_logprobs
        buf.append(entry)


class Publisher:
    """Flushes go through the lean client of `conns` (its owner closes it)."""

    def __init__(
        self, conns: Connections, keys: Keys, consumer: str, ttl_ms: int, reply_maxlen: int = 10_000
    ) -> None:
        self._fast = conns.fast
        self.reply_maxlen = reply_maxlen  # a reply stream is trimmed to about this many entries
        self._reply_keys: dict[str, str] = {}  # request id -> the reply stream its deltas also go to
        self.keys = keys
        self.consumer = consumer
        self.ttl_ms = ttl_ms
        self._deltas: dict[str, list[OutputEntry]] = {}
        self._finals: list[_Final] = []
        self._expiring: set[str] = set()  # output streams whose TTL is already set
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False

    def stop(self) -> None:
        """End run() after its current flush (a cancel alone can be lost on Python 3.11, see OutputReader)."""
        self._closed = True
        self._wake.set()

    def push(self, request_id: str, entry: OutputEntry, reply_key: str | None = None) -> None:
        """Queue an output entry; it is written only while its run still owns the request (`entry.run` is
        the status hash's run)."""
        if reply_key is not None:
            self._reply_keys[request_id] = reply_key
        _merge(self._deltas.setdefault(request_id, []), entry)
        self._idle.clear()
        self._wake.set()

    def finish(
        self,
        request_id: str,
        entry_id: str,
        final: OutputEntry,
        hash_fields: dict[str, str],
        reply: Reply | None = None,
    ) -> asyncio.Future[bool]:
        """Queue the final entry + status + XACK (+ the reply stream's entry), all or nothing; the future
        says whether it was written (False: not ours)."""
        loop = asyncio.get_running_loop()
        f = _Final(request_id, entry_id, final, hash_fields, loop.create_future(), reply)
        self._finals.append(f)
        self._idle.clear()
        self._wake.set()
        return f.done

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def run(self) -> None:
        """Flush until stopped."""
        delay = 0.02
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            deltas, finals = self._deltas, self._finals
            self._deltas, self._finals = {}, []
            if not deltas and not finals:
                self._idle.set()
                continue
            try:
                results = await self._flush(deltas, finals)
            except TRANSIENT_ERRORS as e:
                log.warning("output flush failed (%s); retrying", e)
                self._restore(deltas, finals)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                self._wake.set()
                continue
            except Exception:  # an error reply (OOM, a wrong-type key) must not end the loop all writes go by
                # Not the server being away: retrying would fail the same way. The finals report failure, so
                # their entries stay pending and another delivery runs them again.
                log.exception("output flush failed; dropping %d outputs", len(deltas) + len(finals))
                results = [0] * len(finals)
            delay = 0.02
            for f, ok in zip(finals, results):
                if ok == scripts.REPLY_NOT_A_STREAM and f.reply is not None:
                    # Nothing was written: finish it again as failed, naming the field, without the reply.
                    self._finals.append(_reply_refused(f))
                    self._wake.set()
                    continue
                self._expiring.discard(f.request_id)
                self._reply_keys.pop(f.request_id, None)
                if not f.done.done():
                    f.done.set_result(bool(ok))
            if not self._deltas and not self._finals:
                self._idle.set()

    def _restore(self, deltas: dict[str, list[OutputEntry]], finals: list[_Final]) -> None:
        for rid, newer in self._deltas.items():
            buf = deltas.setdefault(rid, [])
            for e in newer:
                _merge(buf, e)
        self._deltas = deltas
        self._finals = finals + self._finals

    async def _flush(self, deltas: dict[str, list[OutputEntry]], finals: list[_Final]) -> list[int]:
        commands: list[list[str | int]] = []
        for rid, entries in deltas.items():
            # one script per request and run, all in the same write: entries of a run that no longer owns
            # the request are dropped by Redis (scripts.APPEND)
            for run in sorted({e.run for e in entries}):
                packed: list[str | int] = []
                for e in entries:
                    if e.run == run:
                        fields = e.to_fields()
                        packed += [len(fields), *_flat(fields)]
                commands.append(
                    [
                        "EVAL",
                        scripts.APPEND,
                        2,
                        self.keys.out(rid),
                        self.keys.req(rid),
                        run,
                        0 if rid in self._expiring else self.ttl_ms,
                        self._reply_keys.get(rid, ""),
                        self.reply_maxlen,
                        rid,
                        *packed,
                    ]
                )
        for f in finals:
            out_fields = f.entry.to_fields()
            reply_keys = [f.reply.key] if f.reply is not None else []
            reply_fields = f.reply.fields if f.reply is not None else {}
            commands.append(
                [
                    "EVAL",
                    scripts.FINISH,
                    3 + len(reply_keys),
                    self.keys.out(f.request_id),
                    self.keys.req(f.request_id),
                    self.keys.requests,
                    *reply_keys,
                    self.keys.group,
                    self.consumer,
                    f.entry_id,
                    self.ttl_ms,
                    f.entry.status or "finished",
                    len(out_fields),
                    *_flat(out_fields),
                    len(reply_fields),
                    *_flat(reply_fields),
                    self.reply_maxlen,
                    *_flat(f.hash_fields),
                ]
            )
        results = await self._fast.pipeline(commands, raise_on_error=False)
        for r in results:
            if isinstance(r, TRANSIENT_ERRORS):
                # A full server refuses the writes (OOM) but stays connected: retry them all. Deltas that got
                # in are written again; readers skip offsets they have shown.
                raise r
        for rid in deltas:
            self._expiring.add(rid)
        finals_at = len(results) - len(finals)
        for i, r in enumerate(results):
            if not isinstance(r, Exception):
                continue
            if i >= finals_at and "NOGROUP" in str(r):
                # The request stream is gone from the server (a replica promoted before it had the stream,
                # or a restart without persistence): nothing records this request any more.
                log.error(
                    "request %s could not be finished: the server no longer holds its request stream (%s); "
                    "enqueue with durability (replicas >= 1) to keep accepted requests through a failover",
                    finals[i - finals_at].request_id,
                    r,
                )
            else:
                log.error("output write failed: %s", r)
        return [r if isinstance(r, int) else 0 for r in results[finals_at:]] if finals else []


def _reply_refused(f: _Final) -> _Final:
    """The final of a request whose reply stream's key holds another type: failed, naming reply_to; the
    tokens already written stay in its output stream."""
    error = f"the reply stream {f.reply.key} is a key of another type; nothing could be written to it"
    entry = replace(f.entry, status=FAILED, finish_reason="error", error=error, error_field="reply_to")
    hash_fields = {**f.hash_fields, "finish_reason": "error", "error": error, "error_field": "reply_to"}
    return _Final(f.request_id, f.entry_id, entry, hash_fields, f.done, None)


def _flat(fields: dict[str, str]) -> list[str]:
    return [x for kv in fields.items() for x in kv]
