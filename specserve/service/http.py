"""HTTP plumbing shared by the API and the worker's health server: JSON errors, auth and tenants, SSE, and
the connection guard (a cap on open connections, header and body read timeouts)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from redis.exceptions import OutOfMemoryError

from specserve.engine.prepare import GrammarUnavailable
from specserve.queue.connection import UNAVAILABLE_ERRORS
from specserve.queue.wire import MAX_JSON_DEPTH, too_deep
from specserve.service.config import HttpLimits

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT_KEY = web.AppKey("body_timeout_s", float)
TENANT_KEY = web.RequestKey("tenant", str)  # set by auth_middleware when keys are configured
# The most urgent `priority` the request's key may ask for (lower runs sooner), where its key has a floor
PRIORITY_FLOOR_KEY = web.RequestKey("priority_floor", int)
# nginx's code for "the client closed the connection before the answer": not the server's failure, so it
# must not count as a 5xx (nobody receives this response; it exists for the metrics and the access log).
CLIENT_CLOSED = 499
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ApiError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}; `param` names the field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers  # e.g. Retry-After

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


class ClientGone(Exception):
    """The client closed its connection before its request was read: not an error of ours."""


class _NonFinite(Exception):
    def __init__(self, field: str) -> None:
        self.field = field


def _non_finite_field(raw: bytes) -> str | None:
    """The key whose value is NaN, Infinity or a number beyond a double (1e999), if that is why orjson refused
    the body: so the error names the field, as for any other bad value. Only for refused bodies."""
    bad = object()

    def number(text: str) -> Any:
        value = float(text)
        return value if math.isfinite(value) else bad

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        for key, value in items:
            if value is bad or (isinstance(value, list) and any(v is bad for v in value)):
                raise _NonFinite(key)
        return dict(items)

    try:
        json.loads(raw, parse_constant=lambda _: bad, parse_float=number, object_pairs_hook=pairs)
    except _NonFinite as e:
        return e.field
    except (ValueError, RecursionError):
        return None
    return None


async def read_json(request: web.Request) -> dict[str, Any]:
    timeout = request.app.get(BODY_TIMEOUT_KEY)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app.get(MAX_BODY_KEY)
        raise ApiError(
            413, f"body: larger than the limit of {limit} bytes", "body", code="too_large"
        ) from None
    except TimeoutError:
        # A slow body holds a connection and a handler: cut it off (the connection closes after the 408).
        raise ApiError(408, f"body: not received within {timeout:g} s", "body", code="body_timeout") from None
    except (ConnectionError, web.RequestPayloadError):
        if request.transport is None or request.transport.is_closing():
            raise ClientGone() from None
        raise ApiError(400, "body: malformed (truncated or bad chunked encoding)", "body") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        field = _non_finite_field(raw)
        if field is not None:
            raise ApiError(400, f"{field}: must be a finite number", field) from None
        raise ApiError(400, f"body: not valid JSON ({e})", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body: must be a JSON object", "body")
    reject_deep(data)
    return data


def reject_deep(data: Any) -> None:
    """A 400 naming the field nested past the wire's limit, before anything walks it (a schema validator, the
    wire's serializer)."""
    if (field := too_deep(data)) is not None:
        raise ApiError(400, f"{field}: nested deeper than {MAX_JSON_DEPTH} levels", field)


def _retry_later(message: str, code: str, after_s: int) -> web.Response:
    """A 503 that says plainly what failed and that the same call is worth making again, not a bare 500."""
    resp = ApiError(503, f"{message}, retry later", type="server_error", code=code).response()
    resp.headers["Retry-After"] = str(after_s)
    return resp


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        reason = e.reason if e.status != 413 else "body: request body too large"
        return ApiError(e.status, reason, "body" if e.status == 413 else None).response()
    except (ClientGone, ConnectionResetError):
        log.debug("client left during %s %s", request.method, request.path)
        return ApiError(CLIENT_CLOSED, "client closed the connection", code="client_closed").response()
    except OutOfMemoryError:
        # maxmemory reached with noeviction: Redis refused the write, so nothing was queued or changed.
        log.warning("Redis is out of memory (maxmemory); refusing %s %s", request.method, request.path)
        return _retry_later(
            "the queue's Redis is out of memory (maxmemory reached); nothing was queued",
            "redis_out_of_memory",
            5,
        )
    except GrammarUnavailable as e:
        # a grammar child that did not start (a node too loaded to run it): the request is not at fault
        log.warning("grammar checks unavailable on %s %s: %s", request.method, request.path, e)
        return _retry_later("grammar checks are not available; nothing was queued", "grammar_unavailable", 5)
    except UNAVAILABLE_ERRORS as e:
        # The queue's Redis is away (down, restarting, loading its append-only file, failing over).
        log.warning("Redis unavailable on %s %s: %s", request.method, request.path, e)
        return _retry_later("the queue's Redis is unavailable; nothing was done", "redis_unavailable", 2)
    except Exception:  # any handler's bug: the client gets a JSON 500, the server keeps serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error").response()


@dataclass(frozen=True)
class ApiKey:
    tenant: str  # who owns the requests made with this key; recorded in Redis (the token never is)
    token: bytes
    priority_floor: int | None = None  # the most urgent priority its requests may ask for (None: any)


