"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (streaming and not), /v1/models.

They translate to the wire format and ride the same queue as everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import Any, TypeVar

from aiohttp import web

from specserve.engine.sampling_params import SEED_RANGE
from specserve.queue.wire import EXPIRED, FAILED, Delta, OutputEntry, RequestBody, Result
from specserve.service.gateway import Gateway, deadline_after
from specserve.service.http import (
    ApiError,
    ClientGone,
    json_response,
    read_json,
    sse_send,
    sse_start,
)
from specserve.service.tool_calls import (
    CallStart,
    Text,
    ToolPlan,
    delta_tool_calls,
    finish_reason,
    read_whole,
    tool_plan,
)

T = TypeVar("T")
WATCH_S = 0.5  # how often a waiting non-streaming request looks whether its client is still there
# A worker expires a running request at its deadline itself (it polls every 0.1 s); the API steps in only
# after this much more, for requests no worker has taken.
DEADLINE_GRACE_S = 1.0

# Our extensions beyond OpenAI's fields.
EXTENSIONS = {"top_k", "ignore_eos", "speculation", "stop_token_ids", "timeout", "min_tokens"}
EXTENSIONS |= {"priority", "tenant"}  # vLLM's priority; our tenant (the API key's, when keys are set)
# OpenAI's penalties and bias, and vLLM's sampling extras: passed to the wire as they are
ADJUSTMENTS = {"presence_penalty", "frequency_penalty", "logit_bias"}
ADJUSTMENTS |= {"repetition_penalty", "min_p", "bad_words"}
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
}
# Accepted only at their neutral value: we do not implement them, and silently ignoring them would lie.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
# Constrained decoding: OpenAI's response_format, vLLM's structured_outputs and its older guided_* aliases.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED = {"response_format", "structured_outputs", *GUIDED}
# vLLM's extras: tokens named "token_id:<id>", and the prompt's own logprobs
LOGPROBS = {"logprobs", "return_tokens_as_token_ids", "prompt_logprobs"}
MAX_CHOICES = 16  # n: each choice is a sequence of its own in a worker's batch
MAX_LOGPROBS = 20  # vLLM's bound for both routes (OpenAI's completions stop at 5, its chat at 20)
COMPLETION_FIELDS = (
    COMMON | EXTENSIONS | ADJUSTMENTS | STRUCTURED | LOGPROBS | {"prompt", "echo", "best_of", "suffix"}
)
CHAT_FIELDS = (
    COMMON | EXTENSIONS | ADJUSTMENTS | STRUCTURED | LOGPROBS | {"messages", "max_completion_tokens"}
)
CHAT_FIELDS |= {"top_logprobs", "chat_template_kwargs"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}  # service/tool_calls.py
CHAT_FIELDS |= TOOL_FIELDS


def _check_fields(data: dict[str, Any], allowed: set[str]) -> None:
    for key, value in data.items():
        if key not in allowed:
            raise ApiError(400, f"{key}: unknown field", key)
        if key in NEUTRAL and value not in NEUTRAL[key]:
            raise ApiError(400, f"{key}: not supported (only {NEUTRAL[key][-1]!r})", key)


