"""Follow many output streams with one blocking XREAD instead of one connection per waiting client.

A subscriber registers its stream, then XADDs to the reader's private wake stream, which every XREAD also
reads from its last seen id: a subscription made while the XREAD is in flight wakes it at once, and one
made just before it is seen by it, so no token waits for the block timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.exceptions import OutOfMemoryError

from specserve.queue.connection import BLOCK_MS, TRANSIENT_ERRORS, Connections
from specserve.queue.keys import Keys
from specserve.queue.resp import fields_dict
from specserve.queue.wire import OutputCursor, OutputEntry

log = logging.getLogger(__name__)


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Subscription:
    key: str
    last_id: str
    queue: asyncio.Queue[tuple[str, OutputEntry]] = field(default_factory=asyncio.Queue)


class OutputReader:
    """Wake-ups go through the lean client of `conns` (shared with its owner's other per-request commands);
    the blocking XREAD through one of its own, from `conns` too. The owner closes them."""

    def __init__(self, conns: Connections, keys: Keys, block_ms: int = BLOCK_MS) -> None:
        self.keys = keys
        self.block_ms = block_ms
        self._fast = conns.fast
        self._blocking = conns.blocking(block_ms)
        self._wake_key = keys.wake(uuid.uuid4().hex[:12])
        self._wake_last = "0-0"
        self._subs: dict[str, list[Subscription]] = {}
        self._closed = False

    async def _wake(self) -> None:
        await self._fast.pipeline(
            [
                ("XADD", self._wake_key, "MAXLEN", "~", 16, "*", "w", "1"),
                ("PEXPIRE", self._wake_key, 3_600_000),
            ]
        )

    async def follow(self, request_id: str, after: str = "0-0") -> AsyncIterator[tuple[str, OutputEntry]]:
        """Yield (entry id, entry) of a request's output stream after `after`, through the final entry."""
        sub = Subscription(self.keys.out(request_id), after)
        self._subs.setdefault(sub.key, []).append(sub)
        try:
            # The wake-up only hurries the blocking read: a full server, or one away mid-failover, leaves the
            # subscription to its next XREAD (<= block_ms, retried until the server is back).
            with contextlib.suppress(OutOfMemoryError, *TRANSIENT_ERRORS):
                await self._wake()
            while True:
                eid, entry = await sub.queue.get()
                yield eid, entry
                if entry.final:
                    return
        finally:
            subs = self._subs.get(sub.key, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(sub.key, None)

    async def close(self, task: asyncio.Task[None]) -> None:
        """Stop `task` (running run()). A cancel alone is not enough: on Python 3.11 asyncio.wait_for (inside
        redis-py) swallows a cancellation that races with a reply, so the loop also checks a flag, and a wake
        entry ends its blocking read."""
        self._closed = True
        task.cancel()
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await asyncio.wait_for(self._wake(), timeout=1.0)
        await asyncio.wait({task}, timeout=self.block_ms / 1000 + 1)

    async def run(self) -> None:
        """Read until closed."""
        delay = 0.02
        while not self._closed:
            streams = {self._wake_key: self._wake_last}
            for key, subs in self._subs.items():
                streams[key] = min((s.last_id for s in subs), key=_id_tuple)
            try:
                resp = await self._blocking.execute(
                    "XREAD", "COUNT", 1000, "BLOCK", self.block_ms, "STREAMS", *streams, *streams.values()
                )
            except TRANSIENT_ERRORS as e:
                log.warning("output reader: redis unavailable (%s); retrying", e)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            except Exception:  # e.g. a key of the wrong type: keep serving the others
                log.exception("output reader: XREAD failed")
                await asyncio.sleep(0.5)
                continue
            delay = 0.02
            for key, items in resp or []:
                if key == self._wake_key:
                    self._wake_last = items[-1][0]
                    continue
                entries = [(eid, _entry(key, eid, fields)) for eid, fields in items]
                for sub in self._subs.get(key, []):
                    last = _id_tuple(sub.last_id)
                    for eid, entry in entries:
                        if entry is not None and _id_tuple(eid) > last:
                            sub.queue.put_nowait((eid, entry))
                    sub.last_id = max(sub.last_id, items[-1][0], key=_id_tuple)


async def shown(conns: Connections, keys: Keys, request_id: str) -> tuple[list[int], str, bool]:
    """What a reader of a request's output stream has been shown so far (the reading rule of
    docs/wire-format.md): its token ids, its text, and whether a final entry is among them."""
    cursor = OutputCursor()
    ids: list[int] = []
    parts: list[str] = []
    for eid, fields in await conns.fast.execute("XRANGE", keys.out(request_id), "-", "+"):
        entry = _entry(keys.out(request_id), eid, fields)
        delta = cursor.feed(entry) if entry is not None else None
        if delta is not None:
            ids.extend(delta.token_ids)
            parts.append(delta.text)
        if cursor.done:
            break
    return ids, "".join(parts), cursor.done


def _entry(key: str, eid: str, fields: list[str]) -> OutputEntry | None:
    """Only workers write output streams, but anyone with access to Redis can: an entry that does not read
    is skipped (and logged) instead of failing, again and again, the XREAD that serves every subscriber."""
    try:
        return OutputEntry.from_fields(fields_dict(fields))
    except (ValueError, TypeError) as e:  # int() of a non-number, JSON that does not parse, a wrong type
        log.warning("output reader: skipping unreadable entry %s of %s (%s)", eid, key, e)
        return None
