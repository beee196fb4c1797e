"""Redis connections that survive bursts, blocking reads and server restarts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    MaxConnectionsError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specserve.queue.keys import Keys
from specserve.queue.resp import (
    NOT_RUN_RETRIES,
    RespClient,
    ScriptKeyMoved,
    not_run_pause,
    stopped_by_migration,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# A restarting server answers LOADING while it replays its append-only file; a failed-over primary that is
# now a replica answers READONLY until clients reconnect to the new one; a full server (maxmemory with
# noeviction) answers OOM to writes until results expire or an operator makes room. All of these are worth
# retrying: a worker's outputs and claims wait for the server, never dead-letter or drop a request.
# On a cluster, MOVED / ASK (the slot has another owner now), TRYAGAIN (a slot half migrated) and CLUSTERDOWN
# (a master lost, its replica not yet promoted) all mean the command did not run: retrying it is always safe.
REDIRECT_ERRORS: tuple[type[Exception], ...] = (AskError, TryAgainError, ClusterDownError)
# The server away, restarting, failing over or moving a slot: nothing was done, and the same call is worth
# making again (the API's 503 "retry later").
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    *REDIRECT_ERRORS,
    ClusterError,
    SlotNotCoveredError,
)
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (*UNAVAILABLE_ERRORS, OutOfMemoryError, OSError)


class NotReplicated(RedisTimeoutError):
    """Fewer replicas than asked acknowledged a write in time (WAIT): it may not survive a failover."""


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


def _on_node(url: str, node: str) -> str:
    """`url` with its host:port replaced by `node`'s (same scheme, credentials, options)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@{node}" if auth else node))


async def _cluster_enabled(url: str) -> bool:
    probe = Redis.from_url(url, socket_connect_timeout=5.0, socket_timeout=10.0, decode_responses=True)
    try:
        try:
            info = await probe.info("cluster")
        except ResponseError:  # an ACL user without INFO: CLUSTER INFO answers only on a cluster
            try:
                await probe.execute_command("CLUSTER", "INFO")
            except ResponseError:
                return False
            return True
    finally:
        await probe.aclose()
    return str(info.get("cluster_enabled", "0")) == "1"


async def is_cluster(url: str, seeds: Sequence[str] = ()) -> bool:
    """Whether the server at `url` (else the first of `seeds` that answers) is a node of a Redis / Valkey
    Cluster (`INFO cluster`'s cluster_enabled): the same REDIS_URL names a single instance or any node."""
    for i, candidate in enumerate([url, *(_on_node(url, s) for s in seeds)]):
        try:
            return await _cluster_enabled(candidate)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            if i == len(seeds):
                raise
    raise AssertionError("unreachable")


class WaitingRedisCluster(RedisCluster):
    """redis-py's cluster client, except that a burst waits for a connection: its node pools raise
    MaxConnectionsError once `max_connections` are out (256 first enqueues at once did, through
    bench/queue_cluster.py), where the single-instance client's BlockingConnectionPool waits. The wait is per
    node (redis-py raises it before touching the node's state), so a stopped master's full pool never holds
    up the commands for the others; it ends after WAIT_FOR_CONNECTION_S with the error."""

    WAIT_FOR_CONNECTION_S = 30.0

    async def execute_command(self, *args: object, **kwargs: object) -> object:
        deadline = asyncio.get_running_loop().time() + self.WAIT_FOR_CONNECTION_S
        pause = 0.001
        moved = 0
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            except MaxConnectionsError:
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
            except ResponseError as e:
                # A script stopped at a key its slot's migration already moved: run again, as the lean
                # client does (queue/resp.py ScriptKeyMoved), until the slot has moved and redis-py follows.
                if not stopped_by_migration(e):
                    raise
                if moved == NOT_RUN_RETRIES:
                    raise ScriptKeyMoved(str(e)) from e
                await asyncio.sleep(not_run_pause(moved))
                moved += 1


def connect_cluster(
    url: str,
    *,
    seeds: Sequence[str] = (),
    max_connections: int = 64,
    socket_timeout: float = BLOCK_MS / 1000 + 5.0,
) -> RedisCluster:
    """redis-py's cluster client, starting from the node `url` names and `seeds` (host:port): it finds the
    others itself, follows MOVED and ASK, and refreshes its slot map after a failover."""
    nodes = [ClusterNode(host, int(port)) for host, _, port in (s.rpartition(":") for s in seeds)]
    return WaitingRedisCluster.from_url(
        url,
        startup_nodes=nodes or None,
        max_connections=max_connections,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        socket_keepalive=True,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=6),
        require_full_coverage=False,  # a shard whose master is down must not stop the others being served
    )


async def open_redis(url: str, seeds: Sequence[str] = (), **kw: float | int) -> Redis | RedisCluster:
    """`connect`, or `connect_cluster` where the server says it is a cluster node (initialised)."""
    if not await is_cluster(url, seeds):
        return connect(url, **kw)  # type: ignore[arg-type]
    kw.pop("pool_timeout", None)
    client = connect_cluster(url, seeds=seeds, **kw)  # type: ignore[arg-type]
    await client.initialize()
    return client


def server_keys(redis: Redis | RedisCluster, keys: Keys) -> Keys:
    """The key names as this server needs them: hash-tagged on a cluster (queue/keys.py)."""
    cluster = isinstance(redis, RedisCluster)
    return keys if keys.cluster == cluster else replace(keys, cluster=cluster)


class Connections:
    """The Redis connections of one part of a process (a worker, a queue client), held and closed together.

    `redis` (redis-py) serves the occasional command; `fast`, the lean pipelined client, each request's own
    round trips (a hop through Redis costs half with it, see queue/resp.py); a blocking read (XREAD BLOCK)
    gets a lean client of its own from `blocking()`, as it would hold up everyone behind it. The parts that
    use them (StreamConsumer, Publisher, OutputReader) never close them: their owner does, with `aclose()`.

    On a cluster, the lean clients talk to the master of `route`'s slot: every key shares that slot (see
    queue/keys.py).
    """

    def __init__(self, redis: Redis | RedisCluster, route: str = "") -> None:
        self.redis = redis
        self.route = route
        self.fast = RespClient(redis, route=route)
        self._blocking: list[RespClient] = []

    def blocking(self, block_ms: int) -> RespClient:
        client = RespClient(self.redis, block_ms=block_ms, route=self.route)
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


async def stop_tasks(tasks: Sequence[asyncio.Task[object]], timeout: float = 10.0) -> None:
    """Cancel `tasks` and wait for them to end, for at most `timeout` seconds. On Python 3.11 a cancel that
    races a Redis reply can be swallowed (asyncio.wait_for inside redis-py) and a loop goes on: the cancel is
    repeated until each task has ended. An API's shutdown waited on such a loop until it was killed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pending = {t for t in tasks if not t.done()}
    while pending and loop.time() < deadline:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.1, max(0.0, deadline - loop.time())))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: a loop that failed as it stopped is not news at shutdown