def _response_format(rf: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as the wire's structured_outputs (None for plain text)."""
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(
                400, "response_format: json_schema.schema must be a JSON schema object", "response_format"
            )
        return {"json": spec["schema"]}
    raise ApiError(
        400, 'response_format: type must be "text", "json_object" or "json_schema"', "response_format"
    )


def _structured(data: dict[str, Any]) -> dict[str, Any] | None:
    """The one constraint a request asks for, in whichever spelling, as the wire's structured_outputs."""
    given = [k for k in ("response_format", "structured_outputs", *GUIDED) if data.get(k) is not None]
    if len(given) > 1:
        raise ApiError(400, f"{given[1]}: give only one of {', '.join(given)}", given[1])
    if not given:
        return None
    field = given[0]
    if field == "response_format":
        return _response_format(data[field])
    if field == "structured_outputs":
        return data[field]  # checked by SamplingParams like any sampling field; errors name its key
    return {GUIDED[field]: data[field]}


def _structured_field(param: str, data: dict[str, Any]) -> str:
    """An error about the wire's structured_outputs.<kind>, as the field the client sent (a forced tool
    choice's constraint is built from `tool_choice` and the tools' schemas)."""
    if "structured_outputs" in data:
        return param
    if data.get("response_format") is not None:
        return "response_format"
    sent = next((k for k in GUIDED if data.get(k) is not None), None)
    if sent is None and data.get("tool_choice") not in (None, "none", "auto"):
        return "tool_choice"
    return sent or param


def _logprobs(data: dict[str, Any], chat: bool) -> int | None:
    """How many top logprobs the wire asks for (0: the chosen tokens' only), None for none. Chat says it
    as `logprobs: true` and `top_logprobs: n`; completions as `logprobs: n`."""

    def count(name: str) -> int:
        n = data[name]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS:
            raise ApiError(400, f"{name}: must be an integer in [0, {MAX_LOGPROBS}]", name)
        return n

    if not chat:
        return None if data.get("logprobs") is None else count("logprobs")
    wanted = data.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "logprobs: must be a boolean", "logprobs")
    top = None if data.get("top_logprobs") is None else count("top_logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _token_name(entry: dict[str, Any], token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else str(entry.get("token", ""))


def chat_logprobs(logprobs: list[dict[str, Any]], token_ids: list[int], as_ids: bool) -> dict[str, Any]:
    """The wire's logprobs as a chat choice's `logprobs` (OpenAI: content, each with bytes and its top)."""

    def item(e: dict[str, Any], token_id: int) -> dict[str, Any]:
        name = _token_name(e, token_id, as_ids)
        return {"token": name, "logprob": e.get("logprob"), "bytes": list(name.encode())}

    return {
        "content": [
            {**item(e, t), "top_logprobs": [item(x, x.get("id", 0)) for x in e.get("top_logprobs", [])]}
            for e, t in zip(logprobs, token_ids)
        ]
    }


def completion_logprobs(
    logprobs: list[dict[str, Any]], token_ids: list[int], as_ids: bool, text_offset: int = 0
) -> dict[str, Any]:
    """The wire's logprobs as a completion choice's `logprobs` (OpenAI's legacy shape: parallel lists; each
    position's top_logprobs maps token to logprob and holds the chosen token too, as vLLM's does).
    text_offset: where the first token's text starts (its running total while streaming)."""
    tokens, values, tops, offsets = [], [], [], []
    for e, t in zip(logprobs, token_ids):
        name = _token_name(e, t, as_ids)
        tokens.append(name)
        values.append(e.get("logprob"))
        top = {_token_name(x, x.get("id", 0), as_ids): x.get("logprob") for x in e.get("top_logprobs", [])}
        top.setdefault(name, e.get("logprob"))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(str(e.get("token", "")))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(prompt: list[dict[str, Any] | None], as_ids: bool) -> list[dict[str, Any] | None]:
    """The wire's prompt logprobs in vLLM's shape: per position None or {token id: {logprob, rank,
    decoded_token}}, the prompt token itself and the most likely ones (ranked 1, 2, ... in order)."""
    out: list[dict[str, Any] | None] = []
    for e in prompt:
        if e is None:
            out.append(None)
            continue
        entry = {}
        for rank, x in enumerate(e.get("top_logprobs", []), start=1):
            name = _token_name(x, x.get("id", 0), as_ids)
            entry[str(x.get("id"))] = {"logprob": x.get("logprob"), "rank": rank, "decoded_token": name}
        name = _token_name(e, e.get("id", 0), as_ids)
        entry[str(e.get("id"))] = {"logprob": e.get("logprob"), "rank": e.get("rank"), "decoded_token": name}
        out.append(entry)
    return out


def _single_prompt(prompt: Any) -> Any:
    """OpenAI allows a batch of prompts; we take exactly one (string or token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: batches are not supported; send one prompt per request", "prompt")
        return prompt[0]
    return prompt


def _translate(gateway: Gateway, data: dict[str, Any], chat: bool) -> tuple[RequestBody, dict[str, Any]]:
    _check_fields(data, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model: required, a string", "model")
    stream = data.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream: must be a boolean", "stream")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user: must be a string", "user")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, "stream_options: only include_usage is supported", "stream_options")
    body: dict[str, Any] = {"model": model}
    if chat:
        if "messages" not in data:
            raise ApiError(400, "messages: required", "messages")
        body["messages"] = data["messages"]
        if data.get("chat_template_kwargs") is not None:  # vLLM's extra field; the wire checks its shape
            body["chat_template_kwargs"] = data["chat_template_kwargs"]
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        body["max_tokens"] = max_tokens  # None: up to the context length, as OpenAI's chat does
    else:
        if "prompt" not in data:
            raise ApiError(400, "prompt: required", "prompt")
        body["prompt"] = _single_prompt(data["prompt"])
        if data.get("max_tokens") is not None:
            body["max_tokens"] = data["max_tokens"]
    for key in (
        "temperature",
        "top_p",
        "seed",
        "stop",
        *sorted(EXTENSIONS - {"timeout"}),
        *sorted(ADJUSTMENTS),
    ):
        if data.get(key) is not None:
            body[key] = data[key]
    if data.get("timeout") is not None:
        body["deadline"] = deadline_after(data["timeout"])
    structured = _structured(data)
    tools = ToolPlan()
    if chat:
        tools = tool_plan(data, gateway.settings.tool_call_parser)
        if tools.tools is not None:
            body["tools"] = tools.tools
        forced = tools.constraint()
        if forced is not None:
            if structured is not None:  # one constraint per output: the call's JSON is one
                sent = _structured_field("structured_outputs", data)
                raise ApiError(
                    400, f"{sent}: cannot be combined with tool_choice {data['tool_choice']!r}", sent
                )
            structured = forced
    if structured is not None:
        body["structured_outputs"] = structured
    logprobs = _logprobs(data, chat)
    if logprobs is not None:
        body["logprobs"] = logprobs
    if data.get("prompt_logprobs") is not None:
        body["prompt_logprobs"] = data["prompt_logprobs"]  # SamplingParams checks it, naming the field
    as_ids = data.get("return_tokens_as_token_ids")
    if as_ids is not None and not isinstance(as_ids, bool):
        raise ApiError(400, "return_tokens_as_token_ids: must be a boolean", "return_tokens_as_token_ids")
    if not stream:
        body["stream"] = False  # we answer once, at the end: the worker need not write every step
    n = data.get("n")
    n = 1 if n is None else n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n: must be an integer in [1, {MAX_CHOICES}]", "n")
    meta = {"model": model, "stream": stream, "include_usage": bool(options.get("include_usage")), "n": n}
    meta["token_ids"] = bool(as_ids)  # return_tokens_as_token_ids
    meta["tools"] = tools
    return gateway.validate(body), meta


def _as_sent(e: ApiError, data: dict[str, Any]) -> ApiError:
    """Chat's max_completion_tokens travels as the wire's max_tokens; an error about it (from the API's checks
    or the worker's) names the field the client sent."""
    if e.param == "max_tokens" and "max_completion_tokens" in data:
        e.param = "max_completion_tokens"
        e.message = e.message.replace("max_tokens", "max_completion_tokens", 1)
    if e.param and e.param.startswith("structured_outputs"):
        sent = _structured_field(e.param, data)
        e.message = e.message.replace(e.param, sent, 1)
        e.param = sent
    return e


def _raise_for(final: OutputEntry | Result) -> None:
    """The error a failed or expired request answers with (before any byte is sent, or as an SSE event)."""
    if final.status == FAILED:
        if final.error_field:
            raise ApiError(400, final.error or "invalid request", final.error_field)
        raise ApiError(500, final.error or "generation failed")
    if final.status == EXPIRED:
        # 408, not 504: no upstream failed. The client chose the deadline (`timeout`), and the request was not
        # done by then: a client-side condition, so a 4xx, and the one that says "timed out". OpenAI's SDKs
        # retry a 408, which suits a request that waited out its time in the queue (the retry's `timeout`
        # counts afresh).
        raise ApiError(
            408, final.error or "the deadline passed", "timeout", type="timeout", code="deadline_expired"
        )


def completion_body(
    rid: str,
    created: int,
    model: str,
    chat: bool,
    result: Result | list[Result],
    as_ids: bool = False,
    tools: ToolPlan | None = None,
) -> dict[str, Any]:
    """A whole (non-streaming) completion or chat completion, as OpenAI answers it: one choice per result
    (n of them), in order; with `tools`, each chat choice's tool calls read out of its text."""
    results = result if isinstance(result, list) else [result]
    choices = []
    for index, r in enumerate(results):
        logprobs = None
        if r.logprobs is not None:
            shape = chat_logprobs if chat else completion_logprobs
            logprobs = shape(r.logprobs, r.token_ids, as_ids)
        reason = r.finish_reason
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            reader = tools.reader() if tools is not None else None
            if reader is not None:
                message["content"], calls = read_whole(reader, r.text)
                if calls:
                    message["tool_calls"] = calls
                reason = finish_reason(reason, len(calls), reader)
            choice = {"index": index, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": r.text, "logprobs": logprobs}
        choice["finish_reason"] = reason
        if r.prompt_logprobs is not None and not chat:  # vLLM puts them on each completion choice
            choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs, as_ids)
        choices.append(choice)
    obj = "chat.completion" if chat else "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if chat and results[0].prompt_logprobs is not None:  # and on the whole chat response
        body["prompt_logprobs"] = vllm_prompt_logprobs(results[0].prompt_logprobs, as_ids)
    body["usage"] = openai_usage(choices_usage([r.usage for r in results]))
    return body


def choices_usage(usages: list[dict[str, int] | None]) -> dict[str, int] | None:
    """One usage for n choices of one prompt: the prompt counted once, the completions summed (OpenAI's)."""
    if any(u is None for u in usages):
        return None
    if len(usages) == 1:
        return usages[0]
    first: dict[str, int] = usages[0]  # type: ignore[assignment]
    out = dict(first)
    out["completion_tokens"] = sum(u.get("completion_tokens", 0) for u in usages)  # type: ignore[union-attr]
    out["total_tokens"] = out.get("prompt_tokens", 0) + out["completion_tokens"]
    return out


def _nth_seed(seed: int, i: int) -> int:
    return seed + i if seed + i <= SEED_RANGE[1] else seed - i  # stays in what SamplingParams takes


def choice_bodies(body: RequestBody, n: int) -> list[RequestBody]:
    """The wire request of each of n choices: the same prompt and parameters, each sampling from a stream
    of its own (seed + i when a seed is given, as vLLM's; else the worker derives one from each id)."""
    if n == 1:
        return [body]
    seed = body.sampling.get("seed")
    return [
        body
        if seed is None
        else dataclasses.replace(body, sampling={**body.sampling, "seed": _nth_seed(seed, i)})
        for i in range(n)
    ]


def openai_usage(usage: dict[str, int] | None) -> dict[str, Any] | None:
    """The wire's usage in OpenAI's shape: prompt tokens served from the prefix cache go under
    prompt_tokens_details.cached_tokens."""
    if usage is None:
        return None
    usage = dict(usage)
    cached = usage.pop("cached_tokens", None)
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def translate(gateway: Gateway, data: dict[str, Any], chat: bool) -> tuple[RequestBody, dict[str, Any]]:
    """An OpenAI request body as the wire's (and what the answer needs: model, stream, usage options); an
    ApiError naming the field the client sent if it is refused."""
    try:
        return _translate(gateway, data, chat)
    except ApiError as e:
        raise _as_sent(e, data) from None


class OpenAIRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def models(self, _request: web.Request) -> web.Response:
        models = await self.gateway.known_models()
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(info.get("seen", 0)),
                "owned_by": "specserve",
                **info,
            }
            for name, info in sorted(models.items())
        ]
        return json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        data = await read_json(request)
        try:
            return await self._answer(request, data, chat)
        except ApiError as e:
            raise _as_sent(e, data) from None

    async def _answer(self, request: web.Request, data: dict[str, Any], chat: bool) -> web.StreamResponse:
        body, meta = _translate(self.gateway, data, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        # n choices are n wire requests (vLLM v1 fans out the same way); their prompt's blocks are shared
        # through the prefix cache once the first has computed them.
        bodies = choice_bodies(body, meta["n"])
        rids = [rid] if len(bodies) == 1 else [f"{rid}-{i}" for i in range(len(bodies))]
        if not meta["stream"]:
            # Straight from the output stream: no keep-alive ticker or pump task for an answer sent once. Its
            # subscription is made while the enqueue is in flight, not after it, where it would hold up the
            # worker's claim on the same event loop.
            waiting = [asyncio.create_task(self.gateway.client.wait(r)) for r in rids]
            results = asyncio.gather(*waiting)
            try:
                for b, r in zip(bodies, rids):
                    await self.gateway.enqueue(request, b, r)
                got = await self._while_wanted(request, rids, results, body.deadline)
            finally:
                results.cancel()
                for w in waiting:
                    w.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await results  # retrieved, so a cancelled gather is not reported as lost
            for result in got:
                _raise_for(result)
            return self._whole(rid, created, meta, chat, list(got))
        for b, r in zip(bodies, rids):
            await self.gateway.enqueue(request, b, r)
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
                # let the cancel land: the stream may be closed only once nothing is iterating it
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await first
            return await self._stream(request, rid, rids, created, meta, chat, list(zip(firsts, streams)))
        finally:
            for d in streams:
                await d.aclose()

    async def _while_wanted(
        self, request: web.Request, rids: list[str], waiting: asyncio.Future[T], deadline: float | None
    ) -> T:
        """Wait for `waiting` while its client is still there and its deadline has not passed.

        A client that leaves cancels its request (nobody would read its tokens). At the deadline, a worker
        ends a request it runs (expired, answered with 408 through `_raise_for`); one no worker has taken
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
    async def _first(deltas) -> Delta:
        """The first real output: errors found by the worker still become a 4xx before any byte is sent."""
        async for d in deltas:
            if d is not None:
                if d.final is not None:
                    _raise_for(d.final)
                return d
        raise ApiError(500, "the output stream ended without a result")

    @staticmethod
    def _whole(rid, created, meta, chat, results: list[Result]) -> web.Response:
        body = completion_body(rid, created, meta["model"], chat, results, meta["token_ids"], meta["tools"])
        return json_response(body)

    async def _stream(self, request, rid, rids, created, meta, chat, choices) -> web.StreamResponse:
        resp = await sse_start(request)
        try:
            await self._send_chunks(resp, rid, created, meta, chat, choices)
        except ConnectionResetError:
            await self._cancel(rids)  # the client went away: stop spending steps on it
        return resp

    async def _send_chunks(self, resp, rid, created, meta, chat, choices: list[tuple[Delta, Any]]) -> None:
        """The choices' chunks as their tokens come, each naming its choice's index; then usage, [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        shown_chars = [0] * len(choices)  # each completion's text so far, for the legacy text_offset

        def logprobs_of(index: int, d: Delta | None) -> dict[str, Any] | None:
            if d is None or not d.logprobs:
                return None
            if chat:
                return chat_logprobs(d.logprobs, d.token_ids, meta["token_ids"])
            out = completion_logprobs(d.logprobs, d.token_ids, meta["token_ids"], shown_chars[index])
            shown_chars[index] += sum(len(str(e.get("token", ""))) for e in d.logprobs)
            return out

        def chunk(
            index: int,
            text: str | None,
            finish: str | None,
            role: bool = False,
            d: Delta | None = None,
            tool_calls: list[dict[str, Any]] | None = None,
        ) -> dict[str, Any]:
            logprobs = logprobs_of(index, d)
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text or logprobs:
                    delta["content"] = text or ""
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            out = {"id": rid, "object": obj, "created": created, "model": meta["model"], "choices": [choice]}
            if d is not None and d.prompt_logprobs is not None:  # with the first tokens, where vLLM puts them
                (out if chat else choice)["prompt_logprobs"] = vllm_prompt_logprobs(
                    d.prompt_logprobs, meta["token_ids"]
                )
            return out

        finals: list[OutputEntry | None] = [None] * len(choices)
        # Each choice's tool calls are read out of its text as it streams (service/tool_calls.py)
        plan: ToolPlan = meta["tools"]
        readers = [plan.reader() if chat else None for _ in choices]
        calls = [0] * len(choices)

        async def send(index: int, d: Delta) -> None:
            reader = readers[index]
            if reader is None:
                if d.text or d.logprobs or d.prompt_logprobs:
                    await sse_send(resp, chunk(index, d.text, None, d=d))
            else:
                events = reader.feed(d.text)
                if d.final is not None and d.final.status not in (FAILED, EXPIRED):
                    events += reader.finish()
                text = "".join(e.text for e in events if isinstance(e, Text))
                deltas = delta_tool_calls(events)
                calls[index] += sum(isinstance(e, CallStart) for e in events)
                if text or deltas or d.logprobs or d.prompt_logprobs:
                    await sse_send(resp, chunk(index, text, None, d=d, tool_calls=deltas))
            if d.final is None:
                return
            finals[index] = d.final
            if d.final.status in (FAILED, EXPIRED):
                try:
                    _raise_for(d.final)
                except ApiError as e:  # the same error a request that ended before streaming gets
                    await sse_send(resp, e.body())
            else:
                reason = d.final.finish_reason
                await sse_send(resp, chunk(index, None, finish_reason(reason, calls[index], reader)))

        if chat:
            for index in range(len(choices)):
                await sse_send(resp, chunk(index, None, None, role=True))
        for index, (first, _) in enumerate(choices):
            await send(index, first)
        await self._merged(choices, finals, send)
        ended = [f for f in finals if f is not None]
        if meta["include_usage"] and len(ended) == len(choices):
            if all(f.status not in (FAILED, EXPIRED) for f in ended):
                usage = {"id": rid, "object": obj, "created": created, "model": meta["model"], "choices": []}
                usage["usage"] = openai_usage(choices_usage([f.usage for f in ended]))
                await sse_send(resp, usage)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    @staticmethod
    async def _merged(choices: list[tuple[Delta, Any]], finals: list[Any], send) -> None:
        """Hand `send` every later delta of the choices not yet ended, in the order they arrive."""
        if len(choices) == 1:  # one choice: read its stream directly
            if finals[0] is None:
                async for d in choices[0][1]:
                    await send(0, d)
                    if d.final is not None:
                        break
            return
        arrived: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()

        async def pump(index: int, deltas) -> None:
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


def add_routes(app: web.Application, gateway: Gateway) -> None:
    routes = OpenAIRoutes(gateway)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_get("/v1/models", routes.models)
