"""Settings the model or the machine cannot take fail before a weight is read: through the CLI, one line
and exit 2; through the Python API, a ValueError naming the setting. The model's config alone decides."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM
from specserve.models.linear import invariance_refusal
from specserve.service.cli import main

# bf16 batch-invariant decoding on a CPU without our AVX512-BF16 products (an AVX2-only one)
NO_BF16_INVARIANCE = invariance_refusal(torch.bfloat16, torch.device("cpu")) is not None


@pytest.fixture
def no_weights_read(monkeypatch) -> None:
    """Reading a checkpoint's tensors fails the test: every check here must come before it."""
    from specserve.engine import parallel

    def refuse(*_args, **_kwargs):
        raise AssertionError("weights were read before the settings were checked")

    monkeypatch.setattr(parallel, "build_model", refuse)
    monkeypatch.setattr("specserve.engine.llm_engine.build_model", refuse)


CASES = [
    # (flags, words the line must hold); the tiny model's context is 2048 tokens
    (["--max-model-len", "4096"], ["max_model_len 4096", "model's own context of 2048"]),
    (
        ["--max-model-len", "2048", "--kv-cache-bytes", "65536"],
        ["max_model_len 2048", "holds", "kv_cache_bytes"],
    ),
    (
        ["--quantization", "int4", "--tensor-parallel-size", "2"],
        ["quantization int4", "tensor_parallel_size 2"],
    ),
    (["--chat-template", "no/such/file.jinja"], ["chat_template", "no/such/file.jinja"]),
]
if not torch.cuda.is_available():
    CASES.append((["--device", "cuda"], ["device cuda", "CUDA"]))
if NO_BF16_INVARIANCE:
    CASES.append(
        (["--batch-invariant", "--dtype", "bfloat16"], ["batch_invariant", "AVX512-BF16", "float32"])
    )


@pytest.mark.parametrize("flags, words", CASES)
def test_the_cli_refuses_in_one_line_before_the_load(tiny_model_dir, no_weights_read, capsys, flags, words):
    code = main(["serve", "--model", str(tiny_model_dir), "--dtype", "float32", *flags])
    assert code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"max_model_len": 4096}, "max_model_len"),
        ({"max_model_len": 2048, "kv_cache_bytes": 65536}, "max_model_len"),
        ({"quantization": "int4", "tensor_parallel_size": 2}, "quantization"),
        ({"chat_template": "no/such/file.jinja"}, "chat_template"),
    ]
    + ([({"device": "cuda"}, "device")] if not torch.cuda.is_available() else [])
    + ([({"batch_invariant": True, "dtype": "bfloat16"}, "batch_invariant")] if NO_BF16_INVARIANCE else []),
)
def test_the_python_api_raises_naming_the_setting(tiny_model_dir, no_weights_read, kwargs, setting):
    with pytest.raises(ValueError) as e:
        LLM(str(tiny_model_dir), **{"dtype": "float32", **kwargs})
    assert str(e.value).startswith(setting) or f" {setting}" in str(e.value)


def test_a_max_model_len_that_fits_loads(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=2048, kv_cache_bytes=64 << 20)
    assert llm.engine.max_model_len == 2048
