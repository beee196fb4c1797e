"""Every supported family matches HF transformers `generate` token for token (fp32): Qwen3, Qwen3-MoE,
Mixtral, Gemma 3 (interleaved sliding-window and global layers, soft-capped logits), Phi-3 (fused projections,
partial rotary, longrope) and Mistral with a sliding window. Prompts are longer than the windows (8 tokens
here), and each family runs batched, in small prefill chunks, preempted by a tiny pool, and speculating.

Each model is a tiny random one built from transformers' own config class, saved as safetensors and loaded
through specserve's loader, so the names, layouts and config conventions are the real ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS

from specserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
WINDOW = 8  # tokens a sliding-window layer sees (its own included); PROMPTS[1] is ~40 tokens

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
FAMILIES = {
    # per-head q/k RMSNorm, head_dim set explicitly (not hidden / heads)
    "qwen3": ("Qwen3", dict(head_dim=32)),
    # sparse MLPs except the layers in mlp_only_layers; top-2 of 8 experts renormalised
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # two local layers then a global one, each kind with its own rope base; final logits soft-capped
    "gemma3": (
        "Gemma3Text",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_local_base_freq=100.0,
        ),
    ),
    # fused qkv_proj and gate_up_proj, half of each head rotated
    "phi3": ("Phi3", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    # longrope within the original context (see docs/supported-models.md for past it)
    "phi3_longrope": (
        "Phi3",
        dict(
            pad_token_id=0,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.2 * i for i in range(8)],
            },
        ),
    ),
    "mistral_window": ("Mistral", dict(sliding_window=WINDOW)),
}


def _build(name: str, tokenizer, out: Path) -> Path:
    import transformers

    prefix, extra = FAMILIES[name]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    config = config_cls(
        **{**COMMON, **extra},
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1)
    model = model_cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                # Gemma's norms scale by (1 + w): centre them on 0 there, on 1 elsewhere
                p.copy_((0.0 if prefix.startswith("Gemma") else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.generation_config.eos_token_id = None
    refs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        refs.append(gen[0, ids.shape[1] :].tolist())
    torch.save(refs, out / "hf_reference.pt")
    return out


@pytest.fixture(scope="module")
def family(tmp_path_factory, demo_tokenizer):
    """(model dir, HF greedy continuations of PROMPTS) per family, built once per module."""
    cache: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(name: str) -> tuple[Path, list[list[int]]]:
        if name not in cache:
            path = _build(name, demo_tokenizer, tmp_path_factory.mktemp(name))
            cache[name] = (path, torch.load(path / "hf_reference.pt"))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batched_greedy_matches_hf(name, family):
    path, refs = family(name)
    llm = LLM(str(path), dtype="float32")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == refs


@pytest.mark.parametrize("name", ["qwen3_moe", "gemma3", "phi3", "mistral_window"])
def test_small_chunks_and_preemption_keep_outputs_exact(name, family):
    """Prefill in chunks of a few tokens (so chunks straddle the window's edge) with a pool that forces
    preemption and recompute."""
    path, refs = family(name)
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=20, max_num_batched_tokens=6)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == refs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 20


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral", "gemma3", "phi3", "mistral_window"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_outputs_exact(name, method, family):
    """Verify queries are k + 1 tokens that can straddle the window edge; the draft model is the target's
    own family (here the target itself, so every draft is accepted and the verify path is exercised most)."""
    path, refs = family(name)
    spec = (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
        if method == "ngram"
        else {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    )
    llm = LLM(str(path), dtype="float32", block_size=4, speculative_config=spec)
    params = SamplingParams(**{**GREEDY.__dict__, "speculation": 4})
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == refs
    proposed = sum(o.usage.draft_proposed for o in outs)
    assert proposed > 0
    if method == "draft":
        assert sum(o.usage.draft_accepted for o in outs) == proposed
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "phi3", "mistral_window"])
def test_export_gives_hf_the_same_model(name, family, tmp_path):
    """tools/export_hf.py (what the benchmarks hand HF transformers and vLLM) writes a config with the
    family's own fields, so HF's greedy tokens from the exported directory are the original's."""
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from export_hf import export

    path, refs = family(name)
    out = export(tmp_path / "exported", source=path)
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(out)
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        ids = torch.tensor([tokenizer.encode(prompt)])
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        assert gen[0, ids.shape[1] :].tolist() == ref
