"""The HTTP API (aiohttp): enqueue, status and result, resumable SSE streams, cancellation, health, metrics.

The API never touches the engine: it writes to the request stream and reads the per-request keys, so any
number of API processes can front any number of workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any

from aiohttp import web
from redis.exceptions import OutOfMemoryError

from specserve.queue.client import QueueClient, new_request_id
from specserve.queue.connection import TRANSIENT_ERRORS, stop_tasks
from specserve.queue.keys import valid_request_id
from specserve.service import batch
from specserve.service.config import ApiSettings
from specserve.service.gateway import Gateway, deadline_after
from specserve.service.http import (
    MAX_BODY_KEY,
    TENANT_KEY,
    ApiError,
    auth_middleware,
    errors_middleware,
    json_response,
    parse_api_keys,
    read_json,
    sse_send,
    sse_start,
)
from specserve.service.openai import routes as openai_routes
from specserve.service.telemetry import METRICS_CONTENT_TYPE, Telemetry

log = logging.getLogger(__name__)

_EVENT_ID = re.compile(r"^([0-9]{1,15})\.([0-9]{1,15})$")  # <tokens shown>.<characters shown>


class Api:
    def __init__(
        self,
        client: QueueClient,
        telemetry: Telemetry,
        settings: ApiSettings | None = None,
        model_ready: Callable[[], bool] | None = None,
    ) -> None:
        self.client = client
        self.telemetry = telemetry
        self.settings = settings or ApiSettings()
        self.model_ready = model_ready  # in-process worker (serve): its model is loaded
        self.keys = parse_api_keys(self.settings.api_keys, self.settings.key_priority_floor)
        self.gateway = Gateway(client, telemetry, self.settings)
        self._stats_task: asyncio.Task[None] | None = None

    # ---- app ------------------------------------------------------------------------------------------

    def app(self, refresh_queue_stats: bool = True) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=[errors_middleware, auth_middleware(self.keys)],
        )
        app[MAX_BODY_KEY] = self.settings.max_body_bytes
        app.router.add_post("/v1/requests", self.post_request)
        app.router.add_get("/v1/requests/{id}", self.get_request)
        app.router.add_get("/v1/requests/{id}/stream", self.stream_request)
        app.router.add_delete("/v1/requests/{id}", self.delete_request)
        openai_routes.add_routes(app, self.gateway)
        batch.add_routes(app, self.gateway, self.settings.max_file_bytes)
        add_health_routes(app, self.telemetry, self.readiness)
        app.on_startup.append(self._ensure_group)
        app.on_shutdown.append(self._end_streams)
        app.on_cleanup.append(self._close_gateway)
        if refresh_queue_stats:
            app.on_startup.append(self._start_stats)
            app.on_cleanup.append(self._stop_stats)
        app.on_response_prepare.append(self._count)
        return app

    async def _count(self, request: web.Request, response: web.StreamResponse) -> None:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        self.telemetry.http_requests.add(
            1, {"route": name, "method": request.method, "code": response.status}
        )

    async def _ensure_group(self, _app: web.Application) -> None:
        # The workers' group must exist before any worker does: a KEDA redis-streams trigger scales workers
        # up from zero on its lag. Redis being down must not hold up the API's start (its probes would fail);
        # the client then creates the group on its first enqueue.
        try:
            await asyncio.wait_for(self.client.ensure_group(), timeout=5.0)
        except (asyncio.TimeoutError, OutOfMemoryError, *TRANSIENT_ERRORS) as e:
            log.warning("consumer group not created at startup (%r); the first enqueue will create it", e)

    async def _close_gateway(self, _app: web.Application) -> None:
        self.gateway.close()  # its grammar pool's children

    async def _end_streams(self, _app: web.Application) -> None:
        self.gateway.end_streams()

    async def _start_stats(self, _app: web.Application) -> None:
        # the stats query lives with the consumer
        from specserve.queue.consumer import QueueStats, StreamConsumer

        consumers = [StreamConsumer(conns, keys, "api") for conns, keys in self.client.shards()]

        async def refresh() -> None:
            while True:
                with contextlib.suppress(*TRANSIENT_ERRORS):
                    self.telemetry.queue = QueueStats.combine([await c.stats() for c in consumers])
                await asyncio.sleep(2.0)

        self._stats_task = asyncio.create_task(refresh())

    async def _stop_stats(self, _app: web.Application) -> None:
        if self._stats_task is not None:
            await stop_tasks([self._stats_task])

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        try:
            redis_ok = bool(await asyncio.wait_for(self.client.r.ping(), timeout=2.0))
        except (asyncio.TimeoutError, *TRANSIENT_ERRORS):
            redis_ok = False
        model_ok = self.model_ready() if self.model_ready is not None else None
        return redis_ok and model_ok is not False, {"redis": redis_ok, "model": model_ok}

    # ---- native routes --------------------------------------------------------------------------------

    async def post_request(self, request: web.Request) -> web.Response:
        data = await read_json(request)
        client_id = data.pop("id", None)
        if client_id is None:
            client_id = new_request_id()
        elif not valid_request_id(client_id):
            raise ApiError(400, "id: must be 1-200 characters of letters, digits, '_', '.', ':' or '-'", "id")
        rid = self.gateway.redis_id(request, client_id)
        if not valid_request_id(rid):  # the tenant's prefix took it past 200 characters
            room = 200 - (len(rid) - len(client_id))
            raise ApiError(400, f"id: at most {room} characters with this API key", "id")
        timeout = data.pop("timeout", None)
        if timeout is not None:
            data["deadline"] = deadline_after(timeout)
        if isinstance(data.get("reply_to"), str):  # a tenant's reply streams are its own, like its ids
            data["reply_to"] = self.gateway.redis_id(request, data["reply_to"])
        body = self.gateway.validate(data)
        await self.gateway.prepare(body)
        result = await self.gateway.enqueue(request, body, rid)
        status = 202 if result.created else 200
        return json_response(
            {"id": client_id, "status": result.status, "created": result.created}, status=status
        )

    def _not_found(self, client_id: str) -> ApiError:
        return ApiError(404, f"id: no request {client_id!r}", "id", code="not_found")

    async def get_request(self, request: web.Request) -> web.Response:
        client_id = request.match_info["id"]
        result = await self.client.result(self.gateway.redis_id(request, client_id))
        if result is None or not self.gateway.owns(request, result.info):
            raise self._not_found(client_id)
        return json_response({**result.to_dict(), "id": client_id})

    async def delete_request(self, request: web.Request) -> web.Response:
        client_id = request.match_info["id"]
        rid = self.gateway.redis_id(request, client_id)
        outcome, status = await self.client.cancel(rid, request.get(TENANT_KEY))
        if outcome == "missing":
            raise self._not_found(client_id)
        body = {"id": client_id, "status": status, "cancelled": outcome in ("cancelled", "cancelling")}
        return json_response(body, status=202 if outcome == "cancelling" else 200)

    async def stream_request(self, request: web.Request) -> web.StreamResponse:
        """SSE `token` events with id "<tokens>.<chars>" (resume with Last-Event-ID), then `done`."""
        client_id = request.match_info["id"]
        rid = self.gateway.redis_id(request, client_id)
        last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0.0"
        match = _EVENT_ID.match(last)
        if match is None:
            raise ApiError(
                400, "Last-Event-ID: expected <tokens>.<chars>, two non-negative integers", "Last-Event-ID"
            )
        tokens, chars = int(match[1]), int(match[2])
        info = await self.client.info(rid)
        if info:
            if not self.gateway.owns(request, info):
                raise self._not_found(client_id)
        # A raw producer's request has no status hash until a worker claims it; only an open API shows it.
        elif request.get(TENANT_KEY) is not None or not await self.client.r.exists(
            self.client.keys_of(rid).out(rid)
        ):
            raise self._not_found(client_id)
        resp = await sse_start(request)
        with contextlib.suppress(ConnectionResetError):  # the client left; it can resume later
            async with contextlib.aclosing(self.gateway.deltas(rid, tokens, chars)) as deltas:
                async for d in deltas:
                    if d is None:
                        await resp.write(b": keep-alive\n\n")
                        continue
                    tokens += len(d.token_ids)
                    chars += len(d.text)
                    event_id = f"{tokens}.{chars}"
                    if d.token_ids or d.text:
                        data = {"offset": d.offset, "token_ids": d.token_ids, "text": d.text}
                        await sse_send(resp, data, "token", event_id)
                    if d.final is not None:
                        f = d.final
                        done = {"id": client_id, "status": f.status, "finish_reason": f.finish_reason}
                        done.update(usage=f.usage, error=f.error)
                        await sse_send(resp, done, "done", event_id)
        return resp


def add_health_routes(app: web.Application, telemetry: Telemetry, readiness) -> None:
    async def healthz(_request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        ok, detail = await readiness()
        return json_response({"ready": ok, **detail}, status=200 if ok else 503)

    async def metrics(_request: web.Request) -> web.Response:
        resp = web.Response(body=telemetry.metrics_text())
        resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return resp

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
