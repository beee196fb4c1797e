"""Open-chat prompts the target writes itself (Magpie: Xu et al., 2024): given its chat template up to where a
user's message begins, an instruction-tuned model samples a user's message, because that is what it was
tuned to read there. Why: prompts built from package prose ask about software, while open chat asks for
advice, stories, emails and explanations of everyday things, and a head trained on one drafts the other
poorly. The target's own user turns need no text from anywhere, so no benchmark's prompts can leak in.

Sampled at T = 1 with nucleus 0.95; a message is kept when the target ended the turn itself and the text
reads as a request (`is_request`), and each kept text is new (`first_words` apart from the ones before)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from .answers import _as_list

# stands for the user's message while the template is rendered; the prefix is what comes before it
_MARK = "USERMESSAGEGOESHERE"
_REPEATS = re.compile(r"(.)\1{7,}")  # eight of one character in a row: emoji walls, rules, runs
MIN_WORDS, MAX_WORDS = 4, 150
TEMPERATURE, TOP_P = 1.0, 0.95


def user_turn_prefix(tokenizer) -> list[int]:
    """The token ids a user's message follows in the target's chat template (its system prompt and the
    user's turn opening, as the template renders them)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False
    )
    if _MARK not in text:
        raise ValueError("the chat template does not render a user's message as given: no prefix to write")
    ids = tokenizer(text[: text.index(_MARK)], add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the chat template renders nothing before a user's message: no prefix to write from")
    return list(ids)


def is_request(text: str) -> bool:
    """Whether a sampled user turn reads as a request worth answering: MIN_WORDS..MAX_WORDS words, mostly
    Latin letters, no runs of one character, no chat markup."""
    words = text.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or "<|" in text or "<start_of_turn>" in text:
        return False
    letters = sum(c.isascii() and c.isalpha() for c in text)
    visible = sum(not c.isspace() for c in text)
    return letters >= 0.7 * visible and not _REPEATS.search(text)


def keeps(text: str, ended_turn: bool) -> bool:
    """A sampled turn is kept when the target ended it itself (not cut at max_tokens) and it is a request."""
    return ended_turn and is_request(text)


def first_words(text: str, n: int = 8) -> str:
    """What two kept prompts must not share: their first n words, case and punctuation aside."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split()[:n])


class Keeper:
    """The kept user turns by attempt number (each attempt samples with its own seed, so a run's texts do
    not depend on the order in which attempts finish), and the filter."""

    def __init__(self) -> None:
        self.by_attempt: dict[int, str] = {}
        self.keys: set[str] = set()
        self.rejected = 0

    def offer(self, attempt: int, text: str, ended_turn: bool) -> None:
        text = text.strip()
        if keeps(text, ended_turn):
            self.by_attempt[attempt] = text
            self.keys.add(first_words(text))
        else:
            self.rejected += 1

    @property
    def distinct(self) -> int:
        return len(self.keys)

    def summary(self, kept: int, attempts: int, seconds: float) -> str:
        others = len(self.by_attempt) - kept
        return (
            f"the target wrote {kept} prompts in {seconds:.0f} s ({attempts} sampled, {self.rejected} not "
            f"requests, {others} repeats or past the count)"
        )

    def texts(self, count: int) -> list[str]:
        kept: list[str] = []
        seen: set[str] = set()
        for attempt in sorted(self.by_attempt):
            key = first_words(self.by_attempt[attempt])
            if key not in seen:
                seen.add(key)
                kept.append(self.by_attempt[attempt])
        return kept[:count]


def write_with_engine(
    target: str,
    count: int,
    deadline: float,
    *,
    in_flight: int,
    dtype: str,
    seed: int,
    max_tokens: int = 128,
    log: Callable[[str], None] = lambda msg: None,
) -> list[str]:
    """specserve's engine samples user turns `in_flight` at a time until `count` distinct ones are kept or
    8 x count attempts are spent, then lets the attempts in flight finish, so that the prompts are the first
    `count` kept in attempt order whatever the batch; past the deadline (with one kept) it stops at once."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(model=target, max_num_seqs=in_flight, seed=seed, dtype=dtype))
    prefix = user_turn_prefix(engine.tokenizer)
    keeper = Keeper()
    running: dict[str, int] = {}
    out: dict[str, list[int]] = {}
    attempt = 0
    t = time.monotonic()
    while True:
        enough = keeper.distinct >= count or attempt >= 8 * count
        if (enough and not running) or (time.monotonic() > deadline and keeper.by_attempt):
            break
        while not enough and len(running) < in_flight:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=seed * 1_000_003 + attempt
            )
            rid = f"u{attempt}"
            engine.add_request(rid, list(prefix), params, stream=True)
            running[rid], out[rid] = attempt, []
            attempt += 1
            enough = attempt >= 8 * count
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                ids = out.pop(delta.request_id)
                text = engine.tokenizer.decode(ids, skip_special_tokens=True)
                keeper.offer(running.pop(delta.request_id), text, delta.finish_reason == "stop")
    for rid in running:
        engine.abort(rid)
    texts = keeper.texts(count)
    log(keeper.summary(len(texts), attempt, time.monotonic() - t))
    return texts


@torch.inference_mode()
def write_with_hf(
    model,
    tokenizer,
    count: int,
    deadline: float,
    *,
    batch: int,
    seed: int,
    max_tokens: int = 128,
    log: Callable[[str], None] = lambda msg: None,
) -> list[str]:
    """HF generate samples `batch` user turns at a time from the prefix, until `count` distinct ones are kept,
    the deadline passes (with one kept), or 8 x count attempts are spent."""
    device = next(model.parameters()).device
    prefix = torch.tensor([user_turn_prefix(tokenizer)], device=device)
    eos = set(_as_list(model.generation_config.eos_token_id)) | {tokenizer.eos_token_id}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    keeper = Keeper()
    attempt = 0
    t = time.monotonic()
    torch.manual_seed(seed)
    while keeper.distinct < count and attempt < 8 * count:
        if time.monotonic() > deadline and keeper.by_attempt:
            break
        gen = model.generate(
            input_ids=prefix.expand(batch, -1),
            attention_mask=torch.ones(batch, prefix.shape[1], dtype=torch.long, device=device),
            max_new_tokens=max_tokens, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0,
            pad_token_id=pad,
        )  # fmt: skip
        for row in gen[:, prefix.shape[1] :].tolist():
            end = next((j for j, tok in enumerate(row) if tok in eos), None)
            text = tokenizer.decode(row[:end], skip_special_tokens=True)
            keeper.offer(attempt, text, end is not None)
            attempt += 1
    texts = keeper.texts(count)
    log(keeper.summary(len(texts), attempt, time.monotonic() - t))
    return texts
