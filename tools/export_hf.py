"""Write a checkpoint (the demo GGUF by default) as a Hugging Face model directory, optionally truncated.

The dequantized weights in HF form are what every system in the benchmarks loads (HF transformers, vLLM,
our engine's draft), so they all run exactly the same numbers. With --num-layers N only the first N decoder
layers are kept, with the final norm and the (tied) embedding head: a shallow draft of the same model.

    python tools/export_hf.py OUT_DIR [--source PATH] [--num-layers N] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specserve.models.loader import Checkpoint, demo_model_path, load_checkpoint, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def truncated_state(ckpt: Checkpoint, num_layers: int) -> dict[str, torch.Tensor]:
    """The first num_layers decoder layers plus embedding, final norm and head."""
    total = ckpt.config["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], not {num_layers}")
    out = {}
    for name, tensor in ckpt.state_dict.items():
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < num_layers:
            out[name] = tensor
    return out


def hf_config(config: dict[str, Any], num_layers: int, dtype: str) -> dict[str, Any]:
    """The loader's normalised config as HF's config.json: every field it has, so a family's own ones
    (Gemma 3's hidden_activation, sliding_window, layer_types, query_pre_attn_scalar) reach HF and vLLM too;
    an earlier list of Llama's fields alone left vLLM running Gemma 3 with SiLU and no window."""
    out = dict(config)
    out.update(
        architectures=config.get("architectures", ["LlamaForCausalLM"]),
        model_type=config.get("model_type", "llama"),
        num_hidden_layers=num_layers,
        hidden_act=config.get("hidden_act", "silu"),
        mlp_bias=False,
        torch_dtype=dtype,
    )
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:num_layers]
    return out


def export(
    out_dir: str | Path,
    source: str | Path | None = None,
    num_layers: int | None = None,
    dtype: str = "float32",
    ckpt: Checkpoint | None = None,
) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files to out_dir."""
    src = Path(source) if source else demo_model_path()
    ckpt = ckpt or load_checkpoint(src)
    n = num_layers or ckpt.config["num_hidden_layers"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in truncated_state(ckpt, n).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(ckpt.config, n, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    load_tokenizer(src).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--source", type=Path, help="HF dir or .gguf (default: the demo SmolLM2 GGUF)")
    parser.add_argument("--num-layers", type=int, help="keep only the first N decoder layers")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    path = export(args.out_dir, args.source, args.num_layers, args.dtype)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
