"""Builds a SpeculativeDecoder from a SpeculativeConfig and what the target model is, passed explicitly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specserve.spec.config import SpeculativeConfig
from specserve.spec.decoder import SpeculativeDecoder
from specserve.spec.proposer import Proposer


@dataclass(frozen=True)
class TargetInfo:
    """What a draft model must match or mirror: the target's vocabulary, tokenizer, dtype, device,
    attention backend, and KV pool shape (the draft's cache holds the same sequences)."""

    vocab_size: int
    tokenizer: PreTrainedTokenizerBase
    dtype: torch.dtype
    device: torch.device
    attention_backend: str
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = False  # the draft's cache shares prefixes as the target's does
    # what an EAGLE-3 head reads of the target: its depth and width (the head must match them), its
    # embedding (a head saved without one takes it), and its block tables (the head's K/V rides on them)
    num_layers: int = 0
    hidden_size: int = 0
    embed: torch.Tensor | None = None
    block_table: Callable[[int], list[int]] | None = None
    batch_invariant: bool = False  # the draft's distributions, which sampled verification reads, too


def build_decoder(config: SpeculativeConfig, max_model_len: int, target: TargetInfo) -> SpeculativeDecoder:
    proposers = {method: _build_proposer(method, config, target) for method in config.methods}
    return SpeculativeDecoder(proposers, config.num_speculative_tokens, max_model_len)


def _build_proposer(method: str, config: SpeculativeConfig, target: TargetInfo) -> Proposer:
    if method == "ngram":
        from specserve.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    if method == "suffix":
        from specserve.spec.suffix import SuffixProposer

        return SuffixProposer(
            config.num_speculative_tokens,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    if method == "eagle3":
        return _load_eagle3(Path(config.model), target, config.tree_shape())
    return _load_draft_model(Path(config.model), target)


def _load_eagle3(path: Path, target: TargetInfo, tree: tuple[int, int] | None = None) -> Proposer:
    from specserve.spec.eagle3.head import Eagle3Config, check_target, load_eagle3
    from specserve.spec.eagle3.proposer import Eagle3Proposer, PagedHead

    if target.block_table is None or target.embed is None:
        raise ValueError("method eagle3 needs the target's block tables and embedding")
    cfg = Eagle3Config.from_dir(path)
    check_target(cfg, target.num_layers, target.hidden_size, target.vocab_size)
    embed = target.embed.detach().float().cpu()
    head = load_eagle3(path, torch.float32, "cpu", embed)
    paged = PagedHead(head, target.dtype, target.device, target.attention_backend)
    layers = cfg.layer_ids(target.num_layers)
    return Eagle3Proposer(
        paged,
        layers,
        target.vocab_size,
        target.num_blocks,
        target.block_size,
        target.block_table,
        tree=tree,
    )


def _load_draft_model(path: Path, target: TargetInfo) -> Proposer:
    from specserve.models.config import ModelConfig
    from specserve.models.llama import LlamaModel
    from specserve.models.loader import load_checkpoint, load_tokenizer
    from specserve.spec.draft_model import DraftModelProposer

    ckpt = load_checkpoint(path, dtype=target.dtype)
    draft_cfg = ModelConfig.from_hf(ckpt.config)
    if draft_cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model vocab ({draft_cfg.vocab_size}) differs from the target's ({target.vocab_size}): "
            "the draft must share the target's tokenizer"
        )
    draft_tok = load_tokenizer(path)
    probe = "def main():\n    print('speculative décodage 日本')"
    if draft_tok.get_vocab() != target.tokenizer.get_vocab() or draft_tok.encode(
        probe
    ) != target.tokenizer.encode(probe):
        raise ValueError("draft model's tokenizer differs from the target's: it cannot propose target tokens")
    model = LlamaModel(
        draft_cfg,
        ckpt.state_dict,
        target.dtype,
        target.device,
        target.attention_backend,
        batch_invariant=target.batch_invariant,
    )
    return DraftModelProposer(model, target.num_blocks, target.block_size, target.enable_prefix_caching)
