"""Request preparation (engine/prepare.py): grammars built in child processes, the worker's preparation in
threads, each within a time budget; over budget, or over the size cap, is a refusal naming the field, and
the event loop keeps running meanwhile."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.errors import InvalidParameter
from specserve.engine.grammar import MAX_CONSTRAINT_CHARS
from specserve.engine.prepare import GrammarPool, PreparePool
from specserve.engine.sampling_params import SamplingParams

# Builds (tokenizer-free, at the API) take milliseconds even for the red team's inputs; compiling for a
# tokenizer is what takes seconds (2.6 s for this regex with SmolLM2's 49,152 tokens on the 2-core Xeon).
SLOW_COMPILE_REGEX = "[a-z]{1,6000}"
# A schema under the size cap that takes ~0.4 s to build on the loaded 2-core Xeon (1,600 patterned
# properties) and well under 0.1 s on a quiet one: the budgets below stay far under that, while a one-line
# schema and the pipe round trip fit in them
_PROPS = {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(1600)}
SLOW_BUILD = json.dumps({"type": "object", "properties": _PROPS, "required": list(_PROPS)})


async def _largest_gap(until: asyncio.Future, tick: float = 0.01) -> float:
    """The longest the loop went without running this task while `until` was pending."""
    gap, last = 0.0, time.monotonic()
    while not until.done():
        await asyncio.sleep(tick)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    return gap


def test_a_grammar_past_its_budget_is_refused_naming_the_field_and_the_loop_runs_on():
    async def main() -> None:
        pool = GrammarPool(workers=1, budget_s=60.0)
        try:
            await pool.check([("structured_outputs.regex", "regex", "[a-z]+")])  # the child is up and warm
            pool.budget_s = 0.005
            slow = asyncio.ensure_future(pool.check([("structured_outputs.json", "json", SLOW_BUILD)]))
            gap = await _largest_gap(slow)
            with pytest.raises(InvalidParameter) as e:
                await slow
            assert e.value.field == "structured_outputs.json"
            assert "0.005 s" in e.value.message
            assert gap < 0.25, f"the loop stalled {gap:.2f} s while the grammar was built"
            # the overrunning child was killed; the pool serves the next request with a fresh one
            pool.budget_s = 60.0
            await pool.check([("structured_outputs.regex", "regex", "[0-9]{3}")])
            with pytest.raises(InvalidParameter) as e:
                await pool.check(
                    [("tools[0].function.parameters", "json", '{"type": "object", "required": 3}')]
                )
            assert e.value.field == "tools[0].function.parameters"
        finally:
            pool.close()

    asyncio.run(main())


def test_the_field_named_is_the_one_being_built_when_the_budget_ran_out():
    async def main() -> None:
        pool = GrammarPool(workers=1, budget_s=60.0)
        try:
            await pool.check([("structured_outputs.regex", "regex", "[a-z]+")])  # the child is up and warm
            pool.budget_s = 0.02
            job = [
                ("tools[0].function.parameters", "json", '{"type": "object"}'),
                ("tools[1].function.parameters", "json", SLOW_BUILD),
            ]
            with pytest.raises(InvalidParameter) as e:
                await pool.check(job)
            assert e.value.field == "tools[1].function.parameters"
        finally:
            pool.close()

    asyncio.run(main())


def test_worker_preparation_past_its_budget_names_the_field_it_was_on():
    async def main() -> None:
        pool = PreparePool(workers=1, budget_s=0.2)
        try:

            def work(mark):
                mark("bad_words")
                time.sleep(1.0)
                return "done"

            with pytest.raises(InvalidParameter) as e:
                await pool.run(work, "prompt")
            assert e.value.field == "bad_words"
            # waiting behind a busy thread is not the request's budget: the next one is served in full
            assert await pool.run(lambda mark: "quick", "prompt") == "quick"
        finally:
            pool.close()

    asyncio.run(main())


def test_a_constraint_over_the_size_cap_is_refused_before_anything_builds_it():
    choices = [f"option-{i:05d}" for i in range(20_000)]
    assert len(json.dumps(choices)) > MAX_CONSTRAINT_CHARS
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(structured_outputs={"choice": choices})
    assert e.value.field == "structured_outputs.choice"
    assert str(MAX_CONSTRAINT_CHARS) in e.value.message


def test_logprobs_are_bounded_by_max_logprobs():
    params = SamplingParams(logprobs=20, prompt_logprobs=20)
    params.check_logprobs(20)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**{name: 21}).check_logprobs(20)
        assert e.value.field == name
        assert "max_logprobs" in e.value.message


def test_a_slow_compile_runs_beside_the_engine_and_is_refused_past_its_budget(tiny_model_dir):
    """The worker's side: a grammar whose compile for the tokenizer takes seconds is prepared in the pool,
    refused naming its field once the budget is spent, while a short request beside it runs to its end
    before the compile does (the step thread and the loop never wait for it)."""

    async def main() -> None:
        engine = AsyncLLMEngine.from_args(model=str(tiny_model_dir), dtype="float32")
        await engine.start()
        pool = PreparePool(workers=1, budget_s=60.0)
        compiled_at: list[float] = []
        try:  # the tokenizer's grammar tables are made once, by the first constrained request
            warm = SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"})
            await pool.run(lambda mark: engine.engine.prepare("hello", warm, mark), "prompt")
            pool.budget_s = 0.5

            slow = SamplingParams(max_tokens=4, structured_outputs={"regex": SLOW_COMPILE_REGEX})

            def work(mark):
                try:
                    return engine.engine.prepare("hello", slow, mark)
                finally:
                    compiled_at.append(time.monotonic())

            refused = asyncio.ensure_future(pool.run(work, "prompt"))
            await asyncio.sleep(0.05)  # the compile is under way
            greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            tokens = [
                t async for d in engine.add_request("short", "The capital of", greedy) for t in d.token_ids
            ]
            short_done = time.monotonic()
            assert len(tokens) == 8
            with pytest.raises(InvalidParameter) as e:
                await refused
            assert e.value.field == "structured_outputs.regex"
            while not compiled_at:  # the thread finishes its call in the background
                await asyncio.sleep(0.05)
            assert short_done < compiled_at[0], "the short request waited for the compile"
        finally:
            pool.close()
            await engine.shutdown()

    asyncio.run(main())


def test_only_the_first_of_n_choices_computes_the_prompts_logprobs():
    """n choices of one prompt share its prompt_logprobs: the first asks for them and the answer gives them
    to every choice, so n = 16 costs one vocabulary-wide top-k over the prompt, not 16."""
    from specserve.queue.wire import parse_body
    from specserve.service.openai.serving import choice_bodies

    body = parse_body(
        {"prompt": "x " * 1000, "max_tokens": 8, "seed": 7, "logprobs": 20, "prompt_logprobs": 20}
    )
    bodies = choice_bodies(body, 16)
    assert [b.sampling.get("prompt_logprobs") for b in bodies] == [20] + [None] * 15
    assert [b.sampling["seed"] for b in bodies] == [7 + i for i in range(16)]
    assert all(b.sampling["logprobs"] == 20 for b in bodies)
