"""What a structured-output request's constraint is, and checking it is well formed: the part the API
process needs, with no torch and no tokenizer.

    StructuredOutputsParams     vLLM's structured_outputs: exactly one constraint, checked when made
    check_constraint(params)    the kind, its value's type and its size (MAX_CONSTRAINT_CHARS): no xgrammar
    constraint_key(params)      (kind, text): what a grammar is built from and cached by
    build_grammar(kind, text)   the tokenizer-free xgrammar Grammar, memoised per process
    check_grammar(params)       builds it: a bad schema / regex / EBNF is an InvalidParameter naming
                                `structured_outputs.<kind>`. The API runs this in a child process under a time
                                budget (engine/prepare.py), so neither xgrammar nor torch enters the API.

The per-token runtime (compiling for a tokenizer, matchers, bitmasks on the logits) is engine/structured.py.
xgrammar 0.2 itself imports torch (its package and the tvm_ffi binding it loads do), so the first grammar
built in a process brings torch in; nothing here does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from specserve.engine.errors import InvalidParameter

if TYPE_CHECKING:
    import xgrammar as xgr

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CACHED_GRAMMARS = 256
# A constraint's text (a schema, a regex, EBNF, the choices as JSON) past this is refused before anything
# builds it: 20,000 choices (320,000 characters) built in 0.06 s but compiled for a tokenizer for seconds.
MAX_CONSTRAINT_CHARS = 100_000
# Compact separators (", " and ": ") instead of any whitespace: the text between values is then forced, and
# jump-forward drafts it (31 of 51 tokens of a 7-field object had forced text; with any whitespace, none).
ANY_WHITESPACE = False
_XGR_PREFIX = re.compile(r"^\[[^\]]*\] [^:]+:\d+: (Check failed: \([^)]*\) is false: )?")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one constraint. Checked when made (check_constraint builds the
    grammar without a tokenizer), so a bad schema, regex or grammar is an InvalidParameter naming
    `structured_outputs.<kind>` at the API, before anything is queued."""

    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF)
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    structural_tag: str | dict[str, Any] | None = None  # xgrammar's structural tag (JSON)

    def __post_init__(self) -> None:
        check_constraint(self)  # the shape and size; check_grammar builds it

    @property
    def kind(self) -> str:
        """The one constraint set (json, regex, choice, grammar, json_object or structural_tag)."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @classmethod
    def from_dict(cls, body: Any) -> StructuredOutputsParams:
        if not isinstance(body, dict):
            raise InvalidParameter("structured_outputs", "must be an object")
        known = {f.name for f in fields(cls)}
        for key in body:
            if key not in known:
                raise InvalidParameter(f"structured_outputs.{key}", "unknown field")
        return cls(**body)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def constraint_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the cache key, and all a grammar is built from."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "choice":
        return kind, json.dumps(value)
    if kind == "json_object":
        return kind, ""
    return kind, value if isinstance(value, str) else json.dumps(value)


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def build_grammar(kind: str, text: str) -> xgr.Grammar:
    """The tokenizer-free grammar of a constraint (pure, so memoised: the API and the worker check the same
    schema once per process, not once per request)."""
    import xgrammar as xgr

    if kind == "json":
        return xgr.Grammar.from_json_schema(text, any_whitespace=ANY_WHITESPACE)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=ANY_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        # each choice a string literal of EBNF; JSON's escapes (\", \\, \uXXXX) are EBNF's too
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(text)
    return xgr.Grammar.from_structural_tag(text)


def check_constraint(params: StructuredOutputsParams) -> None:
    """Exactly one constraint, of the right type and size; InvalidParameter otherwise. Builds nothing: a
    build may take seconds (`[a-z]{1,60000}`: 3 s), so it runs where it has a time budget (check_grammar)."""
    given = [k for k in KINDS if getattr(params, k) not in (None, False)]
    if len(given) != 1:
        raise InvalidParameter("structured_outputs", f"give exactly one of {', '.join(KINDS)}")
    kind = given[0]
    value = getattr(params, kind)
    name = f"structured_outputs.{kind}"
    if kind in ("json", "structural_tag"):
        if not isinstance(value, (str, dict)):
            raise InvalidParameter(name, "must be a JSON object or its text")
        if isinstance(value, str):
            try:
                if not isinstance(json.loads(value), dict):
                    raise InvalidParameter(name, "must be a JSON object")
            except ValueError:
                raise InvalidParameter(name, "is not valid JSON") from None
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidParameter(name, "must be a non-empty list of non-empty strings")
    elif kind == "json_object":
        if value is not True:
            raise InvalidParameter(name, "must be true or absent")
    elif not isinstance(value, str) or not value:
        raise InvalidParameter(name, "must be a non-empty string")
    size = len(constraint_key(params)[1])
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidParameter(name, f"is {size} characters; at most {MAX_CONSTRAINT_CHARS} are taken")


def grammar_error(kind: str, text: str) -> str | None:
    """Why xgrammar cannot build this constraint (its parser's message, without its log prefix), or None."""
    try:
        build_grammar(kind, text)
    except Exception as e:  # xgrammar raises RuntimeError (and its own errors) with the parser's message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"invalid: {_XGR_PREFIX.sub('', first)}"
    return None


def check_grammar(params: StructuredOutputsParams) -> None:
    """The constraint builds; InvalidParameter naming `structured_outputs.<kind>` otherwise."""
    kind, text = constraint_key(params)
    error = grammar_error(kind, text)
    if error is not None:
        raise InvalidParameter(f"structured_outputs.{kind}", error)
