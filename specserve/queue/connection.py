"""Redis connections that survive bursts, blocking reads and server restarts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specserve.queue.resp import RespClient

log = logging.getLogger(__name__)
T = TypeVar("T")

# A restarting server answers LOADING while it replays its append-only file; a failed-over primary that is
# now a replica answers READONLY until clients reconnect to the new one; a full server (maxmemory with
# noeviction) answers OOM to writes until results expire or an operator makes room. All of these are worth
# retrying: a worker's outputs and claims wait for the server, never dead-letter or drop a request.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    OutOfMemoryError,
    OSError,
)

BLOCK_MS = 2000  # longest blocking XREADGROUP/XREAD; the socket timeout must exceed it


def connect(
    url: str,
    *,
    max_connections: int = 64,
    pool_timeout: float = 30.0,
    socket_timeout: float = BLOCK_MS / 1000 + 5.0,
) -> Redis:
    """A client on a blocking pool: a burst waits for a free connection instead of failing.

    redis:// and rediss:// URLs carry the ACL user and password (redis://user:pass@host:port/db).
    """
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        socket_keepalive=True,
        health_check_interval=30,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return Redis(connection_pool=pool)


class Connections:
    """The Redis connections of one part of a process (a worker, a queue client), held and closed together.

    `redis` (redis-py) serves the occasional command; `fast`, the lean pipelined client, each request's own
    round trips (a hop through Redis costs half with it, see queue/resp.py); a blocking read (XREAD BLOCK)
    gets a lean client of its own from `blocking()`, as it would hold up everyone behind it. The parts that
    use them (StreamConsumer, Publisher, OutputReader) never close them: their owner does, with `aclose()`.
    """

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.fast = RespClient(redis)
        self._blocking: list[RespClient] = []

    def blocking(self, block_ms: int) -> RespClient:
        client = RespClient(self.redis, block_ms=block_ms)
        self._blocking.append(client)
        return client

    async def aclose(self, close_redis: bool = False) -> None:
        for client in [self.fast, *self._blocking]:
            await client.aclose()
        if close_redis:
            await self.redis.aclose()


async def retry_forever(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    stop: Callable[[], bool] | None = None,
    max_delay: float = 1.0,
) -> T:
    """Run op until it succeeds, backing off across transient errors (a restart, a failover).

    Raises asyncio.CancelledError if `stop()` turns true while the server is unreachable.
    """
    delay = 0.02
    warned = False
    while True:
        try:
            return await op()
        except TRANSIENT_ERRORS as e:
            if not warned:
                log.warning("redis unavailable during %s (%s); retrying", what, e)
                warned = True
            if stop is not None and stop():
                raise asyncio.CancelledError(f"stopped while retrying {what}") from e
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 2)
