"""Running one claimed request: its state, handing it to the engine, and its tokens out to the publisher.

The worker (service/worker.py) decides which requests run; this module runs one and reports its Outcome;
service/outcome.py turns that into the final entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.errors import InvalidParameter
from specserve.engine.llm_engine import Prepared
from specserve.engine.outputs import StepDelta, Usage
from specserve.engine.prepare import PreparePool
from specserve.engine.sampling_params import SamplingParams
from specserve.queue.keys import Keys
from specserve.queue.publisher import Publisher
from specserve.queue.wire import OutputEntry, RequestBody, RequestEntry, WireError, model_aliases
from specserve.service.outcome import Ending, Outcome
from specserve.service.telemetry import RequestPhases, Telemetry

log = logging.getLogger(__name__)

# Prompts longer than this are tokenized in a thread, inside their own request's task: tokenizing takes a
# while, and on the loop that does every request's Redis I/O it held up the pull loop and its batch-mates.
LONG_PROMPT_CHARS = 8192
LOGPROB_FLOOR = -9999.0  # what -inf is written as (vLLM's choice): JSON has no infinity


def prompt_chars(body: RequestBody) -> int:
    if body.messages is not None:
        return sum(len(m["content"]) for m in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0


def quick_to_prepare(body: RequestBody) -> bool:
    """A short prompt and nothing else to make ready: the loop may prepare it (Runner.start). A grammar, bad
    words or tools may take seconds (20,000 choices, 256 bad words, 1,500 tools' schemas in the template),
    so they always go through the preparation pool and its budget."""
    costly = ("structured_outputs", "bad_words")
    short = prompt_chars(body) <= LONG_PROMPT_CHARS
    return short and not body.tools and not any(k in body.sampling for k in costly)


def stable_seed(request_id: str) -> int:
    """Seed for a sampled request that gave none, so a rerun after a crash draws the same tokens."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") >> 1


def resume_point(tokenizer, prompt_ids: list[int], shown_ids: list[int], shown_text: str) -> tuple[int, int]:
    """How many of the shown tokens a rerun can take as given, and the characters of text they make.

    Usually all of them. But the text of the last few may not have been shown (half a UTF-8 character, or
    text that could still become a stop string, is held back): those are generated again, so the rerun's
    text picks up exactly where the reader's stopped. Replays the engine's own incremental detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    ids = list(prompt_ids)
    text = ""
    best = (0, 0)
    for i, token in enumerate(shown_ids, 1):
        ids.append(token)
        text += detok.step(ids)
        if len(text) > len(shown_text):
            break
        if detok.read_offset == len(ids):  # every token so far has its text
            best = (i, len(text))
    return best


@dataclass
class ServerClock:
    """The Redis server's clock (stream ids and claim replies carry it) seen from here."""

    offset: float = 0.0  # server clock - local clock, from claim replies

    def now(self) -> float:
        return time.time() + self.offset

    def local_ns(self, server_ms: int) -> int:
        return int((server_ms / 1000 - self.offset) * 1e9)


