"""KV cache sizing: kv_cache_bytes when given; on CUDA vLLM's gpu_memory_utilization rule (the
device is simulated: torch.cuda.mem_get_info is what the rule reads); on CPU a tenth of the memory limit;
a max_model_len asked for that does not fit is an error naming both numbers, one taken from the model is
lowered with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from specserve import LLM
from specserve.engine import memory
from specserve.engine.config import EngineConfig
from specserve.engine.memory import kv_pool_bytes, plan_kv_cache

GIB = 1 << 30


def test_given_bytes_win_over_any_rule():
    assert kv_pool_bytes(torch.device("cuda"), 123 << 20, 0.9, 0) == (123 << 20, "kv_cache_bytes")


def test_cuda_takes_its_share_less_what_is_in_use_and_the_activations(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 80 * GIB))  # 20 GiB in use
    pool, why = kv_pool_bytes(torch.device("cuda:0"), None, 0.9, 2 * GIB)
    assert pool == int(80 * GIB * 0.9) - 20 * GIB - 2 * GIB  # 50 GiB
    assert "gpu_memory_utilization 0.9" in why and "20.00 GiB in use" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * GIB, 80 * GIB))
    with pytest.raises(ValueError, match="no room for a KV cache"):
        kv_pool_bytes(torch.device("cuda:0"), None, 0.9, 2 * GIB)


def test_cpu_takes_a_tenth_of_the_memory_limit_within_bounds(monkeypatch):
    for limit, want in ((24 * GIB, int(2.4 * GIB)), (1 * GIB, 256 << 20), (512 * GIB, 8 * GIB)):
        monkeypatch.setattr(memory, "memory_limit_bytes", lambda limit=limit: limit)
        pool, why = kv_pool_bytes(torch.device("cpu"), None, 0.9, 0)
        assert pool == want and "10%" in why
    assert memory.memory_limit_bytes() > 0  # this machine's (cgroup or RAM)


def test_a_requested_context_that_does_not_fit_names_both_numbers():
    # 1 MiB of blocks at 1 KiB a token: 1024 tokens
    with pytest.raises(ValueError) as e:
        plan_kv_cache(1 << 20, "kv_cache_bytes", 1024, 16, 4096, 8192)
    assert "max_model_len 4096" in str(e.value) and "holds 1024 tokens" in str(e.value)
    assert plan_kv_cache(1 << 20, "kv_cache_bytes", 1024, 16, 1000, 8192).max_model_len == 1000


def test_the_models_own_context_is_lowered_with_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="specserve.engine.memory"):
        plan = plan_kv_cache(1 << 20, "kv_cache_bytes", 1024, 16, None, 8192)
    assert plan.max_model_len == 1024 and plan.num_blocks == 64
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning and "8192" in warning[0].getMessage() and "1024" in warning[0].getMessage()
    assert any("KV cache: 64 blocks of 16 tokens" in r.getMessage() for r in caplog.records)


def test_the_engine_refuses_at_start_up_and_logs_what_it_chose(tiny_model_dir, caplog):
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_bytes=256 << 10, max_model_len=2048)
    with caplog.at_level(logging.INFO, logger="specserve.engine.memory"):
        llm = LLM(str(tiny_model_dir), dtype="float32")
    assert any("KV cache:" in r.getMessage() and "10%" in r.getMessage() for r in caplog.records)
    assert llm.engine.block_manager.num_blocks * 16 >= llm.engine.max_model_len


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True])
def test_gpu_memory_utilization_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)


@pytest.mark.parametrize("tokens,seqs,rows", [(2048, 64, 512), (100, 8, 100), (7, 64, 512), (33, 4, 3)])
def test_the_profiled_step_is_the_largest_the_scheduler_may_plan(tokens, seqs, rows, tiny_model_dir):
    """What the CUDA profile run measures (engine/memory.py): every budgeted token, at most max_num_seqs
    prompts, the logit rows asked; and it runs through the real model (here on CPU, where the allocator's
    peak cannot be read, so the run itself is what is checked)."""
    from specserve.engine.memory import largest_step, profile_activation_bytes
    from specserve.engine.model_runner import ModelRunner

    entries, blocks = largest_step(tokens, seqs, 16, rows)
    assert sum(len(e.token_ids) for e in entries) == tokens
    assert len(entries) <= seqs
    assert sum(e.num_logits for e in entries) == min(rows, tokens)
    used = [b for e in entries for b in e.block_table]
    assert sorted(used) == list(range(blocks))
    assert all(len(e.block_table) * 16 >= len(e.token_ids) for e in entries)
    if tokens <= 100:
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=8)
        logits = ModelRunner(llm.engine.model, blocks, 16).run(entries)
        assert logits.shape[0] == min(rows, tokens) and torch.isfinite(logits).all()
        assert profile_activation_bytes(llm.engine.model, tokens, seqs, 16, rows) == 0  # CPU: the estimate
