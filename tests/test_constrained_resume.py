"""A constrained request rerun after a crash continues after the tokens its readers were shown, with its
grammar's matcher past them: the answer readers stitch together (the shown part, then the rerun's output)
holds its constraint even where the rerun on its own would have chosen otherwise."""

from __future__ import annotations

import asyncio

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.engine.prepare import PreparePool
from specserve.queue.wire import parse_body
from specserve.service.running import Runner, Shown

CHOICES = ["alpha beta gamma delta", "omega sigma tau upsilon"]  # several tokens each


def _stitched(shown: list[int], base: int, tokens: list[int]) -> list[int]:
    """What a reader holds: the shown tokens, then the rerun's tokens past them (a rerun numbered from
    `base` repeats the shown ones below len(shown), which the reader skips)."""
    return shown + tokens[len(shown) - base :]


def test_a_constrained_rerun_continues_the_answer_readers_were_shown(tiny_model_dir):
    async def main() -> None:
        engine = AsyncLLMEngine.from_args(model=str(tiny_model_dir), dtype="float32")
        await engine.start()
        runner = Runner(engine, None, None, None, None, preparer=PreparePool(1, 60.0), max_logprobs=20)
        tok = engine.tokenizer
        try:

            async def run(rid: str, shown: Shown | None) -> list[int]:
                body = parse_body(
                    {
                        "prompt": "Pick one:",
                        "max_tokens": 16,
                        "temperature": 0,
                        "structured_outputs": {"choice": CHOICES},
                    }
                )
                started = await runner.begin(rid, body, shown)
                tokens = [t async for d in started.deltas for t in d.token_ids]
                return _stitched(shown.token_ids if shown else [], started.base_tokens, tokens)

            # the choice this model makes from scratch; readers were shown the start of the other one (an
            # earlier run sampled it before its worker died)
            alone = tok.decode(await run("fresh", None), skip_special_tokens=True)
            assert alone in CHOICES
            other = CHOICES[1 - CHOICES.index(alone)]
            other_ids = tok.encode(other, add_special_tokens=False)
            assert len(other_ids) >= 3
            shown_ids = other_ids[:2]
            answer = tok.decode(
                await run("rerun", Shown(shown_ids, tok.decode(shown_ids))), skip_special_tokens=True
            )
            assert answer == other, f"the stitched answer {answer!r} is not the choice its start began"
        finally:
            runner.preparer.close()
            await engine.shutdown()

    asyncio.run(main())
