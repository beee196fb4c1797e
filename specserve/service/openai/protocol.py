"""The OpenAI request as the routes hold it: the fields each route accepts, and `translate`, which checks a
request body and turns it into the wire's RequestBody and an OpenAIRequest (what the answer needs: model,
n, stream options, logprobs settings, tools, ids). Errors are ApiErrors naming the field the client sent.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.queue.wire import RequestBody
from specserve.service.gateway import Gateway, deadline_after
from specserve.service.http import ApiError
from specserve.service.openai.tool_calls import ToolPlan, tool_plan

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
COMPLETION_FIELDS = (
    COMMON | EXTENSIONS | ADJUSTMENTS | STRUCTURED | LOGPROBS | {"prompt", "echo", "best_of", "suffix"}
)
CHAT_FIELDS = (
    COMMON | EXTENSIONS | ADJUSTMENTS | STRUCTURED | LOGPROBS | {"messages", "max_completion_tokens"}
)
CHAT_FIELDS |= {"top_logprobs", "chat_template_kwargs"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}  # service/openai/tool_calls.py
CHAT_FIELDS |= TOOL_FIELDS


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One OpenAI request as its answer needs it, after its body has been checked and sent to the wire."""

    id: str  # chatcmpl-... or cmpl-...: the response's id; n choices run as id-0, id-1, ...
    created: int  # unix seconds, the response's `created`
    chat: bool  # /v1/chat/completions (else /v1/completions)
    model: str
    n: int  # choices, each a wire request of its own
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    logprobs: int | None  # top logprobs per token (0: the chosen token's only); None: none
    token_ids: bool  # return_tokens_as_token_ids: tokens named "token_id:<id>"
    tools: ToolPlan  # tools, tool_choice, parallel_tool_calls (chat; a plan of none for completions)
    structured: dict[str, Any] | None  # the one constraint asked for, as the wire's structured_outputs
    user: str | None
    tenant: str | None  # as the body names it (the API key's tenant is set by the gateway at enqueue)
    deadline: float | None  # unix seconds, from `timeout`

    @property
    def object(self) -> str:
        """The `object` of a whole answer."""
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        """The `object` of a streamed chunk."""
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice_ids(self) -> list[str]:
        """The wire request id of each choice."""
        return [self.id] if self.n == 1 else [f"{self.id}-{i}" for i in range(self.n)]


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


def _logprobs(data: dict[str, Any], chat: bool, most: int) -> int | None:
    """How many top logprobs the wire asks for (0: the chosen tokens' only), None for none. Chat says it
    as `logprobs: true` and `top_logprobs: n`; completions as `logprobs: n`. At most `most` (vLLM's
    max_logprobs; OpenAI's completions stop at 5, its chat at 20)."""

    def count(name: str) -> int:
        n = data[name]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= most:
            raise ApiError(400, f"{name}: must be an integer in [0, {most}]", name)
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


def _check_total_logprobs(n: int, sampling: dict[str, Any], most: int) -> None:
    """n choices of k alternatives a token ask n x k of the step's rows and the answer (the prompt's k
    counted for the group, as the first choice computes them): over `most` is a 400 naming n."""
    k = max(sampling.get("logprobs") or 0, sampling.get("prompt_logprobs") or 0)
    if n * k > most:
        raise ApiError(
            400,
            f"n: {n} choices of {k} logprobs each ask for {n * k}; at most {most} (max_total_logprobs) are "
            "served: ask for fewer choices or fewer logprobs",
            "n",
        )


def _single_prompt(prompt: Any) -> Any:
    """OpenAI allows a batch of prompts; we take exactly one (string or token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "prompt: batches are not supported; send one prompt per request", "prompt")
        return prompt[0]
    return prompt


def _translate(gateway: Gateway, data: dict[str, Any], chat: bool) -> tuple[RequestBody, OpenAIRequest]:
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
    logprobs = _logprobs(data, chat, gateway.settings.max_logprobs)
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
    wire_body = gateway.validate(body)
    _check_total_logprobs(n, wire_body.sampling, gateway.settings.max_total_logprobs)
    request = OpenAIRequest(
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        created=int(time.time()),
        chat=chat,
        model=model,
        n=n,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        logprobs=logprobs,
        token_ids=bool(as_ids),
        tools=tools,
        structured=structured,
        user=user,
        tenant=wire_body.tenant,
        deadline=wire_body.deadline,
    )
    return wire_body, request


def as_sent(e: ApiError, data: dict[str, Any]) -> ApiError:
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


def translate(gateway: Gateway, data: dict[str, Any], chat: bool) -> tuple[RequestBody, OpenAIRequest]:
    """An OpenAI request body as the wire's, and the OpenAIRequest its answer is shaped from; an ApiError
    naming the field the client sent if it is refused."""
    try:
        return _translate(gateway, data, chat)
    except ApiError as e:
        raise as_sent(e, data) from None
