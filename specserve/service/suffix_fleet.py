"""The fleet-wide suffix tree: every worker's finished outputs reach every other worker's suffix proposer.

One stream per model, `{prefix}:suffix:<model>` (queue/keys.py): each worker XADDs the token ids of its
finished outputs to it (fields `w`: its name, `t`: the ids as little-endian uint32), trimmed with
MAXLEN ~ SUFFIX_FLEET_MAXLEN, and follows it with a blocking XREAD on a connection of its own, skipping its
own entries. Following the output streams instead would cost more for the same ids: they are one per request,
so a reader would first have to learn every new request's key, and they hold deltas and text, the ids of one
output spread over many entries. Here one XREAD brings any number of outputs, each in one field, and a
worker that (re)starts first reads the stream's newest outputs (as many as its builder takes at once), so it
learns what the fleet said recently before its first request.

Nothing the product promises rests on this stream: drafts are verified, so an output lost (a trimmed stream,
a restarted server, a full queue) costs acceptance only, never a token of anyone's output; nothing here is
retried forever, and no request or step waits on it. The feed runs on the worker's event loop; what it reads
goes to FleetTree (spec/suffix.py), whose own thread builds it into the tree in chunks under a lock that a
step takes only when it is free. What it sends the step left in FleetTree's bounded deque, one append per
finished request.

Junk entries (a field missing or not bytes of whole uint32s, no ids or more than MAX_OUTPUT_TOKENS, an id
outside the vocabulary) are counted and skipped. An error reply (WRONGTYPE: the key is not a stream) or a
lost server backs off, up to MAX_BACKOFF_S, and reads on after the last id read: a trimmed stream from its
oldest entry past that id, a restarted empty one from the next entry added.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.queue.connection import BLOCK_MS, TRANSIENT_ERRORS, Connections
from specserve.queue.resp import as_bytes
from specserve.spec.suffix import FleetTree

log = logging.getLogger(__name__)

SUFFIX_FLEET_MAXLEN = 2000  # outputs the stream keeps (about): what a (re)starting worker learns from
MAX_OUTPUT_TOKENS = 16384  # ids in one entry at most; a longer one is junk
READ_COUNT = 64  # entries per XREAD
SEND_EVERY_S = 0.1  # how often this worker's finished outputs go out
MAX_BACKOFF_S = 2.0
BEHIND_WAIT_S = 0.05  # how often a reader waiting for the builder looks again


@dataclass
class FleetCounters:
    received: int = 0  # other workers' outputs handed to the tree's builder
    own: int = 0  # this worker's, skipped
    junk: int = 0  # entries that are not an output
    dropped: int = 0  # outputs the builder had no room for
    sent: int = 0
    unsent: int = 0  # outputs lost to a failed XADD
    errors: int = 0  # failed reads (the server away, an error reply)


def encode_tokens(tokens: list[int]) -> bytes:
    ids = array("I", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def decode_tokens(value: object, vocab_size: int) -> list[int] | None:
    """The ids an entry's `t` field holds, or None when it is not an output for this model."""
    if not isinstance(value, (str, bytes)):
        return None
    raw = as_bytes(value)
    if not raw or len(raw) % 4 or len(raw) > 4 * MAX_OUTPUT_TOKENS:
        return None
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    if max(ids) >= vocab_size:
        return None
    return ids.tolist()


