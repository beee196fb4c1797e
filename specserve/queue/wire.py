"""The wire format (docs/wire-format.md): request entries, status hashes and output entries.

Only structure is checked here; the sampling fields are validated by the engine's SamplingParams in the
service, so queue/ stays free of the engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from specserve.queue.keys import valid_request_id
from specserve.queue.resp import is_text

QUEUED, RUNNING, FINISHED, FAILED, CANCELLED, EXPIRED = (
    "queued",
    "running",
    "finished",
    "failed",
    "cancelled",
    "expired",
)
TERMINAL = frozenset({FINISHED, FAILED, CANCELLED, EXPIRED})

# Body keys that are not sampling parameters; every other key is handed to SamplingParams.from_dict.
REQUEST_KEYS = frozenset(
    {"prompt", "messages", "model", "deadline", "stream", "reply_to", "reply_stream", "chat_template_kwargs"}
    | {"priority", "tenant"}
    | {"tools"}
)
# A deadline is a unix time; anything past 2100 is a mistake (or an attack: 1e308 overflowed the claim's
# integer milliseconds). Bounded here, so every later use of it is plain arithmetic.
MAX_DEADLINE = 4_102_444_800.0
# vLLM's priority: lower runs sooner. Bounded so that it stays an exact number in Lua (a double) and in key
# names; a million bands is far more than any queue needs.
MAX_PRIORITY = 1_000_000
# A tenant names a fair-share queue (queue/scripts.py TAKE) and quota keys: an API key's name has this shape.
_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# OpenAI's rule for a function's name; a template writes it into the prompt, and a client looks it up.
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_FIELDS = frozenset({"name", "description", "parameters", "strict"})


class WireError(ValueError):
    """A malformed request; `field` names the culprit (same shape as the engine's InvalidParameter)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass
class RequestBody:
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    model: str | None = None
    deadline: float | None = None  # unix time, seconds
    sampling: dict[str, Any] = field(default_factory=dict)
    # False: the worker writes only the final output entry (every token at once), no entry per step. For a
    # producer that waits for the whole result: it saves the worker, Redis and readers a round each step.
    stream: bool = True
    # A reply stream ({prefix}:reply:{reply_to}) the worker also writes the final result to (and, with
    # reply_stream, every delta): a producer reads all its results with one XREAD instead of one per id.
    reply_to: str | None = None
    reply_stream: bool = False
    # Variables for the model's chat template (vLLM's field; Qwen3's enable_thinking, for one): messages only.
    chat_template_kwargs: dict[str, Any] | None = None
    # Lower runs sooner (vLLM's meaning); each value is a band of the ready queue (docs/wire-format.md).
    priority: int = 0
    # Whose fair share and quotas the request counts against. Over HTTP with API keys it is the key's name
    # (recorded in the status hash, which wins over the body); a raw producer names itself here.
    tenant: str | None = None
    # Functions the model may call (OpenAI's `tools`, [{"type": "function", "function": {...}}]), rendered by
    # the model's chat template; messages only. The output stays text: the OpenAI route parses the calls.
    tools: list[dict[str, Any]] | None = None

    @property
    def fills_context(self) -> bool:
        """`max_tokens: null`: generate until the context is full (OpenAI chat's default). Only a worker knows
        the context, so the number is set there."""
        return "max_tokens" in self.sampling and self.sampling["max_tokens"] is None

    def sampling_fields(self) -> dict[str, Any]:
        """The fields SamplingParams takes (a null max_tokens left out: see fills_context)."""
        if self.fills_context:
            return {k: v for k, v in self.sampling.items() if k != "max_tokens"}
        return self.sampling

    def to_json(self) -> bytes:
        body: dict[str, Any] = (
            {"prompt": self.prompt} if self.messages is None else {"messages": self.messages}
        )
        if self.model is not None:
            body["model"] = self.model
        if self.deadline is not None:
            body["deadline"] = self.deadline
        if not self.stream:
            body["stream"] = False
        if self.reply_to is not None:
            body["reply_to"] = self.reply_to
            if self.reply_stream:
                body["reply_stream"] = True
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        if self.tools is not None:
            body["tools"] = self.tools
        if self.priority:
            body["priority"] = self.priority
        if self.tenant is not None:
            body["tenant"] = self.tenant
        body.update(self.sampling)
        return orjson.dumps(body)


@dataclass(frozen=True)
class RequestEntry:
    """One entry of the request stream as a worker reads it.

    Anyone with access to Redis can XADD anything, so nothing here is trusted: values may hold bytes that
    are not UTF-8 (kept escaped, see queue/resp.py), and the body is parsed only by `decode_body`.
    """

    entry_id: str
    request_id: str | None  # None when the entry has no usable id (it goes to the dead letters)
    raw_body: str
    traceparent: str | None = None
    tracestate: str | None = None

    @classmethod
    def from_fields(cls, entry_id: str, fields: dict[str, str]) -> RequestEntry:
        rid = fields.get("id")
        # W3C trace headers are ASCII; anything else would only break the tracer, so it is dropped.
        tp, ts = fields.get("traceparent"), fields.get("tracestate")
        return cls(
            entry_id=entry_id,
            request_id=rid if valid_request_id(rid) else None,
            raw_body=fields.get("body", ""),
            traceparent=tp if tp is not None and tp.isascii() else None,
            tracestate=ts if ts is not None and ts.isascii() else None,
        )


def model_aliases(name: str) -> set[str]:
    """The names a request's `model` may give for a served model: its path or id, its last part, and that
    without .gguf (what vLLM users type for a local file)."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return {name, base, base.removesuffix(".gguf")}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_unix_time(v: Any) -> bool:
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and 0 <= v <= MAX_DEADLINE
    )


def _message_text(content: Any, index: int) -> str:
    """OpenAI allows content as a string or a list of parts; only text parts make sense for a text model."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise WireError(f"messages[{index}].content", "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise WireError(f"messages[{index}].content", "must be a string or a list of text parts")


def _function_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise WireError(where, "must be 1-64 letters, digits, '_' or '-'")
    return name


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls (OpenAI's shape). Arguments sent as JSON text become the
    object they hold: templates write them with `tojson` (Qwen's, Llama 3.1's), as transformers documents;
    text that is not a JSON object is kept as it is."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise WireError(where, "must be a list of {id, type, function: {name, arguments}}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise WireError(at, "must be an object")
        if call.get("type", "function") != "function":
            raise WireError(f"{at}.type", 'must be "function"')
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise WireError(f"{at}.id", "must be a string")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise WireError(f"{at}.function", "must be an object with name and arguments")
        name = _function_name(fn.get("name"), f"{at}.function.name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = orjson.loads(arguments)
            except orjson.JSONDecodeError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif not isinstance(arguments, dict):
            raise WireError(f"{at}.function.arguments", "must be a JSON object or its text")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = call["id"]
        out.append(entry)
    return out


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as the chat template gets them: role and text content, and what a tool conversation adds
    (an assistant's `tool_calls`, with content null; a `tool` message's `tool_call_id`; a `name`)."""
    if not isinstance(messages, list) or not messages:
        raise WireError("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise WireError(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            raise WireError(f"messages[{i}].role", f"must be one of {sorted(MESSAGE_ROLES)}")
        message: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise WireError(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
            message["tool_calls"] = _tool_calls(calls, i)
        # OpenAI's assistant message that only calls tools has content null; templates test it for
        # truthiness or concatenate it, so it becomes "" (vLLM does the same for text templates).
        content = m.get("content")
        message["content"] = "" if content is None and calls else _message_text(content, i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise WireError(f"messages[{i}].tool_call_id", "required for a tool message, a string")
            message["tool_call_id"] = call_id
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise WireError(f"messages[{i}].name", "must be a string")
            message["name"] = m["name"]
        out.append(message)
    return out


def parse_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI's `tools`, checked (an error names the tool's field); None for none (an empty list)."""
    if not isinstance(tools, list):
        raise WireError("tools", 'must be a list of {"type": "function", "function": {name, ...}}')
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise WireError(at, 'must be an object {"type": "function", "function": {...}}')
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise WireError(f"{at}.{extra[0]}", "unknown field")
        if tool.get("type") != "function":
            raise WireError(f"{at}.type", 'must be "function"')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise WireError(f"{at}.function", "must be an object with name, description and parameters")
        extra = sorted(set(fn) - TOOL_FIELDS)
        if extra:
            raise WireError(f"{at}.function.{extra[0]}", "unknown field")
        name = _function_name(fn.get("name"), f"{at}.function.name")
        if name in seen:
            raise WireError(f"{at}.function.name", f"{name!r} is already tools[{seen[name]}]")
        seen[name] = i
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise WireError(f"{at}.function.description", "must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise WireError(f"{at}.function.parameters", "must be a JSON schema object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise WireError(f"{at}.function.strict", "must be a boolean")
    return tools or None


def parse_prompt(prompt: Any, max_chars: int | None = None) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise WireError("prompt", "must not be empty")
        if max_chars is not None and len(prompt) > max_chars:
            raise WireError("prompt", f"too long: {len(prompt)} characters, the limit is {max_chars}")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        if max_chars is not None and len(prompt) > max_chars:
            raise WireError("prompt", f"too long: {len(prompt)} tokens, the limit is {max_chars}")
        return prompt
    raise WireError("prompt", "must be a non-empty string or a non-empty list of token ids")


def parse_body(data: Any, max_prompt_chars: int | None = None) -> RequestBody:
    """Check a decoded body's structure. Raises WireError naming the field."""
    if not isinstance(data, dict):
        raise WireError("body", "must be a JSON object")
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise WireError("prompt", "give exactly one of prompt or messages")
    prompt = parse_prompt(data["prompt"], max_prompt_chars) if has_prompt else None
    messages = parse_messages(data["messages"]) if has_messages else None
    tools = parse_tools(data["tools"]) if data.get("tools") is not None else None
    if tools is not None and messages is None:
        raise WireError("tools", "applies to messages only, not to a prompt")
    if messages is not None and max_prompt_chars is not None:
        total = sum(len(m["content"]) for m in messages)
        if total > max_prompt_chars:
            raise WireError("messages", f"too long: {total} characters, the limit is {max_prompt_chars}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise WireError("model", "must be a string")
    deadline = data.get("deadline")
    if deadline is not None and not _is_unix_time(deadline):
        raise WireError("deadline", f"must be a unix time in seconds, from 0 to {MAX_DEADLINE:.0f}")
    stream = data.get("stream", True)
    if not isinstance(stream, bool):
        raise WireError("stream", "must be a boolean")
    reply_to = reply_to_of(data, strict=True)
    reply_stream = data.get("reply_stream", False)
    if not isinstance(reply_stream, bool):
        raise WireError("reply_stream", "must be a boolean")
    if reply_stream and reply_to is None:
        raise WireError("reply_stream", "needs reply_to, the stream to write to")
    template_kwargs = data.get("chat_template_kwargs")
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict):
            raise WireError("chat_template_kwargs", "must be an object of template variables")
        if messages is None:
            raise WireError("chat_template_kwargs", "applies to messages only, not to a prompt")
    priority = data.get("priority", 0)
    if not _is_int(priority) or abs(priority) > MAX_PRIORITY:
        raise WireError("priority", f"must be an integer from -{MAX_PRIORITY} to {MAX_PRIORITY}")
    tenant = tenant_of(data, strict=True)
    sampling = {k: v for k, v in data.items() if k not in REQUEST_KEYS}
    deadline = float(deadline) if deadline is not None else None
    return RequestBody(
        prompt,
        messages,
        model,
        deadline,
        sampling,
        stream,
        reply_to,
        reply_stream,
        template_kwargs,
        priority,
        tenant,
        tools=tools,
    )


def valid_tenant(name: object) -> bool:
    return isinstance(name, str) and bool(_TENANT.match(name))


def tenant_of(data: Any, strict: bool = False) -> str | None:
    """A body's tenant. Not strict: None for anything unusable (the request then shares the unnamed
    tenant's queue until its body is refused for that field)."""
    name = data.get("tenant") if isinstance(data, dict) else None
    if name is None or valid_tenant(name):
        return name
    if strict:
        raise WireError("tenant", "must be 1-64 letters, digits, '_' or '-'")
    return None


def priority_of(data: Any) -> int:
    """A body's priority, 0 for anything unusable (its parse refuses it later, naming the field)."""
    p = data.get("priority", 0) if isinstance(data, dict) else 0
    return p if _is_int(p) and abs(p) <= MAX_PRIORITY else 0


def reply_to_of(data: Any, strict: bool = False) -> str | None:
    """A body's reply stream name. It names a key under the prefix ({prefix}:reply:<name>), never a key of
    its own choosing (the request stream, another producer's status...), so it is an id-like name. Not
    strict: None for anything unusable, so that a body refused for another field still gets its reply."""
    name = data.get("reply_to") if isinstance(data, dict) else None
    if name is None or valid_request_id(name):
        return name
    if strict:
        raise WireError("reply_to", "must be 1-200 characters of letters, digits, '_', '.', ':' or '-'")
    return None


# How deep any JSON value of a body may nest, the body itself being the first level. orjson parses 1,024
# levels but writes only 255, and a schema hundreds of levels deep takes seconds to check: one limit, far
# above any real schema or template argument, checked wherever a body is parsed.
MAX_JSON_DEPTH = 64


def too_deep(data: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The top-level field whose value nests deeper than `limit` levels (`body` if the body itself does)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "body")]
    while stack:
        value, depth, name = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > limit:
            return name
        if isinstance(value, list):
            stack.extend((child, depth + 1, name) for child in value)
        elif depth == 1:
            stack.extend((child, depth + 1, str(key)) for key, child in value.items())
        else:
            stack.extend((child, depth + 1, name) for child in value.values())
    return None


def check_depth(data: Any, limit: int = MAX_JSON_DEPTH) -> None:
    if (name := too_deep(data, limit)) is not None:
        raise WireError(name, f"nested deeper than {limit} levels")


def decode_body(
    raw: str | bytes, max_prompt_chars: int | None = None, max_body_chars: int | None = None
) -> RequestBody:
    """Parse and check a raw body; every failure is a WireError naming the field, whatever the input.

    The size is checked before anything is parsed: a raw XADD does not pass the API's body limit, and a
    50 MB prompt took a worker's loop a minute (and 9 GB) to refuse after tokenizing it."""
    if max_body_chars is not None and len(raw) > max_body_chars:
        raise WireError("body", f"too large: {len(raw)} characters, the limit is {max_body_chars}")
    if isinstance(raw, str) and not is_text(raw):
        raise WireError("body", "not valid UTF-8")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise WireError("body", f"not valid JSON: {e}") from None
    check_depth(data)
    return parse_body(data, max_prompt_chars)


@dataclass
class OutputEntry:
    """One entry of a request's output stream.

    `offset` counts completion tokens and `text_offset` counts Unicode code points of the completion text,
    both from the start of the request; a rerun after a crash (a higher `run`) continues after what earlier
    runs wrote. A reader that remembers how many tokens and characters it has shown skips anything it has
    already seen (a rerun by an older worker restarts at 0)."""

    run: int
    offset: int
    text_offset: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the final entry: stop | length | abort | error
    status: str | None = None  # final entry: the terminal status
    usage: dict[str, int] | None = None
    error: str | None = None
    error_field: str | None = None
    # One per token_ids entry when the request asked for logprobs: {"token", "logprob", "top_logprobs":
    # [{"id", "token", "logprob"}, ...]} (docs/wire-format.md).
    logprobs: list[dict[str, Any]] | None = None
    # On a request's first entry, when it asked (vLLM's prompt_logprobs): one per prompt token, null for the
    # first, {"id", "token", "logprob", "rank", "top_logprobs"} for the others.
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def to_fields(self) -> dict[str, str]:
        f = {
            "run": str(self.run),
            "offset": str(self.offset),
            "text_offset": str(self.text_offset),
            "ids": orjson.dumps(self.token_ids).decode(),
            "text": self.text,
        }
        if self.logprobs is not None:
            f["logprobs"] = orjson.dumps(self.logprobs).decode()
        if self.prompt_logprobs is not None:
            f["prompt_logprobs"] = orjson.dumps(self.prompt_logprobs).decode()
        if self.finish_reason is not None:
            f["finish_reason"] = self.finish_reason
            f["status"] = self.status or FINISHED
            if self.usage is not None:
                f["usage"] = orjson.dumps(self.usage).decode()
            if self.error is not None:
                f["error"] = self.error
            if self.error_field is not None:
                f["error_field"] = self.error_field
        return f

    @classmethod
    def from_fields(cls, f: dict[str, str]) -> OutputEntry:
        usage = f.get("usage")
        return cls(
            run=int(f.get("run", 0)),
            offset=int(f.get("offset", 0)),
            text_offset=int(f.get("text_offset", 0)),
            token_ids=orjson.loads(f.get("ids") or "[]"),
            text=f.get("text", ""),
            finish_reason=f.get("finish_reason"),
            status=f.get("status"),
            usage=orjson.loads(usage) if usage else None,
            error=f.get("error"),
            error_field=f.get("error_field"),
            logprobs=_logprobs_of(f.get("logprobs")),
            prompt_logprobs=_logprobs_of(f.get("prompt_logprobs")),
        )


def _logprobs_of(raw: str | None) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


@dataclass
class Delta:
    """What a reader shows next: only tokens and text it has not shown before."""

    token_ids: list[int]
    text: str
    offset: int  # token offset of token_ids[0]
    final: OutputEntry | None = None
    logprobs: list[dict[str, Any]] | None = None  # one per token_ids entry, when the request asked
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with the request's first tokens


@dataclass
class OutputCursor:
    """Turns a request's output entries, reruns included, into a stream that shows each token once."""

    tokens: int = 0
    chars: int = 0
    done: bool = False

    def feed(self, e: OutputEntry) -> Delta | None:
        if self.done:
            return None
        # Within a run offsets are contiguous; after a restart they go back to 0 and we skip what we showed.
        skip = max(0, self.tokens - e.offset) if e.offset <= self.tokens else 0
        ids = e.token_ids[skip:]
        logprobs = e.logprobs[skip:] if e.logprobs is not None else None
        text = e.text[max(0, self.chars - e.text_offset) :] if e.text_offset <= self.chars else e.text
        start = self.tokens
        self.tokens = max(self.tokens, e.offset + len(e.token_ids))
        self.chars = max(self.chars, e.text_offset + len(e.text))
        prompt = e.prompt_logprobs if start == 0 else None  # shown once, with the first tokens
        if e.final:
            self.done = True
            return Delta(ids, text, start, e, logprobs, prompt)
        return Delta(ids, text, start, logprobs=logprobs, prompt_logprobs=prompt) if ids or text else None


@dataclass
class Result:
    """A request's status hash and assembled output, as GET /v1/requests/{id} shows it."""

    id: str
    status: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    error: str | None = None
    error_field: str | None = None
    info: dict[str, str] = field(default_factory=dict)  # the raw status hash
    logprobs: list[dict[str, Any]] | None = None  # one per token_ids entry, when the request asked
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "status": self.status,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "error": self.error,
            "error_field": self.error_field,
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


def assemble(request_id: str, info: dict[str, str], entries: list[OutputEntry]) -> Result:
    """Build a Result from the status hash and every entry of the output stream."""
    cursor = OutputCursor()
    ids: list[int] = []
    parts: list[str] = []
    logprobs: list[dict[str, Any]] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    final: OutputEntry | None = None
    for e in entries:
        d = cursor.feed(e)
        if d is None:
            continue
        prompt_logprobs = prompt_logprobs or d.prompt_logprobs
        if d.logprobs is not None:
            logprobs = (logprobs or []) + d.logprobs
        ids.extend(d.token_ids)
        parts.append(d.text)
        if d.final is not None:
            final = d.final
    status = info.get("status", QUEUED)
    if final is not None and final.status in TERMINAL and status not in TERMINAL:
        status = final.status  # the final entry is written in the same transaction; trust either
    return Result(
        id=request_id,
        status=status,
        text="".join(parts),
        token_ids=ids,
        finish_reason=final.finish_reason if final else info.get("finish_reason"),
        usage=final.usage if final else None,
        error=(final.error if final else None) or info.get("error"),
        error_field=(final.error_field if final else None) or info.get("error_field"),
        info=info,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
