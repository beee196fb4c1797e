"""A lean Redis client for the commands every request makes: RESP over an asyncio protocol, parsed by hiredis.

redis-py spends ~150 us of Python on each command (pool checkout, retry and timeout wrappers, observability
hooks), and on an event loop that has sat idle through an engine step, with its caches cold, a hop through
Redis took 1.2 ms with it against 0.54 ms here. Every request makes a handful of these hops in a row.

Commands from any number of tasks share one connection and Redis answers in order, so each reply goes to the
oldest waiting caller; a caller that gives up leaves its place in the line. Commands issued in the same turn
of the event loop go out in one write at its end: a write to loopback costs ~0.1 ms here (it wakes the
reader), more than the Python of a command.
A blocking read (XREAD/XREADGROUP BLOCK) would hold up everyone behind it, so it gets a client of its own.
The server, credentials, database and TLS context are those of the redis-py client it is made from, and
errors are redis-py's exceptions, so callers' handling of transient errors (TRANSIENT_ERRORS) is unchanged.
A lost connection fails what was in flight with ConnectionError and the next command connects again; a
READONLY reply (a failed-over primary) drops the connection, so the next one reaches the new primary.
On a cluster it talks to the master of one slot (every key of a shard shares it, queue/keys.py); a MOVED
or CLUSTERDOWN reply drops the connection too, and each new connection asks the cluster client for a fresh
slot map first, so after a failover or a slot move the next command reaches the slot's new owner. An ASK (the
slot half migrated, the command's keys already on the target) is answered on a connection to the node it
names, with ASKING first, as Cluster asks clients to (not a script: it waits for the move to end, _is_script);
the slot's own connection stays. These replies mean the
command did not run, so `execute` retries them whatever the command, and `pipeline` sends again just the
commands that got one: nothing that ran is sent twice. One exception: a script that reaches, midway, a key the
migration has already moved stops there (ScriptKeyMoved), and is run again from the start as well; every
script in queue/ is safe to run again after stopping at any of its commands.

Binary-safe: replies are decoded as UTF-8 with surrogateescape, so bytes that are not UTF-8 (anyone can XADD
them) come back as lone surrogates instead of failing the whole reply, and with it every command behind it
on the connection. `as_bytes` gives the original bytes back; `is_text` tells whether a value was valid
UTF-8. A field is checked where it is known to be text (queue/wire.py), so one bad entry fails alone.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import hiredis
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # redis-py maps an error reply to its exception class here (LOADING -> BusyLoadingError, ...)
    from redis._parsers.base import BaseParser
except ImportError:  # pragma: no cover - older layouts
    from redis.connection import BaseParser  # type: ignore[no-redef]

Command = Sequence[str | bytes | int | float]


class _ErrorReply(Exception):
    """What hiredis returns for an error reply, before it becomes redis-py's exception."""


@dataclass(frozen=True)
class Endpoint:
    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # a unix socket instead of host:port
    username: str | None = None
    password: str | None = None
    db: int = 0
    ssl: ssl.SSLContext | None = None
    connect_timeout: float = 5.0

    @classmethod
    def of(cls, redis: Redis) -> Endpoint:
        """Where a redis-py client connects, with the same credentials and TLS settings."""
        return cls._of(redis.connection_pool.connection_class, redis.connection_pool.connection_kwargs)

    @classmethod
    def of_slot(cls, cluster: RedisCluster, key: str) -> Endpoint:
        """The master of `key`'s slot, as the cluster client's slot map has it."""
        node = cluster.get_node_from_key(key)
        if node is None:
            raise ClusterDownError(f"no master holds the slot of {key}")
        return cls._of(node.connection_class, node.connection_kwargs)

    @classmethod
    def _of(cls, connection_class: type, kw: dict[str, Any]) -> Endpoint:
        context = None
        if issubclass(connection_class, SSLConnection):
            # redis-py builds its TLS context from the URL's ssl_* arguments: build the same one.
            context = connection_class(**kw).ssl_context.get()
        return cls(
            host=kw.get("host", "127.0.0.1"),
            port=int(kw.get("port", 6379)),
            path=kw.get("path") if issubclass(connection_class, UnixDomainSocketConnection) else None,
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db") or 0),
            ssl=context,
            connect_timeout=float(kw.get("socket_connect_timeout") or 5.0),
        )


