"""How a request ends, in one vocabulary: from what happened to it to the final entry on the wire.

Pure functions of plain data, so the mapping is one table (tests/test_worker_finalize.py) instead of a
branch in each place a request can end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import orjson

from specserve.engine.outputs import StepDelta
from specserve.queue import wire
from specserve.queue.wire import OutputEntry


class Ending(enum.Enum):
    """Why the worker stopped a request itself (None on an Outcome: the engine ended it)."""

    CANCELLED = "cancelled"  # the client asked
    EXPIRED = "expired"  # its deadline passed while it ran
    LOST = "lost"  # another worker took its entry over: that worker finishes it
    HANDBACK = "handback"  # this worker is draining, or its engine failed: another worker runs it again


@dataclass(frozen=True)
class Outcome:
    """What one run of a request came to, as the worker saw it."""

    run: int
    ending: Ending | None = None
    last: StepDelta | None = None  # the engine's final delta (None: none came)
    text_offset: int = 0  # characters published before the final delta
    error: str | None = None  # the engine raised while the request ran
    engine_ms: float | None = None  # the engine's share of the latency
    # the whole output (earlier runs' included), kept only for a request with a reply stream
    token_ids: list[int] | None = None
    text: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # the final delta's tokens', on the wire, when asked
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # when the final delta is the first too


@dataclass(frozen=True)
class Final:
    """The final output entry and the status hash fields written with it (in one FINISH)."""

    entry: OutputEntry
    hash_fields: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return self.entry.status or wire.FINISHED


def usage_fields(delta: StepDelta) -> dict[str, int] | None:
    u = delta.usage
    if u is None:
        return None
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "draft_proposed": u.draft_proposed,
        "draft_accepted": u.draft_accepted,
        "cached_tokens": u.cached_tokens,
    }


def _final(entry: OutputEntry, engine_ms: float | None = None) -> Final:
    fields = {"finish_reason": entry.finish_reason or ""}
    if entry.usage:
        fields.update({k: str(v) for k, v in entry.usage.items()})
    if entry.error:
        fields["error"] = entry.error
    if entry.error_field:
        fields["error_field"] = entry.error_field
    if engine_ms is not None:
        # the engine's share of the latency (tokenising, waiting for a batch slot, prefill, decode), so a
        # client can tell it from what the queue and the transport add
        fields["engine_ms"] = f"{engine_ms:.2f}"
    return Final(entry, fields)


def finalize(o: Outcome) -> Final:
    """The final entry of a run that ended here. A request the engine finished keeps its own reason even
    when a cancel or deadline came too late to stop it; one we aborted says why; an error is `failed`.
    (LOST and HANDBACK runs are not finished here: the caller hands them on instead.)"""
    last = o.last
    reason = last.finish_reason if last is not None else None
    status, error, error_field = wire.FINISHED, None, None
    if o.error is not None or reason == "error" or last is None:
        status, reason, error = wire.FAILED, "error", o.error or "the engine failed"
    elif reason == "abort":
        if o.ending is Ending.CANCELLED:
            status = wire.CANCELLED
        elif o.ending is Ending.EXPIRED:
            status, error, error_field = wire.EXPIRED, "the deadline passed while it was running", "deadline"
        else:
            status, error = wire.FAILED, "aborted by the engine"
    entry = OutputEntry(
        o.run,
        last.offset if last is not None else 0,
        o.text_offset,
        last.token_ids if last is not None else [],
        last.text if last is not None else "",
        finish_reason=reason or "stop",
        status=status,
        usage=usage_fields(last) if last is not None else None,
        error=error,
        error_field=error_field,
        logprobs=o.logprobs if last is not None else None,
        prompt_logprobs=o.prompt_logprobs if last is not None else None,
    )
    return _final(entry, o.engine_ms)


def unstarted(status: str, error: str | None = None, error_field: str | None = None, run: int = 0) -> Final:
    """The final entry of a request that never reached the engine (refused, cancelled or expired)."""
    reason = "error" if status == wire.FAILED else "abort"
    return _final(OutputEntry(run, 0, 0, [], "", reason, status, None, error, error_field))


def reply_fields(request_id: str, final: Final, token_ids: list[int], text: str) -> dict[str, str]:
    """A reply stream's entry for a finished request: the whole result in one entry, as GET shows it."""
    e = final.entry
    fields = {
        "id": request_id,
        "status": final.status,
        "finish_reason": e.finish_reason or "",
        "ids": orjson.dumps(token_ids).decode(),
        "text": text,
    }
    if e.usage is not None:
        fields["usage"] = orjson.dumps(e.usage).decode()
    if e.error is not None:
        fields["error"] = e.error
    if e.error_field is not None:
        fields["error_field"] = e.error_field
    return fields
