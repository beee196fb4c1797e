"""Where specserve keeps what it derives from its inputs and can derive again: the compiled CPU kernels and
the tokenizers converted from GGUF files. $SPECSERVE_CACHE_DIR, else $XDG_CACHE_HOME/specserve, else
~/.cache/specserve; each user of it takes a folder of its own below."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(part: str) -> Path:
    if os.environ.get("SPECSERVE_CACHE_DIR"):
        return Path(os.environ["SPECSERVE_CACHE_DIR"]) / part
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "specserve" / part
