"""The target's answers to the prompts, cached as JSON lines (prompt ids, answer ids) and resumable.

On the CPU specserve's own engine answers (continuous batching, the CPU's best dtype): HF `generate` runs
one padded batch to its longest answer and recomputes nothing it could skip, far too slow on two cores.
On CUDA HF `generate` answers in large left-padded batches: the engine has not been checked on a GPU."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .prompts import Prompt


@dataclass(frozen=True)
class Answer:
    index: int  # the prompt's index in the prompts list
    prompt_ids: list[int]  # chat-templated
    answer_ids: list[int]  # ends with the EOS when the target stopped by itself
    greedy: bool
    holdout: bool

    @property
    def tokens(self) -> torch.Tensor:
        return torch.tensor(self.prompt_ids + self.answer_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def is_sampled(index: int, prompt: Prompt, fraction: float, seed: int) -> bool:
    """Held-out prompts are always answered greedily (the held-out figure compares with the target's greedy
    continuation); of the others, `fraction` at random, fixed by (seed, index)."""
    return not prompt.holdout and random.Random(seed * 1_000_003 + index).random() < fraction


class AnswerCache:
    """answers.jsonl under the work directory: one answer a line, appended as each one finishes, so a
    killed run loses only the answers in flight (a torn last line is dropped on reading)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answers: dict[int, Answer] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                self.answers[row["index"]] = Answer(**row)
        self._file = None

    def add(self, a: Answer) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(a.__dict__) + "\n")
        self._file.flush()
        self.answers[a.index] = a

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def ordered(self) -> list[Answer]:
        return [self.answers[i] for i in sorted(self.answers)]


def answer_with_engine(
    target: str,
    prompts: list[Prompt],
    todo: list[int],
    cache: AnswerCache,
    deadline: float,
    *,
    in_flight: int,
    dtype: str,
    max_tokens: int,
    temperature: float,
    sampled_fraction: float,
    seed: int,
    on_answer: Callable[[Answer], None] = lambda a: None,
    log: Callable[[str], None] = lambda msg: None,
) -> None:
    """specserve's engine keeps `in_flight` prompts running, refilling as each finishes; at the deadline
    the answers still running are kept as far as they got. The deadline waits for a first answer: a run
    without one has nothing to train on."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.sampling_params import SamplingParams

    t = time.monotonic()
    engine = LLMEngine(EngineConfig.from_kwargs(model=target, max_num_seqs=in_flight, seed=seed, dtype=dtype))
    log(f"engine ready in {time.monotonic() - t:.1f} s ({engine.dtype})")
    tokenizer = engine.tokenizer
    eos = sorted(engine.eos_token_ids)
    queue = list(reversed(todo))
    running: dict[str, tuple[int, list[int], bool]] = {}
    out: dict[str, list[int]] = {}
    while queue or running:
        if time.monotonic() > deadline and cache.answers:
            # what the target wrote so far is its own continuation all the same: kept, cut short
            for rid, (i, ids, greedy) in running.items():
                if out[rid]:
                    a = Answer(i, ids, out[rid], greedy, prompts[i].holdout)
                    cache.add(a)
                    on_answer(a)
            break
        while queue and len(running) < in_flight:
            i = queue.pop()
            ids = chat_ids(tokenizer, prompts[i].text)
            sampled = is_sampled(i, prompts[i], sampled_fraction, seed)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature if sampled else 0.0,
                seed=seed + i if sampled else None,
            )
            rid = f"a{i}"
            engine.add_request(rid, ids, params, stream=True)
            running[rid] = (i, ids, not sampled)
            out[rid] = []
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                i, ids, greedy = running.pop(delta.request_id)
                answer = out.pop(delta.request_id)
                if delta.finish_reason == "stop" and (not answer or answer[-1] not in eos):
                    answer.append(eos[0])  # the head learns where the target stops
                a = Answer(i, ids, answer, greedy, prompts[i].holdout)
                cache.add(a)
                on_answer(a)


@torch.inference_mode()
def answer_with_hf(
    model,
    tokenizer,
    prompts: list[Prompt],
    todo: list[int],
    cache: AnswerCache,
    deadline: float,
    *,
    batch: int,
    max_tokens: int,
    temperature: float,
    sampled_fraction: float,
    seed: int,
    on_answer: Callable[[Answer], None] = lambda a: None,
) -> None:
    """HF generate on left-padded batches of `batch` prompts (greedy ones and sampled ones apart), prompts
    of similar length together; stops between batches at the deadline, once there is an answer."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = set(_as_list(model.generation_config.eos_token_id)) | {tokenizer.eos_token_id}
    encoded = {i: chat_ids(tokenizer, prompts[i].text) for i in todo}
    groups: list[list[int]] = []
    for sampled in (False, True):
        mine = [i for i in todo if is_sampled(i, prompts[i], sampled_fraction, seed) == sampled]
        # held-out prompts first: a run cut short still has its figure
        mine.sort(key=lambda i: (not prompts[i].holdout, len(encoded[i])))
        groups += [mine[s : s + batch] for s in range(0, len(mine), batch)]
    torch.manual_seed(seed)
    for group in groups:
        if time.monotonic() > deadline and cache.answers:
            break
        sampled = is_sampled(group[0], prompts[group[0]], sampled_fraction, seed)
        width = max(len(encoded[i]) for i in group)
        ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in group], device=device)
        mask = torch.tensor(
            [[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in group], device=device
        )
        if sampled:
            kwargs = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:  # the generation config's own sampling settings would only warn
            kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, pad_token_id=pad, **kwargs
        )
        for i, row in zip(group, gen[:, width:].tolist()):
            end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            a = Answer(i, encoded[i], row[:end], not sampled, prompts[i].holdout)
            cache.add(a)
            on_answer(a)


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]
