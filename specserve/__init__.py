"""specserve: queue-native LLM serving with continuous batching and speculative decoding.

`LLM` and `SamplingParams` load lazily, so the queue and the API (which need no torch) import fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.engine.llm import LLM
    from specserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from specserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
