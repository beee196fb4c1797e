"""Request preparation (engine/prepare.py): grammars built in child processes, the worker's preparation in
threads, each within a budget of CPU time; over budget, or over the size cap, is a refusal naming the field,
time spent waiting for a core is not charged, and the event loop keeps running meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.errors import InvalidParameter
from specserve.engine.grammar import MAX_CONSTRAINT_CHARS
from specserve.engine.prepare import WALL_FACTOR, GrammarPool, PreparePool, Spend
from specserve.engine.sampling_params import SamplingParams

# Builds (tokenizer-free, at the API) take milliseconds even for the red team's inputs; compiling for a
# tokenizer is what takes seconds. A class of 95 characters repeated up to 6,000 times: 1.7 s with SmolLM2's
# 49,152 tokens under xgrammar 0.2.9 on a quiet Zen 4, where [a-z]{1,6000} now compiles in 0.4 s (it took
# 2.6 s on the 2-core Xeon under older releases) and ended inside a 0.5 s budget, its child not killed.
SLOW_COMPILE_REGEX = "[ -~]{1,6000}"
# A schema under the size cap that takes ~0.4 s to build on the loaded 2-core Xeon (1,600 patterned
# properties) and well under 0.1 s on a quiet one: the budgets below stay far under that, while a one-line
# schema and the pipe round trip fit in them
_PROPS = {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(1600)}
SLOW_BUILD = json.dumps({"type": "object", "properties": _PROPS, "required": list(_PROPS)})


def _spin(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


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
                _spin(1.0)
                return "done"

            with pytest.raises(InvalidParameter) as e:
                await pool.run(work, "prompt")
            assert e.value.field == "bad_words"
            # waiting behind a busy thread is not the request's budget: the next one is served in full
            assert await pool.run(lambda mark: "quick", "prompt") == "quick"
        finally:
            pool.close()

    asyncio.run(main())


def test_time_waited_is_not_charged_to_a_preparation():
    """On a node shared with busy neighbours the preparing thread waits for a core: that waiting (here a
    sleep, which spends no CPU) is not the request's cost, and the request is served."""

    async def main() -> None:
        pool = PreparePool(workers=1, budget_s=0.2)
        try:

            def work(mark):
                mark("prompt")
                time.sleep(0.6)
                return "done"

            assert await pool.run(work, "prompt") == "done"
        finally:
            pool.close()

    asyncio.run(main())


def test_a_stopped_grammar_child_is_not_charged_for_the_time_it_waits():
    """A grammar check's child that the kernel does not run (here stopped, as a starved process is) for
    longer than the budget is not refused for it; it finishes once it runs again."""

    async def main() -> None:
        pool = GrammarPool(workers=1, budget_s=60.0)
        try:
            await pool.check([("structured_outputs.regex", "regex", "[a-z]+")])  # the child is up and warm
            pool.budget_s = 0.3
            (pid,) = pool.pids()
            os.kill(pid, signal.SIGSTOP)
            check = asyncio.ensure_future(pool.check([("structured_outputs.regex", "regex", "[0-9]{3}")]))
            await asyncio.sleep(0.9)
            assert not check.done()
            os.kill(pid, signal.SIGCONT)
            await check
        finally:
            pool.close()

    asyncio.run(main())


def test_waiting_is_bounded_at_wall_factor_times_the_budget():
    """Work the node never runs still ends: a CPU clock that does not move spends the budget in wall time at
    WALL_FACTOR times its length."""
    spend = Spend(0.01, lambda: 1.0)
    assert spend.left() > 0
    time.sleep(0.01 * WALL_FACTOR + 0.05)
    assert spend.left() <= 0
    unreadable = Spend(0.05, lambda: None)  # no CPU clock: wall time is the budget
    time.sleep(0.06)
    assert unreadable.left() <= 0


def test_a_refused_preparation_that_fails_later_in_its_thread_logs_nothing(caplog):
    """The thread of a request refused for its budget may end with an error of its own (a compile's child
    killed at the same budget raises too): nobody is left to read it, and asyncio must not log it as an
    exception never retrieved."""
    import gc

    async def main() -> None:
        pool = PreparePool(workers=1, budget_s=0.2)
        try:

            def work(mark):
                mark("structured_outputs.regex")
                _spin(0.5)
                raise InvalidParameter("structured_outputs.regex", "took too long in its thread")

            with pytest.raises(InvalidParameter):
                await pool.run(work, "prompt")
            await asyncio.sleep(0.6)  # the thread has raised by now
        finally:
            pool.close()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


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


