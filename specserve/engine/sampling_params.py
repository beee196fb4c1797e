"""Per-request sampling parameters, validated at the edge so bad input never reaches the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from specserve.engine.errors import InvalidParameter
from specserve.engine.grammar import StructuredOutputsParams

MAX_TOKENS_LIMIT = 1 << 20
MAX_SPECULATIVE_TOKENS = 16
# The proposers a worker may hold (spec/config.py), which a request may also name as its `speculation`
SPECULATION_METHODS = ("ngram", "draft_model", "suffix", "eagle3")
# What torch.Generator.manual_seed takes: a larger seed raised on the engine's step thread and took the
# whole engine (every running request) down with it.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


@dataclass(frozen=True)
class SamplingParams:
    """Frozen: validated once where a request enters a process (the API's gateway, the worker), then passed
    on unchanged; a derived value (a worker's seed, a resumed run's budget) is a new object
    (dataclasses.replace), never an edit of one another stage holds."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # "auto": the engine decides k per step; "off": never speculate; an int: that many draft tokens; a
    # method's name ("suffix", "ngram"): "auto" with that proposer, which the engine must hold.
    speculation: str | int = "auto"
    # Constrained decoding (engine/grammar.py checks it, engine/structured.py applies it); the wire sends it
    # as a dict, made a StructuredOutputsParams
    structured_outputs: StructuredOutputsParams | None = None
    # Log-probabilities of the generated tokens and of this many most likely tokens at each position (vLLM's
    # logprobs); None: none. Values are the target's (engine/sampler.py token_logprobs says which).
    logprobs: int | None = None
    # vLLM's prompt_logprobs: each prompt token's logprob (the first has none) and this many alternatives.
    # The prompt is then computed whole (no prefix cache hit), in chunks of at most PROMPT_LOGPROBS_CHUNK.
    prompt_logprobs: int | None = None
    # vLLM's and OpenAI's adjustments (engine/penalties.py applies them, per verify position too)
    presence_penalty: float = 0.0  # minus this for every token the output already holds
    frequency_penalty: float = 0.0  # minus this times how often the output holds the token
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: / it if > 0, * it if < 0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (after temperature)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output before this many
    bad_words: list[str] | None = None  # never generated (vLLM's): each as tokenized alone and after a space

    def __post_init__(self) -> None:
        # the two spellings OpenAI clients send, normalised once (the only writes a frozen instance gets)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(
                self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs)
            )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict) and all(
            isinstance(k, str) and k.isdigit() for k in self.logit_bias
        ):  # OpenAI's JSON keys are token ids as strings
            bias = {int(k): v for k, v in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias or None)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise InvalidParameter(name, msg)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        check(is_int(self.max_tokens), "max_tokens", "must be an integer")
        check(1 <= self.max_tokens <= MAX_TOKENS_LIMIT, "max_tokens", f"must be in [1, {MAX_TOKENS_LIMIT}]")
        check(is_num(self.temperature), "temperature", "must be a finite number")
        check(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        check(is_num(self.top_p), "top_p", "must be a finite number")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k), "top_k", "must be an integer")
        check(self.top_k >= 0, "top_k", "must be >= 0 (0 or -1 disables it)")
        check(self.seed is None or is_int(self.seed), "seed", "must be an integer or null")
        lo, hi = SEED_RANGE
        check(self.seed is None or lo <= self.seed <= hi, "seed", f"must be in [{lo}, {hi}]")
        check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of them",
        )
        check(
            isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        spec = self.speculation
        check(
            spec in ("auto", "off", *SPECULATION_METHODS)
            or (is_int(spec) and 0 <= spec <= MAX_SPECULATIVE_TOKENS),
            "speculation",
            f'must be "auto", "off", a method ({", ".join(SPECULATION_METHODS)}) or an integer in '
            f"[0, {MAX_SPECULATIVE_TOKENS}]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            check(lp is None or (is_int(lp) and lp >= 0), name, "must be an integer >= 0 or null")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(is_num(v) and -2.0 <= v <= 2.0, name, "must be a number in [-2, 2]")
        rp = self.repetition_penalty
        check(is_num(rp) and 0.0 < rp <= 10.0, "repetition_penalty", "must be a number in (0, 10]")
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be a number in [0, 1]")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        lb = self.logit_bias
        check(
            lb is None
            or (
                isinstance(lb, dict)
                and len(lb) <= 1024
                and all(is_int(k) and k >= 0 and is_num(v) and -100 <= v <= 100 for k, v in lb.items())
            ),
            "logit_bias",
            "must map token ids (integers >= 0, at most 1024 of them) to numbers in [-100, 100]",
        )
        bw = self.bad_words
        check(
            bw is None
            or (
                isinstance(bw, list) and len(bw) <= 256 and all(isinstance(w, str) and w.strip() for w in bw)
            ),
            "bad_words",
            "must be a list of at most 256 non-blank strings",
        )
        so = self.structured_outputs
        check(
            so is None or isinstance(so, StructuredOutputsParams), "structured_outputs", "must be an object"
        )

    def check_logprobs(self, most: int) -> None:
        """logprobs and prompt_logprobs ask for at most `most` alternatives (vLLM's max_logprobs, a service
        setting: service/config.py): each is a top-k over the vocabulary at every position it covers."""
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and lp > most:
                raise InvalidParameter(name, f"is {lp}; at most {most} (max_logprobs) are served")

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> SamplingParams:
        """Build from a request body's sampling fields; unknown keys are refused, not silently dropped."""
        known = {f.name for f in fields(cls)}
        for key in body:
            if key not in known:
                raise InvalidParameter(key, "unknown field")
        return cls(**body)
