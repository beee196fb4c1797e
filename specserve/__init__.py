"""specserve: queue-native LLM serving with continuous batching and speculative decoding."""

from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
