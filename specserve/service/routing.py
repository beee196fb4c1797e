"""The worker's part in prefix-aware claiming (queue/routing.py has the protocol and its Redis side).

Fresh keyed entries this worker is cold for are offered to a warm worker before they are claimed; what was
passed here is read from this worker's pass stream and admitted as if read from the group; what this worker
passed and the other did not claim within the wait comes back and runs here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from specserve.queue.connection import TRANSIENT_ERRORS, retry_forever
from specserve.queue.consumer import StreamConsumer
from specserve.queue.routing import Router, RoutingConfig, prefix_key
from specserve.queue.wire import RequestBody, RequestEntry, WireError

log = logging.getLogger(__name__)

Admit = Callable[[list[RequestEntry]], Awaitable[None]]


class PrefixRouting:
    def __init__(self, consumer: StreamConsumer, router: Router, cfg: RoutingConfig, ttl_ms: int) -> None:
        self.consumer = consumer
        self.router = router
        self.cfg = cfg
        self.ttl_ms = ttl_ms
        self._warm: dict[str, float] = {}  # keys this worker advertised -> monotonic time they lapse
        self.passed = self.received = self.taken_back = 0

    def keys_of(self, batch: list[tuple[RequestEntry, RequestBody | WireError]]) -> dict[str, str]:
        """entry id -> routing key, for the entries that have one."""
        keys = {}
        for e, body in batch:
            if isinstance(body, RequestBody) and (key := prefix_key(body)) is not None:
                keys[e.entry_id] = key
        return keys

    async def offer(self, entries: list[RequestEntry], keys: dict[str, str]) -> dict[str, str]:
        """Pass the keyed entries this worker is cold for; entry id -> the worker each went to. A Redis
        error keeps them all here: routing is an optimisation, never a reason to wait."""
        now = time.monotonic()
        keyed = [(e, keys[e.entry_id]) for e in entries if e.entry_id in keys]
        cold = [(e, k) for e, k in keyed if self._warm.get(k, 0) < now]
        if not cold:
            return {}
        try:
            passed = await self.router.offer(cold, self.ttl_ms)
        except TRANSIENT_ERRORS as err:
            log.debug("prefix routing skipped: %s", err)
            return {}
        self.passed += len(passed)
        return passed

    async def started(self, route_keys: list[str]) -> None:
        """Advertise the keys of requests just started here (again only once half their time has gone)."""
        now = time.monotonic()
        fresh = [k for k in dict.fromkeys(route_keys) if self._warm.get(k, 0) < now]
        if not fresh:
            return
        if len(self._warm) > 4096:  # forget lapsed keys now and then
            self._warm = {k: t for k, t in self._warm.items() if t >= now}
        for k in fresh:
            self._warm[k] = now + self.cfg.warm_ttl_ms / 1000 / 2
        await self.router.advertise(fresh)

    async def take_back_later(self, entry: RequestEntry, passed_to: str, admit: Admit) -> None:
        """After the wait, run the entry here if `passed_to` has not claimed it."""
        await asyncio.sleep(self.cfg.wait_ms / 1000)
        ours = await retry_forever(lambda: self.router.take_back(entry, passed_to), what="take back")
        if ours is not None:
            self.taken_back += 1
            await admit([ours])

    async def receive(self, admit: Admit, stop: Callable[[], bool]) -> None:
        """Admit what other workers pass here, until `stop()`."""
        while not stop():
            try:
                ids = await retry_forever(self.router.passed_to_me, what="XREAD passes", stop=stop)
                if not ids:
                    continue
                entries = await self.consumer.entries(ids)
                self.received += len(entries)
                if entries:
                    await admit(entries)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad reply or one entry's error must not stop this worker taking passes
                log.exception("reading passed requests failed")
                await asyncio.sleep(0.5)
