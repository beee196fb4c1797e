"""The worker's finalize(): how a run of a request ends on the wire, as one table (vLLM's style: hand-made
inputs, expected outputs). Each row reads: what happened -> status, finish_reason, error, error_field."""

from __future__ import annotations

import pytest

from specserve.engine.outputs import StepDelta, Usage
from specserve.service.outcome import Ending, Outcome, finalize, unstarted


def _last(reason: str, ids=(5, 6), text="ab") -> StepDelta:
    return StepDelta("r", 3, list(ids), text, finished=True, finish_reason=reason, usage=Usage(4, 5, 2, 1))


ROWS = [
    # what the engine said, why we stopped it, an exception -> status, finish_reason, error?, error_field
    ("engine stopped it", _last("stop"), None, None, "finished", "stop", False, None),
    ("max_tokens reached", _last("length"), None, None, "finished", "length", False, None),
    ("cancelled by the client", _last("abort"), Ending.CANCELLED, None, "cancelled", "abort", False, None),
    ("deadline passed", _last("abort"), Ending.EXPIRED, None, "expired", "abort", True, "deadline"),
    ("aborted, no reason of ours", _last("abort"), None, None, "failed", "abort", True, None),
    ("cancel came too late", _last("stop"), Ending.CANCELLED, None, "finished", "stop", False, None),
    ("deadline came too late", _last("length"), Ending.EXPIRED, None, "finished", "length", False, None),
    ("engine reported an error", _last("error"), None, None, "failed", "error", True, None),
    ("engine raised", None, None, "boom", "failed", "error", True, None),
    ("no final delta", None, None, None, "failed", "error", True, None),
    ("raised after a final delta", _last("stop"), None, "boom", "failed", "error", True, None),
]


@pytest.mark.parametrize(
    "last,ending,error,status,reason,has_error,error_field",
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_finalize(last, ending, error, status, reason, has_error, error_field):
    final = finalize(Outcome(run=2, ending=ending, last=last, text_offset=7, error=error, engine_ms=12.5))
    e = final.entry
    assert (e.status, e.finish_reason, e.error is not None, e.error_field) == (
        status,
        reason,
        has_error,
        error_field,
    )
    assert final.status == status and e.run == 2 and e.text_offset == 7
    # the status hash says what the final entry says, in the same FINISH
    assert final.hash_fields["finish_reason"] == reason and final.hash_fields["engine_ms"] == "12.50"
    assert final.hash_fields.get("error") == e.error
    assert final.hash_fields.get("error_field") == error_field
    if last is not None:
        assert (e.offset, e.token_ids, e.text) == (3, [5, 6], "ab")
        assert e.usage == {
            "prompt_tokens": 4,
            "completion_tokens": 5,
            "total_tokens": 9,
            "draft_proposed": 2,
            "draft_accepted": 1,
            "cached_tokens": 0,
        }
        assert final.hash_fields["completion_tokens"] == "5"
    else:
        assert (e.offset, e.token_ids, e.text, e.usage) == (0, [], "", None)


@pytest.mark.parametrize(
    "status,error,field,reason",
    [
        ("failed", "top_p: must be in (0, 1]", "top_p", "error"),
        ("cancelled", None, None, "abort"),
        ("expired", "the deadline passed before it started", "deadline", "abort"),
        ("failed", "delivered 4 times without finishing", None, "error"),
    ],
)
def test_unstarted(status, error, field, reason):
    final = unstarted(status, error, field, run=1)
    e = final.entry
    assert (e.status, e.finish_reason, e.error, e.error_field) == (status, reason, error, field)
    assert (e.token_ids, e.text, e.offset, e.usage, e.run) == ([], "", 0, None, 1)
    assert final.hash_fields.get("error_field") == field and final.hash_fields["finish_reason"] == reason
