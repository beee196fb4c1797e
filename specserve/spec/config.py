"""SpeculativeConfig: vLLM's field names, validated once at construction."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, fields
from typing import Any

from specserve.engine.errors import InvalidParameter
from specserve.engine.sampling_params import MAX_SPECULATIVE_TOKENS
from specserve.engine.sampling_params import SPECULATION_METHODS as METHODS

# Draft tokens per step where none are asked for and suffix is not a method (n-gram, draft model, EAGLE-3).
DEFAULT_K = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # unset: vLLM's defaults, suffix's tree depth (up to MAX_SPECULATIVE_TOKENS) where suffix is one of the
    # methods (its drafts are as long as its match supports, and priced token by token), else DEFAULT_K
    num_speculative_tokens: int | None = None
    model: str | None = None  # the draft model's path (method "draft_model"), the head's ("eagle3")
    prompt_lookup_max: int = 4  # n-gram lengths tried, longest first (method "ngram")
    prompt_lookup_min: int = 1
    # method "suffix" (spec/suffix.py): the trees' depth, how many finished outputs the shared tree holds
    # (0: none, only the request's own tokens), a draft's length at most this x its match, and the least
    # estimated probability of a draft token
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # method "eagle3": draft trees instead of chains (spec/eagle3/proposer.py: propose_tree). vLLM's form, a
    # list of paths (each node by its children's ranks, root excluded: [(0,), (1,), (0, 0)], or that list
    # as a string), or {"depth": d, "branching": b}; None: chains. The tree is dynamic: its branching
    # (the most children a node has) and depth bound it, num_speculative_tokens its nodes.
    speculative_token_tree: Any = None

    def __post_init__(self) -> None:
        methods = self.methods
        if not all(m in METHODS for m in methods) or len(set(methods)) != len(methods):
            _fail("method", f"must be one of {METHODS} or several, comma-separated, not {self.method!r}")
        if self.num_speculative_tokens is None:
            depth = self.suffix_decoding_max_tree_depth
            k = DEFAULT_K
            if "suffix" in methods and _is_int(depth):
                k = max(1, min(depth, MAX_SPECULATIVE_TOKENS))
            object.__setattr__(self, "num_speculative_tokens", k)
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            _fail("num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}], not {k!r}")
        if "draft_model" in methods and not self.model:
            _fail("model", "(the draft model's path) is required for method draft_model")
        if "eagle3" in methods and not self.model:
            _fail("model", "(the EAGLE-3 head's directory) is required for method eagle3")
        if "draft_model" in methods and "eagle3" in methods:
            _fail("method", "draft_model and eagle3 both read `model`: one of them at a time")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _fail(name, f"must be a positive integer, not {getattr(self, name)!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            _fail("prompt_lookup_min", "must not exceed prompt_lookup_max")
        depth = self.suffix_decoding_max_tree_depth
        if not _is_int(depth) or depth < 2:
            _fail("suffix_decoding_max_tree_depth", f"must be an integer >= 2, not {depth!r}")
        cached = self.suffix_decoding_max_cached_requests
        if not _is_int(cached) or cached < 0:
            _fail("suffix_decoding_max_cached_requests", f"must be an integer >= 0, not {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        if not _is_number(factor) or factor <= 0:
            _fail("suffix_decoding_max_spec_factor", f"must be a number > 0, not {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if not _is_number(prob) or not 0 <= prob <= 1:
            _fail("suffix_decoding_min_token_prob", f"must be a number in [0, 1], not {prob!r}")
        if self.speculative_token_tree is not None:
            if "eagle3" not in methods:
                _fail("speculative_token_tree", "drafts trees with method eagle3 only")
            self.tree_shape()

    def tree_shape(self) -> tuple[int, int] | None:
        """(branching, depth) of speculative_token_tree; None for chains."""
        tree = self.speculative_token_tree
        if tree is None:
            return None
        name = "speculative_token_tree"
        if isinstance(tree, str):
            try:
                tree = ast.literal_eval(tree)
            except (ValueError, SyntaxError):
                _fail(name, f"is not a list of paths: {self.speculative_token_tree!r}")
        if isinstance(tree, dict):
            if set(tree) != {"depth", "branching"} or not all(_is_int(v) and v >= 1 for v in tree.values()):
                _fail(name, f"as a dict is {{'depth': d, 'branching': b}} with d, b >= 1, not {tree!r}")
            return tree["branching"], tree["depth"]
        if not isinstance(tree, (list, tuple)) or not tree:
            _fail(name, f"must be a list of paths or {{'depth': d, 'branching': b}}, not {tree!r}")
        paths = set()
        for path in tree:
            if (
                not isinstance(path, (list, tuple))
                or not path
                or not all(_is_int(c) and c >= 0 for c in path)
            ):
                _fail(name, f"paths are non-empty tuples of child ranks, not {path!r}")
            if len(path) > 1 and tuple(path[:-1]) not in paths:
                _fail(name, f"path {tuple(path)!r} comes before its parent {tuple(path[:-1])!r}")
            paths.add(tuple(path))
        if len(paths) > self.num_speculative_tokens:
            _fail(
                name,
                f"holds {len(paths)} nodes, more than num_speculative_tokens ({self.num_speculative_tokens})",
            )
        return max(max(p) for p in paths) + 1, max(len(p) for p in paths)

    @property
    def methods(self) -> tuple[str, ...]:
        """ "suffix,ngram": both proposers, the first drafting unless a request does better with another."""
        return tuple(self.method.split(",")) if isinstance(self.method, str) else (self.method,)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(config) - {f.name for f in fields(cls)})
        if unknown:
            _fail(unknown[0], f"unknown field (known: {', '.join(f.name for f in fields(cls))})")
        if "method" not in config:
            _fail("method", f"is required, one of {METHODS}")
        return cls(**config)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fail(name: str, message: str) -> None:
    raise InvalidParameter(f"speculative_config.{name}", message)
