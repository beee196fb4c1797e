"""The step loop: schedule, propose, one target forward, sample/verify, update.

plan  = scheduler.schedule()
draft = proposer.propose(plan)          (speculation only)
out   = runner.run(entries)             one forward over all query tokens of all sequences
acc   = sample / verify(out, draft)
update: append tokens, stop checks, roll back rejected KV, free finished sequences
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.blockmgr import BlockManager
from specserve.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from specserve.engine.cpu_tuning import keep_freed_memory_in_heap
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.engine.outputs import StepDelta, Usage
from specserve.engine.sampler import RowParams, sample
from specserve.engine.sampling_params import InvalidParameter, SamplingParams
from specserve.engine.scheduler import ScheduledSeq, Scheduler
from specserve.engine.sequence import SeqStatus, Sequence
from specserve.models.config import ModelConfig
from specserve.models.llama import LlamaModel
from specserve.models.loader import demo_model_path, load_checkpoint, load_tokenizer


@dataclass
class StepTimes:
    """Seconds spent in each phase, summed over steps (the benchmark's per-step breakdown)."""

    schedule: float = 0.0
    propose: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    steps: int = 0
    seqs: int = 0  # sequences scheduled, summed over steps (mean batch = seqs / steps)
    tokens: int = 0  # query tokens through the target, summed over steps

    def as_dict(self) -> dict[str, float]:
        keys = ("schedule", "propose", "forward", "sample", "update", "steps", "seqs", "tokens")
        return {k: getattr(self, k) for k in keys}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    draft_proposed: int
    draft_accepted: int
    steps: int
    last_batch_size: int


@dataclass
class _Totals:
    draft_proposed: int = 0
    draft_accepted: int = 0
    last_batch_size: int = 0
    times: StepTimes = field(default_factory=StepTimes)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = Path(config.model) if config.model else demo_model_path()
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        ckpt = load_checkpoint(path, dtype=torch.float32)
        self.model_config = ModelConfig.from_hf(ckpt.config)
        self.tokenizer = load_tokenizer(path)
        self.model = LlamaModel(
            self.model_config, ckpt.state_dict, self.dtype, self.device, config.attention_backend
        )
        del ckpt

        block_size = config.block_size
        num_blocks = config.num_kv_blocks or max(
            1,
            (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES)
            // (self.model_config.kv_bytes_per_token(self.dtype) * block_size),
        )
        # A sequence must fit in the pool on its own, or preemption could never make room for it.
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_blocks * block_size,
        )
        self.block_manager = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(self.model, num_blocks, block_size)
        batched_tokens = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            batched_tokens = max(batched_tokens, self.max_model_len)
        self.spec = None
        if config.speculative_config:
            from specserve.spec.decoder import SpeculativeDecoder

            self.spec = SpeculativeDecoder.from_config(config.speculative_config, self)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            static_batching=config.static_batching,
            lookahead=self.spec.lookahead if self.spec else None,
            static_padding=config.static_padding,
            max_model_len=self.max_model_len,
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seq_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._generator = torch.Generator().manual_seed(config.seed)
        self._totals = _Totals()

    # ---- requests -------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidParameter("prompt", f"token ids must be in [0, {vocab})")
        else:
            raise InvalidParameter("prompt", "must be a string or a list of token ids")
        if not ids:
            raise InvalidParameter("prompt", "is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt", f"has {len(ids)} tokens; this model serves at most {self.max_model_len - 1}"
            )
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidParameter("messages", "must be a non-empty list of {role, content} objects")
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidParameter("messages", "each message needs string fields role and content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        return self.encode_prompt(ids)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, stream: bool = True
    ) -> None:
        """stream=False: no per-step deltas, only the final one (for callers that want the whole result)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params.validate()
        ids = self.encode_prompt(prompt)
        gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            arrival_time=time.monotonic(),
            generator=gen,
            stream=stream,
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def stats(self) -> EngineStats:
        t = self._totals
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            draft_proposed=t.draft_proposed,
            draft_accepted=t.draft_accepted,
            steps=t.times.steps,
            last_batch_size=t.last_batch_size,
        )

    @property
    def step_times(self) -> StepTimes:
        return self._totals.times

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[StepDelta]:
        times = self._totals.times
        t0 = time.perf_counter()
        deltas = [self._delta(seq) for seq in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule()
        if self.spec is not None:
            for seq in plan.preempted:
                self.spec.forget(seq)
        t1 = time.perf_counter()
        if not plan.scheduled:
            times.schedule += t1 - t0
            return deltas
        drafts = self.spec.propose(plan.scheduled, self._generator) if self.spec is not None else {}
        t2 = time.perf_counter()
        entries = []
        for s in plan.scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            draft = drafts.get(seq.seq_id)
            tokens = seq.token_ids[start : start + s.num_tokens]
            if draft is not None:
                tokens = tokens + draft.token_ids
            num_logits = (1 + (len(draft.token_ids) if draft else 0)) if s.samples else 0
            entries.append(
                ForwardEntry(tokens, start, self.block_manager.block_table(seq.seq_id), num_logits)
            )
        if plan.padding:  # padded static batching only: computed like HF's padding, then dropped
            num_real = sum(e.num_logits for e in entries)
            for row in plan.padding:
                table = self.block_manager.block_table(row.seq_id)
                entries.append(ForwardEntry([row.token_id], row.position, table, 1))
            logits = self.runner.run(entries)[:num_real]
        else:
            logits = self.runner.run(entries)
        t3 = time.perf_counter()
        if self.spec is not None:
            self.spec.record_forward(sum(len(e.token_ids) for e in entries), t3 - t2)
        accepted = self._sample(plan.scheduled, drafts, logits)
        t4 = time.perf_counter()
        for s, (tokens, num_drafts_accepted) in zip(plan.scheduled, accepted):
            self._update(s, tokens, num_drafts_accepted, drafts.get(s.seq.seq_id))
            if s.seq.is_finished or (tokens and s.seq.stream):
                deltas.append(self._delta(s.seq))
        t5 = time.perf_counter()
        times.schedule += t1 - t0
        times.propose += t2 - t1
        times.forward += t3 - t2
        times.sample += t4 - t3
        times.update += t5 - t4
        times.steps += 1
        times.seqs += len(plan.scheduled)
        times.tokens += sum(len(e.token_ids) for e in entries)
        self._totals.last_batch_size = len(plan.scheduled)
        return deltas

    def _sample(
        self, scheduled: list[ScheduledSeq], drafts: dict, logits: torch.Tensor
    ) -> list[tuple[list[int], int]]:
        """New tokens per scheduled sequence (none mid-prompt) and how many of them were accepted drafts."""
        sampling = [s.seq for s in scheduled if s.samples]
        if not sampling:
            return [([], 0)] * len(scheduled)
        if self.spec is not None and drafts:
            by_seq = self.spec.verify(sampling, drafts, logits, self._generator)
        else:
            rows = RowParams.build(
                [q.params for q in sampling], [q.generator for q in sampling], logits.shape[-1]
            )
            tokens = sample(logits, rows, self._generator).tolist()
            by_seq = {q.seq_id: ([t], 0) for q, t in zip(sampling, tokens)}
        return [by_seq.get(s.seq.seq_id, ([], 0)) if s.samples else ([], 0) for s in scheduled]

    def _update(self, s: ScheduledSeq, tokens: list[int], num_accepted: int, draft) -> None:
        seq = s.seq
        seq.num_computed_tokens += s.num_tokens + num_accepted
        if draft is not None:
            seq.draft_proposed += len(draft.token_ids)
            seq.draft_accepted += num_accepted
            seq.spec_steps += 1
            self._totals.draft_proposed += len(draft.token_ids)
            self._totals.draft_accepted += num_accepted
        reason = None
        for token in tokens:
            reason = self._append(seq, token)
            if reason is not None:
                break
        if draft is not None and reason is None:
            self.spec.observe(seq, len(draft.token_ids), num_accepted)
        if not seq.params.stop:
            seq.text += seq.detokenizer.step(seq.token_ids)
        if reason is not None:
            self._finish(seq, reason)
        elif s.num_lookahead:
            # Roll back rejected drafts: keep room for the tokens we have, free whole blocks past them.
            self.block_manager.truncate(seq.seq_id, seq.num_tokens)

    def _append(self, seq: Sequence, token: int) -> str | None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        p = seq.params
        if p.stop:
            # A stop string completed by this token ends inside its new text; it may start just before it.
            tail_from = max(0, len(seq.text) - max(map(len, p.stop)) + 1)
            seq.text += seq.detokenizer.step(seq.token_ids)
            for stop in p.stop:
                at = seq.text.find(stop, tail_from)
                if at != -1:
                    seq.text = seq.text[:at]
                    return "stop"
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if reason != "stop" or not seq.params.stop:
            seq.text += seq.detokenizer.step(seq.token_ids, final=True)
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.forget(seq)
        self._requests.pop(seq.request_id, None)

    def _delta(self, seq: Sequence) -> StepDelta:
        finished = seq.status is SeqStatus.FINISHED
        hold = 0 if finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        text_end = max(seq.num_emitted_chars, len(seq.text) - hold)
        delta = StepDelta(
            request_id=seq.request_id,
            offset=seq.num_emitted_tokens,
            token_ids=seq.output_token_ids[seq.num_emitted_tokens :],
            text=seq.text[seq.num_emitted_chars : text_end],
            finished=finished,
            finish_reason=seq.finish_reason,
        )
        seq.num_emitted_tokens = seq.num_output_tokens
        seq.num_emitted_chars = text_end
        if finished:
            delta.first_token_time = seq.first_token_time
            delta.usage = Usage(
                seq.num_prompt_tokens, seq.num_output_tokens, seq.draft_proposed, seq.draft_accepted
            )
        return delta
