"""Batch-invariant decoding (the engine's `batch_invariant`, off by default for its cost): a request's
tokens and logprobs are the same bit for bit whether it runs alone or beside 1..63 random mates, in one
prefill chunk or many, from a cached prefix or not, and with speculation off, n-gram or a draft model at any
k, in float32 and bf16, dense and quantized. The model has 64-wide heads, so the C++ attention's fast paths
(decode, verify, prefill tiles) run, and weights spread so that logits are far apart."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.outputs import RequestOutput
from specserve.models import quant
from specserve.models.linear import invariance_refusal
from specserve.models.loader import demo_model_path, load_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
# bf16 holds only on a CPU with our AVX512-BF16 products; elsewhere the engine refuses it (test_preflight.py)
NO_BF16 = invariance_refusal(torch.bfloat16, torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(demo_model_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("hd64")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _seen(out: RequestOutput) -> tuple:
    assert out.logprobs is not None
    return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_decodes_alike_whatever_its_step_holds(model_dir: Path, dtype: str, quantization: str):
    if dtype == "bfloat16" and NO_BF16:
        pytest.skip(NO_BF16)
    kw = dict(dtype=dtype, quantization=quantization, num_kv_blocks=512, batch_invariant=True)
    llm = LLM(str(model_dir), **kw)
    assert llm.engine.model.batch_invariant
    ids = llm.tokenizer.encode(PROMPT)
    alone = _seen(llm.generate([ids], GREEDY)[0])
    rng = random.Random(0)
    for mates in (1, 2, 3, 7, 17, 63):  # decode steps of 2..64 rows, prefills of mates beside them
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 40))] for _ in range(mates)]
        params = [
            SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True) for _ in prompts
        ]
        assert _seen(llm.generate([ids, *prompts], [GREEDY, *params])[0]) == alone, mates
    assert _seen(llm.generate([ids], GREEDY)[0]) == alone  # the prompt's blocks cached: a 1-row prefill
    chunked = LLM(str(model_dir), max_num_batched_tokens=8, enable_prefix_caching=False, **kw)
    assert _seen(chunked.generate([ids], GREEDY)[0]) == alone
    for k in (1, 2, 3, 5, 8):
        for spec in (
            {"method": "ngram", "num_speculative_tokens": k},
            {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k},
        ):
            out = LLM(str(model_dir), speculative_config=spec, **kw).generate([ids], GREEDY)[0]
            assert _seen(out) == alone, spec
            # the target drafting for itself always proposes (n-gram only where the output repeats the prompt)
            assert out.usage.draft_proposed > 0 or spec["method"] == "ngram"


def test_packed_matrices_give_each_row_its_one_row_result():
    """Every form a batch-invariant plan picks, at every step size up to 64 rows: each row bit for bit as
    a step of that row alone."""
    torch.manual_seed(0)
    w = torch.randn(256, 576) * 0.05
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(64, 576).to(dtype)
        for q in (quant.quantize_int8(w), quant.quantize_int4(w), quant.quantize_int8_grouped(w)):
            packed = quant.pack(q, dtype, cpu, batch_invariant=True)
            alone = torch.cat([packed.mm(x[r : r + 1]) for r in range(64)])
            for rows in (2, 3, 5, 8, 9, 16, 17, 33, 64):
                assert torch.equal(packed.mm(x[:rows]), alone[:rows]), (dtype, type(q), packed.few, rows)


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt",
    [
        "Hello! Can you tell me a fun fact about octopuses?",
        "Summarize the plot of Romeo and Juliet in a few sentences.",
    ],
)
def test_the_demo_model_as_served_decodes_alike_at_every_speculation_k(prompt: str):
    """The demo's Q4_1 GGUF in bf16 under `auto` with `--batch-invariant`: a chat prompt's greedy tokens and
    logprobs with n-gram speculation at k = 1..8 equal those without (its int4 few-row product and a dense
    copy's panels for more rows parted them from k = 2)."""
    if NO_BF16:
        pytest.skip(NO_BF16)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    plain = LLM(None, dtype="bfloat16", quantization="auto", num_kv_blocks=256, batch_invariant=True)
    ids = plain.engine.encode_chat([{"role": "user", "content": prompt}])
    want = _seen(plain.generate([ids], params)[0])
    for k in (1, 2, 3, 5, 8):
        spec = {"method": "ngram", "num_speculative_tokens": k}
        llm = LLM(
            None,
            dtype="bfloat16",
            quantization="auto",
            num_kv_blocks=256,
            speculative_config=spec,
            batch_invariant=True,
        )
        assert _seen(llm.generate([ids], params)[0]) == want, k
