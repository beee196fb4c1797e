"""`auto` holds a GGUF's own weights: for every quantisation type the loader reads (a sample of each family:
the legacy 32-blocks, the K-quants, a ternary one), fp32 greedy tokens equal transformers' own GGUF loading of
the same file. The 4-bit blocks stay int4 with the file's codes and scales (dequantized, bit for bit the
`gguf` library's values); every other type is dequantized, never re-quantized to a coarser scale."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models import quant
from specserve.models.loader import load_checkpoint

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 128
# Where each K-quant block keeps its float16 super-block scale(s), and a value that keeps weights ~0.1:
# gguf's Python writer quantizes the 32-blocks and ternary types itself but none of the K-quants, so those
# blocks are random bytes with sane scales.
K_SCALES = {
    "Q2_K": ((80, 82), 4e-3),
    "Q3_K": ((108,), 1e-3),
    "Q4_K": ((0, 2), 2e-4),
    "Q5_K": ((0, 2), 1e-4),
    "Q6_K": ((208,), 2e-5),
}
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ2_0", *K_SCALES]
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in K_SCALES:
        return gguf.quants.quantize((0.1 * rng.standard_normal((rows, cols))).astype(np.float32), kind)
    block, size = gguf.constants.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    offsets, scale = K_SCALES[qtype]
    for off in offsets:
        d = (scale * rng.uniform(0.5, 1.5, raw.shape[0])).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def _write(path: Path, qtype: str) -> Path:
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")  # a tokenizer the engine can build; the tests pass token ids
    w.add_token_list(["t", "o", "to", *[f"tok{i}" for i in range(3, VOCAB)]])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["t o"])
    w.add_token_scores([0.0] * VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def dense(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    w.add_tensor("token_embd.weight", dense(VOCAB, HIDDEN, scale=1.0))
    w.add_tensor("output.weight", dense(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", 1.0 + dense(HIDDEN))
    kind = gguf.GGMLQuantizationType[qtype]
    head_dim = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for layer in range(LAYERS):
        w.add_tensor(f"blk.{layer}.attn_norm.weight", 1.0 + dense(HIDDEN))
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", 1.0 + dense(HIDDEN))
        for name, (rows, cols) in shapes.items():
            data = _blocks(qtype, rows, cols, rng)
            w.add_tensor(f"blk.{layer}.{name}.weight", data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", TYPES)
def test_auto_holds_the_files_weights_and_greedy_matches_transformers(tmp_path: Path, qtype: str) -> None:
    from transformers import AutoModelForCausalLM

    path = _write(tmp_path / f"{qtype}.gguf", qtype)
    dense = load_checkpoint(path, torch.float32, "none").state_dict
    kept = load_checkpoint(path, torch.float32, "auto").state_dict
    for name, w in kept.items():
        if isinstance(w, torch.Tensor):
            assert torch.equal(w, dense[name]), name
            continue
        # only 4-bit blocks stay quantized, and then exactly as the file holds them
        assert qtype in INT4_TYPES and isinstance(w, quant.Int4Weight), name
        assert torch.equal(quant.dequantize(w), dense[name]), name
    assert any(not isinstance(w, torch.Tensor) for w in kept.values()) == (qtype in INT4_TYPES)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(str(path), dtype="float32", quantization="auto", num_kv_blocks=64)
    prompts = [[1, 5, 9, 33, 70, 2, 101], [1, 64, 3]]
    for ids, out in zip(prompts, llm.generate(prompts, GREEDY)):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("qtype", TYPES)
def test_w4a8_keeps_4_bit_blocks_and_holds_every_other_type_as_int8_of_the_files_values(
    tmp_path: Path, qtype: str
) -> None:
    """Under w4a8 a 4-bit block is what `auto` keeps; any other type is int8 per output of its dequantized
    values (Q5_0's or Q6_K's blocks read as Q4_1's would be garbage weights)."""
    path = _write(tmp_path / f"{qtype}.gguf", qtype)
    dense = load_checkpoint(path, torch.float32, "none").state_dict
    auto = load_checkpoint(path, torch.float32, "auto").state_dict
    a8 = load_checkpoint(path, torch.float32, "w4a8").state_dict
    held = [name for name, w in a8.items() if not isinstance(w, torch.Tensor)]
    assert len(held) == LAYERS * 7  # every decoder matrix
    for name in held:
        w = a8[name]
        if qtype in INT4_TYPES and isinstance(auto[name], quant.Int4Weight):
            assert isinstance(w, quant.Int4Weight) and torch.equal(quant.dequantize(w), dense[name]), name
            continue
        want = quant.quantize_int8(dense[name])
        assert isinstance(w, quant.Int8Weight), name
        assert torch.equal(w.codes, want.codes) and torch.equal(w.scales, want.scales), name
