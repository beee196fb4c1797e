"""The EAGLE-3 trainer's self-written prompts (tools/eagle3_train/self_prompts.py): the prefix cut from the
chat template, the filter and the de-duplication as tables, the engine's sampling loop on a tiny target
(the first kept in attempt order, the same on a second run), and --prompt-source's mix."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_eagle  # noqa: E402
from eagle3_train import self_prompts as sp  # noqa: E402


def test_the_prefix_is_the_template_up_to_the_users_message(demo_tokenizer):
    prefix = sp.user_turn_prefix(demo_tokenizer)
    message = "How do I keep basil alive on a windowsill?"
    whole = demo_tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=False
    )
    text = demo_tokenizer.decode(prefix)
    assert whole.startswith(text) and whole[len(text) :].startswith(message)
    assert text.endswith("user\n")  # the user's turn is open: what the target writes next is the message


class _Template:
    def __init__(self, template):
        self.template = template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return self.template(messages[0]["content"])

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}


@pytest.mark.parametrize(
    "template, error",
    [
        (lambda m: "<user>" + m.lower(), "does not render a user's message"),
        (lambda m: m + "<end>", "renders nothing before"),
    ],
)
def test_a_template_without_a_prefix_is_refused(template, error):
    with pytest.raises(ValueError, match=error):
        sp.user_turn_prefix(_Template(template))


@pytest.mark.parametrize(
    "text, kept",
    [
        ("I'm looking for a way to improve my work-life balance. Can you suggest some tips?", True),
        ("Can you help me write an email to my landlord?", True),
        ("Hey Alice,\n\nI'm looking for a new recipe for dinner. Could you suggest one?", True),
        ("Why?", False),  # too short to answer
        (" ".join(["word"] * 151), False),  # too long
        ("🏰🏰🏰🏰🏰🏰🏰🏰 **SILKENVERB** **THEY** **NOT**", False),  # a wall of one character
        ("==========================================\nWhat is this table?", False),
        ("Что такое фотосинтез и зачем он нужен растениям?", False),  # not Latin letters
        ("What is 2 + 2? <|im_start|>assistant", False),  # chat markup
        ("12345 67890 12345 67890 12345 67890", False),  # no letters
    ],
)
def test_a_user_turn_is_kept_when_it_reads_as_a_request(text, kept):
    assert sp.is_request(text) is kept


def test_the_kept_turns_are_the_first_distinct_ones_in_attempt_order():
    k = sp.Keeper()
    offers = [
        (3, "Can you give me three tips for running in the rain?", True),
        (0, "Can you give me three tips for running in the rain, please?", True),  # first 8 words as 3's
        (2, "Write a short story about a lighthouse keeper and a lost cat.", True),
        (1, "Write a short story about a lighthouse keeper and a lost cat.", False),  # cut by max_tokens
        (4, "Why?", True),  # not a request
        (5, "  What should I pack for a week of hiking in Scotland?  ", True),
    ]
    for attempt, text, ended in offers:
        k.offer(attempt, text, ended)
    assert k.rejected == 2 and k.distinct == 3
    assert k.texts(10) == [
        "Can you give me three tips for running in the rain, please?",
        "Write a short story about a lighthouse keeper and a lost cat.",
        "What should I pack for a week of hiking in Scotland?",
    ]
    assert k.texts(2) == k.texts(10)[:2]
    assert sp.first_words("Can you, please: HELP me?") == "can you please help me"


@pytest.mark.slow
def test_the_engine_writes_the_first_kept_turns_in_attempt_order(tiny_model_dir, monkeypatch):
    """A tiny random target neither ends its turns nor writes requests, so the filter here keeps any text:
    the loop stops at `count`, lets the attempts in flight finish, and a second run with the seed writes
    the same turns."""
    monkeypatch.setattr(sp, "keeps", lambda text, ended_turn: bool(text.strip()))
    logs: list[str] = []

    def write(in_flight: int) -> list[str]:
        return sp.write_with_engine(
            str(tiny_model_dir), 5, time.monotonic() + 300, in_flight=in_flight, dtype="float32", seed=3,
            max_tokens=8, log=logs.append,
        )  # fmt: skip

    first = write(3)
    assert len(first) == 5 and len({sp.first_words(t) for t in first}) == 5
    assert write(3) == first
    assert "the target wrote 5 prompts" in logs[0]

    # nothing is ever kept: the loop ends after 8 x count attempts with no prompts, not a hang
    monkeypatch.setattr(sp, "keeps", lambda text, ended_turn: False)
    assert sp.write_with_engine(
        str(tiny_model_dir), 2, time.monotonic() + 300, in_flight=4, dtype="float32", seed=3, max_tokens=4
    ) == []  # fmt: skip


@pytest.mark.slow
def test_hf_generate_writes_the_kept_turns_in_batches(tiny_model_dir, monkeypatch):
    """The CUDA path's loop, run on the CPU: batches of sampled turns from the prefix until `count` are
    kept, the same turns from the same seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(sp, "keeps", lambda text, ended_turn: bool(text.strip()))

    def write(seed: int) -> list[str]:
        return sp.write_with_hf(model, tokenizer, 5, time.monotonic() + 300, batch=2, seed=seed, max_tokens=6)

    first = write(0)
    assert len(first) == 5 and write(0) == first
    assert all(0 < len(tokenizer(t, add_special_tokens=False)["input_ids"]) <= 8 for t in first)
    assert write(1) != first  # sampled: another seed, other turns


@pytest.mark.parametrize(
    "source, written, want",
    [
        ("mixed", ["s0", "s1", "s2"], ["s0", "p0", "s1", "p1", "s2", "p2"]),
        ("mixed", ["s0"], ["s0", "p0", "p1", "p2", "p3", "p4"]),  # the target wrote fewer: prose fills in
        ("self", ["s0", "s1"], ["s0", "s1"]),  # no prose asked for: fewer prompts
        ("packages", [], ["p0", "p1", "p2", "p3", "p4", "p5"]),
    ],
)
def test_prompt_sources_interleave_so_the_held_out_prompts_sample_both(monkeypatch, source, written, want):
    monkeypatch.setattr(train_eagle, "target_path", lambda target: Path("unused"))
    monkeypatch.setattr(train_eagle, "write_with_engine", lambda *a, **k: list(written))
    monkeypatch.setattr(
        train_eagle,
        "build_prompts",
        lambda count, seed, scan_s: [train_eagle.Prompt(f"p{i}", False) for i in range(count)],
    )
    args = train_eagle.parse_args(["--out", "unused", "--num-prompts", "6", "--prompt-source", source])
    prompts = train_eagle.new_prompts(args, deadline=0.0)
    assert [p.text for p in prompts] == want
    assert [p.holdout for p in prompts] == [i % 10 == 0 for i in range(len(want))]


@pytest.mark.parametrize("share", ["0", "0.4", "0.5"])
def test_a_prompt_share_outside_the_answers_share_is_refused(share, capsys):
    with pytest.raises(SystemExit):
        train_eagle.parse_args(["--out", "x", "--prompt-share", share])
    assert "--prompt-share" in capsys.readouterr().err
