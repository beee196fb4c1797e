"""The engine: requests in, one step at a time, deltas out.

plan     = scheduler.schedule()                 SchedulerOutput: who runs, how many tokens, k lookahead each
drafts   = spec.propose(plan)                   DraftBatch (speculation only)
logits   = forward(plan, drafts)                one target forward over all query tokens of all sequences
accepted = sample / spec.verify(...)            one Accepted per scheduled sequence
scheduler.update(plan, accepted)                cache positions, tokens, token stops, KV rollback
outputs.process(plan, accepted)                 text, stop strings, deltas
spec.update(plan, accepted)                     acceptance estimates, draft cache, forgetting finished ones
spec.record_step(plan, accepted, seconds)       the whole step's time: does drafting pay at this load
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2 import TemplateError

from specserve.blockmgr import BlockManager
from specserve.engine import cuda_graphs
from specserve.engine.config import EngineConfig
from specserve.engine.cpu_tuning import (
    TeamTuner,
    keep_freed_memory_in_heap,
    release_freed_memory,
    return_freed_memory_at_once,
    size_thread_team,
    team_tuner,
)
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.errors import InvalidParameter
from specserve.engine.logprobs import record_prompt_logprobs, with_logprobs
from specserve.engine.memory import (
    activation_reserve_bytes,
    kv_pool_bytes,
    plan_kv_cache,
    profile_activation_bytes,
)
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import StepDelta
from specserve.engine.parallel import ModelSpec, ParallelRunner, RankGroup, build_model
from specserve.engine.penalties import adjust_logits
from specserve.engine.preflight import preflight
from specserve.engine.prepare import GrammarCompilers
from specserve.engine.sampler import RowParams, sample
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence
from specserve.engine.static_scheduler import StaticScheduler
from specserve.engine.step import NOTHING, Accepted, DraftBatch, SchedulerOutput
from specserve.engine.structured import StructuredOutputs
from specserve.kernels import tree as tree_mask
from specserve.models import quant
from specserve.models.loader import load_tokenizer
from specserve.spec.decoder import SpeculativeDecoder, check_speculation
from specserve.spec.factory import TargetInfo, build_decoder

log = logging.getLogger(__name__)

# apply_chat_template's own arguments: a request's template variables may not override them
RESERVED_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "add_generation_prompt", "tokenize", "return_dict", "chat_template"}
    | {"continue_final_message", "tokenizer_kwargs", "return_tensors", "padding", "truncation", "tools"}
    | {"documents", "max_length"}
)


@dataclass(frozen=True)
class Prepared:
    """A request made ready off the step thread (LLMEngine.prepare)."""

    prompt_ids: list[int]
    bad_words_ids: list[list[int]] | None = None
    grammar: Any = None  # xgrammar's CompiledGrammar for this tokenizer, for a constrained request
    # tokens the grammar's matcher accepts before the first step: a resumed rerun's tokens readers were shown,
    # which its prompt already ends with, so its output continues the answer they began
    grammar_prefix: tuple[int, ...] = ()


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

    def lap(self) -> Callable[[str], None]:
        """A stopwatch for one step: lap(phase) adds the time since the previous lap to that phase."""
        last = time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal last
            now = time.perf_counter()
            setattr(self, phase, getattr(self, phase) + now - last)
            last = now

        return lap

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
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, found there
    # draft_proposed and draft_accepted by the method that proposed them: method -> (proposed, accepted)
    draft_by_method: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _Totals:
    last_batch_size: int = 0
    times: StepTimes = field(default_factory=StepTimes)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        checked = preflight(config)
        path = checked.path
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.device, self.dtype, self.kv_dtype = checked.device, checked.dtype, checked.kv_dtype
        tp_size = config.tensor_parallel_size
        # sharded ranks hold dense matrices: auto leaves a GGUF's quantization for the dequantized path
        self.quantization = (
            "none" if tp_size > 1 else quant.effective_mode(config.quantization, self.device, self.dtype)
        )
        spec = ModelSpec(
            path,
            self.dtype,
            self.device.type,
            config.attention_backend,
            self.quantization,
            config.batch_invariant,
            self.kv_dtype,
        )
        # Before the weights: building a GGUF's tokenizer holds ~100 MiB of Python strings for a moment (its
        # vocabulary and merges), which on top of the weights was the load's peak (bench/load.py).
        self.tokenizer = load_tokenizer(path)
        if config.chat_template is not None:
            self.tokenizer.chat_template = config.chat_template
        self.ranks = RankGroup(tp_size, spec) if tp_size > 1 else None
        # batch-invariant rows keep one arithmetic whatever the step: the team that splits them stays put
        self._team: TeamTuner | None = None
        if self.device.type == "cpu":
            if self.ranks is None:  # the ranks size theirs as they start
                threads = size_thread_team()
                self._team = team_tuner(threads, config.adaptive_threads and not config.batch_invariant)
            return_freed_memory_at_once()
        try:
            self.model, hf_config = build_model(spec, self.ranks.tp if self.ranks else None)
            if self.ranks is not None:
                self.ranks.models_built()
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        self.device = self.model.device
        self.model_config = self.model.cfg
        if self.device.type == "cpu":
            release_freed_memory()
            keep_freed_memory_in_heap()

        # decided before the KV pool is sized: captured graphs hold memory the pool must leave them
        graphs_refusal = self.graphs_refusal = cuda_graphs.setup_refusal(
            cuda_graphs.SetupFacts.of(self.model, config.enforce_eager, tp_size, capture=True)
        )
        block_size = config.block_size
        mc = self.model_config
        # a rank holds its share of the KV heads; on CPU the ranks share the host's memory
        per_token = mc.kv_bytes_per_token(self.kv_dtype) * self.model.num_kv_heads // mc.num_kv_heads
        share = tp_size if self.device.type == "cpu" else 1
        if config.num_kv_blocks:  # tests and benchmarks: an exact pool
            pool, why = config.num_kv_blocks * block_size * per_token, "num_kv_blocks"
        else:
            dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
            logit_rows = min(config.max_num_batched_tokens, 512)
            # on CUDA the largest step is run once and its peak measured (vLLM's profile run); the estimate
            # is for CPU, where nothing reads the allocator's peak, and for tensor-parallel ranks, which
            # could only run it together
            profiled = (
                profile_activation_bytes(
                    self.model, config.max_num_batched_tokens, config.max_num_seqs, block_size, logit_rows
                )
                if tp_size == 1 and not config.kv_cache_bytes
                else 0
            )
            # The graphs' shared pool holds the activations of their largest step, which has no more tokens
            # than the profiled one (cuda_graphs.CudaGraphs.shapes): the profiled peak again covers it, and
            # the capture logs what the pool took.
            if profiled and graphs_refusal is None:
                profiled *= 2
            reserve = profiled or activation_reserve_bytes(
                config.max_num_batched_tokens,
                mc.hidden_size,
                mc.intermediate_size,
                mc.vocab_size,
                dtype_bytes,
            )
            pool, why = kv_pool_bytes(
                self.device, config.kv_cache_bytes, config.gpu_memory_utilization, reserve
            )
            if share > 1:
                pool, why = pool // share, f"{why}, split between {share} ranks"
        plan = plan_kv_cache(
            pool, why, per_token, block_size, config.max_model_len, mc.max_position_embeddings
        )
        num_blocks, self.max_model_len = plan.num_blocks, plan.max_model_len
        self.block_manager = BlockManager(
            num_blocks, block_size, config.enable_prefix_caching and not config.static_batching
        )
        self.runner = (
            ParallelRunner(self.model, num_blocks, block_size, self.ranks)
            if self.ranks is not None
            else ModelRunner(self.model, num_blocks, block_size)
        )
        if graphs_refusal is None:
            try:
                self.runner.graphs = cuda_graphs.build(self.runner, config, self.max_model_len, capture=True)
            except Exception as exc:  # the eager forward serves every step as well
                # a failed capture costs speed, not service: the engine starts eager and says why
                self.graphs_refusal = f"capture failed: {exc!r}"
                log.exception("CUDA graphs off: capture failed; every step runs eagerly")
                torch.cuda.empty_cache()
        else:
            log_graphs = log.info if self.device.type == "cuda" else log.debug
            log_graphs("CUDA graphs off: %s", graphs_refusal)
        batched_tokens = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            batched_tokens = max(batched_tokens, self.max_model_len)
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_config is not None:
            target = TargetInfo(
                self.model_config.vocab_size,
                self.tokenizer,
                self.dtype,
                self.device,
                config.attention_backend,
                num_blocks,
                block_size,
                self.block_manager.enable_prefix_caching,
                self.model_config.num_layers,
                self.model_config.hidden_size,
                self.model.embed,
                self.block_manager.block_table,
                batch_invariant=config.batch_invariant,
            )
            self.spec = build_decoder(config.speculative_config, self.max_model_len, target)
            if self.spec.capture_layers and self.ranks is not None:
                self.ranks.close()
                raise InvalidParameter(
                    "speculative_config.method",
                    "eagle3 reads the target's hidden states, which tensor-parallel ranks do not hand back",
                )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        scheduler_args = (self.block_manager, config.max_num_seqs, batched_tokens, self.max_model_len)
        scheduler_kwargs = dict(
            eos_token_ids=self.eos_token_ids,
            enable_chunked_prefill=config.enable_chunked_prefill,
            lookahead=self.spec.lookahead if self.spec else None,
            policy=config.scheduling_policy,
            background_tokens=config.background_tokens,
            prefill_tokens_beside_decode=config.prefill_tokens_beside_decode,
        )
        if config.static_batching:  # the benchmark's baseline
            self.scheduler: Scheduler = StaticScheduler(
                *scheduler_args, padding=config.static_padding, **scheduler_kwargs
            )
        else:
            self.scheduler = Scheduler(*scheduler_args, **scheduler_kwargs)
        self.outputs = OutputProcessor(self.scheduler.finish)
        self._seq_ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self._generator = torch.Generator().manual_seed(config.seed)
        self._totals = _Totals()
        # made at the first constrained request (a disabled feature costs nothing); the lock because the
        # service compiles a request's grammar on its own thread while the step thread runs
        self.structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()

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

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a chat through the model's own template; `chat_template_kwargs` are the template's
        variables (vLLM's extra field: Qwen3's enable_thinking, for one), `tools` the functions the model may
        call (OpenAI's shape). A template that does not use `tools` renders without them, as transformers
        does: the model is then not told of them."""
        if self.tokenizer.chat_template is None:
            raise InvalidParameter(
                "chat_template",
                "this model has no chat template; pass --chat-template (a file or a Jinja template) to chat "
                "with it, or send a prompt to /v1/completions",
            )
        if not isinstance(messages, list) or not messages:
            raise InvalidParameter("messages", "must be a non-empty list of {role, content} objects")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidParameter("tools", "must be a list of tool objects")
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidParameter("messages", "each message needs string fields role and content")
        kwargs = chat_template_kwargs or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise InvalidParameter("chat_template_kwargs", "must be an object of template variables")
        taken = sorted(set(kwargs) & RESERVED_TEMPLATE_ARGS)
        if taken:
            raise InvalidParameter("chat_template_kwargs", f"{taken[0]!r} is the server's to set")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs
            )
        except (TemplateError, TypeError) as e:
            # the template's own checks (Gemma: roles must alternate), or what it does with a message it
            # was not written for (a tool message's fields given to a template without tool support)
            raise InvalidParameter("messages", f"the model's chat template refused them: {e}") from None
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        return self.encode_prompt(ids)

    def _structured_outputs(self) -> StructuredOutputs:
        """Made at the first constrained request (a disabled feature costs nothing)."""
        with self._structured_lock:
            if self.structured is None:
                self.structured = StructuredOutputs(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                )
        return self.structured

    def check_speculation(self, params: SamplingParams) -> None:
        check_speculation(params.speculation, self.spec.methods if self.spec is not None else None)

    def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        mark: Callable[[str | None], None] = lambda _: None,
        compilers: GrammarCompilers | None = None,
    ) -> Prepared:
        """Everything a request needs before a step may take it: its prompt's ids, its bad words' ids, its
        grammar compiled for this tokenizer. The service runs this in a thread of its own under a time budget
        (engine/prepare.py PreparePool), calling mark(field) as each part starts (None: the process's one-time
        setup, not the request's), with the grammar compiled in `compilers`' child processes (else here);
        add_request given the result does none of it on the step thread."""
        self.check_speculation(params)
        mark("prompt")
        ids = self.encode_prompt(prompt)
        bad = None
        if params.bad_words:
            mark("bad_words")
            bad = self.bad_words_ids(params.bad_words)
        grammar = None
        if params.structured_outputs is not None:
            # the first constrained request loads xgrammar and the tokenizer's tables: not its own cost
            mark(None)
            structured = self._structured_outputs()
            field = f"structured_outputs.{params.structured_outputs.kind}"
            mark(field)
            build = None
            if compilers is not None:
                build = functools.partial(compilers.compile, mark=mark, field=field)
            grammar = structured.compile(params.structured_outputs, build)
        return Prepared(ids, bad, grammar)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = True,
        priority: int = 0,
        prepared: Prepared | None = None,
    ) -> None:
        """stream=False: no per-step deltas, only the final one (for callers that want the whole result).
        `priority`: lower runs sooner, under scheduling_policy="priority" (vLLM's argument). `prepared`:
        what prepare() made of this prompt and params (else it is made here)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if prepared is None:
            prepared = self.prepare(prompt, params)
        ids = prepared.prompt_ids
        seed = params.seed
        if seed is None:  # the engine's stream, so an engine built with the same config.seed repeats
            seed = int(torch.randint(1 << 62, (1,), generator=self._generator))
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            arrival_time=time.monotonic(),
            seed=seed,
            stream=stream,
            bad_words_ids=prepared.bad_words_ids,
            priority=priority,
        )
        if prepared.grammar is not None:  # compiled by prepare(): the matcher is all the step thread makes
            self._structured_outputs().add(seq, prepared.grammar, prepared.grammar_prefix)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would appear alone and after a space (vLLM's rule), distinct."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort(self, request_id: str) -> bool:
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        if self.spec is not None:
            self.spec.forget(seq)
        if self.structured is not None:
            self.structured.forget(seq)
        self._requests.pop(request_id, None)
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
            draft_proposed=self.spec.num_proposed if self.spec else 0,
            draft_accepted=self.spec.num_accepted if self.spec else 0,
            steps=t.times.steps,
            last_batch_size=t.last_batch_size,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            draft_by_method={m: (p, a) for m, (p, a) in self.spec.by_method.items()} if self.spec else {},
        )

    @property
    def step_times(self) -> StepTimes:
        return self._totals.times

    # ---- the step -------------------------------------------------------------------------------------

    def step(self) -> list[StepDelta]:
        step_started = time.perf_counter()
        lap = self._totals.times.lap()
        deltas = self.outputs.aborted(self._aborted)
        self._aborted.clear()
        plan = self.scheduler.schedule()
        if self.spec is not None:
            self.spec.preempted(plan.preempted)
        lap("schedule")
        if not plan.scheduled:
            return deltas
        grammar = self.structured if self.structured is not None and len(self.structured) else None
        drafts = self.spec.propose(plan, grammar) if self.spec is not None else None
        lap("propose")
        started, tokens_before = time.perf_counter(), self._totals.times.tokens
        logits = self._forward(plan, drafts)
        lap("forward")
        if grammar is not None:  # every sampled position, verify positions included, before any sampling
            grammar.mask(plan, drafts, logits)
        accepted = self._sample(plan, drafts, logits)
        if drafts is not None and drafts.parents is not None:
            self._settle_trees(plan, drafts, accepted)
        lap("sample")
        tokens, seconds = self._totals.times.tokens - tokens_before, time.perf_counter() - started
        if self.spec is not None:
            # The policy prices a step by its forward and its sampling: each draft adds a verify row to
            # sample (softmax, top-p's sort over the vocabulary), and priced by the forward alone n-gram +
            # auto cost 18-24 % of tok/s at 32 in flight in bench/chat_traffic.py (quiet AVX2 EPYC).
            self.spec.record_forward(tokens, seconds)
        if self._team is not None:
            threads = self._team.observe(tokens, seconds)
            if threads != torch.get_num_threads():  # our kernels read the team size at each call
                torch.set_num_threads(threads)
        self.scheduler.update(plan, accepted)
        deltas += self.outputs.process(plan, accepted)
        if grammar is not None:
            grammar.advance(plan, accepted)
        if self.spec is not None:
            self.spec.update(plan, accepted)
            self.spec.record_step(plan, accepted, time.perf_counter() - step_started)
        for s in plan.scheduled:
            if s.seq.is_finished:
                self._requests.pop(s.seq.request_id, None)
        lap("update")
        return deltas

    def _forward(self, plan: SchedulerOutput, drafts: DraftBatch | None) -> torch.Tensor:
        """One target forward over every query token of the step; logits of the sampling rows only."""
        entries = []
        table = self.block_manager.block_table
        prompt_rows: list[tuple[Sequence, int, int]] = []  # (seq, first position, rows) of prompt logprobs
        for i, s in enumerate(plan.scheduled):
            seq = s.seq
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + s.num_tokens]
            num_drafts = drafts.num_drafts(i) if drafts is not None else 0
            if num_drafts:
                tokens = tokens + list(drafts.drafts(i))
            num_logits = 1 + num_drafts if s.samples else 0
            if seq.wants_prompt_rows:  # every row of the chunk (the last may also be the sampling row)
                num_logits = len(tokens)
                prompt_rows.append((seq, start, len(tokens) - (1 if s.samples else 0)))
            capture = self.spec is not None and self.spec.wants_capture(seq)
            tree = drafts.tree(i) if num_drafts else None
            tree_list = None if tree is None else list(tree)
            entries.append(ForwardEntry(tokens, start, table(seq.seq_id), num_logits, capture, tree_list))
        num_real = len(entries)
        for row in plan.padding:  # padded static batching: computed like HF's padding, then dropped
            entries.append(ForwardEntry([row.token_id], row.position, table(row.seq_id), 1))
        if any(e.capture for e in entries):
            logits, aux = self.runner.run_capturing(entries, self.spec.capture_layers)
            at = 0
            for s, e in zip(plan.scheduled, entries):
                if e.capture:
                    n = len(e.token_ids)
                    self.spec.capture(s.seq, e.start_pos, aux[at : at + n])
                    at += n
        else:
            logits = self.runner.run(entries)
        if plan.padding:
            logits = logits[: sum(e.num_logits for e in entries[:num_real])]
        if prompt_rows:
            logits = self._take_prompt_logprobs(plan, entries[:num_real], logits)
        num_tokens = sum(len(e.token_ids) for e in entries)
        times = self._totals.times
        times.steps += 1
        times.seqs += num_real
        times.tokens += num_tokens
        self._totals.last_batch_size = num_real
        return logits

    def _take_prompt_logprobs(
        self, plan: SchedulerOutput, entries: list[ForwardEntry], logits: torch.Tensor
    ) -> torch.Tensor:
        """Record prompt logprobs from the rows asked for them; the sampling rows, as _forward returns."""
        keep: list[int] = []
        at = 0
        for s, e in zip(plan.scheduled, entries):
            seq = s.seq
            num_sampling = e.num_logits if not seq.wants_prompt_rows else (1 if s.samples else 0)
            if seq.wants_prompt_rows:
                record_prompt_logprobs(seq, e.start_pos, logits[at : at + e.num_logits - num_sampling])
            keep.extend(range(at + e.num_logits - num_sampling, at + e.num_logits))
            at += e.num_logits
        return logits[keep]

    def _sample(
        self, plan: SchedulerOutput, drafts: DraftBatch | None, logits: torch.Tensor
    ) -> list[Accepted]:
        """One Accepted per scheduled sequence, in plan order (nothing for a chunk mid-prompt)."""
        sampling = [s.seq for s in plan.scheduled if s.samples]
        if not sampling:
            return [NOTHING] * len(plan.scheduled)
        eos = self.eos_token_ids
        if drafts is not None:
            verified = iter(self.spec.verify(plan, drafts, logits, eos))
        else:
            vocab = logits.shape[-1]
            rows = RowParams.build([q.params for q in sampling], [q.seed for q in sampling], vocab)
            adjusted = adjust_logits(logits[:, None, :], sampling, None, eos)[:, 0]
            tokens = sample(adjusted, rows, [q.num_tokens for q in sampling]).tolist()
            verified = iter(Accepted((t,)) for t in tokens)
        accepted = [next(verified) if s.samples else NOTHING for s in plan.scheduled]
        if any(s.samples and s.seq.params.logprobs is not None for s in plan.scheduled):
            if drafts is not None and drafts.parents is not None:
                logits = self._path_rows_first(plan, drafts, logits, accepted)
            accepted = with_logprobs(plan, drafts, logits, accepted)
        return accepted

    @staticmethod
    def _path_rows_first(
        plan: SchedulerOutput, drafts: DraftBatch, logits: torch.Tensor, accepted: list[Accepted]
    ) -> torch.Tensor:
        """The logits with each tree's accepted path rows first among its rows: the rows its emitted tokens
        came from stand where a chain's would (engine/logprobs.py reads them so)."""
        order: list[int] = []
        start = 0
        for i, (s, acc) in enumerate(zip(plan.scheduled, accepted)):
            if not s.samples:
                continue
            n = 1 + drafts.num_drafts(i)
            rows = list(range(n))
            if acc.path is not None:
                rows = [*acc.path, *(r for r in rows if r not in acc.path)]
            order.extend(start + r for r in rows)
            start += n
        return logits[torch.tensor(order, dtype=torch.long)]

    def _settle_trees(self, plan: SchedulerOutput, drafts: DraftBatch, accepted: list[Accepted]) -> None:
        """Each verified tree's accepted path: its K/V moves from slot root + row to root + depth in every
        target layer (tree.path_slots; the head's rows past the verified tokens are rewritten by its next
        catch-up), and its captured states follow; the scheduler then rolls back the rest as for a chain."""
        src: list[int] = []
        dst: list[int] = []
        for i, (s, acc) in enumerate(zip(plan.scheduled, accepted)):
            tree = drafts.tree(i)
            if acc.path is None or tree is None:
                continue
            seq = s.seq
            table = self.block_manager.block_table(seq.seq_id)
            moves = tree_mask.path_slots(
                tree, acc.path, table, seq.num_computed_tokens, self.runner.block_size
            )
            src.extend(moves[0])
            dst.extend(moves[1])
            self.spec.tree_accepted(seq, acc.path)
        tree_mask.move_kv(self.runner.kv_caches, src, dst)
