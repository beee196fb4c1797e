"""GGUF files: llama.cpp's tensor names and metadata read into HF names and an HF-shaped config; matrices
dequantized into the served dtype, or kept as the int4 they are (models/quant.py)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specserve.models import quant
from specserve.models.config import UnsupportedModel
from specserve.models.loader.state import Transform, cast, keep

if TYPE_CHECKING:
    import gguf

    from specserve.models.loader.gguf_header import GGUFHeader, GGUFTensors

GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# The quantisation types gguf.quants.dequantize reads (what `specserve models` lists).
GGUF_QUANT_TYPES = (
    "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S "
    "IQ1_S IQ1_M IQ4_NL IQ4_XS TQ1_0 TQ2_0"
).split()

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused projection
    "ffn_gate_inp": "mlp.gate",  # the router
    # experts as [num_experts, out, in] tensors; gate and up are joined after loading (_join_experts)
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Phi-3's ffn_up is its fused gate_up_proj (gate rows first, as in the HF checkpoint).
_GGUF_PHI3_NAMES = {**_GGUF_BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj"}
# Phi-3's longrope factors are tensors in GGUF and config values in HF.
_GGUF_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# Gemma 3 has norms on both sides of attention and MLP: llama.cpp's ffn_norm is its pre-MLP norm.
_GGUF_GEMMA_NAMES = {
    **_GGUF_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF types that are tinygemm's int4 exactly: groups of 32 with a scale and a minimum (or a symmetric scale).
GGUF_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def load_gguf(
    p: Path, dtype: torch.dtype, quantization: str, transform: Transform | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    from gguf.quants import dequantize

    from specserve.models.loader.gguf_header import GGUFHeader, GGUFTensors

    header = GGUFHeader(p)
    reader = GGUFTensors(header)
    arch = field(header, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(
            f"{p}: unsupported GGUF architecture {arch!r} (GGUF ones read: {', '.join(GGUF_ARCHITECTURES)})"
        )
    config = gguf_config(header, arch, p)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = {"gemma3": _GGUF_GEMMA_NAMES, "phi3": _GGUF_PHI3_NAMES}.get(arch, _GGUF_BLOCK_NAMES)
    state: dict[str, Any] = {}
    for t in reader.tensors:
        kept = _kept_quantized(t, quantization)
        if kept is not None:
            name = _hf_name(t.name, p, names)
            if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
                kept = _permute_rows(kept, heads if ".attn_q." in t.name else kv_heads)
            keep(state, name, kept, transform)
            _release(reader, t)
            continue
        shape = tuple(reversed([int(n) for n in t.shape]))
        name = _hf_name(t.name, p, names) if t.name not in _GGUF_ROPE_FACTORS else t.name
        if _keeps_q8_0_head(t, config, dtype, quantization):
            keep(state, name.removesuffix(".weight") + quant.HEAD_Q8_0, _gguf_q8_0(t, shape), transform)
        plain = len(shape) == 2 and not (arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name))
        if plain:  # most matrices: dequantized in slices of rows straight into the served dtype
            keep(state, name, _dequantize_rows(t, shape, dtype), transform)
            _release(reader, t)
            continue
        w = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        _release(reader, t)
        if t.name in _GGUF_ROPE_FACTORS:
            config["rope_scaling"][_GGUF_ROPE_FACTORS[t.name]] = [_f32(x) for x in w]
            continue
        if w.ndim == 3:  # experts: HF names the 3-D tensor without a .weight suffix
            name = name.removesuffix(".weight")
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = _unpermute_rope(w, heads if ".attn_q." in t.name else kv_heads)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's (1 + w) norm scales; the HF weight is w.
            w = w - 1
        if not w.flags.writeable:
            # F32 tensors come back as views of the read-only memory map; torch needs memory it may own.
            w = w.copy()
        keep(state, name, cast(torch.from_numpy(np.ascontiguousarray(w)), dtype), transform)
    return config, _join_experts(state)


GGUF_ROWS_PER_SLICE = 4096


def _dequantize_rows(t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A 2-D tensor dequantized GGUF_ROWS_PER_SLICE rows at a time into a tensor of the served dtype: whole,
    the demo's 49152-row embedding passed through a 113 MB float32 array on its way to bfloat16 (the load's
    peak, bench/load.py)."""
    from gguf.quants import dequantize

    out = torch.empty(shape, dtype=dtype)
    data = np.asarray(t.data)  # [rows, bytes a row] for quantized types, [rows, cols] for float ones
    for start in range(0, shape[0], GGUF_ROWS_PER_SLICE):
        rows = dequantize(data[start : start + GGUF_ROWS_PER_SLICE], t.tensor_type).reshape(-1, shape[1])
        # float types come back as read-only views of the map: copied (a slice at a time) for torch
        rows = rows if rows.flags.writeable and rows.flags.c_contiguous else rows.copy()
        out[start : start + rows.shape[0]] = torch.from_numpy(rows)
    return out


