"""What the engine hands back: a streamed delta per step, and a request's final output."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_proposed: int = 0  # draft tokens proposed for this request over its life
    draft_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's prompt_tokens_details)
    # draft_proposed and draft_accepted by the method that proposed them: method -> (proposed, accepted)
    draft_by_method: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability and, best first, the most likely tokens at its position with
    theirs (as many as the request asked for). Under the target model, from the forward that produced the
    token, before temperature, top-k and top-p (vLLM's default); a constrained request's grammar mask is
    applied first, so tokens it forbids are -inf."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs carry it, as vLLM's)
    token_id: int | None = None  # the token itself, on prompt logprobs (a delta's tokens are in token_ids)


@dataclass
class StepDelta:
    """New output of one request after one engine step (what the async engine streams)."""

    request_id: str
    offset: int  # index, among the completion tokens, of token_ids[0]
    token_ids: list[int]
    text: str  # new text; never ends inside a UTF-8 character
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None  # set on the final delta
    first_token_time: float | None = None  # time.monotonic() of the first output token; on the final delta
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when the request asked
    # on a request's first delta, when it asked: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestOutput:
    """A finished request (what LLM.generate returns)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    metrics: dict[str, float] = field(default_factory=dict)  # ttft, e2e seconds
    logprobs: list[TokenLogprobs] | None = None  # one per token_ids entry, when the request asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, None for the first