def _wall_ns(monotonic: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds that spans take."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


@dataclass
class Started:
    """A request the engine has taken: its deltas, and when it took it. A rerun that resumes after
    `base_tokens` completion tokens (`base_chars` characters) numbers its output after them."""

    request_id: str
    deltas: AsyncIterator[StepDelta]
    at: float  # time.monotonic()
    base_tokens: int = 0
    base_chars: int = 0
    base_ids: list[int] = field(default_factory=list)  # the earlier runs' tokens it continues after
    base_text: str = ""


@dataclass(frozen=True)
class Shown:
    """What readers of a rerun request have been shown by its earlier runs."""

    token_ids: list[int]
    text: str


@dataclass(eq=False)
class RequestState:
    """Everything the worker knows about one request it runs: one object from claim to final entry."""

    entry: RequestEntry
    request_id: str
    body: RequestBody
    run: int
    enqueued_ms: int
    span: Span
    ending: Ending | None = None  # set when the worker stops it itself
    task: asyncio.Task[None] | None = None
    engine_start: float = field(default_factory=time.monotonic)
    engine_end: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def deadline(self) -> float | None:
        return self.body.deadline

    def phases(self, wall_now: float) -> RequestPhases | None:
        """Queue, prefill and decode time of a request that made tokens (`wall_now`: the server's clock)."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        started = wall_now - (time.monotonic() - self.engine_start)  # the engine start on the server's clock
        return RequestPhases(
            queue=max(0.0, started - self.enqueued_ms / 1000),
            prefill=max(0.0, self.first_token_at - self.engine_start),
            decode=self.last_token_at - self.first_token_at,
        )


class Runner:
    """Hands requests to the engine and drives their output to the publisher."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        publisher: Publisher,
        telemetry: Telemetry,
        clock: ServerClock,
        keys: Keys,
        names: tuple[str, ...] = (),
        *,
        preparer: PreparePool,
        max_logprobs: int,
    ) -> None:
        self.engine = engine
        self.preparer = preparer
        self.max_logprobs = max_logprobs
        self.keys = keys
        self.names = names or (engine.model_name,)  # the served model's names, primary first
        self.publisher = publisher
        self.telemetry = telemetry
        self.clock = clock
        self.models = set().union(*(model_aliases(name) for name in self.names))
        self.preparing = 0  # requests being tokenized in a thread, not yet in the engine
        # A token's text for logprobs, decoded alone; a top-20 request decodes 21 a token, mostly the same few
        self._token_text = functools.lru_cache(maxsize=65_536)(lambda t: engine.tokenizer.decode([t]))

    # ---- into the engine ------------------------------------------------------------------------------

    def params(self, rid: str, body: RequestBody) -> tuple[SamplingParams, bool]:
        """The request's sampling parameters, and whether max_tokens is to fill the context."""
        if body.model is not None and body.model not in self.models:
            raise WireError("model", f"unknown model {body.model!r}; this worker serves {list(self.names)}")
        until_full = body.fills_context
        params = SamplingParams.from_dict(body.sampling_fields())
        params.check_logprobs(self.max_logprobs)
        limit = self.engine.max_model_len
        if not until_full and params.max_tokens > limit:
            raise InvalidParameter(
                "max_tokens", f"is {params.max_tokens}; this model's context is {limit} tokens"
            )
        if params.seed is None and not params.greedy:
            params = dataclasses.replace(params, seed=stable_seed(rid))
        return params, until_full

    def start(self, rid: str, body: RequestBody) -> Started:
        """Hand a request to the engine now, preparing it on the loop: only for requests that are quick to
        prepare (quick_to_prepare); begin() prepares the others in the preparation pool."""
        params, until_full = self.params(rid, body)
        with _as_sent(body):
            prepared = self.engine.engine.prepare(self._prompt(body), params)
            return self._hand_over(rid, body, params, until_full, prepared)

    async def begin(self, rid: str, body: RequestBody, shown: Shown | None = None) -> Started:
        """Hand a request to the engine, prepared (tokenized, its bad words and grammar made ready) in the
        preparation pool under its time budget; a rerun whose earlier runs showed tokens continues after
        them (a constrained one with its grammar's matcher past them)."""
        if shown is not None and shown.token_ids:
            return await self._resume(rid, body, shown)
        if quick_to_prepare(body):  # not behind the pool's queue, which a costly request may hold
            return self.start(rid, body)
        params, until_full = self.params(rid, body)  # a bad field fails before the tokenizer runs

        def work(mark: Callable[[str | None], None]) -> Prepared:
            with _as_sent(body):
                return self.engine.engine.prepare(
                    self._prompt(body, mark), params, mark, self.preparer.compilers
                )

        with self._preparing(), _as_sent(body):
            prepared = await self.preparer.run(work, self._prompt_field(body))
            return self._hand_over(rid, body, params, until_full, prepared)

    def _prompt_field(self, body: RequestBody) -> str:
        return "messages" if body.messages is not None else "prompt"

    def _prompt(
        self, body: RequestBody, mark: Callable[[str | None], None] = lambda _: None
    ) -> str | list[int]:
        """The prompt as the engine takes it: a chat through the model's template, else as given."""
        if body.messages is None:
            assert body.prompt is not None
            return body.prompt
        mark("tools" if body.tools else "messages")
        prompt = self.engine.encode_chat(body.messages, body.chat_template_kwargs, body.tools)
        mark("messages")
        return prompt

    def _hand_over(
        self, rid: str, body: RequestBody, params: SamplingParams, until_full: bool, prepared: Prepared
    ) -> Started:
        if until_full:
            budget = max(1, self.engine.max_model_len - len(prepared.prompt_ids))
            params = dataclasses.replace(params, max_tokens=budget)
        at = time.monotonic()
        deltas = self.engine.add_request(
            rid, prepared.prompt_ids, params, stream=body.stream, priority=body.priority, prepared=prepared
        )
        return Started(rid, deltas, at)

    @contextlib.contextmanager
    def _preparing(self) -> Iterator[None]:
        """Counts requests being prepared off the loop: they hold a batch slot the engine cannot see yet."""
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1

    async def _resume(self, rid: str, body: RequestBody, shown: Shown) -> Started:
        """Continue a request from the tokens a reader has been shown: the prompt grows by them, the budget
        shrinks by them, and the output is numbered after them, so the reader sees one sequence, nothing
        replayed (docs/wire-format.md, Reading rule). A constrained request's matcher starts past them: the
        answer readers see is one the grammar accepts, the shown part and the rest together."""
        params, until_full = self.params(rid, body)

        def work(mark: Callable[[str | None], None]) -> tuple[Prepared, int, int]:
            with _as_sent(body):
                prompt = self._prompt(body, mark)
                if isinstance(prompt, str):
                    prompt = self.engine.tokenizer.encode(prompt)
                n, chars = resume_point(self.engine.tokenizer, prompt, shown.token_ids, shown.text)
                whole = self.engine.engine.prepare(
                    prompt + shown.token_ids[:n], params, mark, self.preparer.compilers
                )
                return dataclasses.replace(whole, grammar_prefix=tuple(shown.token_ids[:n])), n, chars

        with self._preparing(), _as_sent(body):
            prepared, n, chars = await self.preparer.run(work, self._prompt_field(body))
        given = shown.token_ids[:n]
        prompt_len = len(prepared.prompt_ids) - n
        at = time.monotonic()
        last = given[-1] if given else None
        eos = set() if params.ignore_eos else self.engine.engine.eos_token_ids
        stop_ids = set(params.stop_token_ids) | eos
        if not until_full and n >= params.max_tokens or last in stop_ids:
            # the earlier run made every token and died before its final entry: only that is left to write
            reason = "stop" if last in stop_ids else "length"
            return Started(rid, _ended(rid, reason, prompt_len + n), at, n, chars, given, shown.text[:chars])
        budget = self.engine.max_model_len - prompt_len - n if until_full else params.max_tokens - n
        # the seed stays: a token's draw is keyed by its position (engine/sampler.py), and the prompt grows
        # by the shown tokens, so the rerun draws what the first run would have drawn next
        params = dataclasses.replace(params, max_tokens=max(1, budget))
        deltas = self.engine.add_request(
            rid, prepared.prompt_ids, params, stream=body.stream, priority=body.priority, prepared=prepared
        )
        return Started(rid, deltas, at, n, chars, given, shown.text[:chars])

    async def abort(self, started: Started) -> None:
        """Abort a request the engine took; its final delta ends the stream, and with it its queue."""
        self.engine.abort(started.request_id)
        async for _ in started.deltas:
            pass

    # ---- out to the publisher -------------------------------------------------------------------------

    async def drive(self, state: RequestState, started: Started) -> Outcome:
        """Publish a running request's tokens as they come; its Outcome when the engine is done with it."""
        rid = state.request_id
        state.engine_start = started.at
        tracer = self.telemetry.tracer
        in_request = trace.set_span_in_context(state.span)
        phase = tracer.start_span("prefill", context=in_request)
        base = started.base_tokens
        text_offset = started.base_chars
        last: StepDelta | None = None
        last_logprobs: list[dict[str, Any]] | None = None
        # a resumed run's prompt holds the earlier runs' tokens: its prompt logprobs are not the request's
        last_prompt: list[dict[str, Any] | None] | None = None
        error: str | None = None
        body = state.body
        reply_key = self.keys.reply(body.reply_to) if body.reply_stream and body.reply_to else None
        # a reply stream's final entry carries the whole output: kept only for those who asked for one
        whole: tuple[list[int], list[str]] | None = None
        if body.reply_to is not None:
            whole = (list(started.base_ids), [started.base_text])
        try:
            async with contextlib.aclosing(started.deltas) as deltas:
                async for d in deltas:
                    if d.token_ids:
                        arrived = time.monotonic()
                        if state.last_token_at is not None:
                            self.telemetry.inter_token(self.names[0], arrived - state.last_token_at)
                        state.last_token_at = arrived
                        if state.first_token_at is None:
                            # A final-only request's one delta says when its first token really came.
                            state.first_token_at = d.first_token_time or state.last_token_at
                            phase.end(end_time=_wall_ns(state.first_token_at))
                            phase = tracer.start_span(
                                "decode", context=in_request, start_time=_wall_ns(state.first_token_at)
                            )
                            since_first = time.monotonic() - state.first_token_at
                            ttft = self.clock.now() - since_first - state.enqueued_ms / 1000
                            self.telemetry.ttft.record(max(0.0, ttft))
                    if whole is not None:
                        whole[0].extend(d.token_ids)
                        whole[1].append(d.text)
                    if d.finished:
                        last = _after(d, base)  # its tokens go out with the final entry
                        last_logprobs = self.wire_logprobs(d)
                        last_prompt = None if base else self.wire_prompt_logprobs(d)
                        state.engine_end = time.monotonic()
                    elif d.token_ids or d.text:
                        entry = OutputEntry(state.run, base + d.offset, text_offset, d.token_ids, d.text)
                        entry.logprobs = self.wire_logprobs(d)
                        entry.prompt_logprobs = None if base else self.wire_prompt_logprobs(d)
                        self.publisher.push(rid, entry, reply_key)
                        text_offset += len(d.text)
        except Exception as err:  # whatever the engine raises fails this request, not the worker's others
            log.exception("request %s failed in the engine", rid)
            error = str(err) or type(err).__name__
        phase.end()
        if self.engine.error is not None and state.ending is None:
            state.ending = Ending.HANDBACK  # the engine died, not the request: let a healthy worker run it
        engine_ms = None
        if state.engine_end is not None:
            engine_ms = 1000 * (state.engine_end - state.engine_start)
        ids, text = (whole[0], "".join(whole[1])) if whole is not None else (None, None)
        return Outcome(
            state.run,
            state.ending,
            last,
            text_offset,
            error,
            engine_ms,
            ids,
            text,
            last_logprobs,
            last_prompt,
        )

    def wire_prompt_logprobs(self, d: StepDelta) -> list[dict[str, Any] | None] | None:
        """A first delta's prompt logprobs as output entries carry them (None for the first token)."""
        if d.prompt_logprobs is None:
            return None
        token = self._token_text
        out: list[dict[str, Any] | None] = []
        for lp in d.prompt_logprobs:
            if lp is None or lp.token_id is None:
                out.append(None)
                continue
            top = [{"id": i, "token": token(i), "logprob": max(v, LOGPROB_FLOOR)} for i, v in lp.top]
            out.append(
                {
                    "id": lp.token_id,
                    "token": token(lp.token_id),
                    "logprob": max(lp.logprob, LOGPROB_FLOOR),
                    "rank": lp.rank,
                    "top_logprobs": top,
                }
            )
        return out

    def wire_logprobs(self, d: StepDelta) -> list[dict[str, Any]] | None:
        """A delta's logprobs as output entries carry them, each token with its text (the worker has the
        tokenizer; readers need not). -inf (a token a grammar forbids) is written as -9999.0, as vLLM
        does: JSON has no infinity."""
        if d.logprobs is None:
            return None
        token = self._token_text
        return [
            {
                "token": token(t),
                "logprob": max(lp.logprob, LOGPROB_FLOOR),
                "top_logprobs": [
                    {"id": i, "token": token(i), "logprob": max(v, LOGPROB_FLOOR)} for i, v in lp.top
                ],
            }
            for t, lp in zip(d.token_ids, d.logprobs)
        ]


@contextlib.contextmanager
def _as_sent(body: RequestBody) -> Iterator[None]:
    """A chat request's prompt is the worker's doing: an error about it names the field the client sent."""
    try:
        yield
    except InvalidParameter as err:
        if err.field == "prompt" and body.messages is not None:
            raise InvalidParameter("messages", err.message) from None
        raise


def _after(final: StepDelta, base: int) -> StepDelta:
    """A resumed run's final delta, counted from the request's start: the `base` tokens it was given were
    completion tokens, not prompt."""
    if not base:
        return final
    u = final.usage
    usage = (
        None
        if u is None
        else dataclasses.replace(
            u, prompt_tokens=u.prompt_tokens - base, completion_tokens=u.completion_tokens + base
        )
    )
    return dataclasses.replace(final, offset=final.offset + base, usage=usage)


async def _ended(rid: str, reason: str, tokens: int) -> AsyncIterator[StepDelta]:
    """The final delta of a request whose tokens were all made by an earlier run."""
    yield StepDelta(rid, 0, [], "", finished=True, finish_reason=reason, usage=Usage(tokens, 0))