def _release(reader: GGUFTensors, t: Any) -> None:
    """Drop the tensor's pages of the memory-mapped file from the resident set once it has been read (they
    are read again from the file if touched): otherwise the whole file stays resident through the load."""
    mapped = reader.map
    if not hasattr(mapped, "madvise"):
        return
    page = mmap.PAGESIZE
    begin = int(t.data_offset) - int(t.data_offset) % page
    end = min(len(mapped), int(t.data_offset) + int(t.n_bytes))
    if end > begin:
        mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def _keeps_q8_0_head(t: Any, config: dict[str, Any], dtype: torch.dtype, quantization: str) -> bool:
    """Whether tensor t is the LM head (the embedding, when tied) in Q8_0 that a quantized model in a dtype
    other than float32 should keep as its blocks: float32 holds Q8_0's values exactly, so there head_form
    finds them again in the dense head; bf16 rounds them (8 significant bits against Q8_0's code times an
    fp16 scale)."""
    head = "token_embd.weight" if config["tie_word_embeddings"] else "output.weight"
    return (
        t.name == head
        and t.tensor_type.name == "Q8_0"
        and quantization != "none"
        and dtype != torch.float32
        and len(t.shape) == 2
    )


def _gguf_q8_0(t: Any, shape: tuple[int, ...]) -> quant.Int8Weight:
    """Q8_0's blocks (34 bytes: an fp16 scale, then 32 int8 codes) as codes [n, k] and scales [n, k // 32]."""
    n, k = shape
    blocks = np.asarray(t.data).reshape(-1, 34)
    scales = np.ascontiguousarray(blocks[:, :2]).view(np.float16).astype(np.float32).reshape(n, k // 32)
    codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8).reshape(n, k)
    return quant.Int8Weight(torch.from_numpy(codes), torch.from_numpy(scales))


def _kept_quantized(t: Any, quantization: str) -> quant.QuantizedWeight | None:
    """A decoder matrix of a quantized type, in the form `quantization` keeps it in (None: dequantize).

    `auto` and `int4` keep only what a kernel runs on the file's own values: GGUF's 4-bit blocks as int4
    (_gguf_int4). Other types (Q5_0, Q5_1, Q6_K, Q8_0, the other K- and I-quants) are dequantized to the
    served dtype, exactly; re-quantizing them to a coarser scale is the explicit `int8` / `int4` modes' doing
    (models/quant.py: quantizer). `w4a8` keeps the 4-bit blocks as `auto` does and holds every other type as
    int8 per output, by choice: int4 round to nearest of Gemma 3's 5- and 6-bit matrices cost 18 % perplexity
    (docs/benchmarks.md). Only the 4-bit layouts are read as int4: another type's blocks read as Q4_1's
    were garbage weights (Gemma 3 270M under w4a8, +12.7 % perplexity)."""
    qtype = t.tensor_type.name
    if (
        quantization not in ("auto", "int4", "w4a8")
        or qtype in ("F32", "F16", "BF16")
        or len(t.shape) != 2
        or not t.name.startswith("blk.")
    ):
        return None
    k, n = (int(x) for x in t.shape)
    if qtype in GGUF_INT4_TYPES and quant.fits_int4(n, k):
        kept = _gguf_int4(np.asarray(t.data).reshape(-1), qtype, n, k)
        if kept is not None:
            return kept
    if quantization != "w4a8":
        return None
    from gguf.quants import dequantize

    w = dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k)
    return quant.quantize_int8(torch.from_numpy(np.ascontiguousarray(w)))


