"""Structured output, stage by stage (engine/structured.py): the bitmask on packed verify logits, the matcher
across an accept/reject, grammar-aware drafts with forced text; then the engine: constrained outputs valid,
speculation on == off for constrained greedy requests, bad constraints refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from specserve.engine.errors import InvalidParameter
from specserve.engine.grammar import StructuredOutputsParams, check_grammar
from specserve.engine.sampler import RowParams
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.engine.step import Accepted, DraftBatch, ScheduledSeq, SchedulerOutput
from specserve.engine.structured import StructuredOutputs
from specserve.spec.verifier import VerifyBatch, verify

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"enum": ["gold", "silver", "bronze"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "tier", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammar(demo_tokenizer) -> StructuredOutputs:
    return StructuredOutputs(demo_tokenizer, len(demo_tokenizer), {demo_tokenizer.eos_token_id})


def _seq(seq_id: int, params: SamplingParams, tokens: int = 3) -> Sequence:
    seq = Sequence(
        seq_id, f"r{seq_id}", list(range(1, tokens + 1)), params, detokenizer=None, arrival_time=0.0
    )
    seq.num_computed_tokens = tokens - 1
    return seq


def _constrained(grammar: StructuredOutputs, seq_id: int, **constraint) -> Sequence:
    seq = _seq(
        seq_id, SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(**constraint))
    )
    grammar.add(seq)
    return seq


def _allowed(matcher: xgr.GrammarMatcher, vocab: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return torch.isfinite(logits[0])


def _reference(grammar: StructuredOutputs, seq: Sequence, tokens: list[int]) -> xgr.GrammarMatcher:
    m = xgr.GrammarMatcher(grammar.compile(seq.params.structured_outputs))
    for t in tokens:
        assert m.accept_token(t)
    return m


def test_bitmask_lands_on_every_packed_verify_row(grammar, demo_tokenizer):
    vocab = len(demo_tokenizer)
    a = _constrained(grammar, 1, json=SCHEMA)
    b = _seq(2, SamplingParams(temperature=0.0))  # unconstrained: its rows stay as they are
    c = _seq(3, SamplingParams(temperature=0.0), tokens=8)  # a prefill chunk mid-prompt: no rows at all
    d = _constrained(grammar, 4, regex=r"[0-9]{2}-[a-z]{3}")
    a_drafts = grammar.draft(a, [], 3, extend=True)  # forced text: '{"name": "' tokenized
    assert len(a_drafts) == 3 and '{"name": "'.startswith(demo_tokenizer.decode(a_drafts))
    d_drafts = [demo_tokenizer.convert_tokens_to_ids("4")]
    plan = SchedulerOutput(
        (
            ScheduledSeq(a, 1, 3),
            ScheduledSeq(b, 1, 1),
            ScheduledSeq(c, 4, samples=False),
            ScheduledSeq(d, 1, 1),
        )
    )
    b_draft = [5]
    cu = (0, len(a_drafts), len(a_drafts) + 1, len(a_drafts) + 1, len(a_drafts) + 2)
    drafts = DraftBatch((*a_drafts, *b_draft, *d_drafts), cu)
    logits = torch.randn(len(a_drafts) + 1 + 2 + 2, vocab)
    before = logits.clone()
    grammar.mask(plan, drafts, logits)

    rows_a = range(len(a_drafts) + 1)
    for j in rows_a:  # row j: the constrained distribution after the first j drafts
        allowed = _allowed(_reference(grammar, a, a_drafts[:j]), vocab)
        assert torch.equal(torch.isfinite(logits[j]), allowed)
        assert torch.equal(logits[j][allowed], before[j][allowed])
        assert 0 < int(allowed.sum()) < vocab
    b_rows = [len(a_drafts) + 1, len(a_drafts) + 2]
    assert torch.equal(logits[b_rows], before[b_rows])
    d_rows = [len(a_drafts) + 3, len(a_drafts) + 4]
    for j, row in enumerate(d_rows):
        assert torch.equal(torch.isfinite(logits[row]), _allowed(_reference(grammar, d, d_drafts[:j]), vocab))

    # The verifier reads these rows for greedy argmax and for rejection sampling: whatever either picks at
    # a masked position is a token the grammar allows there.
    target = logits[: len(a_drafts) + 1][None]
    for temperature in (0.0, 1.0):
        rows = RowParams.build([SamplingParams(temperature=temperature)], [None], vocab)
        gen = torch.Generator().manual_seed(0)
        out = verify(
            VerifyBatch(target, torch.tensor([a_drafts]), torch.tensor([len(a_drafts)]), None, rows), gen
        )
        n = int(out.num_accepted[0])
        emitted = [*a_drafts[:n], int(out.next_token[0])]
        assert _reference(grammar, a, emitted) is not None  # every emitted token accepted by the grammar


def test_matcher_advances_on_accepted_and_rolls_back_rejected(grammar, demo_tokenizer):
    vocab = len(demo_tokenizer)
    seq = _constrained(grammar, 11, json=SCHEMA)
    drafts = grammar.draft(seq, [], 4, extend=True)
    assert len(drafts) == 4
    plan = SchedulerOutput((ScheduledSeq(seq, 1, 4),))
    grammar.mask(plan, DraftBatch(tuple(drafts), (0, 4)), torch.randn(5, vocab))
    # two drafts accepted, the third rejected; the sampled token is one the grammar allows after two
    bonus = int(_allowed(_reference(grammar, seq, drafts[:2]), vocab).nonzero()[0])
    assert bonus != drafts[2]
    grammar.advance(plan, [Accepted((drafts[0], drafts[1], bonus), 2, 4)])
    expected = _reference(grammar, seq, [drafts[0], drafts[1], bonus])
    state = grammar._states[seq.seq_id].matcher
    assert torch.equal(_allowed(state, vocab), _allowed(expected, vocab))
    assert state.find_jump_forward_string() == expected.find_jump_forward_string()
    # and a step with every draft accepted leaves it after all of them and the bonus token
    more = grammar.draft(seq, [], 2, extend=True)
    plan = SchedulerOutput((ScheduledSeq(seq, 1, 2),))
    grammar.mask(plan, DraftBatch(tuple(more), (0, len(more))), torch.randn(len(more) + 1, vocab))
    after = _reference(grammar, seq, [drafts[0], drafts[1], bonus, *more])
    last = int(_allowed(after, vocab).nonzero()[0])
    grammar.advance(plan, [Accepted((*more, last), len(more), len(more))])
    expected = _reference(grammar, seq, [drafts[0], drafts[1], bonus, *more, last])
    assert torch.equal(_allowed(grammar._states[seq.seq_id].matcher, vocab), _allowed(expected, vocab))
    grammar.forget(seq)
    assert not grammar.constrained(seq)


def test_drafts_end_at_a_forbidden_token_and_forced_text_is_drafted(grammar, demo_tokenizer):
    seq = _constrained(grammar, 21, json=SCHEMA)
    forced = demo_tokenizer.encode('{"name": "', add_special_tokens=False)
    # nothing proposed: the forced opening of the object, tokenized, up to k
    assert grammar.draft(seq, [], 8, extend=True) == forced
    assert grammar.draft(seq, [], 2, extend=True) == forced[:2]
    # a proposal is cut at its first token the grammar forbids (a draft model's: not extended)
    junk = demo_tokenizer.encode("hello", add_special_tokens=False)
    assert grammar.draft(seq, [forced[0], *junk, forced[1]], 4, extend=False) == [forced[0]]
    assert grammar.draft(seq, junk, 4, extend=False) == []
    # extended after the cut with forced text (an n-gram proposal)
    assert grammar.draft(seq, [forced[0], *junk], 8, extend=True) == forced
    # the matcher is where it was: drafting changed nothing
    assert grammar.draft(seq, [], 8, extend=True) == forced
    # where the text is free (inside a string) nothing is forced
    free = _constrained(grammar, 22, regex=r"[a-z]+")
    assert grammar.draft(free, [], 4, extend=True) == []
    # a stop token is never drafted: the step's own sample ends the sequence
    done = _constrained(grammar, 23, choice=["yes"])
    yes = demo_tokenizer.encode("yes", add_special_tokens=False)
    assert grammar.draft(done, [*yes, demo_tokenizer.eos_token_id], 4, extend=True) == yes


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"json": {"type": "object", "properties": 5}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a"], "regex": "a"}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"jsn": {}}, "structured_outputs.jsn"),
    ],
)
def test_bad_constraints_name_their_field(constraint, field):
    """The shape is checked when the parameters are made; the grammar when it is built (check_grammar: at
    the API in its grammar pool, in the worker before the request reaches the step thread)."""
    with pytest.raises(InvalidParameter) as e:
        params = SamplingParams.from_dict({"structured_outputs": constraint})
        check_grammar(params.structured_outputs)
    assert e.value.field == field
    assert "[" not in e.value.message  # xgrammar's log prefix (time, C++ file) is not shown to clients


def _valid(text: str, constraint: dict) -> bool:
    kind, value = next(iter(constraint.items()))
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), value)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(value, text) is not None
    return text in value


CONSTRAINTS = [
    {"json": SCHEMA},
    {"regex": r"(ab|cd)[0-9]{2,4}-[xyz]{3}"},
    {"choice": ["alpha", "beta gamma", "delta"]},
]


def test_engine_constrained_outputs_are_valid_and_equal_with_speculation_on_and_off(tiny_model_dir):
    from specserve.engine.llm import LLM

    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    prompts = ['Reply in JSON: {"name": "ab", "tags": ["x"]}', "ab12-xyz cd99-zzz ab12-xyz", "beta gamma"]
    outs: dict[str, list] = {}
    for spec in ("off", 4):
        params = [
            SamplingParams(max_tokens=160, temperature=0.0, speculation=spec, structured_outputs=c)
            for c in CONSTRAINTS
            for _ in prompts
        ]
        outs[str(spec)] = llm.generate([p for _ in CONSTRAINTS for p in prompts], params)
    off, on = outs["off"], outs["4"]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    for i, o in enumerate(off):
        assert o.finish_reason == "stop" and _valid(o.text, CONSTRAINTS[i // len(prompts)]), o.text
    assert sum(o.usage.draft_accepted for o in on) > 0  # jump-forward drafts were proposed and accepted
    # sampled, with speculation: still valid every time
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=i, speculation=4, structured_outputs=c)
        for i, c in enumerate(CONSTRAINTS * 2)
    ]
    for o, c in zip(llm.generate([prompts[0]] * len(params), params), CONSTRAINTS * 2):
        assert o.finish_reason == "stop" and _valid(o.text, c), o.text


@pytest.mark.parametrize("path", ["native", "portable", "torch"])
def test_bitmask_application_equals_xgrammars_kernel(monkeypatch, path):
    """Our C++ kernel (each build variant) and the torch fallback write what xgrammar's kernel does."""
    import xgrammar as xgr

    from specserve.engine import structured
    from specserve.engine.structured import apply_bitmask
    from specserve.kernels import cpu

    if path == "torch":
        monkeypatch.setattr(structured.cpu.build, "load", lambda: None)
    else:
        if cpu.build.load() is None:
            pytest.skip("no C++ compiler")
        monkeypatch.setattr(cpu.build, "_lib", cpu.build.build_variant(path))
    gen = torch.Generator().manual_seed(0)
    for vocab in (49152, 1000, 33):
        bitmask = xgr.allocate_token_bitmask(6, vocab)
        bitmask.copy_(
            torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen, dtype=torch.int64).int()
        )
        bitmask[1] = 0  # everything forbidden
        bitmask[2] = -1  # everything allowed
        logits = torch.randn(6, vocab, generator=gen)
        want, got = logits.clone(), logits.clone()
        rows = [0, 1, 2, 4]
        xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
        apply_bitmask(got, bitmask, rows)
        assert torch.equal(got, want)


def test_sampled_json_never_holds_raw_control_characters(tiny_model_dir):
    """xgrammar's rule for a string with maxLength lets control characters through; JSON forbids them raw,
    and such an answer failed json.loads (a raw 0x02 or tab in the name, about 1 answer in 80 here)."""
    from specserve import LLM
    from tests.test_structured_api import SCHEMA

    llm = LLM(str(tiny_model_dir), dtype="float32")
    prompt = llm.engine.encode_chat([{"role": "user", "content": "Describe a member as JSON."}])
    constraint = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=constraint)
        for s in range(80)
    ]
    for out in llm.generate([prompt] * 80, params):
        jsonschema.validate(json.loads(out.text), SCHEMA)
