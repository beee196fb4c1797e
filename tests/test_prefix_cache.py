"""Automatic prefix caching: full blocks named by a hash chained over their tokens are shared by
later sequences with the same prefix, kept after their owners finish and evicted least recently freed first.

The block manager is tested as a table of operations and as a property (hypothesis: a cache hit always
hands back a block that holds exactly the tokens asked for, and the pool's invariants hold after every
operation); the engine is held to HF with the cache on, warm, across chunked prefill, preemption and
speculation; the service reports the hits in OpenAI's usage shape.
"""

from __future__ import annotations

import openai
import pytest
from conftest import MAX_TOKENS, PROMPTS
from hypothesis import given, settings
from hypothesis import strategies as st
from valkey_helpers import api_stack, run

from specserve import LLM, SamplingParams
from specserve.blockmgr import BlockManager
from specserve.engine.scheduler import PROMPT_LOGPROBS_CHUNK

pytest_plugins = ("valkey_fixtures",)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _admit(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    cached = bm.allocate_prefix(seq_id, tokens)
    assert bm.ensure(seq_id, len(tokens))
    bm.cache_full_blocks(seq_id, tokens, len(tokens))
    return cached


def test_a_shared_prefix_is_found_and_the_last_token_always_computed():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert _admit(bm, "a", a) == 0
    assert _admit(bm, "b", a[:8] + [99, 98, 97]) == 8  # both full blocks shared
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.pool.ref_counts[bm.block_table("a")[0]] == 2
    # exactly two full blocks: the second holds the last token, whose logits are needed, so it is computed
    assert _admit(bm, "c", a[:8]) == 4
    # the same tokens under another parent are another block
    assert _admit(bm, "d", [42, 42, 42, 42] + a[4:8] + [1]) == 0
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    _admit(bm, "a", [1, 2, 3, 4, 5])  # 3 blocks, two of them full and named
    bm.free("a")
    assert bm.num_free_blocks == 4 and len(bm.pool.cached) == 2
    assert _admit(bm, "b", [1, 2, 3, 4, 9]) == 4  # still there after their owner left
    bm.free("b")
    # 4 fresh blocks needed: the never-named block goes first, then the named ones, deepest first
    assert _admit(bm, "c", [7, 7, 7, 7, 7, 7, 7]) == 0
    assert len(bm.pool.cached) == 3  # c's own three full blocks; a's were overwritten
    bm.check_invariants()


def test_a_shared_block_is_never_evicted_and_rollback_keeps_named_blocks():
    bm = BlockManager(5, 2, enable_prefix_caching=True)
    _admit(bm, "a", [1, 2, 3, 4, 5])
    assert _admit(bm, "b", [1, 2, 3, 4, 6]) == 4
    bm.free("a")
    assert not bm.ensure("c", 5 * 2)  # only a's last block and one spare are free
    assert bm.ensure("b", 8)  # lookahead slots for drafts
    bm.truncate("b", 5)  # rejected: the named blocks stay
    assert len(bm.block_table("b")) == 3
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "rollback", "free"]),
            st.integers(0, 5),  # sequence
            st.lists(st.integers(0, 2), min_size=1, max_size=12),  # tokens (few values: many shared prefixes)
        ),
        max_size=40,
    )
)
def test_a_hit_always_holds_the_tokens_asked_for(ops):
    bs = 3
    bm = BlockManager(24, bs, enable_prefix_caching=True)
    contents: dict[int, list[int]] = {}  # block -> the tokens written into it (what its K/V would be)
    seqs: dict[int, list[int]] = {}

    def write(seq: int, start: int, tokens: list[int]) -> None:
        table = bm.block_table(seq)
        for pos in range(start, start + len(tokens)):
            block = table[pos // bs]
            contents.setdefault(block, [None] * bs)[pos % bs] = tokens[pos - start]

    for op, seq, tokens in ops:
        if op == "admit" and seq not in seqs:
            cached = bm.allocate_prefix(seq, tokens)
            for i, block in enumerate(bm.block_table(seq)):
                assert contents[block] == tokens[i * bs : (i + 1) * bs], "a hit returned other tokens"
            if not bm.ensure(seq, len(tokens)):
                bm.free(seq)
                continue
            write(seq, cached, tokens[cached:])
            seqs[seq] = list(tokens)
            bm.cache_full_blocks(seq, tokens, len(tokens))
        elif op == "grow" and seq in seqs and bm.ensure(seq, len(seqs[seq]) + len(tokens)):
            write(seq, len(seqs[seq]), tokens)
            seqs[seq] += tokens
            bm.cache_full_blocks(seq, seqs[seq], len(seqs[seq]))
        elif op == "rollback" and seq in seqs and bm.ensure(seq, len(seqs[seq]) + len(tokens)):
            bm.truncate(seq, len(seqs[seq]))  # lookahead slots given back unwritten
        elif op == "free" and seq in seqs:
            bm.free(seq)
            del seqs[seq]
        bm.check_invariants()


@pytest.fixture(scope="module")
def reference(tiny_model_factory, hf_reference):
    return tiny_model_factory("llama_gqa_tied"), hf_reference("llama_gqa_tied")


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"block_size": 4, "max_num_batched_tokens": 6},  # cached prefixes shorten chunked prefills
        {"block_size": 4, "num_kv_blocks": 20},  # preempted sequences find their own blocks again
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}},
        {"block_size": 4, "speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}},
    ],
    ids=["plain", "chunked", "preempted", "ngram", "draft"],
)
def test_warm_cache_outputs_equal_hf(reference, engine_args):
    path, refs = reference
    spec = engine_args.get("speculative_config")
    if spec and spec["method"] == "draft_model":
        engine_args = {**engine_args, "speculative_config": {**spec, "model": str(path)}}
    llm = LLM(str(path), dtype="float32", **engine_args)
    params = SamplingParams(**{**GREEDY.__dict__, "speculation": 3 if spec else "off"})
    cold = llm.generate(PROMPTS, params)
    # the same prompts again, and each prompt continued by its own output (a chat's next turn)
    warm = llm.generate(PROMPTS, params)
    turns = llm.generate([o.prompt_token_ids + o.token_ids for o in cold], params)
    assert [o.token_ids for o in cold] == refs
    assert [o.token_ids for o in warm] == refs
    stats = llm.engine.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    if "num_kv_blocks" in engine_args:
        # the pool holds a quarter of the run: warm prompts find little, but a preempted sequence finds
        # the blocks it just gave back
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        block_size = llm.engine.block_manager.block_size
        for o in warm:  # every full block before the last prompt token was found
            assert o.usage.cached_tokens == (len(o.prompt_token_ids) - 1) // block_size * block_size
        assert sum(o.usage.cached_tokens for o in turns) > 0
    # a turn continues its own greedy output: the same as the cold run generating that much longer
    longer = llm.generate(PROMPTS, SamplingParams(**{**params.__dict__, "max_tokens": 2 * MAX_TOKENS}))
    assert [o.token_ids for o in turns] == [o.token_ids[MAX_TOKENS:] for o in longer]
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    if spec and spec["method"] == "draft_model":  # the draft's own cache names its blocks the same way
        draft = llm.engine.spec.proposer.block_manager
        assert draft.enable_prefix_caching and draft.pool.cached
        draft.check_invariants()


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"block_size": 4, "max_num_batched_tokens": 12}, {"speculative_config": {"method": "ngram"}}],
    ids=["plain", "chunked", "ngram"],
)
def test_copies_admitted_in_one_step_share_the_prompt_blocks_it_fills(reference, engine_args):
    """n > 1 choices arrive together: the first copy's prompt blocks are named when its step is planned, so
    the copies admitted behind it in the same step start after them, and every output still equals HF's."""
    path, refs = reference
    llm = LLM(str(path), dtype="float32", **engine_args)
    prompt = llm.tokenizer.encode(PROMPTS[-1])
    outs = llm.generate([prompt] * 4, GREEDY)
    assert [o.token_ids for o in outs] == [refs[-1]] * 4
    block_size = llm.engine.block_manager.block_size
    full = (len(prompt) - 1) // block_size * block_size
    assert outs[0].usage.cached_tokens == 0
    if "max_num_batched_tokens" in engine_args:  # copies wait for the chunks before them, then share
        assert all(o.usage.cached_tokens > 0 for o in outs[1:])
    else:
        assert [o.usage.cached_tokens for o in outs[1:]] == [full] * 3
    llm.engine.block_manager.check_invariants()


