"""CUDA graphs for decode and verify steps (engine/cuda_graphs.py): which sizes and query lengths are
captured, which steps a graph takes, and the padded static forward against the unpadded eager one. On a CPU
the padded path runs uncaptured (the same buffers and code a graph replays); with CUDA the last test
captures and replays."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from conftest import MAX_TOKENS, PROMPTS
from test_families import _build

from specserve import LLM, SamplingParams
from specserve.engine import cuda_graphs
from specserve.engine.config import EngineConfig
from specserve.engine.cuda_graphs import (
    SetupFacts,
    StepShape,
    capture_sizes,
    padded_size,
    query_lengths,
    setup_refusal,
    step_refusal,
)
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.service import config

SHAPE = "llama_gqa_tied"
BLOCK = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [
        (1, (1,)),
        (2, (1, 2)),
        (3, (1, 2, 4)),
        (4, (1, 2, 4)),
        (5, (1, 2, 4, 8)),
        (8, (1, 2, 4, 8)),
        (12, (1, 2, 4, 8, 16)),
        (64, (1, 2, 4, *range(8, 65, 8))),
        (256, (1, 2, 4, *range(8, 257, 8))),
        (1000, (1, 2, 4, *range(8, 257, 8))),
    ],
)
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_under_a_lower_cap():
    assert capture_sizes(100, cap=24) == (1, 2, 4, 8, 16, 24)


@pytest.mark.parametrize(("k", "lens"), [(0, (1,)), (1, (1, 2)), (4, (1, 2, 3, 4, 5))])
def test_query_lengths(k, lens):
    assert query_lengths(k) == lens


@pytest.mark.parametrize(
    ("n", "size"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (17, 24), (64, 64), (65, None)]
)
def test_padded_size(n, size):
    assert padded_size(capture_sizes(64), n) == size


CUDA_FACTS = SetupFacts(
    capture=True,
    enforce_eager=False,
    device_type="cuda",
    tensor_parallel_size=1,
    moe=False,
    batch_invariant=False,
    backend="triton",
    quantized=False,
)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"enforce_eager": True}, "--enforce-eager"),
        ({"enforce_eager": True, "device_type": "cpu"}, "--enforce-eager"),  # the first rule that holds
        ({"device_type": "cpu", "backend": "torch"}, "not a CUDA device"),
        ({"tensor_parallel_size": 2}, "tensor parallelism"),
        ({"moe": True}, "MoE layers"),
        ({"batch_invariant": True}, "batch-invariant mode"),
        ({"backend": "torch"}, "not the Triton attention backend"),
        ({"quantized": True}, "quantized weights"),
        # uncaptured (CPU tests): any device, the torch reference too, but never the C++ kernels
        ({"capture": False, "device_type": "cpu", "backend": "torch"}, None),
        ({"capture": False, "device_type": "cpu", "backend": "cpu"}, "not the Triton attention backend"),
        ({"capture": False, "device_type": "cpu", "backend": "torch", "moe": True}, "MoE layers"),
    ],
)
def test_setup_refusals(change, why):
    assert setup_refusal(dataclasses.replace(CUDA_FACTS, **change)) == why


UNIFORM = StepShape(
    num_seqs=3,
    query_lens=frozenset({3}),
    all_logits=True,
    capture=False,
    widest_table=5,
    captured_query_lens=(1, 2, 3),
    largest_size=8,
    table_width=8,
)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"num_seqs": 8}, None),
        ({"num_seqs": 0, "query_lens": frozenset()}, "empty step"),
        ({"capture": True}, "hidden states captured"),
        ({"query_lens": frozenset({1, 3})}, "query lengths differ"),
        ({"query_lens": frozenset({4})}, "query length not captured"),
        ({"all_logits": False}, "logits not wanted for every token"),
        ({"num_seqs": 9}, "batch above the largest captured size"),
        ({"widest_table": 9}, "block table wider than max_model_len's"),
        ({"tree": True}, "draft tree"),
        ({"capture": True, "query_lens": frozenset({1, 3})}, "hidden states captured"),
    ],
)
def test_step_refusals(change, why):
    assert step_refusal(dataclasses.replace(UNIFORM, **change)) == why


def _llm(path, **kw) -> LLM:
    return LLM(
        str(path), dtype="float32", attention_backend="torch", block_size=BLOCK, num_kv_blocks=64, **kw
    )


def _uncaptured(llm: LLM, runner: ModelRunner | None = None) -> cuda_graphs.CudaGraphs:
    """The engine's graphs for its config, run uncaptured over `runner`'s cache (the engine's by default)."""
    engine = llm.engine
    return cuda_graphs.build(runner or engine.runner, engine.config, engine.max_model_len, capture=False)


def _contexts(model, seqs: int, generator: torch.Generator) -> list[list[int]]:
    lengths = [3 + 7 * i % 29 for i in range(seqs)]  # mixed, several blocks long, some mid-block
    return [torch.randint(0, model.cfg.vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("q", [1, 3, 5], ids=["decode", "verify3", "verify5"])
@pytest.mark.parametrize("seqs", [1, 3, 5, 11])
def test_padded_static_forward_equals_eager(tiny_model_factory, q, seqs):
    """Two runners over the same prompts, one eager and one through the padded static path: the same
    logits within float32 noise and the same greedy tokens, step after step (what the padded rows compute
    must not leak into the real ones, nor their writes into the cache)."""
    llm = _llm(tiny_model_factory(SHAPE), max_num_seqs=16, speculative_config={"method": "ngram"})
    model = llm.engine.model
    blocks = 16 * seqs
    eager, padded = ModelRunner(model, blocks, BLOCK), ModelRunner(model, blocks, BLOCK)
    padded.graphs = graphs = _uncaptured(llm, padded)
    assert q in graphs.query_lens
    contexts = _contexts(model, seqs, torch.Generator().manual_seed(seqs * 10 + q))
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(seqs)]
    prefill = [ForwardEntry(c, 0, t, 1) for c, t in zip(contexts, tables)]
    for runner in (eager, padded):
        runner.run(prefill)  # a prefill: not uniform, eager in both
    assert graphs.last_refusal is not None
    tokens = [c[-1:] * q for c in contexts]
    starts = [len(c) for c in contexts]
    for _ in range(3):
        entries = [ForwardEntry(t, s, tb, q) for t, s, tb in zip(tokens, starts, tables)]
        want = eager.run(entries)
        got = padded.run(entries)
        assert graphs.last_refusal is None
        assert got.shape == want.shape == (seqs * q, model.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        nxt = want.argmax(-1).view(seqs, q).tolist()
        tokens = [row[-1:] + row[:-1] for row in nxt]
        starts = [s + q for s in starts]
    assert sum(graphs.steps_run.values()) == 3
    assert set(graphs.steps_run) == {(padded_size(graphs.sizes, seqs), q)}
    # the padded rows wrote nothing: both caches hold the same K/V
    for (k1, v1), (k2, v2) in zip(eager.kv_caches, padded.kv_caches):
        torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-5)


def test_steps_a_graph_cannot_take_run_eagerly(tiny_model_factory):
    llm = _llm(tiny_model_factory(SHAPE), max_num_seqs=4)
    model = llm.engine.model
    runner = ModelRunner(model, 32, BLOCK)
    runner.graphs = graphs = _uncaptured(llm, runner)
    assert graphs.sizes == (1, 2, 4) and graphs.query_lens == (1,)
    prompt = list(range(5, 14))
    runner.run([ForwardEntry(prompt, 0, [0, 1, 2], 1)])
    assert graphs.last_refusal == "query length not captured"
    cases = [
        ([ForwardEntry([7, 8], 9, [0, 1, 2], 2)], "query length not captured"),
        ([ForwardEntry([7], 9, [0, 1, 2], 1, capture=True)], "hidden states captured"),
        ([ForwardEntry([7], 9, [0, 1, 2], 1)] * 5, "batch above the largest captured size"),
        ([ForwardEntry([7], 9, [0, 1, 2], 0)], "logits not wanted for every token"),
    ]
    for entries, why in cases:
        assert graphs.refusal(entries) == why
    assert runner.run([ForwardEntry([7], 9, [0, 1, 2], 1)]).shape == (1, model.cfg.vocab_size)
    assert graphs.last_refusal is None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_greedy_with_padded_steps_matches_hf(tiny_model_factory, hf_reference, method):
    """Through LLM.generate with speculation: three prompts at a time pad to 4. N-gram drafts come and go
    over a random model's output, so most steps are decodes; the target as its own draft model has every
    draft accepted, so the steps are verifies of k + 1 tokens each."""
    path = tiny_model_factory(SHAPE)
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(path)
    llm = _llm(path, max_num_seqs=8, speculative_config=spec)
    engine = llm.engine
    engine.runner.graphs = graphs = _uncaptured(llm)
    params = SamplingParams(**{**GREEDY.__dict__, "speculation": 3})
    outs = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == hf_reference(SHAPE)[:3]
    assert sum(o.usage.draft_proposed for o in outs) > 0
    served = graphs.steps_run
    assert any(b == 4 for b, _ in served)  # three sequences padded to four
    assert any(q == 1 if method == "ngram" else q > 1 for _, q in served)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3", "mistral_window"])
def test_families_with_padded_steps_match_hf(name, tmp_path_factory, demo_tokenizer):
    """q/k norms (Qwen3), sliding windows and soft-capping (Gemma 3, Mistral), partial rotary (Phi-3): what
    the padded rows and the widened block tables go through in each."""
    path = _build(name, demo_tokenizer, tmp_path_factory.mktemp(name))
    refs = torch.load(path / "hf_reference.pt")
    llm = _llm(path, max_num_seqs=8)
    llm.engine.runner.graphs = graphs = _uncaptured(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == refs[:3]
    assert graphs.steps_run[(4, 1)] > 0


def test_enforce_eager_and_cpu_leave_the_runner_eager(tiny_model_dir):
    assert EngineConfig().enforce_eager is False
    for enforce, why in ((False, "not a CUDA device"), (True, "--enforce-eager")):
        llm = _llm(tiny_model_dir, enforce_eager=enforce)
        assert llm.engine.runner.graphs is None
        assert llm.engine.graphs_refusal == why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 2}])
