"""OpenAI's response shapes: a whole completion or chat completion, a streamed chunk, logprobs (OpenAI's and
vLLM's prompt logprobs), usage, and the error a failed or expired request answers with.
"""

from __future__ import annotations

from typing import Any

from specserve.queue.wire import EXPIRED, FAILED, Delta, OutputEntry, Result
from specserve.service.http import ApiError
from specserve.service.openai.protocol import OpenAIRequest
from specserve.service.openai.tool_calls import ToolPlan, finish_reason, read_whole


def raise_for(final: OutputEntry | Result) -> None:
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
        shared = results[0].prompt_logprobs  # only the first choice asked for them (serving.choice_bodies)
        if shared is not None and not chat:  # vLLM puts them on each completion choice
            choice["prompt_logprobs"] = vllm_prompt_logprobs(shared, as_ids)
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


class ChunkShaper:
    """A streamed answer's chunks, for one request's n choices: each names its choice's index; a completion's
    legacy text_offset runs on across its chunks."""

    def __init__(self, req: OpenAIRequest) -> None:
        self.req = req
        self.shown_chars = [0] * req.n  # each completion's text so far, for the legacy text_offset

    def _logprobs(self, index: int, d: Delta | None) -> dict[str, Any] | None:
        if d is None or not d.logprobs:
            return None
        if self.req.chat:
            return chat_logprobs(d.logprobs, d.token_ids, self.req.token_ids)
        out = completion_logprobs(d.logprobs, d.token_ids, self.req.token_ids, self.shown_chars[index])
        self.shown_chars[index] += sum(len(str(e.get("token", ""))) for e in d.logprobs)
        return out

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        role: bool = False,
        d: Delta | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One choice's chunk: its text (a chat delta's content, with the role on the first), logprobs of
        the delta `d`, tool calls and finish reason."""
        req = self.req
        logprobs = self._logprobs(index, d)
        if req.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text or logprobs:
                delta["content"] = text or ""
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        out = {"id": req.id, "object": req.chunk_object, "created": req.created, "model": req.model}
        out["choices"] = [choice]
        if d is not None and d.prompt_logprobs is not None:  # with the first tokens, where vLLM puts them
            (out if req.chat else choice)["prompt_logprobs"] = vllm_prompt_logprobs(
                d.prompt_logprobs, req.token_ids
            )
        return out

    def usage(self, usages: list[dict[str, int] | None]) -> dict[str, Any]:
        """The chunk that ends a stream asked to include usage: no choices, the n choices' usage."""
        req = self.req
        out = {"id": req.id, "object": req.chunk_object, "created": req.created, "model": req.model}
        out["choices"] = []
        out["usage"] = openai_usage(choices_usage(usages))
        return out