def parse_api_keys(entries: Iterable[str], priority_floor: int | None = None) -> list[ApiKey]:
    """Key entries are `name:token` (several tokens may share a name: rotation) or a bare `token`, whose
    tenant is named after a hash of it. A bare token must not contain ':' (it would read as name:token).
    `name@N:token` gives that key a priority floor N of its own: its requests may ask for priority N or
    more (lower runs sooner); other keys get `priority_floor`."""
    keys: list[ApiKey] = []
    seen: set[str] = set()
    for n, entry in enumerate(entries, 1):
        name, sep, token = entry.partition(":")
        floor = priority_floor
        if not sep:
            name, token = "key-" + hashlib.sha256(entry.encode()).hexdigest()[:16], entry
        else:
            name, at, own = name.partition("@")
            if at:
                try:
                    floor = int(own)
                except ValueError:
                    raise ValueError(
                        f"API key {n} ({name}): the priority floor after '@' is an integer"
                    ) from None
            if not _TENANT_NAME.match(name):
                raise ValueError(f"API key {n}: a tenant name is 1-64 letters, digits, '_' or '-'")
        if not token:
            raise ValueError(f"API key {n} ({name}): empty token")
        if token in seen:
            raise ValueError(f"API key {n} ({name}): the same token is listed twice")
        seen.add(token)
        keys.append(ApiKey(name, token.encode(), floor))
    return keys


def auth_middleware(keys: list[ApiKey]):
    """Bearer-token auth on every route but health and metrics (no keys: no auth, and no tenant)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys and request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            given = token.encode()
            # Compare against every key, always, so timing does not tell which one (or which prefix) matched.
            matches = [k for k in keys if hmac.compare_digest(given, k.token)]
            if scheme.lower() != "bearer" or not matches:
                err = ApiError(
                    401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
                )
                resp = err.response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
            request[TENANT_KEY] = matches[0].tenant
            if matches[0].priority_floor is not None:
                request[PRIORITY_FLOOR_KEY] = matches[0].priority_floor
        return await handler(request)

    return check


async def sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    return resp


async def sse_send(
    resp: web.StreamResponse, data: Any, event: str | None = None, id: str | None = None
) -> None:
    lines = b""
    if id is not None:
        lines += b"id: " + id.encode() + b"\n"
    if event is not None:
        lines += b"event: " + event.encode() + b"\n"
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    await resp.write(lines + b"data: " + payload + b"\n\n")


# ---- slow clients and connection floods --------------------------------------------------------------------


# Unread bytes of a refused request are drained this long before closing, so the client still gets the answer
# (closing with unread data sends a reset that can destroy it); short, since a slow client is the case here.
LINGER_S = 2.0
_OVER_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s"
)
_OVER_CAPACITY_BODY = orjson.dumps(
    {
        "error": {
            "message": "too many open connections; retry later",
            "type": "server_error",
            "param": None,
            "code": "too_many_connections",
        }
    }
)


class _GuardedConnection(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection: counts it, refuses it over the cap, and closes it when its
    request headers take longer than the header timeout (aiohttp has no such timeout of its own)."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner: Any = inner  # aiohttp's RequestHandler
        self.refused = False
        self.busy = False  # a request's handler is running (headers complete): no header clock
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        if guard.open >= guard.limits.max_connections:
            self.refused = True
            guard.note_refused()
            assert isinstance(transport, asyncio.Transport)
            transport.write(_OVER_CAPACITY % (len(_OVER_CAPACITY_BODY), _OVER_CAPACITY_BODY))
            transport.close()
            return
        guard.open += 1
        guard.connections[self.inner] = self
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if not self.busy and self.timer is None:
            self._arm()  # a kept-alive connection starts its next request: its headers are on the clock
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def pause_writing(self) -> None:
        if not self.refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self.refused:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self._disarm()
        self.guard.open -= 1
        self.guard.connections.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def request_started(self) -> None:
        self.busy = True
        self._disarm()

    def request_done(self) -> None:
        self.busy = False

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.guard.limits.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expire(self) -> None:
        self.timer = None
        if not self.busy:
            self.inner.force_close()


class ConnectionGuard:
    WARN_EVERY_S = 60.0  # a flood refuses thousands of connections: one log line a minute says enough

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open = 0
        self.connections: dict[object, _GuardedConnection] = {}
        self._refused = 0  # since the last warning
        self._warned_at = -self.WARN_EVERY_S

    def note_refused(self) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._warned_at >= self.WARN_EVERY_S:
            log.warning(
                "%d connection(s) refused: %d open, the cap (SPECSERVE_MAX_CONNECTIONS)",
                self._refused,
                self.open,
            )
            self._refused, self._warned_at = 0, now

    def protocol_factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedConnection(self, server())

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        conn = self.connections.get(request.protocol)
        if conn is None:
            return await handler(request)
        conn.request_started()
        try:
            return await handler(request)
        finally:
            conn.request_done()


class _GuardedSite(web.BaseSite):
    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), self._host, self._port, backlog=self._backlog
        )


async def serve(app: web.Application, host: str, port: int, limits: HttpLimits) -> web.AppRunner:
    """Run `app` on host:port behind the connection guard and the read timeouts of `limits`."""
    guard = ConnectionGuard(limits)
    app.middlewares.insert(0, guard.middleware)  # outermost: the header clock stops once a handler runs
    app[BODY_TIMEOUT_KEY] = limits.body_timeout_s
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=5.0,
        keepalive_timeout=limits.keepalive_timeout_s,
        lingering_time=LINGER_S,
    )
    await runner.setup()
    await _GuardedSite(runner, host, port, guard).start()
    return runner