class ScriptKeyMoved(TryAgainError):
    """A script stopped by its slot's migration: at a key already moved to the target (Valkey: "Script
    attempted to access a non local key"), or at a command over keys of which some have moved (the TRYAGAIN
    of a script: "... undeclared keys were accessed during rehashing of the slot"). Unlike TRYAGAIN it may
    come after some of the script's writes: the scripts of queue/ are written so that running one again from
    the start is safe (an ownership move is the last write), so it is retried as TRYAGAIN is, until the
    migration ends and MOVED names the slot's new owner."""


SCRIPT_STOPPED_BY_MIGRATION = (
    "Script attempted to access a non local key",
    "undeclared keys were accessed during rehashing of the slot",
)


def stopped_by_migration(error: Exception | str) -> bool:
    """Whether an error reply is a script stopped midway by its slot's migration (ScriptKeyMoved)."""
    text = str(error)
    return any(t in text for t in SCRIPT_STOPPED_BY_MIGRATION)


def _error_of(reply: _ErrorReply) -> Exception:
    text = str(reply)
    if stopped_by_migration(text):
        return ScriptKeyMoved(text)
    return BaseParser.parse_error(text)


# Replies after which this connection no longer reaches the owner of the slot (or the primary).
_MOVED_ON = (ReadOnlyError, MovedError, ClusterDownError)
# Replies that say the command did not run: retried by `execute` whatever the command.
_NOT_RUN = (AskError, ClusterDownError, TryAgainError)
NOT_RUN_RETRIES = 40  # with the backoff below (capped at 0.25 s): about 8 s, a cluster's failover and more


def not_run_pause(tries: int) -> float:
    """Seconds before the next try of a command turned away unrun (or a script a slot's move stopped)."""
    return min(0.25, 0.01 * 2**tries)


