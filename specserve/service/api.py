"""The HTTP API (aiohttp): enqueue, status and result, resumable SSE streams, cancellation, health, metrics.

The API never touches the engine: it writes to the request stream and reads the per-request keys, so any
number of API processes can front any number of workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from opentelemetry import trace

from specserve.engine.sampling_params import InvalidParameter, SamplingParams
from specserve.queue.client import Enqueued, QueueClient
from specserve.queue.connection import TRANSIENT_ERRORS
from specserve.queue.keys import valid_request_id
from specserve.queue.wire import Delta, RequestBody, WireError, parse_body
from specserve.service import openai_api
from specserve.service.http import (
    MAX_BODY_KEY,
    ApiError,
    auth_middleware,
    errors_middleware,
    json_response,
    read_json,
    sse_send,
    sse_start,
)
from specserve.service.telemetry import METRICS_CONTENT_TYPE, Telemetry

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0
MODEL_CACHE_S = 5.0


@dataclass
class ApiSettings:
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int = 200_000
    api_keys: list[str] = field(default_factory=list)
    served_models: list[str] = field(default_factory=list)  # names this API answers for besides live workers'
    model_stale_s: float = 600.0  # a worker not seen for this long no longer vouches for its model


def _aliases(name: str) -> set[str]:
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return {name, base, base.removesuffix(".gguf")}


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
        self._stats_task: asyncio.Task[None] | None = None
        self._models_ok: dict[str, float] = {}  # model name -> when a live worker last vouched for it

    # ---- app ------------------------------------------------------------------------------------------

    def app(self, refresh_queue_stats: bool = True) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes,
            middlewares=[errors_middleware, auth_middleware(self.settings.api_keys)],
        )
        app[MAX_BODY_KEY] = self.settings.max_body_bytes
        app.router.add_post("/v1/requests", self.post_request)
        app.router.add_get("/v1/requests/{id}", self.get_request)
        app.router.add_get("/v1/requests/{id}/stream", self.stream_request)
        app.router.add_delete("/v1/requests/{id}", self.delete_request)
        openai_api.add_routes(app, self)
        add_health_routes(app, self.telemetry, self.readiness)
        app.on_startup.append(self._ensure_group)
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
        except (asyncio.TimeoutError, *TRANSIENT_ERRORS) as e:
            log.warning("consumer group not created at startup (%r); the first enqueue will create it", e)

    async def _start_stats(self, _app: web.Application) -> None:
        from specserve.queue.consumer import StreamConsumer  # the stats query lives with the consumer

        consumer = StreamConsumer(self.client.r, self.client.keys, "api")

        async def refresh() -> None:
            while True:
                with contextlib.suppress(*TRANSIENT_ERRORS):
                    self.telemetry.queue = await consumer.stats()
                await asyncio.sleep(2.0)

        self._stats_task = asyncio.create_task(refresh())

    async def _stop_stats(self, _app: web.Application) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.gather(self._stats_task, return_exceptions=True)

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        try:
            redis_ok = bool(await asyncio.wait_for(self.client.r.ping(), timeout=2.0))
        except (asyncio.TimeoutError, *TRANSIENT_ERRORS):
            redis_ok = False
        model_ok = self.model_ready() if self.model_ready is not None else None
        return redis_ok and model_ok is not False, {"redis": redis_ok, "model": model_ok}

    # ---- shared by the native and OpenAI routes -------------------------------------------------------

    async def known_models(self) -> dict[str, dict[str, Any]]:
        """Models live workers advertise, plus the ones configured here."""
        raw = await self.client.r.hgetall(self.client.keys.models)
        now = time.time()
        models: dict[str, dict[str, Any]] = {}
        for name, info in raw.items():
            data = orjson.loads(info)
            if now - float(data.get("seen", 0)) < self.settings.model_stale_s:
                models[name] = data
        for name in self.settings.served_models:
            models.setdefault(name, {})
        return models

    async def check_model(self, model: str | None) -> None:
        if model is None:
            return
        # A name seen recently skips the lookup (one round trip per request saved); misses always look.
        if time.monotonic() - self._models_ok.get(model, -MODEL_CACHE_S) < MODEL_CACHE_S:
            return
        models = await self.known_models()
        if not models:
            return  # nobody has said what is served yet: the worker checks it
        if any(model in _aliases(name) for name in models):
            self._models_ok[model] = time.monotonic()
        else:
            raise ApiError(
                404,
                f"model: {model!r} is not served here; try one of {sorted(models)}",
                "model",
                code="model_not_found",
            )

    def validate(self, data: dict[str, Any]) -> RequestBody:
        try:
            body = parse_body(data, self.settings.max_prompt_chars)
            sampling = {k: v for k, v in body.sampling.items() if not (k == "max_tokens" and v is None)}
            SamplingParams.from_dict(sampling)
        except (WireError, InvalidParameter) as e:
            raise ApiError(400, str(e), e.field) from None
        return body

    async def enqueue(
        self, request: web.Request, body: RequestBody, request_id: str | None = None
    ) -> Enqueued:
        await self.check_model(body.model)
        parent = Telemetry.extract(request.headers.get("traceparent"), request.headers.get("tracestate"))
        with self.telemetry.tracer.start_as_current_span("enqueue", context=parent) as span:
            carrier = Telemetry.inject(trace.set_span_in_context(span))
            try:
                result = await self.client.enqueue(
                    body, request_id, carrier.get("traceparent"), carrier.get("tracestate")
                )
            except WireError as e:
                raise ApiError(400, str(e), e.field) from None
            span.set_attribute("specserve.request_id", result.id)
        return result

    async def deltas(self, request_id: str, tokens: int = 0, chars: int = 0) -> AsyncIterator[Delta | None]:
        """A request's new output; None every KEEPALIVE_S while nothing happens (time for a keep-alive)."""
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()
        end = asyncio.CancelledError()  # a marker: the stream is over

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self.client.stream(request_id, tokens, chars)) as stream:
                    async for d in stream:
                        queue.put_nowait(d)
                queue.put_nowait(end)
            except Exception as e:  # handed to the reader, raised there
                queue.put_nowait(e)

        async def tick() -> None:
            while True:
                await asyncio.sleep(KEEPALIVE_S)
                queue.put_nowait(None)

        # A ticker instead of wait_for() around every get: one timer per stream, not one per token.
        tasks = [asyncio.create_task(pump()), asyncio.create_task(tick())]
        try:
            while True:
                item = await queue.get()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- native routes --------------------------------------------------------------------------------

    async def post_request(self, request: web.Request) -> web.Response:
        data = await read_json(request)
        request_id = data.pop("id", None)
        if request_id is not None and not valid_request_id(request_id):
            raise ApiError(400, "id: must be 1-200 characters of letters, digits, '_', '.', ':' or '-'", "id")
        timeout = data.pop("timeout", None)
        if timeout is not None:
            if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
                raise ApiError(400, "timeout: must be a positive number of seconds", "timeout")
            data["deadline"] = time.time() + timeout
        body = self.validate(data)
        result = await self.enqueue(request, body, request_id)
        status = 202 if result.created else 200
        return json_response(
            {"id": result.id, "status": result.status, "created": result.created}, status=status
        )

    async def get_request(self, request: web.Request) -> web.Response:
        result = await self.client.result(request.match_info["id"])
        if result is None:
            raise ApiError(404, f"id: no request {request.match_info['id']!r}", "id", code="not_found")
        return json_response(result.to_dict())

    async def delete_request(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        outcome, status = await self.client.cancel(rid)
        if outcome == "missing":
            raise ApiError(404, f"id: no request {rid!r}", "id", code="not_found")
        body = {"id": rid, "status": status, "cancelled": outcome in ("cancelled", "cancelling")}
        return json_response(body, status=202 if outcome == "cancelling" else 200)

    async def stream_request(self, request: web.Request) -> web.StreamResponse:
        """SSE `token` events with id "<tokens>.<chars>" (resume with Last-Event-ID), then `done`."""
        rid = request.match_info["id"]
        last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0.0"
        try:
            tokens, chars = (int(x) for x in last.split(".", 1))
        except ValueError:
            raise ApiError(400, "Last-Event-ID: expected <tokens>.<chars>", "Last-Event-ID") from None
        if not await self.client.info(rid) and not await self.client.r.exists(self.client.keys.out(rid)):
            raise ApiError(404, f"id: no request {rid!r}", "id", code="not_found")
        resp = await sse_start(request)
        with contextlib.suppress(ConnectionResetError):  # the client left; it can resume later
            async with contextlib.aclosing(self.deltas(rid, tokens, chars)) as deltas:
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
                        done = {"id": rid, "status": f.status, "finish_reason": f.finish_reason}
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
