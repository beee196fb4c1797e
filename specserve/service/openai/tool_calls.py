"""Tool calling on the OpenAI chat route: what a request's `tools`, `tool_choice` and `parallel_tool_calls`
ask for, and the tool calls read back out of each choice's text.

    tool_plan(data, parser)   the request's ToolPlan (400 naming the field when refused): the tools to render,
                              the constraint that enforces `required` or a named function (a JSON schema on
                              the wire's structured_outputs, as vLLM builds it), and how to read the output
    plan.reader()             a fresh OutputReader for one choice: feed() its text as it streams, finish() at
                              the end; each returns Events (text to show, a call's start, its arguments)
    read_whole(reader, text)  the same reader over a whole text: (content, tool_calls)

The whole answer is the streamed events put together, so a streamed choice and a whole one say the same.
Readers for `auto` are registered by name (TOOL_PARSERS, vLLM's --tool-call-parser); `hermes` reads
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen's, Hermes' and SmolLM3's
templates.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.engine.errors import InvalidParameter
from specserve.engine.grammar import StructuredOutputsParams, constraint_key
from specserve.engine.prepare import Check
from specserve.queue.wire import WireError, parse_tools
from specserve.service.http import ApiError

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


def call_id() -> str:
    """OpenAI's shape of a tool call's id: call_ and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


# ---- events -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    """Text outside any tool call: the message's content."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: OpenAI's first delta of it names index, id and the function."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of a call's arguments (a JSON text once all of them are put together)."""

    index: int
    text: str


Event = Text | CallStart | CallArguments


class OutputReader(ABC):
    """Reads one choice's output as it grows. Subclasses keep whatever they cannot decide on yet."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls  # parallel_tool_calls: false allows one
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...

    def complete(self) -> bool:
        """Whether the output read so far is whole calls and nothing after them may follow: true only for
        forced calls, whose grammar ends where their JSON does (free text may always go on)."""
        return False

    def _call(self, name: str, arguments: str) -> list[Event]:
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        index, self.calls = self.calls, self.calls + 1
        return [CallStart(index, call_id(), name), CallArguments(index, arguments)]


TOOL_PARSERS: dict[str, Callable[[int | None], OutputReader]] = {}


def register_parser(name: str) -> Callable[[type[OutputReader]], type[OutputReader]]:
    """Register a reader for tool_choice `auto` under a name (the `--tool-call-parser` setting picks one)."""

    def add(cls: type[OutputReader]) -> type[OutputReader]:
        TOOL_PARSERS[name] = cls
        return cls

    return add


def _arguments_text(arguments: Any) -> str | None:
    """A parsed call's arguments as the JSON text OpenAI's `arguments` is, or None if they are no object."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):  # some models write them as JSON text already
        try:
            return arguments if isinstance(json.loads(arguments), dict) else None
        except ValueError:
            return None
    return None