# Retries after a lost connection or a timeout start only within this long of the first try. A failover's
# refused connections fail at once and are retried all along; a master that stopped answering (stopped, cut
# off, its slot not failed over) costs a whole socket timeout a try, and retrying it `retries` times kept a
# caller waiting a minute for an answer (an enqueue's 503) it could have had in seconds.
RETRY_WINDOW_S = 8.0


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.reader = hiredis.Reader(
            encoding="utf-8", errors="surrogateescape", replyError=_ErrorReply, notEnoughData=False
        )
        self.waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        self._out: list[bytes] = []  # written at the end of this turn of the loop
        self.scripts: set[str] = set()  # SHA1s of the scripts sent by EVAL on this connection: cached there

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)

    def send(self, data: bytes, replies: int) -> list[asyncio.Future[Any]]:
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            raise RedisConnectionError(f"connection to Redis lost: {self.lost}")
        deadline = self.loop.time() + self.timeout
        futures = [self.loop.create_future() for _ in range(replies)]
        self.waiting.extend((f, deadline) for f in futures)
        if not self._out:
            self.loop.call_soon(self._write)
        self._out.append(data)
        if self._timer is None:
            self._timer = self.loop.call_at(deadline, self._check_timeout)
        return futures

    def _write(self) -> None:
        data, self._out = b"".join(self._out), []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)  # if it closed meanwhile, connection_lost fails the callers

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            if isinstance(reply, _ErrorReply):
                reply = _error_of(reply)
            if not self.waiting:  # a reply nobody asked for: the stream is out of step, start afresh
                if self.transport is not None:
                    self.transport.abort()
                return
            future, _ = self.waiting.popleft()
            if not future.done():  # its caller may have given up; the reply still held its place
                future.set_result(reply)
            if isinstance(reply, _MOVED_ON) and self.transport is not None:
                self.transport.close()  # talking to a replica now: reconnect to whoever is primary

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to Redis lost ({exc or 'closed by the server'})"))

    def _check_timeout(self) -> None:
        self._timer = None
        if not self.waiting:
            return
        deadline = self.waiting[0][1]
        if self.loop.time() < deadline:
            self._timer = self.loop.call_at(deadline, self._check_timeout)
            return
        self._fail(RedisTimeoutError(f"no reply from Redis within {self.timeout:.1f} s"))
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        if self.lost is None:
            self.lost = exc
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class RespClient:
    """Commands pipelined on one connection to the server of a redis-py client, opened on first use and again
    after it is lost.

    A reply is waited for as long as the redis-py client's socket timeout, plus `block_ms` for a client that
    runs blocking reads (XREAD ... BLOCK block_ms).
    """

    def __init__(self, redis: Redis | RedisCluster, block_ms: int = 0, route: str = "") -> None:
        self._redis = redis
        self._route = route  # a cluster: the key whose slot's master this client talks to
        if isinstance(redis, RedisCluster):
            socket_timeout = redis.nodes_manager.connection_kwargs.get("socket_timeout") or 30.0
        else:
            socket_timeout = redis.connection_pool.connection_kwargs.get("socket_timeout") or 30.0
        self.timeout = float(socket_timeout) + block_ms / 1000
        self._endpoint: Endpoint | None = None  # resolved at the first connect, as redis-py does
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._closed = False

    async def execute(self, *args: str | bytes | int | float, retries: int = 0) -> Any:
        """One command; an error reply raises. `retries`: for idempotent commands, how many more tries
        after a lost connection or a timeout (as redis-py's client retries them)."""
        reply = await self._execute(args, retries)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _execute(self, command: Command, retries: int) -> Any:
        attempt = not_run = 0
        loop = asyncio.get_running_loop()
        until = loop.time() + RETRY_WINDOW_S
        while True:
            try:
                proto = await self._ready()
                data = _pack(proto, command)
                (future,) = proto.send(data, 1)
                reply = await future
                if _is_ask(reply) and not _is_script(command):
                    reply = await self._asking(reply, data)
            except (RedisConnectionError, RedisTimeoutError):
                if attempt == retries or self._closed or loop.time() > until:
                    raise
                await asyncio.sleep(0.02 * 2**attempt)
                attempt += 1
                continue
            if isinstance(reply, NoScriptError) and not_run < NOT_RUN_RETRIES and not self._closed:
                proto.scripts.discard(str(_script_sha(command)))  # the next try sends the script itself
                not_run += 1
                continue
            if isinstance(reply, _NOT_RUN) and not_run < NOT_RUN_RETRIES and not self._closed:
                await asyncio.sleep(not_run_pause(not_run))
                not_run += 1
                continue
            return reply

    async def _asking(self, ask: AskError, data: bytes) -> Any:
        """The command once more, on the node an ASK names, preceded by ASKING (good for one command)."""
        if self._endpoint is None:
            return ask
        proto = await self._open(replace(self._endpoint, host=ask.host, port=ask.port))
        try:
            _, reply = await asyncio.gather(*proto.send(b"".join([_ASKING, data]), 2))
        finally:
            if proto.transport is not None:
                proto.transport.close()
        return reply

    async def pipeline(
        self, commands: Sequence[Command], raise_on_error: bool = True, retried: list[int] | None = None
    ) -> list[Any]:
        """Several commands in one write. An error reply raises (the first one), or with raise_on_error=False
        comes back in its place, as an exception. `retried` gets the positions of the commands that were
        turned away and ran again on their own, after the commands behind them."""
        if not commands:
            return []
        proto = await self._ready()
        multi = any(str(c[0]).upper() == "MULTI" for c in commands)
        # In MULTI every script goes whole: a NOSCRIPT there would fail one command of the transaction.
        packed = [hiredis.pack_command(tuple(c)) if multi else _pack(proto, c) for c in commands]
        replies = list(await asyncio.gather(*proto.send(b"".join(packed), len(commands))))
        # Commands a redirect, a failover or an emptied script cache turned away did not run: each goes again
        # on its own, with execute's retries. Not inside MULTI, where they must run together or not at all.
        if not multi:
            for i, reply in enumerate(replies):
                if isinstance(reply, NoScriptError):
                    proto.scripts.discard(str(_script_sha(commands[i])))
                if isinstance(reply, (*_NOT_RUN, NoScriptError)) and not self._closed:
                    replies[i] = await self._execute(commands[i], 0)
                    if retried is not None:
                        retried.append(i)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return list(replies)

    async def aclose(self) -> None:
        self._closed = True
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None

    async def _ready(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.lost is None:
            return proto
        if self._closed:
            raise RedisConnectionError("the client is closed")
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            # shielded: one caller giving up must not cancel the connection the others wait for
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> _Protocol:
        if isinstance(self._redis, RedisCluster):
            # Each new connection follows the cluster's current map: the last one may have ended with the
            # slot's master (a failover) or with the slot moving away.
            await self._redis.nodes_manager.initialize()
            self._endpoint = Endpoint.of_slot(self._redis, self._route)
        elif self._endpoint is None:
            self._endpoint = Endpoint.of(self._redis)
        proto = await self._open(self._endpoint)
        if self._closed:
            if proto.transport is not None:
                proto.transport.close()
            raise RedisConnectionError("the client is closed")
        self._proto = proto
        return proto

    async def _open(self, e: Endpoint) -> _Protocol:
        """A connection to `e`, authenticated and on its database."""
        loop = asyncio.get_running_loop()

        def factory() -> _Protocol:
            return _Protocol(self.timeout)

        try:
            if e.path is not None:
                opening = loop.create_unix_connection(factory, e.path)
            else:
                opening = loop.create_connection(
                    factory, e.host, e.port, ssl=e.ssl, server_hostname=e.host if e.ssl else None
                )
            _, proto = await asyncio.wait_for(opening, e.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            where = e.path or f"{e.host}:{e.port}"
            raise RedisConnectionError(f"cannot connect to Redis at {where}: {exc}") from exc
        hello: list[Command] = []
        if e.password is not None:
            hello.append(("AUTH", e.username, e.password) if e.username else ("AUTH", e.password))
        if e.db:
            hello.append(("SELECT", e.db))
        if hello:
            data = b"".join(hiredis.pack_command(tuple(c)) for c in hello)
            for reply in await asyncio.gather(*proto.send(data, len(hello))):
                if isinstance(reply, Exception):
                    if proto.transport is not None:
                        proto.transport.close()
                    raise reply
        return proto


_ASKING = hiredis.pack_command(("ASKING",))
_SHA: dict[str, str] = {}  # script text -> its SHA1 (the scripts are the modules' constants: a few)


def _script_sha(command: Command) -> str | None:
    """The SHA1 of an EVAL's script (None for any other command)."""
    if len(command) < 2 or command[0] != "EVAL" or not isinstance(command[1], str):
        return None
    sha = _SHA.get(command[1])
    if sha is None:
        sha = _SHA[command[1]] = hashlib.sha1(command[1].encode()).hexdigest()
    return sha


def _pack(proto: _Protocol, command: Command) -> bytes:
    """The command as it goes on `proto`'s connection: an EVAL whose script that connection already sent goes
    as EVALSHA (its 1-3 KB of text become 40 bytes: most of what the output path sent per token). The first
    EVAL of a script on a connection goes whole, and loads it into that server's cache before anything sent
    after it runs; a new connection (a restart, a failover, a slot moved) starts over. A NOSCRIPT all the
    same (SCRIPT FLUSH) means the command did not run: it goes again whole (execute, pipeline)."""
    sha = _script_sha(command)
    if sha is None:
        return hiredis.pack_command(tuple(command))
    if sha in proto.scripts:
        return hiredis.pack_command(("EVALSHA", sha, *command[2:]))
    proto.scripts.add(sha)
    return hiredis.pack_command(tuple(command))


def _is_script(command: Command) -> bool:
    """EVAL / EVALSHA. A script is not followed to the node an ASK names: Valkey runs its commands there as
    ASKING too, so a key not yet imported reads as absent and a write creates it on the target, where the
    migration's MIGRATE of the source's copy then fails (BUSYKEY). It waits on the source instead, as for
    TRYAGAIN, until the slot has moved (MOVED)."""
    return str(command[0]).upper() in ("EVAL", "EVALSHA")


def _is_ask(reply: Any) -> bool:
    """An ASK redirect (MOVED is its subclass in redis-py, and means something else: the slot has moved)."""
    return isinstance(reply, AskError) and not isinstance(reply, MovedError)


def is_text(value: str) -> bool:
    """Whether a decoded reply value was valid UTF-8 (it holds no escaped byte)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def as_bytes(value: str | bytes) -> bytes:
    """A reply value's original bytes (escaped bytes restored), for writing it back to Redis unchanged."""
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


def fields_dict(flat: list[str] | None) -> dict[str, str]:
    """A stream entry's [field, value, ...] as a dict (what redis-py hands out)."""
    if not flat:
        return {}
    it = iter(flat)
    return dict(zip(it, it))