def test_graph_replay_equals_eager_on_cuda(tiny_model_factory, hf_reference, spec):
    path = tiny_model_factory(SHAPE)
    kw = dict(
        dtype="float32", device="cuda", max_num_seqs=8, kv_cache_bytes=64 << 20, speculative_config=spec
    )
    graphed, eager = LLM(str(path), **kw), LLM(str(path), enforce_eager=True, **kw)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.capture
    assert eager.engine.runner.graphs is None
    params = SamplingParams(**{**GREEDY.__dict__, "speculation": 2 if spec else 0})
    outs = graphed.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(PROMPTS[:3], params)]
    assert [o.token_ids for o in outs] == hf_reference(SHAPE)[:3]
    assert graphs.steps_run
    # one step, replayed and eager, on the same cache
    model, runner = graphed.engine.model, graphed.engine.runner
    plain = ModelRunner(model, 1, runner.block_size)
    plain.kv_caches = runner.kv_caches  # the same cache, read and written eagerly
    entries = [ForwardEntry([11], 5 + i, [i], 1) for i in range(3)]
    runner.run([ForwardEntry(list(range(5 + i)), 0, [i], 1) for i in range(3)])
    torch.testing.assert_close(runner.run(entries), plain.run(entries), rtol=1e-4, atol=1e-4)
    assert graphs.last_refusal is None


def test_a_failed_capture_leaves_the_engine_eager(tiny_model_factory, hf_reference, monkeypatch):
    """Where capture fails (here: a CPU let past the setup rules, which has no graphs to capture), the engine
    starts anyway, eager, and says why."""
    monkeypatch.setattr(cuda_graphs, "setup_refusal", lambda facts: None)
    llm = _llm(tiny_model_factory(SHAPE))
    assert llm.engine.runner.graphs is None
    assert llm.engine.graphs_refusal.startswith("capture failed: ")
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == hf_reference(SHAPE)[0]


def test_enforce_eager_reaches_the_engine_from_flag_and_environment():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, config.read_by("worker"))
    flagged = config.from_args(parser.parse_args(["--enforce-eager"]), environ={})
    assert flagged.engine_kwargs()["enforce_eager"] is True
    from_env = config.from_args(parser.parse_args([]), environ={"SPECSERVE_ENFORCE_EAGER": "1"})
    assert from_env.engine_kwargs()["enforce_eager"] is True
    unset = config.from_args(parser.parse_args([]), environ={})
    assert "enforce_eager" not in unset.engine_kwargs()  # the engine's default (off) applies
