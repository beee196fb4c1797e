"""The API's one way into the queue, shared by the native routes (service/api.py) and the OpenAI routes
(service/openai/): request validation, the `timeout` rule, model names, tenants, enqueue and reading
a request's output.

A body is validated here once, as the worker will read it (wire.parse_body, then SamplingParams), so a bad
field is a 400 naming it before anything is queued; the worker validates again at its own process boundary,
since raw producers skip this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web
from opentelemetry import trace

from specserve.engine.errors import InvalidParameter
from specserve.engine.grammar import StructuredOutputsParams, constraint_key
from specserve.engine.prepare import Check, GrammarPool
from specserve.engine.sampling_params import SamplingParams
from specserve.queue.client import Enqueued, QueueClient, QuotaExceeded
from specserve.queue.wire import Delta, RequestBody, WireError, model_aliases, parse_body
from specserve.service.config import ApiSettings
from specserve.service.http import PRIORITY_FLOOR_KEY, TENANT_KEY, ApiError
from specserve.service.telemetry import Telemetry

KEEPALIVE_S = 15.0  # a stream with nothing new for this long gets a keep-alive
MODEL_CACHE_S = 5.0  # a model name a live worker vouched for is trusted this long without a lookup
# `timeout` (seconds from now: the API's relative form of the wire's `deadline`) is bounded so the deadline it
# makes stays a sane unix time: 1e308 or inf would overflow a worker's arithmetic, and a month is past any
# reasonable wait for one generation.
MAX_TIMEOUT_S = 30 * 86400
DEFAULT_MAX_TOKENS = SamplingParams.__dataclass_fields__["max_tokens"].default
LIMIT_TEXT = {  # the limits scripts.ENQUEUE applies, as a client reads them in a 429
    "max_backlog": "the service's queue is full",
    "tenant_max_queued": "this API key has as many requests waiting as it may",
    "tenant_tokens_per_minute": "this API key has asked for as many tokens this minute as it may",
}


def deadline_after(timeout: Any) -> float:
    """The deadline (unix seconds) for a request's `timeout`; ApiError naming `timeout` unless it is a number
    in (0, MAX_TIMEOUT_S]. The one check for the native and the OpenAI routes and the CLI."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ApiError(
            400, f"timeout: must be a number of seconds above 0 and at most {MAX_TIMEOUT_S}", "timeout"
        )
    return time.time() + timeout


def validate(
    data: dict[str, Any], max_prompt_chars: int | None = None, max_logprobs: int = ApiSettings.max_logprobs
) -> RequestBody:
    """A wire body as the worker will read it; ApiError naming the field if it would fail there. A
    constraint's grammar is not built here (see Gateway.prepare)."""
    try:
        body = parse_body(data, max_prompt_chars)
        SamplingParams.from_dict(body.sampling_fields()).check_logprobs(max_logprobs)
    except (WireError, InvalidParameter) as e:
        raise ApiError(400, str(e), e.field) from None
    return body


