"""What the completions and chat completions routes share: a request's n choices fanned out as wire requests,
answered once at the end or streamed as Server-Sent Events (the choices' streams merged as their deltas
arrive), while its client is still there and its deadline has not passed.

A route (service/openai/completions.py, chat.py) says what its kind is, how a streamed choice's text becomes
chunks (ChoiceOutput) and what a stream opens with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from aiohttp import web

from specserve.engine.sampling_params import SEED_RANGE
from specserve.queue.wire import EXPIRED, FAILED, Delta, OutputEntry, RequestBody, Result
from specserve.service.gateway import Gateway
from specserve.service.http import ApiError, ClientGone, json_response, read_json, sse_send, sse_start
from specserve.service.openai.protocol import OpenAIRequest, as_sent, translate
from specserve.service.openai.responses import ChunkShaper, completion_body, raise_for

T = TypeVar("T")
WATCH_S = 0.5  # how often a waiting non-streaming request looks whether its client is still there
# A worker expires a running request at its deadline itself (it polls every 0.1 s); the API steps in only
# after this much more, for requests no worker has taken.
DEADLINE_GRACE_S = 1.0

Deltas = AsyncIterator[Delta]  # a choice's output, read without keep-alives (so never None)
Send = Callable[[int, Delta], Awaitable[None]]


def _nth_seed(seed: int, i: int) -> int:
    return seed + i if seed + i <= SEED_RANGE[1] else seed - i  # stays in what SamplingParams takes


def choice_bodies(body: RequestBody, n: int) -> list[RequestBody]:
    """The wire request of each of n choices: the same prompt and parameters, each sampling from a stream
    of its own (seed + i when a seed is given, as vLLM's; else the worker derives one from each id).
    Only the first asks for prompt_logprobs: they are the prompt's, the same for every choice, and each
    request asking for them computes its whole prompt with a vocabulary-wide top-k at every position (n = 16
    of a 2,000-character prompt held a short request beside them 35 s, tests/chaos/test_stall.py); the
    answer gives the first's to every choice."""
    if n == 1:
        return [body]
    seed = body.sampling.get("seed")
    out = []
    for i in range(n):
        sampling = dict(body.sampling)
        if seed is not None:
            sampling["seed"] = _nth_seed(seed, i)
        if i:
            sampling.pop("prompt_logprobs", None)
        out.append(dataclasses.replace(body, sampling=sampling))
    return out


class ChoiceOutput:
    """How one streamed choice's output becomes chunks: its text as it comes, its finish reason as given."""

    def delta(self, d: Delta) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The text and tool calls a delta adds to the choice's chunks."""
        return d.text, None

    def finish_reason(self, reason: str | None) -> str | None:
        return reason


async def merge_choices(choices: list[tuple[Delta, Deltas]], finals: list[Any], send: Send) -> None:
    """Hand `send` every later delta of the choices not yet ended, in the order they arrive."""
    if len(choices) == 1:  # one choice: read its stream directly
        if finals[0] is None:
            async for d in choices[0][1]:
                await send(0, d)
                if d.final is not None:
                    break
        return
    arrived: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()

    async def pump(index: int, deltas: Deltas) -> None:
        try:
            async for d in deltas:
                await arrived.put((index, d))
                if d.final is not None:
                    break
        finally:
            arrived.put_nowait((index, None))

    pumps = [
        asyncio.create_task(pump(i, deltas)) for i, (_, deltas) in enumerate(choices) if finals[i] is None
    ]
    try:
        live = len(pumps)
        while live:
            index, d = await arrived.get()
            if d is None:
                live -= 1
            else:
                await send(index, d)
    finally:
        for task in pumps:
            task.cancel()
        # let the cancels land: the streams may be closed only once nothing is iterating them
        await asyncio.gather(*pumps, return_exceptions=True)


class OpenAIServing:
    """One generating route: translate, fan out, then answer once or stream."""

    chat: ClassVar[bool]

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def choice_outputs(self, req: OpenAIRequest) -> list[ChoiceOutput]:
        """Each streamed choice's ChoiceOutput."""
        return [ChoiceOutput() for _ in range(req.n)]

    async def open_stream(self, resp: web.StreamResponse, shaper: ChunkShaper) -> None:
        """What a stream sends before any choice's output (nothing, unless the route says otherwise)."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        data = await read_json(request)
        try:
            return await self._answer(request, data)
        except ApiError as e:
            raise as_sent(e, data) from None

    async def _answer(self, request: web.Request, data: dict[str, Any]) -> web.StreamResponse:
        body, req = translate(self.gateway, data, self.chat)
        await self.gateway.prepare(body, req.tools.checks() if req.tools is not None else [])
        # n choices are n wire requests (vLLM v1 fans out the same way); their prompt's blocks are shared
        # through the prefix cache once the first has computed them.
        bodies = choice_bodies(body, req.n)
        rids = req.choice_ids()
        if not req.stream:
            # Straight from the output stream: no keep-alive ticker or pump task for an answer sent once. Its
            # subscription is made while the enqueue is in flight, not after it, where it would hold up the
            # worker's claim on the same event loop.
            waiting = [asyncio.create_task(self.gateway.client.wait(r)) for r in rids]
            results = asyncio.gather(*waiting)
            try:
                await self.gateway.enqueue_all(request, bodies, rids)
                got = await self._while_wanted(request, rids, results, body.deadline)
            finally:
                results.cancel()
                for w in waiting:
                    w.cancel()
                # Whatever the cancelled waits ended with (their errors were the answer's, raised above if
                # it was still wanted) is retrieved here, so a cancelled gather is not reported as lost.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await results
            for result in got:
                raise_for(result)
            return self._whole(req, list(got))
        await self.gateway.enqueue_all(request, bodies, rids)
        # No keep-alive comments: OpenAI and vLLM send none, and clients written against them choke on them
        # (vLLM's bench client strips each read before splitting on blank lines, so a comment swallows the
        # data: message glued after it).
        streams = [self.gateway.deltas(r, keepalive=False) for r in rids]
        try:
            first = asyncio.ensure_future(asyncio.gather(*(self._first(d) for d in streams)))
            try:
                firsts = await self._while_wanted(request, rids, first, body.deadline)
            finally:
                first.cancel()
                # let the cancel land: the stream may be closed only once nothing is iterating it (what it
                # ended with was raised above when it was still wanted)
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await first
            return await self._stream(request, rids, req, list(zip(firsts, streams)))
        finally:
            for d in streams:
                await d.aclose()

    async def _while_wanted(
        self, request: web.Request, rids: list[str], waiting: asyncio.Future[T], deadline: float | None
    ) -> T:
        """Wait for `waiting` while its client is still there and its deadline has not passed.

        A client that leaves cancels its request (nobody would read its tokens). At the deadline, a worker
        ends a request it runs (expired, answered with 408 through `raise_for`); one no worker has taken
        (none is up, say) is ended here, a moment later, with the same 408, instead of hanging the client."""
        while True:
            timeout = WATCH_S
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline + DEADLINE_GRACE_S - time.time()))
            done, _ = await asyncio.wait({waiting}, timeout=timeout)
            if done:
                return waiting.result()
            if request.transport is None or request.transport.is_closing():
                await self._cancel(rids)
                raise ClientGone()
            if deadline is not None and time.time() >= deadline + DEADLINE_GRACE_S:
                await self._cancel(rids)
                raise ApiError(
                    408,
                    "the deadline passed before the request was done",
                    "timeout",
                    type="timeout",
                    code="deadline_expired",
                )

    async def _cancel(self, rids: list[str]) -> None:
        for rid in rids:
            await self.gateway.client.cancel(rid)

    @staticmethod
    async def _first(deltas: Deltas) -> Delta:
        """The first real output: errors found by the worker still become a 4xx before any byte is sent."""
        async for d in deltas:
            if d is not None:
                if d.final is not None:
                    raise_for(d.final)
                return d
        raise ApiError(500, "the output stream ended without a result")

    @staticmethod
    def _whole(req: OpenAIRequest, results: list[Result]) -> web.Response:
        body = completion_body(req.id, req.created, req.model, req.chat, results, req.token_ids, req.tools)
        return json_response(body)

    async def _stream(
        self, request: web.Request, rids: list[str], req: OpenAIRequest, choices: list[tuple[Delta, Deltas]]
    ) -> web.StreamResponse:
        resp = await sse_start(request)
        try:
            await self._send_chunks(resp, req, choices)
        except ConnectionResetError:
            await self._cancel(rids)  # the client went away: stop spending steps on it
        return resp

    async def _send_chunks(
        self, resp: web.StreamResponse, req: OpenAIRequest, choices: list[tuple[Delta, Deltas]]
    ) -> None:
        """The choices' chunks as their tokens come, each naming its choice's index; then usage, [DONE]."""
        shaper = ChunkShaper(req)
        finals: list[OutputEntry | None] = [None] * len(choices)
        outputs = self.choice_outputs(req)

        async def send(index: int, d: Delta) -> None:
            out = outputs[index]
            text, calls = out.delta(d)
            if text or calls or d.logprobs or d.prompt_logprobs:
                await sse_send(resp, shaper.chunk(index, text, None, d=d, tool_calls=calls))
            if d.final is None:
                return
            finals[index] = d.final
            if d.final.status in (FAILED, EXPIRED):
                try:
                    raise_for(d.final)
                except ApiError as e:  # the same error a request that ended before streaming gets
                    await sse_send(resp, e.body())
            else:
                await sse_send(resp, shaper.chunk(index, None, out.finish_reason(d.final.finish_reason)))

        await self.open_stream(resp, shaper)
        shared = choices[0][0].prompt_logprobs  # only the first choice asked for them (choice_bodies)
        for index, (first, _) in enumerate(choices):
            if index and shared is not None and not req.chat:  # vLLM puts them on each completion choice
                first = dataclasses.replace(first, prompt_logprobs=shared)
            await send(index, first)
        await merge_choices(choices, finals, send)
        ended = [f for f in finals if f is not None]
        if req.include_usage and len(ended) == len(choices):
            if all(f.status not in (FAILED, EXPIRED) for f in ended):
                await sse_send(resp, shaper.usage([f.usage for f in ended]))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
