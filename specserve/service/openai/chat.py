"""/v1/chat/completions: messages in, an assistant message out; with tools, each choice's tool calls read
out of its text (service/openai/tool_calls.py), as it streams and in a whole answer alike."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from specserve.queue.wire import EXPIRED, FAILED, Delta
from specserve.service.http import sse_send
from specserve.service.openai.protocol import OpenAIRequest
from specserve.service.openai.responses import ChunkShaper
from specserve.service.openai.serving import ChoiceOutput, OpenAIServing
from specserve.service.openai.tool_calls import (
    CallStart,
    OutputReader,
    Text,
    delta_tool_calls,
    finish_reason,
)


class ToolCallOutput(ChoiceOutput):
    """A streamed choice whose text may hold tool calls: content and calls as its reader reads them."""

    def __init__(self, reader: OutputReader) -> None:
        self.reader = reader
        self.calls = 0  # calls begun so far

    def delta(self, d: Delta) -> tuple[str | None, list[dict[str, Any]] | None]:
        events = self.reader.feed(d.text)
        if d.final is not None and d.final.status not in (FAILED, EXPIRED):
            events += self.reader.finish()
        self.calls += sum(isinstance(e, CallStart) for e in events)
        return "".join(e.text for e in events if isinstance(e, Text)), delta_tool_calls(events)

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.calls, self.reader)


class ChatCompletions(OpenAIServing):
    chat = True

    def choice_outputs(self, req: OpenAIRequest) -> list[ChoiceOutput]:
        readers = [req.tools.reader() for _ in range(req.n)]
        return [ChoiceOutput() if r is None else ToolCallOutput(r) for r in readers]

    async def open_stream(self, resp: web.StreamResponse, shaper: ChunkShaper) -> None:
        """Each choice's first chunk names the role, as OpenAI's do."""
        for index in range(shaper.req.n):
            await sse_send(resp, shaper.chunk(index, None, None, role=True))
