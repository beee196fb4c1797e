"""Speculative decoding as the engine uses it: choose k, propose, verify, learn.

The engine calls, per step: lookahead(running) from the scheduler (k per decoding sequence), propose() before
the target forward, verify() on its logits, observe() per sequence after its tokens are appended.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specserve.engine.sampler import RowParams
from specserve.engine.scheduler import ScheduledSeq
from specserve.engine.sequence import Sequence
from specserve.spec.policy import AdaptivePolicy
from specserve.spec.proposer import Draft, Proposer
from specserve.spec.verifier import VerifyBatch, verify

if TYPE_CHECKING:
    from specserve.engine.llm_engine import LLMEngine

METHODS = ("ngram", "draft_model")
ACCEPTANCE_PRIOR = 0.7
# Per idle step, a request's acceptance estimate drifts back toward the prior, so speculation is retried when
# the text may have become predictable. Every retry that accepts nothing halves that drift (down to
# 1 / 2**MAX_BACKOFF of it): with a useless proposer, retries grow rare and cost next to nothing.
RELAX = 0.02
MAX_BACKOFF = 6


class SpeculativeDecoder:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int) -> None:
        self.proposer = proposer
        self.k_max = num_speculative_tokens
        self.max_model_len = max_model_len
        self.policy = AdaptivePolicy(num_speculative_tokens)
        self._last_forward: tuple[int, float] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], engine: LLMEngine) -> SpeculativeDecoder:
        cfg = dict(config)
        method = cfg.pop("method", None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, not {method!r}")
        k = cfg.pop("num_speculative_tokens", 4)
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in [1, 16], not {k!r}")
        if method == "ngram":
            from specserve.spec.ngram import NgramProposer

            proposer: Proposer = NgramProposer(
                cfg.pop("prompt_lookup_max", 4), cfg.pop("prompt_lookup_min", 1)
            )
        else:
            proposer = _load_draft_model(cfg, engine)
        if cfg:
            raise ValueError(f"unknown speculative_config field(s): {', '.join(sorted(cfg))}")
        return cls(proposer, k, engine.max_model_len)

    # ---- scheduling ------------------------------------------------------------------------------------

    def _cap(self, seq: Sequence, k: int) -> int:
        """No drafts past max_model_len, nor past max_tokens (the bonus token counts too)."""
        room = min(
            self.max_model_len - seq.num_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
        )
        return max(0, min(k, room))

    def lookahead(self, running: list[Sequence]) -> dict[int, int]:
        ks: dict[int, int] = {}
        auto: list[Sequence] = []
        other_tokens = 0
        for seq in running:
            mode = seq.params.speculation
            if not seq.in_decode:
                other_tokens += seq.num_tokens - seq.num_computed_tokens
            elif mode == "auto":
                auto.append(seq)
            elif mode != "off" and mode:
                ks[seq.seq_id] = self._cap(seq, min(int(mode), self.k_max))
            else:
                other_tokens += 1
        if auto:
            k = self.policy.choose_k([s.acceptance_ewma for s in auto], other_tokens)
            for seq in auto:
                ks[seq.seq_id] = self._cap(seq, k)
                if k == 0:
                    relax = RELAX / 2 ** min(seq.failed_probes, MAX_BACKOFF)
                    seq.acceptance_ewma += relax * (ACCEPTANCE_PRIOR - seq.acceptance_ewma)
        return ks

    # ---- the step --------------------------------------------------------------------------------------

    def propose(self, scheduled: list[ScheduledSeq], generator: torch.Generator) -> dict[int, Draft]:
        requests = [(s.seq, s.num_lookahead) for s in scheduled if s.num_lookahead and s.samples]
        if not requests:
            return {}
        t0 = time.perf_counter()
        drafts = self.proposer.propose(requests, generator)
        k = max(k for _, k in requests)
        self.policy.draft_step_seconds.observe(len(requests), (time.perf_counter() - t0) / k)
        return drafts

    def record_forward(self, num_tokens: int, seconds: float) -> None:
        self.policy.target.observe(num_tokens, seconds)

    def verify(
        self, seqs: list[Sequence], drafts: dict[int, Draft], logits: torch.Tensor, generator: torch.Generator
    ) -> dict[int, tuple[list[int], int]]:
        """Accepted drafts + the next token per sequence; logits hold 1 + len(draft) rows per sequence."""
        counts = [len(drafts[s.seq_id].token_ids) if s.seq_id in drafts else 0 for s in seqs]
        k = max(counts)
        vocab = logits.shape[-1]
        # Scatter the packed rows into a padded [S, K + 1, V] view; padding rows repeat a real one.
        starts = torch.tensor([0] + counts[:-1]).add(1).cumsum(0) - 1
        offsets = torch.arange(k + 1)[None, :].clamp(max=torch.tensor(counts)[:, None])
        target_logits = logits[(starts[:, None] + offsets).clamp(max=logits.shape[0] - 1)]
        draft_tokens = torch.zeros(len(seqs), k, dtype=torch.long)
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            if n:
                draft_tokens[i, :n] = torch.tensor(drafts[seq.seq_id].token_ids)
        draft_probs = None
        if any(n and drafts[s.seq_id].probs is not None for s, n in zip(seqs, counts)):
            # proposals without a distribution (greedy rows, n-gram) are one-hot on their tokens
            draft_probs = torch.zeros(len(seqs), k, vocab).scatter_(2, draft_tokens[:, :, None], 1.0)
            for i, (seq, n) in enumerate(zip(seqs, counts)):
                if n and drafts[seq.seq_id].probs is not None:
                    draft_probs[i, :n] = drafts[seq.seq_id].probs
        rows = RowParams.build([s.params for s in seqs], [s.generator for s in seqs], vocab)
        result = verify(
            VerifyBatch(target_logits, draft_tokens, torch.tensor(counts), draft_probs, rows), generator
        )
        out = {}
        for i, seq in enumerate(seqs):
            a = int(result.num_accepted[i])
            out[seq.seq_id] = (draft_tokens[i, :a].tolist() + [int(result.next_token[i])], a)
        return out

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        seq.acceptance_ewma = self.policy.observe_acceptance(seq.acceptance_ewma, num_proposed, num_accepted)
        if num_proposed:
            seq.failed_probes = 0 if num_accepted else seq.failed_probes + 1
        if not seq.is_finished:
            self.proposer.accepted(seq, num_proposed, num_accepted)

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq)


def _load_draft_model(cfg: dict[str, Any], engine: LLMEngine) -> Proposer:
    from specserve.models.config import ModelConfig
    from specserve.models.llama import LlamaModel
    from specserve.models.loader import load_checkpoint, load_tokenizer
    from specserve.spec.draft_model import DraftModelProposer

    path = cfg.pop("model", None)
    if not path:
        raise ValueError("speculative_config.model (the draft model's path) is required for draft_model")
    ckpt = load_checkpoint(Path(path), dtype=torch.float32)
    draft_cfg = ModelConfig.from_hf(ckpt.config)
    target_vocab = engine.model_config.vocab_size
    if draft_cfg.vocab_size != target_vocab:
        raise ValueError(
            f"draft model vocab ({draft_cfg.vocab_size}) differs from the target's ({target_vocab}): "
            "the draft must share the target's tokenizer"
        )
    draft_tok = load_tokenizer(Path(path))
    probe = "def main():\n    print('speculative décodage 日本')"
    if draft_tok.get_vocab() != engine.tokenizer.get_vocab() or draft_tok.encode(
        probe
    ) != engine.tokenizer.encode(probe):
        raise ValueError("draft model's tokenizer differs from the target's: it cannot propose target tokens")
    model = LlamaModel(
        draft_cfg, ckpt.state_dict, engine.dtype, engine.device, engine.config.attention_backend
    )
    bm = engine.block_manager
    return DraftModelProposer(model, bm.num_blocks, bm.block_size)
