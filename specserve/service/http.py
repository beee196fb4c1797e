"""HTTP plumbing shared by the API and the worker's health server: JSON errors, auth, SSE."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)


class ApiError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}; `param` names the field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return json_response(body, status=self.status)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app.get(MAX_BODY_KEY)
        raise ApiError(
            413, f"body: larger than the limit of {limit} bytes", "body", code="too_large"
        ) from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"body: not valid JSON ({e})", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body: must be a JSON object", "body")
    return data


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
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error").response()


def auth_middleware(keys: list[str]):
    """Bearer-token auth on every route but health and metrics (no keys: no auth)."""
    encoded = [k.encode() for k in keys]

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if encoded and request.path not in OPEN_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            # Compare against every key, always, so timing does not tell which prefix matched.
            ok = scheme.lower() == "bearer" and any([hmac.compare_digest(token.encode(), k) for k in encoded])
            if not ok:
                err = ApiError(
                    401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
                )
                resp = err.response()
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
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