def test_copies_wait_for_a_prompt_still_being_computed_and_take_it_from_the_cache(reference):
    """n choices whose first asks for prompt logprobs: that one computes its prompt PROMPT_LOGPROBS_CHUNK
    tokens a step, with no cache hit; the copies wait for its blocks instead of computing the prompt again
    beside it, so the prompt is computed about once, and every output and the prompt logprobs are the same
    as each request's alone."""
    path, _ = reference
    llm = LLM(str(path), dtype="float32")
    prompt = llm.tokenizer.encode(PROMPTS[1] * 8)
    assert len(prompt) > PROMPT_LOGPROBS_CHUNK
    first = SamplingParams(**{**GREEDY.__dict__, "prompt_logprobs": 3, "logprobs": 2})
    rest = SamplingParams(**{**GREEDY.__dict__, "logprobs": 2})
    outs = llm.generate([prompt] * 4, [first, rest, rest, rest])
    block_size = llm.engine.block_manager.block_size
    full = (len(prompt) - 1) // block_size * block_size
    assert outs[0].usage.cached_tokens == 0
    assert [o.usage.cached_tokens for o in outs[1:]] == [full] * 3
    stats = llm.engine.stats()
    assert stats.prefix_cache_queries - stats.prefix_cache_hits == len(prompt) + 3 * (len(prompt) - full)
    alone = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    want = alone.generate([prompt], first)[0]
    assert all(o.token_ids == want.token_ids for o in outs)
    got_p, want_p = outs[0].prompt_logprobs, want.prompt_logprobs
    assert got_p[0] is None and want_p[0] is None and len(got_p) == len(want_p) == len(prompt)
    assert [p.rank for p in got_p[1:]] == [p.rank for p in want_p[1:]]
    assert [p.logprob for p in got_p[1:]] == pytest.approx([p.logprob for p in want_p[1:]], abs=1e-5)
    for o in outs:
        assert [t.logprob for t in o.logprobs] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-5)
    llm.engine.block_manager.check_invariants()


def test_turning_it_off_finds_nothing(reference):
    path, refs = reference
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False)
    llm.generate(PROMPTS, GREEDY)
    warm = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in warm] == refs
    assert all(o.usage.cached_tokens == 0 for o in warm) and not llm.engine.block_manager.pool.cached


def test_openai_usage_reports_cached_prompt_tokens(valkey, tiny_model_dir):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    model = str(tiny_model_dir)

    async def main():
        async with api_stack(valkey.url, tiny_model_dir) as (base, _w, _q):
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
            args = dict(model=model, prompt=prompt, max_tokens=4, temperature=0)
            first = await client.completions.create(**args)
            again = await client.completions.create(**args)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
            assert again.choices[0].text == first.choices[0].text
            await client.close()

    run(main())
