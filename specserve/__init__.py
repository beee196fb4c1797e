"""specserve: queue-native LLM serving with continuous batching and speculative decoding.

`LLM` and `SamplingParams` load lazily, so the queue and the API (which need no torch) import fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.engine.llm import LLM
    from specserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]
# The installed distribution's metadata says the version (service/cli.py `--version`); this is what a source
# tree run without installing reports, and pyproject.toml's `version` must match it (tests/test_packaging.py).
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from specserve.engine.cpu_tuning import default_wait_policy

        default_wait_policy()  # before the engine's import loads torch, and libgomp with it
        from specserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