class Gateway:
    def __init__(self, client: QueueClient, telemetry: Telemetry, settings: ApiSettings) -> None:
        self.client = client
        self.telemetry = telemetry
        self.settings = settings
        self.grammars = GrammarPool(settings.prepare_workers, settings.prepare_timeout_s)
        self._models_ok: dict[str, float] = {}  # model name -> when a live worker last vouched for it
        self._open: set[asyncio.Queue[Any]] = set()  # the queues of the streams being read now
        self._end = asyncio.CancelledError()  # a marker a stream's queue gets: the stream is over

    def validate(self, data: dict[str, Any]) -> RequestBody:
        return validate(data, self.settings.max_prompt_chars, self.settings.max_logprobs)

    async def prepare(self, body: RequestBody, tools: list[Check] = ()) -> None:
        """Build the body's grammar and any tools' schemas in the grammar pool, within its budget: a bad or
        over-budget one is a 400 naming its field. Nothing is built in this process: xgrammar would bring
        torch in, and a build holds the event loop for as long as it runs (seconds for `[a-z]{1,60000}`)."""
        job = list(tools)
        constraint = body.sampling.get("structured_outputs")
        if constraint is not None:
            kind, text = constraint_key(StructuredOutputsParams.from_dict(constraint))
            job.append((f"structured_outputs.{kind}", kind, text))
        try:
            await self.grammars.check(job)
        except InvalidParameter as e:
            raise ApiError(400, str(e), e.field) from None

    def close(self) -> None:
        self.grammars.close()

    # ---- models ---------------------------------------------------------------------------------------

    async def known_models(self) -> dict[str, dict[str, Any]]:
        """Models live workers advertise, plus the ones configured here."""
        raw = await self.client.r.hgetall(self.client.keys.models)
        now = time.time()
        models: dict[str, dict[str, Any]] = {}
        for name, info in raw.items():
            data = orjson.loads(info)
            # a worker's word holds for the ttl_s it gave (a couple of its heartbeats)
            ttl = float(data.pop("ttl_s", self.settings.model_stale_s))
            if now - float(data.get("seen", 0)) < ttl:
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
        if any(model in model_aliases(name) for name in models):
            self._models_ok[model] = time.monotonic()
        else:
            raise ApiError(
                404,
                f"model: {model!r} is not served here; try one of {sorted(models)}",
                "model",
                code="model_not_found",
            )

    # ---- tenants --------------------------------------------------------------------------------------
    # With API keys, every request belongs to the tenant of the key that made it. Ids on the native routes
    # are the client's own, scoped per tenant: in Redis the request is "<tenant>:<id>" (so two tenants may
    # use the same id, and neither can squat or read the other's), and the status hash records the tenant.
    # Without keys there is one tenant, unnamed, and ids are used as given.

    @staticmethod
    def redis_id(request: web.Request, client_id: str) -> str:
        tenant = request.get(TENANT_KEY)
        return client_id if tenant is None else f"{tenant}:{client_id}"

    @staticmethod
    def owns(request: web.Request, info: dict[str, str]) -> bool:
        tenant = request.get(TENANT_KEY)
        return tenant is None or info.get("tenant") == tenant

    # ---- the queue ------------------------------------------------------------------------------------

    @staticmethod
    def check_priority(request: web.Request, body: RequestBody) -> None:
        """A key with a priority floor may not ask to run sooner than it: otherwise any key could put its
        requests ahead of every other tenant's."""
        floor = request.get(PRIORITY_FLOOR_KEY)
        if floor is not None and body.priority < floor:
            raise ApiError(
                400, f"priority: this API key may ask for {floor} or more (lower runs sooner)", "priority"
            )

    async def enqueue(self, request: web.Request, body: RequestBody, request_id: str) -> Enqueued:
        """`request_id` is the id in Redis (see redis_id)."""
        (result,) = await self.enqueue_all(request, [body], [request_id])
        return result

    async def enqueue_all(
        self, request: web.Request, bodies: list[RequestBody], request_ids: list[str]
    ) -> list[Enqueued]:
        """Requests of one client call (the choices of n > 1), all or none: a limit that refuses one refuses
        them all, so no choice runs on that nobody will read."""
        for body in bodies:
            await self.check_model(body.model)
            self.check_priority(request, body)
        key_tenant = request.get(TENANT_KEY)
        if key_tenant is not None:  # the key decides whose share and quotas a request counts against
            if any(body.tenant not in (None, key_tenant) for body in bodies):
                raise ApiError(400, "tenant: set by the API key; give this key's tenant or none", "tenant")
            for body in bodies:
                body.tenant = key_tenant
        parent = Telemetry.extract(request.headers.get("traceparent"), request.headers.get("tracestate"))
        with self.telemetry.tracer.start_as_current_span("enqueue", context=parent) as span:
            carrier = Telemetry.inject(trace.set_span_in_context(span))
            try:
                results = await self.client.enqueue_all(
                    list(zip(bodies, request_ids)),
                    carrier.get("traceparent"),
                    carrier.get("tracestate"),
                    tenant=bodies[0].tenant,
                    tokens=await self.tokens_asked(bodies[0]),
                )
            except WireError as e:
                raise ApiError(400, str(e), e.field) from None
            except QuotaExceeded as e:
                self.telemetry.refused.add(
                    1, {"limit": e.limit, "tenant": self.telemetry.tenant_label(bodies[0].tenant)}
                )
                raise ApiError(
                    429,
                    f"{e.limit}: {LIMIT_TEXT[e.limit]}; retry after {e.retry_after} s",
                    e.limit,
                    type="rate_limit_error" if e.limit.startswith("tenant") else "overloaded_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(e.retry_after)},
                ) from None
            span.set_attribute("specserve.request_id", ",".join(r.id for r in results))
        return results

    async def tokens_asked(self, body: RequestBody) -> int:
        """What a request counts against its tenant's tokens per minute: the output it asks for. `max_tokens:
        null` asks for the rest of the context, as long as the served model's (its workers say)."""
        if not self.client.limits.tenant_tokens_per_minute:
            return 0
        if body.fills_context:
            known = await self.known_models()
            return max((int(info.get("max_model_len", 0)) for info in known.values()), default=0)
        asked = body.sampling.get("max_tokens", DEFAULT_MAX_TOKENS)
        return asked if isinstance(asked, int) else 0

    async def deltas(
        self, request_id: str, tokens: int = 0, chars: int = 0, keepalive: bool = True
    ) -> AsyncIterator[Delta | None]:
        """A request's new output; with `keepalive`, None every KEEPALIVE_S while nothing happens (time for
        a keep-alive)."""
        queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()
        end = self._end

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self.client.stream(request_id, tokens, chars)) as stream:
                    async for d in stream:
                        queue.put_nowait(d)
                queue.put_nowait(end)
            except Exception as e:  # the stream's error (Redis gone, say) is its reader's, raised there
                queue.put_nowait(e)

        async def tick() -> None:
            while True:
                await asyncio.sleep(KEEPALIVE_S)
                queue.put_nowait(None)

        # A ticker instead of wait_for() around every get: one timer per stream, not one per token.
        tasks = [asyncio.create_task(pump())] + ([asyncio.create_task(tick())] if keepalive else [])
        self._open.add(queue)
        try:
            while True:
                item = await queue.get()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._open.discard(queue)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def end_streams(self) -> None:
        """End every stream being read (the API is shutting down): its response ends cleanly now, and its
        client resumes elsewhere with Last-Event-ID, instead of being cut off after the shutdown timeout."""
        for queue in self._open:
            queue.put_nowait(self._end)