def _lowest_priority(pid: int, tid: int | None = None) -> bool:
    """Whether the kernel runs this process (or one of its threads) at the lowest priority we set: nice 19
    (or SCHED_IDLE)."""
    task = f"/proc/{pid}" if tid is None else f"/proc/{pid}/task/{tid}"
    with open(f"{task}/sched") as f:
        policy = next(int(line.split(":")[1]) for line in f if line.startswith("policy"))
    with open(f"{task}/stat") as f:
        nice = int(f.read().rsplit(")", 1)[1].split()[16])
    return policy == os.SCHED_IDLE or nice == 19


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_grammar_children_run_lowest_and_preparation_threads_at_the_engines_priority(tiny_model_dir):
    """Grammar checks (API) and grammar compiles (worker) yield the cores to the engine: the kernel holds
    their children at nice 19. The preparation threads share the engine's GIL, so they are
    not lowered: one holding it while a neighbour took its core would stall the step thread."""

    async def main() -> None:
        checks = GrammarPool(workers=1, budget_s=60.0)
        engine = AsyncLLMEngine.from_args(model=str(tiny_model_dir), dtype="float32")
        pool = PreparePool(workers=1, budget_s=60.0)
        try:
            await checks.check([("structured_outputs.regex", "regex", "[a-z]+")])
            assert checks.pids() and all(_lowest_priority(pid) for pid in checks.pids())

            params = SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"})

            def work(mark):
                prepared = engine.engine.prepare("hello", params, mark, pool.compilers)
                return prepared, threading.get_native_id()

            prepared, tid = await pool.run(work, "prompt")
            assert prepared.grammar is not None
            assert not _lowest_priority(os.getpid(), tid), "a preparation thread was lowered"
            assert pool.compilers.pids() and all(_lowest_priority(pid) for pid in pool.compilers.pids())
        finally:
            checks.close()
            pool.close()

    asyncio.run(main())


def test_a_slow_compile_runs_beside_the_engine_and_is_refused_past_its_budget(tiny_model_dir):
    """The worker's side: a grammar whose compile for the tokenizer takes seconds is compiled in a child
    process, refused naming its field once the budget is spent, while a short request beside it runs to its
    end (the step thread and the loop never wait for it); the refused compile's process is killed, so
    nothing keeps compiling it, and the pool's thread is free at once."""

    async def main() -> None:
        engine = AsyncLLMEngine.from_args(model=str(tiny_model_dir), dtype="float32")
        await engine.start()
        pool = PreparePool(workers=1, budget_s=60.0)
        try:  # the tokenizer's grammar tables and the compiling child are made by the first constrained one
            warm = SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"})
            await pool.run(lambda mark: engine.engine.prepare("hello", warm, mark, pool.compilers), "prompt")
            (compiler,) = pool.compilers.pids()
            pool.budget_s = 0.5

            slow = SamplingParams(max_tokens=4, structured_outputs={"regex": SLOW_COMPILE_REGEX})
            refused = asyncio.ensure_future(
                pool.run(lambda mark: engine.engine.prepare("hello", slow, mark, pool.compilers), "prompt")
            )
            await asyncio.sleep(0.05)  # the compile is under way
            greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            tokens = [
                t async for d in engine.add_request("short", "The capital of", greedy) for t in d.token_ids
            ]
            assert len(tokens) == 8
            with pytest.raises(InvalidParameter) as e:
                await refused
            assert e.value.field == "structured_outputs.regex"
            # the child compiling it is gone (not left compiling in the background), and the pool's only
            # thread takes the next request at once
            deadline = time.monotonic() + 5.0
            while _alive(compiler) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not _alive(compiler), "the refused compile's process is still running"
            assert compiler not in pool.compilers.pids()
            started = time.monotonic()
            assert await pool.run(lambda mark: "next", "prompt") == "next"
            assert time.monotonic() - started < 2.0, "the pool's thread was still busy with the compile"
            # a fresh child compiles the next grammar
            digits = SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]+"})
            got = await pool.run(
                lambda mark: engine.engine.prepare("hi", digits, mark, pool.compilers), "prompt"
            )
            assert got.grammar is not None and pool.compilers.pids() not in ([], [compiler])
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
