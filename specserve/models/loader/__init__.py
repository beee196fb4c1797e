"""Checkpoint loaders: HF safetensors directories and GGUF files -> HF-named fp tensors + HF-shaped config.

Both paths end in the same `Checkpoint`, so the forward only ever sees Hugging Face parameter names. Pickle
checkpoints (.bin/.pt) are refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specserve.cache import cache_dir
from specserve.models import quant
from specserve.models.loader.gguf import (
    GGUF_ARCHITECTURES,
    GGUF_INT4_TYPES,
    GGUF_QUANT_TYPES,
    field,
    gguf_config,
    load_gguf,
)
from specserve.models.loader.gguf_header import GGUFHeader
from specserve.models.loader.hf import HF_MODEL_TYPES, PICKLE_SUFFIXES, load_hf_dir, normalize_hf_config
from specserve.models.loader.resolve import (
    DEMO_GGUF,
    DEMO_PACKAGE,
    HF_PATTERNS,
    demo_model_path,
    existing,
    resolve_model,
)
from specserve.models.loader.state import Transform, check_names

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
# the file a saved tokenizer's folder ends with: its presence says the folder is whole
DONE = "specserve-done"

__all__ = [
    "DEMO_GGUF",
    "DEMO_PACKAGE",
    "GGUF_ARCHITECTURES",
    "GGUF_INT4_TYPES",
    "GGUF_QUANT_TYPES",
    "HF_MODEL_TYPES",
    "HF_PATTERNS",
    "PICKLE_SUFFIXES",
    "Checkpoint",
    "Transform",
    "demo_model_path",
    "load_checkpoint",
    "load_tokenizer",
    "read_config",
    "resolve_model",
]


@dataclass
class Checkpoint:
    config: dict[str, Any]
    state_dict: dict[str, Any]  # tensors, and quant.Int4Weight / Int8Weight for matrices kept quantized
    source: Path


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
    transform: Transform | None = None,
) -> Checkpoint:
    """Load an HF model directory (config.json + safetensors) or a .gguf file, one tensor at a time: each
    matrix is cast (or dequantized) to `dtype` as it is read, so the host never holds the whole model in
    float32 when it is served in bf16. Vectors (norms, biases) stay float32: the model folds
    Gemma's (1 + w) in float32 before its own cast, and they are small.

    With `quantization` auto or int4, a GGUF's Q4_0, Q4_1 and Q4_K decoder matrices are kept as the int4
    they are, the file's own codes and block scales; other types are dequantized (auto serves them so, int4
    and int8 have the model quantize them itself); w4a8 keeps the 4-bit blocks as auto does and holds the
    other types as int8 per channel (an explicit re-quantization)."""
    quant.check_mode(quantization)
    p = existing(path)
    if p.is_file() and p.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{p}: refusing pickle checkpoint ({p.suffix}); convert it to safetensors or GGUF")
    if p.is_file() and p.suffix == ".gguf":
        config, state = load_gguf(p, dtype, quantization, transform)
    elif p.is_dir():
        config, state = load_hf_dir(p, dtype, transform)
    else:
        raise ValueError(f"{p}: expected an HF model directory or a .gguf file")
    check_names(config, state, p)
    return Checkpoint(config=config, state_dict=state, source=p)


def read_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's HF-shaped config alone, without reading a weight: enough to check a configuration
    against the model before anything is loaded. A GGUF's header is read by GGUFHeader, which steps over the
    tokenizer's arrays (tens of milliseconds against seconds for gguf.GGUFReader)."""
    p = existing(path)
    if p.is_file() and p.suffix == ".gguf":
        header = GGUFHeader(p)
        return gguf_config(header, field(header, "general.architecture"), p)
    if p.is_dir() and (p / "config.json").is_file():
        return normalize_hf_config(json.loads((p / "config.json").read_text()), p)
    raise ValueError(f"{p}: expected an HF model directory or a .gguf file")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer of a model directory or a .gguf file, carrying the source's chat template if it has
    one. None is guessed: a base model chatted with its family's instruct template answers noise."""
    from transformers import AutoTokenizer

    p = existing(path)
    if p.is_file() and p.suffix == ".gguf":
        tokenizer = _gguf_tokenizer(p)
    elif p.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(p)
    else:
        raise ValueError(f"{p}: expected an HF model directory or a .gguf file")
    return tokenizer


def _gguf_tokenizer(p: Path) -> PreTrainedTokenizerBase:
    """A GGUF's tokenizer, converted by transformers once per file (its size and time, and the converters'
    versions) and saved in the cache: the conversion reads the whole header again and builds the vocabulary
    (8.7 s for the demo SmolLM2 on the 2-core AVX2 EPYC), which every engine start, a restarted worker's
    too, would otherwise pay; the saved one loads in a fraction of a second."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    stat = p.stat()
    versions = (transformers.__version__, tokenizers.__version__)
    key = "\0".join((str(p.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *versions))
    saved = cache_dir("tokenizers") / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (saved / DONE).is_file():
        try:
            return AutoTokenizer.from_pretrained(saved)
        except (OSError, ValueError) as e:
            log.warning("tokenizer cache %s unreadable (%s): converting %s again", saved, e, p.name)
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    try:  # written beside its place and renamed, so that a reader never sees half of one
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=saved.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            (Path(tmp) / DONE).write_text(p.name + "\n")
            os.replace(tmp, saved)
    except OSError as e:  # a read-only or full cache costs the next start the conversion, nothing else
        log.info("tokenizer of %s not cached (%s)", p.name, e)
    return tokenizer


# What tells a template from a file name (vLLM's rule): a string with none of these is a path
_TEMPLATE_CHARS = "{}\n"


def read_chat_template(value: str) -> str:
    """--chat-template's value: the file it names, else the template itself (vLLM's flag and rule)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except OSError as e:
        if any(c in value for c in _TEMPLATE_CHARS):
            return value
        raise ValueError(
            f"chat_template: {value!r} looks like a file name, and it cannot be read: {e}"
        ) from None