def _gguf_int4(raw: np.ndarray, qtype: str, n: int, k: int) -> quant.Int4Weight | None:
    """Codes, scales and zeros read from GGUF's 4-bit blocks, no re-quantization: each 32 values are
    q * scale + minimum (Q4_1, Q4_K's sub-blocks) or (q - 8) * scale (Q4_0), which is tinygemm's
    (q - 8) * scale + zero with zero = minimum + 8 * scale. The kernels read zero - 8 * scale back as the
    minimum; where float32 cannot carry a block's minimum through that round trip exactly (a minimum far
    below 8 * scale in magnitude), None: the matrix is dequantized instead, so no weight moves."""
    from gguf.quants import Q4_K

    def f16(b: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(b).view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [..., 16] bytes -> [..., 32] codes: low nibbles first
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    if qtype == "Q4_K":  # 144 bytes: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of codes
        blocks = raw.reshape(-1, 144)
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # each 32 bytes hold two sub-blocks: low, then high nibbles
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        scales = d * sc.astype(np.float32)
        minimum = -(dmin * mn.astype(np.float32))  # gguf's dequantization: d * sc * q - dmin * m
    else:
        size = 18 if qtype == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        scales = f16(blocks[:, 0:2])[:, 0]
        codes = nibbles(blocks[:, size - 16 :])
        minimum = -8.0 * scales if qtype == "Q4_0" else f16(blocks[:, 2:4])[:, 0]
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    zeros = (minimum + np.float32(8.0) * scales).astype(np.float32)
    if not np.array_equal(zeros - np.float32(8.0) * scales, minimum):
        return None
    return quant.Int4Weight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k)),
        torch.from_numpy(scales.reshape(n, k // quant.GROUP)),
        torch.from_numpy(np.ascontiguousarray(zeros).reshape(n, k // quant.GROUP)),
    )


def _permute_rows(w: quant.QuantizedWeight, n_head: int) -> quant.QuantizedWeight:
    def rows(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(_unpermute_rope(x.numpy(), n_head)))

    if isinstance(w, quant.Int8Weight):
        return quant.Int8Weight(rows(w.codes), rows(w.scales))
    return quant.Int4Weight(rows(w.codes), rows(w.scales), rows(w.zeros))


def _join_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF keeps the experts' gate and up projections apart; HF (transformers 5) and our forward take them
    joined, gate rows first: [num_experts, 2 * intermediate, hidden]."""
    for name in [n for n in state if n.endswith("mlp.experts.gate_proj")]:
        prefix = name.removesuffix("gate_proj")
        state[prefix + "gate_up_proj"] = torch.cat([state.pop(name), state.pop(prefix + "up_proj")], dim=1)
    return state


def _hf_name(gguf_name: str, p: Path, block_names: dict[str, str]) -> str:
    if gguf_name == "rope_freqs.weight":
        # llama.cpp bakes llama3-style rope scaling into this tensor; our config cannot express it.
        raise ValueError(f"{p}: GGUF carries rope_freqs (llama3 rope scaling), which is not supported")
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES and suffix == "weight":
        return f"{_GGUF_GLOBAL_NAMES[base]}.weight"
    m = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"{p}: unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half / second
    # half) to interleaved pairs for its GPT-J style rope: reshape(n_head, 2, d/2).swapaxes(1, 2).
    # This is the inverse. Qwen2 uses NEOX rope in llama.cpp and is stored unpermuted.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader: GGUFHeader, arch: str, p: Path) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{p}: GGUF has no token_embd.weight")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{p}: per-layer kv head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    eos = [
        field(reader, f"tokenizer.ggml.{k}_token_id")
        for k in ("eos", "eot", "eom")
        if field(reader, f"tokenizer.ggml.{k}_token_id") is not None
    ]
    eos = list(dict.fromkeys(eos))
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        extra = _gguf_gemma3_config(get, int(get("block_count")), int(get("attention.key_length")))
    if get("expert_count"):
        extra |= {
            "num_experts": int(get("expert_count")),
            "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalises the top-k weights
        }
    if arch == "phi3":
        extra |= _gguf_phi3_config(get, tensor_names, hidden // heads)
    return {
        "model_type": model_type,
        "architectures": [hf_arch],
        # Embedding rows, not len(tokenizer.ggml.tokens): some vocabularies are padded past the tokenizer.
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": _gguf_rope_scaling(get),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
        **extra,  # family conventions win over the generic reading above
    }


def _gguf_gemma3_config(get: Any, num_layers: int, head_dim: int) -> dict[str, Any]:
    """What a Gemma 3 GGUF leaves to convention, filled in as llama.cpp and transformers' GGUF loader (its
    Gemma3TextConfig defaults) both do: every sixth layer global, local layers on rope base 10000, scores
    scaled by head_dim ** -0.5 (query_pre_attn_scalar = head_dim: 256 on 270M, 1B and 4B), GeGLU."""
    window = get("attention.sliding_window")
    pattern = 6
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(window) if window else None,
        "layer_types": [
            "sliding_attention" if window and (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ],
        "rope_local_base_freq": 10000.0,
    }


def _gguf_phi3_config(get: Any, tensor_names: set[str], head_dim: int) -> dict[str, Any]:
    """Phi-3's partial rotary, window and longrope (its factors are filled in from their tensors)."""
    extra: dict[str, Any] = {
        "head_dim": head_dim,  # rope.dimension_count is the rotated part only
        "partial_rotary_factor": int(get("rope.dimension_count", head_dim)) / head_dim,
    }
    window = get("attention.sliding_window")
    if window:
        extra["sliding_window"] = int(window)
    if "rope_factors_long.weight" in tensor_names:
        original = get("rope.scaling.original_context_length")
        extra["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
        attn_factor = get("rope.scaling.attn_factor")
        if attn_factor is not None:
            extra["rope_scaling"]["attention_factor"] = _f32(attn_factor)
    return extra


def _gguf_rope_scaling(get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def field(reader: gguf.GGUFReader | GGUFHeader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747378752e-06; keep the decimal value the author wrote.
    return float(str(np.float32(x)))