@register_parser("hermes")
class HermesReader(OutputReader):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them, with text around.

    Text before a call streams as it comes, except what could still be the start of a `<tool_call>` tag. A
    call is held until its closing tag and then sent whole. A call whose JSON does not parse (or is no
    {"name", "arguments"} object) is left in the content as it was written, as vLLM leaves it; so is one the
    output ends inside of, unless its JSON is complete (a model that stops at EOS before the closing tag).
    Whitespace between a call and the text beside it is dropped (the template's newlines around its tags)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._pending = ""  # text not yet decided on
        self._in_call = False
        self._held = ""  # trailing whitespace of the text so far: dropped if a call follows it
        self._after_call = False  # leading whitespace after a call is dropped

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._pending.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._pending, self.START)
                    cut = len(self._pending) - keep
                    events += self._text(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return events
                events += self._text(self._pending[:at])
                self._pending = self._pending[at + len(self.START) :]
                self._in_call = True
            else:
                at = self._pending.find(self.END)
                if at < 0:
                    return events
                body = self._pending[:at]
                self._pending = self._pending[at + len(self.END) :]
                self._in_call = False
                events += self._parsed(body, self.START + body + self.END)

    def finish(self) -> list[Event]:
        if self._in_call:
            body, self._pending, self._in_call = self._pending, "", False
            events = self._parsed(body, self.START + body)
        else:
            events, self._pending = self._text(self._pending), ""
        held, self._held = self._held, ""
        return events + ([Text(held)] if held else [])

    def _text(self, text: str) -> list[Event]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        text, self._held = self._held + text, ""
        shown = text.rstrip()
        self._held = text[len(shown) :]
        return [Text(shown)] if shown else []

    def _parsed(self, body: str, raw: str) -> list[Event]:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        name = call.get("name") if isinstance(call, dict) else None
        arguments = _arguments_text(call.get("arguments")) if isinstance(call, dict) else None
        if not isinstance(name, str) or not name or arguments is None:
            return self._text(raw)
        self._held, self._after_call = "", True
        return self._call(name, arguments)


@register_parser("llama3_json")
class Llama3JsonReader(OutputReader):
    """Llama 3.x's JSON tool calls: an answer that is `{"name": ..., "parameters": {...}}` (or "arguments"),
    several joined by `;`, optionally after `<|python_tag|>`, as Llama 3.1-3.3's template asks for.

    Whether an answer is calls shows in its first character, so an answer that does not start with `{` or
    the tag streams as content at once; one that does is held to its end and read whole (its JSON can only be
    judged complete there), and left as content if it is not calls after all, as vLLM's parser does."""

    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._buffer = ""
        self._calls: bool | None = None  # undecided until the first non-blank characters

    def feed(self, text: str) -> list[Event]:
        if self._calls is False:
            return [Text(text)] if text else []
        self._buffer += text
        head = self._buffer.lstrip()
        if self._calls is None and head:
            if head.startswith(("{", self.TAG)):
                self._calls = True
            elif not self.TAG.startswith(head):
                self._calls = False
                text, self._buffer = self._buffer, ""
                return [Text(text)]
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        body = text.strip().removeprefix(self.TAG)
        decoder, at, parsed = json.JSONDecoder(), 0, []
        while True:
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
            if at == len(body):
                break
            try:
                call, at = decoder.raw_decode(body, at)
            except ValueError:
                return [Text(text)]
            name = call.get("name") if isinstance(call, dict) else None
            args = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
            arguments = _arguments_text(args)
            if not isinstance(name, str) or not name or arguments is None:
                return [Text(text)]
            parsed.append((name, arguments))
        if not parsed:
            return [Text(text)]
        return [event for name, arguments in parsed for event in self._call(name, arguments)]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class NamedCallReader(OutputReader):
    """tool_choice naming a function: the whole output is its arguments (generated under its `parameters`
    schema), streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__(1)
        self.name = name
        self._id: str | None = None
        self._arguments = ""

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._id is None:
            self._id = call_id()
            self.calls = 1
            events.append(CallStart(0, self._id, self.name))
        if text:
            self._arguments += text
            events.append(CallArguments(0, text))
        return events

    def finish(self) -> list[Event]:
        return self.feed("") if self._id is None else []

    def complete(self) -> bool:
        try:
            json.loads(self._arguments)
        except ValueError:
            return False
        return True


class RequiredCallsReader(OutputReader):
    """tool_choice `required`: the output is a JSON array of {"name", "parameters"} (vLLM's schema). Each call
    is sent once its object is complete; what is left when the output ends unfinished (cut by max_tokens)
    is content."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._pos = 0  # where the next array element (or the array's start) begins
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        if "}" not in text:  # no element can have been completed
            return events
        while True:
            at = self._pos
            while at < len(self._buffer) and self._buffer[at] in " \t\r\n,[":
                at += 1
            try:
                element, end = self._decoder.raw_decode(self._buffer, at)
            except ValueError:
                return events
            name = element.get("name") if isinstance(element, dict) else None
            arguments = _arguments_text(element.get("parameters")) if isinstance(element, dict) else None
            if not isinstance(name, str) or arguments is None:
                return events
            self._pos = end
            events += self._call(name, arguments)

    def finish(self) -> list[Event]:
        rest = self._buffer if not self.calls else self._buffer[self._pos :]
        return [Text(rest)] if rest.strip() not in ("", "]") else []

    def complete(self) -> bool:
        return self.calls > 0 and self._buffer[self._pos :].strip() == "]"


def read_whole(reader: OutputReader, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's message content (None when there is none) and OpenAI's `tool_calls`."""
    return assemble([*reader.feed(text), *reader.finish()])


def assemble(events: list[Event]) -> tuple[str | None, list[dict[str, Any]]]:
    """Events put together: what a client that joins the streamed deltas ends up with."""
    content = "".join(e.text for e in events if isinstance(e, Text))
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, CallArguments):
            calls[e.index]["function"]["arguments"] += e.text
    return content or None, calls


def delta_tool_calls(events: list[Event]) -> list[dict[str, Any]]:
    """Call events as OpenAI's streamed `delta.tool_calls`: the first names index, id, type and function
    (arguments ""), later ones add arguments."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, CallStart):
            out.append(
                {
                    "index": e.index,
                    "id": e.id,
                    "type": "function",
                    "function": {"name": e.name, "arguments": ""},
                }
            )
        elif isinstance(e, CallArguments):
            out.append({"index": e.index, "function": {"arguments": e.text}})
    return out


def finish_reason(reason: str | None, calls: int, reader: OutputReader | None = None) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended by itself with calls, or whose forced calls were
    complete when max_tokens cut it (the end of the JSON is the end of the answer: only the end-of-sequence
    token was left); an answer cut short otherwise keeps `length` (its last call may be incomplete)."""
    if calls and (reason == "stop" or (reason == "length" and reader is not None and reader.complete())):
        return "tool_calls"
    return reason


# ---- the request ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools, decided at the API (the wire carries only `tools`, for the template,
    and the constraint, as structured_outputs)."""

    mode: str = NONE  # none | auto | required | named
    tools: list[dict[str, Any]] | None = None
    name: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # parallel_tool_calls
    parser: str = "hermes"  # the auto reader's name

    def reader(self) -> OutputReader | None:
        """A reader for one choice's output; None when the output is plain content (no tools, or `none`)."""
        if self.mode == AUTO:
            return TOOL_PARSERS[self.parser](None if self.parallel else 1)
        if self.mode == NAMED:
            assert self.name is not None
            return NamedCallReader(self.name)
        if self.mode == REQUIRED:
            return RequiredCallsReader()
        return None

    def constraint(self) -> dict[str, Any] | None:
        """The wire's structured_outputs that makes the output the call(s) (None: generate freely)."""
        if self.mode == NAMED:
            return {"json": _parameters(self._function(self.name))}
        if self.mode == REQUIRED:
            return {"json": required_schema(self.tools or [], self.parallel)}
        return None

    def checks(self) -> list[Check]:
        """The grammars a forced call is generated under, one per tool, for the API's grammar pool
        (Gateway.prepare): a bad schema is named as the tool's, not blamed on a constraint the client never
        sent."""
        out: list[Check] = []
        for field, params in _forced_parameters(self):
            kind, text = constraint_key(StructuredOutputsParams(json=params))
            out.append((field, kind, text))
        return out

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(t["function"] for t in self.tools or [] if t["function"]["name"] == name)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    # OpenAI: "omitting parameters defines a function with an empty parameter list"
    params = function.get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice `required`: a non-empty array of {"name": one function, "parameters":
    its schema}, at most one item when parallel calls are off. Each function's `$defs` move to the top, where
    its `#/$defs/...` references then resolve."""
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        params = dict(_parameters(tool["function"]))
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise ApiError(
                    400,
                    f"tools[{i}].function.parameters: $defs.{key} differs from another tool's",
                    f"tools[{i}].function.parameters",
                )
            defs[key] = value
        name = {"type": "string", "enum": [tool["function"]["name"]]}
        options.append(
            {"properties": {"name": name, "parameters": params}, "required": ["name", "parameters"]}
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_plan(data: dict[str, Any], parser: str) -> ToolPlan:
    """A chat request's tool fields as a ToolPlan; ApiError naming the field when they are refused."""
    try:
        tools = parse_tools(data["tools"]) if data.get("tools") is not None else None
    except WireError as e:
        raise ApiError(400, str(e), e.field) from None
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls: must be a boolean", "parallel_tool_calls")
    choice = data.get("tool_choice")
    if choice is None:
        choice = AUTO if tools else NONE  # OpenAI's defaults
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise ApiError(
                400,
                'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": '
                '{"name": ...}}',
                "tool_choice",
            )
        name = fn["name"]
        if not any(t["function"]["name"] == name for t in tools or []):
            raise ApiError(400, f"tool_choice: no function named {name!r} in tools", "tool_choice")
        choice = NAMED
    elif choice not in (NONE, AUTO, REQUIRED):
        raise ApiError(
            400, 'tool_choice: must be "none", "auto", "required" or a named function', "tool_choice"
        )
    elif choice != NONE and not tools:
        raise ApiError(400, f"tool_choice: {choice!r} needs tools", "tool_choice")
    plan = ToolPlan(choice, tools, name, True if parallel is None else parallel, parser)
    for field, params in _forced_parameters(plan):
        try:
            StructuredOutputsParams(json=params)  # its shape and size; its grammar is built in checks()
        except InvalidParameter as e:
            raise ApiError(400, f"{field}: {e.message}", field) from None
    return plan


def _forced_parameters(plan: ToolPlan) -> list[tuple[str, dict[str, Any]]]:
    """(field, schema) of each tool whose parameters a forced call is generated under."""
    if plan.mode not in (NAMED, REQUIRED):
        return []
    return [
        (f"tools[{i}].function.parameters", _parameters(tool["function"]))
        for i, tool in enumerate(plan.tools or [])
        if plan.mode != NAMED or tool["function"]["name"] == plan.name
    ]
