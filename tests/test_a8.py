"""w8a8 / w4a8 models (models/quant.py: A8Weight, PackedA8): the engine against transformers running the same
integer arithmetic (kernels/reference_a8.py) in every decoder matrix, speculation lossless with respect to
the quantized model, the form table's choice, and what a GGUF keeps."""

from __future__ import annotations

import shutil

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.config import EngineConfig
from specserve.kernels import cpu, reference_a8
from specserve.models import linear, quant
from specserve.models.loader import demo_model_path, load_checkpoint
from tests.conftest import MAX_TOKENS, PROMPTS

MODES = ["w8a8", "w4a8"]


def _a8_linear(w: quant.A8Weight):
    """A decoder matrix's forward in the reference arithmetic, on the weights the engine quantizes."""
    inner = w.w
    if isinstance(inner, quant.Int4Weight):
        offsets = inner.zeros - 8.0 * inner.scales

        def product(x: torch.Tensor) -> torch.Tensor:
            return reference_a8.w4a8_matmul(x, inner.codes, inner.scales, offsets)
    else:

        def product(x: torch.Tensor) -> torch.Tensor:
            return reference_a8.w8a8_matmul(x, inner.codes, inner.scales)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return product(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    return forward


def _hf_in_a8(path, mode: str):
    """transformers' model of `path` whose decoder linears run the w*a8 arithmetic: its attention, norms and
    head are HF's own in float32, its products the integer ones, independently of our engine."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    q = quant.quantizer(mode)
    for name, module in hf.named_modules():
        if ".layers." in name and isinstance(module, torch.nn.Linear):
            assert module.bias is None
            module.forward = _a8_linear(q(module.weight.detach().clone()))
    hf.generation_config.eos_token_id = None
    return hf


def _forms(llm) -> set[str]:
    layer = llm.engine.model.layers[0]
    return {w.few.name for w in (layer.qkv, layer.o, layer.gate_up, layer.down)}


@pytest.mark.parametrize("shape", ["llama_gqa_tied", "llama3_untied"])
@pytest.mark.parametrize("mode", MODES)
def test_a8_greedy_matches_transformers_running_the_same_integer_arithmetic(tiny_model_factory, shape, mode):
    path = tiny_model_factory(shape)
    hf = _hf_in_a8(path, mode)
    llm = LLM(str(path), dtype="float32", quantization=mode, num_kv_blocks=256)
    expected = linear.OWN_A8 if linear.Isa.here(torch.device("cpu")).int_dot else linear.TORCH_A8
    assert _forms(llm) == {expected.name}
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(ids, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


def _with_q8_0_head(path, out):
    """A copy of the model at `path` whose LM head holds exactly Q8_0 blocks' values, as a GGUF's Q8_0 head
    dequantized does (the tied embedding with it)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(path, out)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        head = hf.lm_head.weight
        head.copy_(quant.dequantize(quant.quantize_int8_grouped(head)))
    hf.save_pretrained(out)
    return out


@pytest.mark.parametrize("shape", ["llama_gqa_tied", "llama3_untied"])
@pytest.mark.parametrize("mode", MODES)
def test_a_q8_0_head_runs_on_int8_activations_as_the_reference(tiny_model_factory, tmp_path, shape, mode):
    """A w*a8 model's Q8_0 head (a GGUF's) runs llama.cpp's Q8_0 x Q8_0 arithmetic at every step size: the
    engine equals transformers with that head's product in the reference arithmetic too, and speculation
    (verify steps of several rows) stays lossless."""
    path = _with_q8_0_head(tiny_model_factory(shape), tmp_path / "q8_0")
    hf = _hf_in_a8(path, mode)
    q8 = quant.quantize_int8_grouped(hf.lm_head.weight.detach())
    hf.lm_head.forward = lambda x: reference_a8.w8a8_grouped_matmul(
        x.reshape(-1, x.shape[-1]), q8.codes, q8.scales
    ).reshape(*x.shape[:-1], -1)
    llm = LLM(str(path), dtype="float32", quantization=mode, num_kv_blocks=256)
    head = llm.engine.model.lm_head
    assert isinstance(head, quant.PackedA8) and head.grouped
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(ids, params)]
    for prompt, out in zip(ids, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        assert out == ref[0, len(prompt) :].tolist()
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    drafted = LLM(str(path), dtype="float32", quantization=mode, num_kv_blocks=256, speculative_config=spec)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    looped = [p * 3 for p in ids]  # prompts that repeat themselves: drafts to verify
    want = [o.token_ids for o in llm.generate(looped, long)]
    got = drafted.generate(looped, long)
    assert [o.token_ids for o in got] == want
    assert sum(o.usage.draft_proposed for o in got) > 0


def test_a_head_that_is_not_q8_0_blocks_stays_as_the_weight_only_modes_run_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", quantization="w4a8", num_kv_blocks=64)
    assert not isinstance(llm.engine.model.lm_head, quant.PackedA8)
    w = torch.randn(32, 64)
    q = quant.quantize_int8_grouped(w)
    exact = quant.dequantize(q)
    assert quant.a8_head(w, torch.float32) is None
    assert torch.equal(quant.a8_head(exact, torch.float32).w.codes, q.codes)
    # a file's code of -128 (AVX2's sign trick cannot take it): not an a8 head
    low = quant.Int8Weight(q.codes.clone(), q.scales)
    low.codes[0, 0] = -128
    assert quant.a8_head(quant.dequantize(low).to(torch.bfloat16), torch.bfloat16, low) is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_an_a8_target_is_lossless(tiny_model_dir, mode, method):
    """The verifier holds the w*a8 model's own distribution: a row's activations are quantized on their own,
    so a verify step of many rows gives each row what a decode step of one gives it."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    spec = (
        {"method": "ngram", "num_speculative_tokens": 4}
        if method == "ngram"
        else {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}
    )
    plain = LLM(str(tiny_model_dir), dtype="float32", quantization=mode, num_kv_blocks=256)
    drafted = LLM(
        str(tiny_model_dir), dtype="float32", quantization=mode, num_kv_blocks=256, speculative_config=spec
    )
    prompts = PROMPTS + [PROMPTS[0] * 3]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = drafted.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.usage.draft_accepted for o in got) > 0


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_a8_speculation_a_request_at_a_time_gives_the_tokens_of_decoding(tiny_model_factory, method):
    """Long contexts, where the float32 attention splits a lone sequence's keys in parts (at head size 64),
    and the engine's adaptive team: a verify step's rows carry the decode steps' very bits (each token's
    logprob equal to the last bit), so w4a8's activation codes, which turn a last-bit difference into a whole
    code, never see one, and greedy tokens are the same one request at a time on real models too."""
    path = tiny_model_factory("llama_hd64")
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True, logprobs=0)
    spec = {"method": method, "num_speculative_tokens": 16 if method == "suffix" else 8}
    plain = LLM(str(path), dtype="float32", quantization="w4a8", num_kv_blocks=512)
    drafted = LLM(str(path), dtype="float32", quantization="w4a8", num_kv_blocks=512, speculative_config=spec)
    prompts = [(p * 40)[:1600] for p in PROMPTS]  # contexts past several of the split's octaves

    def tokens(llm: LLM) -> list[list[tuple[int, float]]]:
        outs = [llm.generate([p], params)[0] for p in prompts]
        assert llm is plain or sum(o.usage.draft_accepted for o in outs) > 0
        return [[(t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs)] for o in outs]

    assert tokens(drafted) == tokens(plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_without_integer_simd_the_torch_form_runs_the_same_arithmetic(monkeypatch, dtype, mode):
    torch.manual_seed(0)
    w = quant.quantizer(mode)(torch.randn(48, 96))
    x = torch.randn(7, 96).to(dtype)
    fast = quant.pack(w, dtype, torch.device("cpu"))
    monkeypatch.setattr(cpu.build, "_paths", cpu.build._paths & ~cpu.build.PATH_INT_DOT)
    isa = linear.Isa.here(torch.device("cpu"))
    reason = linear.OWN_A8.can_run(quant.matrix(w), 1, dtype, isa)
    assert reason is not None and "integer SIMD" in reason
    slow = quant.pack(w, dtype, torch.device("cpu"))
    assert slow.few is linear.TORCH_A8 and slow.many is linear.TORCH_A8
    assert torch.equal(fast.mm(x), slow.mm(x))
    assert slow.library_products() == [(float("inf"), None)]  # torch's: not a layer chain's product
    if fast.few is linear.OWN_A8:
        assert fast.library_products() == [(float("inf"), fast._product)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_q8_0_head_without_integer_simd_gives_the_same_float32_logits(monkeypatch, dtype):
    torch.manual_seed(0)
    head = quant.a8_head(quant.dequantize(quant.quantize_int8_grouped(torch.randn(48, 96))), torch.float32)
    x = torch.randn(5, 96).to(dtype)
    fast = quant.PackedA8(head, dtype, torch.device("cpu"))
    monkeypatch.setattr(cpu.build, "_paths", cpu.build._paths & ~cpu.build.PATH_INT_DOT)
    slow = quant.PackedA8(head, dtype, torch.device("cpu"))
    assert slow.few is linear.TORCH_A8
    logits = fast.mm(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, slow.mm(x))
    assert torch.equal(logits[2:3], fast.mm(x[2:3]))  # a row's logits whatever the step's rows


def test_the_table_refuses_what_the_integer_products_cannot_take():
    isa = linear.Isa(cpu=True, library=True, avx2_fma=True, avx512_bf16=False, amx=False, int_dot=True)
    ok = linear.Matrix(linear.INT8_A8, (48, 96))
    assert linear.choose(ok, 1, torch.float32, isa) is linear.OWN_A8
    assert linear.choose(ok, 500, torch.bfloat16, isa) is linear.OWN_A8
    assert "tiles of 16" in linear.OWN_A8.can_run(
        linear.Matrix(linear.INT4_A8, (40, 96)), 1, torch.float32, isa
    )
    assert linear.choose(linear.Matrix(linear.INT4_A8, (40, 96)), 1, torch.float32, isa) is linear.TORCH_A8
    assert "bfloat16 only" in linear.OWN_A8.can_run(ok, 1, torch.float16, isa)
    # the weight-only forms never take an a8 matrix
    assert all(f in (linear.OWN_A8, linear.TORCH_A8) for f in linear.FORMS if linear.INT8_A8 in f.kinds)


def test_a8_weights_hold_codes_the_integer_products_take():
    torch.manual_seed(1)
    w8 = quant.quantizer("w8a8")(torch.randn(32, 64))
    assert isinstance(w8.w, quant.Int8Weight) and int(w8.w.codes.min()) >= -127
    # a code of -128 (any int8 source) is clamped into the symmetric range
    raw = quant.Int8Weight(torch.full((16, 32), -128, dtype=torch.int8), torch.ones(16))
    assert int(quant.A8Weight.of(raw).w.codes.min()) == -127
    assert isinstance(quant.quantizer("w4a8")(torch.randn(32, 64)).w, quant.Int4Weight)
    # a matrix int4 cannot take (width not a multiple of 32) stays int8, as in int4 mode
    assert isinstance(quant.quantizer("w4a8")(torch.randn(32, 48)).w, quant.Int8Weight)
    parts = [quant.quantizer("w4a8")(torch.randn(16, 64)), quant.quantizer("w4a8")(torch.randn(32, 64))]
    joined = quant.cat(parts)
    assert isinstance(joined, quant.A8Weight) and joined.w.codes.shape == (48, 64)


def test_modes_are_settings_and_refused_with_tensor_parallelism():
    for mode in MODES:
        assert EngineConfig(quantization=mode).quantization == mode
        assert quant.effective_mode(mode, torch.device("cpu"), torch.float32) == mode
        with pytest.raises(ValueError, match=f"quantization {mode} is not supported"):
            EngineConfig(tensor_parallel_size=2, quantization=mode)


def test_w4a8_keeps_the_gguf_int4_blocks():
    """A GGUF under w4a8 keeps what auto keeps (Q4 blocks as int4, exactly), and its activations go int8."""
    path = demo_model_path()
    kept = load_checkpoint(path, torch.float32, "w4a8").state_dict
    auto = load_checkpoint(path, torch.float32, "auto").state_dict
    quantized = [k for k, v in kept.items() if isinstance(v, quant.Int4Weight)]
    assert len(quantized) == 30 * 7
    for name in quantized[:7]:
        assert torch.equal(kept[name].codes, auto[name].codes) and torch.equal(
            kept[name].scales, auto[name].scales
        )
    a8 = quant.quantizer("w4a8")(kept[quantized[0]])
    assert isinstance(a8, quant.A8Weight) and a8.w is kept[quantized[0]]
    # w8a8 holds int8 weights: the loader dequantizes and the model quantizes per output channel
    assert all(
        isinstance(v, torch.Tensor) for v in load_checkpoint(path, torch.float32, "w8a8").state_dict.values()
    )
