"""Offline batch generation, vLLM-shaped: LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import time
from typing import Any

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.outputs import RequestOutput, Usage
from specserve.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        start = time.monotonic()
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p, stream=False)  # outputs are read from the sequences
        seqs = {rid: engine._requests[rid] for rid in ids}
        finished_at: dict[str, float] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.finished:
                    finished_at[delta.request_id] = time.monotonic()
        outputs = []
        for rid in ids:
            seq = seqs[rid]
            ttft = (seq.first_token_time or finished_at[rid]) - start
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=seq.prompt_token_ids,
                    token_ids=seq.output_token_ids,
                    text=seq.text,
                    finish_reason=seq.finish_reason,
                    usage=Usage(
                        seq.num_prompt_tokens,
                        seq.num_output_tokens,
                        seq.draft_proposed,
                        seq.draft_accepted,
                        seq.num_cached_tokens,
                        seq.usage_by_method(),
                    ),
                    metrics={"ttft": ttft, "e2e": finished_at[rid] - start},
                    logprobs=None if seq.logprobs is None else seq.logprobs[: seq.num_output_tokens],
                    prompt_logprobs=seq.prompt_logprobs,
                )
            )
        return outputs
