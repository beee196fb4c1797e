"""SpeculativeConfig: vLLM's field names, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from specserve.engine.errors import InvalidParameter
from specserve.engine.sampling_params import MAX_SPECULATIVE_TOKENS

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model's path (method "draft_model")
    prompt_lookup_max: int = 4  # n-gram lengths tried, longest first (method "ngram")
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", f"must be one of {METHODS}, not {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            _fail("num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}], not {k!r}")
        if self.method == "draft_model" and not self.model:
            _fail("model", "(the draft model's path) is required for method draft_model")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _fail(name, f"must be a positive integer, not {getattr(self, name)!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            _fail("prompt_lookup_min", "must not exceed prompt_lookup_max")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(config) - {f.name for f in fields(cls)})
        if unknown:
            _fail(unknown[0], f"unknown field (known: {', '.join(f.name for f in fields(cls))})")
        if "method" not in config:
            _fail("method", f"is required, one of {METHODS}")
        return cls(**config)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, message: str) -> None:
    raise InvalidParameter(f"speculative_config.{name}", message)