class SuffixFleet:
    """Sends this worker's finished outputs to the model's suffix stream and feeds the others' to `tree`."""

    def __init__(
        self,
        conns: Connections,
        key: str,
        name: str,
        tree: FleetTree,
        vocab_size: int,
        maxlen: int = SUFFIX_FLEET_MAXLEN,
        block_ms: int = BLOCK_MS,
    ) -> None:
        self.key = key
        self.name = name
        self.tree = tree
        self.vocab_size = vocab_size
        self.maxlen = maxlen
        self.block_ms = block_ms
        self._fast = conns.fast
        self._blocking = conns.blocking(block_ms)
        self.last_id = "0-0"
        self._started = False
        self.counters = FleetCounters()

    async def send(self) -> None:
        """XADD the outputs this worker finished since the last call, in one pipeline; on a failure they are
        counted and dropped (the stream is a hint, not a record)."""
        outputs = self.tree.outgoing()
        if not outputs:
            return
        commands = [
            ("XADD", self.key, "MAXLEN", "~", self.maxlen, "*", "w", self.name, "t", encode_tokens(tokens))
            for tokens in outputs
        ]
        try:
            replies = await self._fast.pipeline(commands, raise_on_error=False)
        except TRANSIENT_ERRORS as e:
            self.counters.unsent += len(outputs)
            log.debug("suffix fleet: %d outputs not sent (%s)", len(outputs), e)
            return
        failed = sum(isinstance(r, Exception) for r in replies)
        self.counters.sent += len(outputs) - failed
        self.counters.unsent += failed

    async def run_sender(self, stop: Callable[[], bool]) -> None:
        while not stop():
            await asyncio.sleep(SEND_EVERY_S)
            try:
                await self.send()
            except Exception:  # a bug here must not end the loop: the next round tries again
                log.exception("suffix fleet: sending failed")

    async def start_at_recent(self) -> None:
        """A first read takes the newest outputs the builder has room for (XREVRANGE), not the stream's
        oldest: those would fill its queue and the newer ones be dropped."""
        reply = await self._fast.execute("XREVRANGE", self.key, "+", "-", "COUNT", self.tree.capacity // 2)
        entries = [(item[0], _fields(item[1] if len(item) > 1 else None)) for item in reply or []]
        for entry_id, fields in reversed(entries):
            self._take(entry_id, fields)
        self.last_id = entries[0][0] if entries else "0-0"
        self._started = True

    async def read_once(self) -> int:
        """One XREAD (blocking up to block_ms): hands the new entries' outputs to the tree; returns how many
        entries it read. While the builder is behind by half its queue, it waits instead of reading, so a
        burst waits in the stream rather than being dropped here."""
        if not self._started:
            await self.start_at_recent()
        while self.tree.pending >= self.tree.capacity // 2:
            await asyncio.sleep(BEHIND_WAIT_S)
        reply = await self._blocking.execute(
            "XREAD", "COUNT", READ_COUNT, "BLOCK", self.block_ms, "STREAMS", self.key, self.last_id
        )
        entries = _entries(reply)
        for entry_id, fields in entries:
            self.last_id = entry_id
            self._take(entry_id, fields)
        return len(entries)

    def _take(self, entry_id: str, fields: dict[str, Any]) -> None:
        c = self.counters
        worker = fields.get("w")
        if not isinstance(worker, str):
            c.junk += 1
            return
        if worker == self.name:
            c.own += 1
            return
        tokens = decode_tokens(fields.get("t"), self.vocab_size)
        if tokens is None:
            c.junk += 1
            return
        if self.tree.offer(("fleet", entry_id), tokens):
            c.received += 1
        else:
            c.dropped += 1

    async def run_reader(self, stop: Callable[[], bool]) -> None:
        """Follow the stream until `stop()`; errors back off and the read resumes after the last id."""
        delay = 0.05
        while not stop():
            try:
                await self.read_once()
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the server away, an error reply, a reply of the wrong shape
                self.counters.errors += 1
                log.debug("suffix fleet: reading %s failed (%s); again in %.2f s", self.key, e, delay)
                await asyncio.sleep(delay)
                delay = min(MAX_BACKOFF_S, delay * 2)


def _entries(reply: Any) -> list[tuple[str, dict[str, Any]]]:
    """XREAD's reply for one stream as (id, fields) pairs; None (the block timed out) is none. An entry whose
    fields are not a flat list of pairs comes back with no fields (junk, counted by the caller)."""
    if not reply:
        return []
    (_key, items), *_ = reply
    return [(item[0], _fields(item[1] if len(item) > 1 else None)) for item in items]


def _fields(flat: Any) -> dict[str, Any]:
    if isinstance(flat, list) and len(flat) % 2 == 0:
        it = iter(flat)
        return dict(zip(it, it))
    return {}
