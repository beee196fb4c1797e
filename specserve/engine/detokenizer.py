"""Incremental detokenisation that never emits half a UTF-8 character (vLLM's prefix/read offsets)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# How many tokens before the new ones are decoded with them, so that spaces and merges come out as in a
# full decode of the sequence.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.read_offset = len(prompt_ids)
        self.prefix_offset = max(len(prompt_ids) - CONTEXT_TOKENS, 0)

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Text for the tokens past read_offset; held back while it would end in a broken character."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(token_ids)
            return full[len(prefix) :]
        return ""
