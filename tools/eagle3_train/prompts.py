"""Open-chat prompts built from installed third-party packages' prose, never CPython's standard library
(the benchmarks are cut from it), and the prompts file that carries them to a machine whose packages
differ (`--export-prompts` / `--prompts`)."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

# prompt i is held out when i % 10 == 0: the first answers, always greedy, hold one, so even a run cut
# short has a held-out figure
HOLDOUT_EVERY = 10
TOPIC_TEMPLATES = (
    "What is {t}? Explain it simply.",
    "Give me three practical tips about {t}.",
    "Write a short story in which someone discovers {t}.",
    "Write a polite email to a colleague asking for help with {t}.",
    "I'm feeling stuck learning about {t}. Any advice?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "How would you explain {t} to a ten-year-old?",
    "What are common mistakes people make with {t}?",
    "Plan a one-week study schedule for {t}.",
    "Write a friendly message inviting my team to a workshop on {t}.",
    "My manager asked me to look into {t}. Where should I start?",
    "Tell me a fun fact about {t} and why it matters.",
    "Compare {t} with something from everyday life.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "Draft a short blog post introduction about {t}.",
    "What questions should I ask before getting into {t}?",
    "Write a haiku about {t}, then explain it.",
)
SNIPPET_TEMPLATES = (
    "Explain the following to someone new to the subject:\n\n{s}",
    "Summarize this in a few sentences:\n\n{s}",
    "Write a short email to my team that explains this:\n\n{s}",
    "What are the main points here, and why do they matter?\n\n{s}",
    "{s}\n\nWhat questions would a beginner ask about this? Answer two of them.",
    "Rewrite this in plain, friendly language:\n\n{s}",
    "{s}\n\nGive me an everyday analogy for this.",
)


@dataclass(frozen=True)
class Prompt:
    text: str  # the user's message; the target's chat template is applied when it answers
    holdout: bool


def _package_roots() -> list[Path]:
    """site-packages directories (third-party code), never the standard library's own directory."""
    import site

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots = {Path(p).resolve() for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]}
    return sorted(r for r in roots if r.is_dir() and r != stdlib)


def _text_files(roots: list[Path]) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "tests", "test"))
            for f in sorted(filenames):
                if f.endswith((".md", ".rst", ".py")) or f == "METADATA":
                    files.append(Path(dirpath) / f)
    return files


def _clean(paragraph: str) -> str | None:
    text = re.sub(r"\s+", " ", paragraph).strip()
    if not 160 <= len(text) <= 600:
        return None
    letters = sum(c.isalpha() or c == " " for c in text)
    if letters / len(text) < 0.85 or re.search(r"[{}<>=_\\|]|://|\.\. |::", text):
        return None
    return text


def _texts_of(path: Path) -> tuple[list[str], list[str]]:
    """(paragraphs, topics) of one file: prose paragraphs; headings and one-line summaries of docs."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")[:200_000]
    except OSError:
        return [], []
    topics: list[str] = []
    if path.suffix == ".py":
        try:
            tree = ast.parse(raw)
        except (SyntaxError, ValueError):
            return [], []
        docs = [
            ast.get_docstring(n) or ""
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        raw = "\n\n".join(d for d in docs if len(d) > 160)
    else:
        lines = raw.splitlines()
        for j, line in enumerate(lines):
            line = line.strip()
            under = lines[j + 1].strip() if j + 1 < len(lines) else ""
            m = re.match(r"^(?:#{1,3} +|Summary: +)?([A-Za-z][A-Za-z ,'-]{6,60})$", line)
            heading = line.startswith(("#", "Summary:")) or (len(under) >= 4 and set(under) <= set("=-~^"))
            if m and heading and 2 <= len(m.group(1).split()) <= 7:
                topics.append(m.group(1).strip().rstrip(".").lower())
    paragraphs = [p for p in (_clean(x) for x in re.split(r"\n\s*\n", raw)) if p]
    return paragraphs, topics


def build_prompts(count: int, seed: int, scan_s: float = 60.0) -> list[Prompt]:
    """`count` distinct open-chat prompts from the installed packages' text, in a fixed order (docs first,
    then docstrings, until there is enough text or `scan_s` has passed); every HOLDOUT_EVERY-th held out."""
    rng = random.Random(seed)
    files = _text_files(_package_roots())
    docs = [f for f in files if f.suffix != ".py"]
    code = [f for f in files if f.suffix == ".py"]
    rng.shuffle(docs)
    rng.shuffle(code)
    paragraphs: list[str] = []
    topics: set[str] = set()
    stop = time.monotonic() + scan_s
    for f in docs + code:
        p, t = _texts_of(f)
        paragraphs.extend(p)
        topics.update(t)
        if (len(paragraphs) >= count and len(topics) >= count // 2) or time.monotonic() > stop:
            break
    paragraphs = sorted(set(paragraphs))
    topic_list = sorted(topics)
    rng.shuffle(paragraphs)
    rng.shuffle(topic_list)
    if not paragraphs and not topic_list:
        raise RuntimeError("no prose found in site-packages to build prompts from")
    texts: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(texts) < count and i < 20 * count:
        if topic_list and (rng.random() < 0.6 or not paragraphs):
            p = rng.choice(TOPIC_TEMPLATES).format(t=topic_list[i % len(topic_list)])
        else:
            p = rng.choice(SNIPPET_TEMPLATES).format(s=paragraphs[i % len(paragraphs)])
        i += 1
        if p not in seen:
            seen.add(p)
            texts.append(p)
    return [Prompt(t, j % HOLDOUT_EVERY == 0) for j, t in enumerate(texts)]


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    """One JSON object a line: the chat messages and whether the prompt is held out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"messages": [{"role": "user", "content": p.text}], "holdout": p.holdout}))
            f.write("\n")
    tmp.rename(path)


def read_prompts(path: Path) -> list[Prompt]:
    """A prompts file as write_prompts writes it; a line without a user message is refused by number."""
    prompts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            text = next(m["content"] for m in row["messages"] if m["role"] == "user")
        except (ValueError, KeyError, TypeError, StopIteration) as e:
            raise ValueError(f"{path}:{n}: messages: expected a user message ({e})") from None
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{n}: messages: the user message must be non-empty text")
        prompts.append(Prompt(text, bool(row.get("holdout", False))))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
