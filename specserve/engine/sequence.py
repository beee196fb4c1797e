"""A request as the engine sees it: its tokens, how many have KV in the cache, and its output so far."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.outputs import TokenLogprobs
from specserve.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    # what its sampled tokens are a function of, with their positions (engine/sampler.py); the request's
    # seed, else one the engine draws
    seed: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    text: str = ""
    num_emitted_tokens: int = 0  # output tokens already handed out in deltas
    num_emitted_chars: int = 0
    first_token_time: float | None = None
    draft_proposed: int = 0
    draft_accepted: int = 0
    # the same by the method that proposed them (spec/decoder.py): method -> [proposed, accepted]
    draft_by_method: dict[str, list[int]] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache at admission
    stream: bool = True  # hand out a delta every step; False: only the final one, with every token
    logprobs: list[TokenLogprobs] | None = None  # per output token, when params.logprobs is set
    bad_words_ids: list[list[int]] | None = None  # params.bad_words as token ids (the engine tokenizes them)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, when params ask
    prompt_logprobs_sent: bool = False
    priority: int = 0  # lower runs sooner, under the scheduler's priority policy (vLLM's meaning)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def usage_by_method(self) -> dict[str, tuple[int, int]]:
        """Its draft tokens (proposed, accepted) by the method that proposed them."""
        return {method: (p, a) for method, (p, a) in self.draft_by_method.items()}

    @property
    def wants_prompt_rows(self) -> bool:
        """Prompt logprobs still to compute: the prompt must then be computed (not taken from the cache)."""
        return self.prompt_logprobs is not None and self.num_computed_tokens < self.num_prompt_tokens - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def in_decode(self) -> bool:
        """Every token but the last is in the cache: the next step is a decode (or a speculative verify)."""
        return self.num_computed_tokens == len(self.token_ids) - 1
