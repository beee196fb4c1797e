"""Configuration: flags over environment over defaults, the Helm chart's variable names, API keys."""

from __future__ import annotations

import argparse

import pytest

from specserve.service import config as cfg_mod
from specserve.spec.config import SpeculativeConfig


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cfg_mod.add_arguments(p)
    return p.parse_args(argv)


def test_defaults():
    c = cfg_mod.from_args(_parse([]), environ={})
    assert (c.redis_url, c.prefix, c.model, c.port, c.health_port, c.drain_timeout) == (
        None,
        "specserve",
        None,
        8000,
        8001,
        30.0,
    )
    assert c.keys_list() == []
    # n-gram speculation is on by default (README: chat traffic gains at 1 in flight and is level at 8 and 32,
    # as requests' "auto" backs off); --speculative-method none turns it off
    # (k unset: the engine's default by method, spec/config.py: 4 for n-gram, suffix's tree depth for suffix)
    assert c.speculative_config() == {"method": "ngram"}
    assert SpeculativeConfig.from_dict(c.speculative_config()).num_speculative_tokens == 4
    off = cfg_mod.from_args(_parse(["--speculative-method", "none"]), environ={})
    assert off.speculative_config() is None
    suffix = cfg_mod.from_args(_parse(["--speculative-method", "suffix"]), environ={})
    assert SpeculativeConfig.from_dict(suffix.speculative_config()).num_speculative_tokens == 16


def test_environment_names_and_flag_precedence(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nfile-key\n\n")
    env = {
        "REDIS_URL": "rediss://user:pw@redis:6380/0",
        "SPECSERVE_PREFIX": "acme",
        "SPECSERVE_MODEL": "/models/a",
        "SPECSERVE_DTYPE": "bfloat16",
        "SPECSERVE_DEVICE": "cpu",
        "SPECSERVE_SPEC_METHOD": "draft_model",
        "SPECSERVE_SPEC_MODEL": "/models/draft",
        "SPECSERVE_NUM_SPEC_TOKENS": "5",
        "SPECSERVE_MAX_NUM_SEQS": "8",
        "SPECSERVE_KV_CACHE_BYTES": "1048576",
        "SPECSERVE_HOST": "0.0.0.0",
        "SPECSERVE_PORT": "9000",
        "SPECSERVE_HEALTH_PORT": "9001",
        "SPECSERVE_API_KEYS": "a, b",
        "SPECSERVE_API_KEYS_FILE": str(keys_file),
        "SPECSERVE_DRAIN_TIMEOUT": "12.5",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
    }
    c = cfg_mod.from_args(_parse(["--port", "7000", "--model", "/models/b"]), environ=env)
    assert c.port == 7000 and c.model == "/models/b"  # flags win
    assert c.redis_url == env["REDIS_URL"] and c.prefix == "acme" and c.health_port == 9001
    assert c.drain_timeout == 12.5 and c.otlp_endpoint == "http://collector:4318" and c.host == "0.0.0.0"
    assert c.keys_list() == ["a", "b", "file-key"]
    assert c.speculative_config() == {
        "method": "draft_model",
        "num_speculative_tokens": 5,
        "model": "/models/draft",
    }
    assert c.engine_kwargs() == {
        "model": "/models/b",
        "dtype": "bfloat16",
        "device": "cpu",
        "speculative_config": c.speculative_config(),
        "max_num_seqs": 8,
        "kv_cache_bytes": 1048576,
        # the service's own defaults (the engine's are vLLM's fcfs): Batch API lines yield to interactive work
        "scheduling_policy": "priority",
        "prefill_tokens_beside_decode": 128,
    }


@pytest.mark.parametrize(
    "env",
    [{"SPECSERVE_DTYPE": "int3"}, {"SPECSERVE_PORT": "eighty"}, {"SPECSERVE_SPEC_METHOD": "draft_model"}],
)
def test_bad_settings_are_refused_with_the_variable_named(env):
    with pytest.raises(ValueError) as e:
        cfg_mod.from_args(_parse([]), environ=env)
    assert next(iter(env)) in str(e.value) or "speculative" in str(e.value)


def test_the_service_loop_is_uvloop_where_it_installs() -> None:
    import asyncio

    from specserve.service.cli import run_loop

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_loop(loop_module()).startswith("uvloop")


def test_hardening_settings_environment_names_and_defaults(tmp_path):
    c = cfg_mod.from_args(_parse([]), environ={})
    assert (c.allow_unauthenticated, c.max_connections, c.header_timeout, c.body_timeout) == (
        False,
        1000,
        15.0,
        60.0,
    )
    assert (c.keepalive_timeout, c.embedded_maxmemory) == (75.0, "1gb")
    assert (c.dead_letter_maxlen, c.dead_letter_ttl) == (100_000, 7 * 86400.0)
    env = {
        "SPECSERVE_ALLOW_UNAUTHENTICATED": "true",
        "SPECSERVE_MAX_CONNECTIONS": "50",
        "SPECSERVE_HEADER_TIMEOUT": "2.5",
        "SPECSERVE_BODY_TIMEOUT": "9",
        "SPECSERVE_KEEPALIVE_TIMEOUT": "30",
        "SPECSERVE_EMBEDDED_MAXMEMORY": "256mb",
        "SPECSERVE_DEAD_LETTER_MAXLEN": "10",
        "SPECSERVE_DEAD_LETTER_TTL": "60",
    }
    c = cfg_mod.from_args(_parse(["--max-connections", "70"]), environ=env)
    assert (c.allow_unauthenticated, c.max_connections, c.header_timeout, c.body_timeout) == (
        True,
        70,
        2.5,
        9.0,
    )
    assert (c.keepalive_timeout, c.embedded_maxmemory) == (30.0, "256mb")
    assert (c.dead_letter_maxlen, c.dead_letter_ttl) == (10, 60.0)
    assert cfg_mod.from_args(_parse(["--allow-unauthenticated"]), environ={}).allow_unauthenticated is True
    off = {"SPECSERVE_ALLOW_UNAUTHENTICATED": "0"}
    assert cfg_mod.from_args(_parse([]), environ=off).allow_unauthenticated is False


@pytest.mark.parametrize(
    "env",
    [
        {"SPECSERVE_ALLOW_UNAUTHENTICATED": "maybe"},
        {"SPECSERVE_MAX_CONNECTIONS": "0"},
        {"SPECSERVE_HEADER_TIMEOUT": "-1"},
        {"SPECSERVE_BODY_TIMEOUT": "nan"},
        {"SPECSERVE_DEAD_LETTER_TTL": "0"},
    ],
)
def test_bad_hardening_settings_are_refused_with_the_variable_named(env):
    with pytest.raises(ValueError) as e:
        cfg_mod.from_args(_parse([]), environ=env)
    assert next(iter(env)) in str(e.value)


def test_a_keyless_api_may_bind_loopback_only_unless_allowed(caplog):
    from specserve.service.launch import check_api_exposure

    def exposure(**env: str) -> None:
        check_api_exposure(cfg_mod.from_args(_parse([]), environ=env))

    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        exposure(SPECSERVE_HOST=host)
    for host in ("0.0.0.0", "::", "10.1.2.3", "api.example.com"):
        with pytest.raises(SystemExit) as e:
            exposure(SPECSERVE_HOST=host)
        assert "--allow-unauthenticated" in str(e.value) and "SPECSERVE_API_KEYS" in str(e.value)
        exposure(SPECSERVE_HOST=host, SPECSERVE_API_KEYS="acme:tok-a")
        with caplog.at_level("WARNING", logger="specserve"):
            exposure(SPECSERVE_HOST=host, SPECSERVE_ALLOW_UNAUTHENTICATED="1")
        assert "has no API keys" in caplog.text
    with pytest.raises(SystemExit) as e:  # a malformed entry stops the start, without echoing the token
        exposure(SPECSERVE_API_KEYS="bad name:secret-tok")
    assert "SPECSERVE_API_KEYS" in str(e.value) and "secret-tok" not in str(e.value)


def test_worker_settings_reach_the_worker():
    env = {"SPECSERVE_DEAD_LETTER_MAXLEN": "10", "SPECSERVE_DEAD_LETTER_TTL": "60"}
    env |= {
        "SPECSERVE_MAX_BODY_BYTES": "4096",
        "SPECSERVE_MAX_PROMPT_CHARS": "1000",
        "SPECSERVE_RESULT_TTL": "30",
    }
    w = cfg_mod.from_args(_parse([]), environ=env).worker_config()
    assert (w.dead_letter_maxlen, w.dead_letter_ttl_s) == (10, 60.0)
    assert (w.max_body_chars, w.max_prompt_chars, w.ttl_s) == (4096, 1000, 30.0)


def test_every_engine_knob_is_a_flag_and_a_variable_and_reaches_the_engine():
    env = {
        "SPECSERVE_MAX_NUM_BATCHED_TOKENS": "512",
        "SPECSERVE_BLOCK_SIZE": "32",
        "SPECSERVE_MAX_MODEL_LEN": "1024",
        "SPECSERVE_ENABLE_CHUNKED_PREFILL": "false",
        "SPECSERVE_SPEC_METHOD": "ngram",
        "SPECSERVE_NUM_SPEC_TOKENS": "6",
        "SPECSERVE_PROMPT_LOOKUP_MAX": "3",
        "SPECSERVE_ATTENTION_BACKEND": "torch",
    }
    c = cfg_mod.from_args(_parse(["--max-num-seqs", "12", "--block-size", "8"]), environ=env)
    kw = c.engine_kwargs()
    assert {k: kw[k] for k in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len")} == {
        "max_num_seqs": 12,
        "max_num_batched_tokens": 512,
        "block_size": 8,  # the flag wins over the variable
        "max_model_len": 1024,
    }
    assert kw["enable_chunked_prefill"] is False and kw["attention_backend"] == "torch"
    assert kw["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_max": 3,
    }
    on = cfg_mod.from_args(_parse(["--enable-chunked-prefill"]), environ=env)
    assert on.engine_kwargs()["enable_chunked_prefill"] is True
    # unset knobs are left to the engine's own defaults, not written twice here
    assert set(cfg_mod.from_args(_parse([]), environ={}).engine_kwargs()) == {
        "model",
        "dtype",
        "device",
        "speculative_config",
        "scheduling_policy",  # the service's own default, not the engine's (service/config.py)
        "prefill_tokens_beside_decode",  # likewise: a stream's token gaps matter to a service
    }
    from specserve.engine.config import EngineConfig

    EngineConfig.from_kwargs(**kw)  # every knob is one the engine takes


@pytest.mark.parametrize(
    "env",
    [
        {"SPECSERVE_BLOCK_SIZE": "0"},
        {"SPECSERVE_MAX_MODEL_LEN": "-5"},
        {"SPECSERVE_ATTENTION_BACKEND": "gpu"},
        {"SPECSERVE_PREFILL_TOKENS_BESIDE_DECODE": "-1"},
    ],
)
def test_bad_engine_knobs_are_refused_before_any_model_loads(env):
    (name,) = env
    with pytest.raises(ValueError, match=name):
        cfg_mod.from_args(_parse([]), environ=env)


def test_the_worker_and_api_defaults_are_the_services():
    """One source for each default: the service's settings give the worker's, the worker's the queue's."""
    from specserve.queue.consumer import ConsumerConfig

    c = cfg_mod.from_args(_parse([]), environ={})
    assert c.worker_config() == cfg_mod.WorkerConfig()
    assert c.worker_config().consumer_config() == ConsumerConfig()
    api = c.api_settings([])
    assert (api.max_body_bytes, api.max_prompt_chars) == (
        cfg_mod.ApiSettings().max_body_bytes,
        cfg_mod.ApiSettings().max_prompt_chars,
    )


def _options(command: str) -> dict[str, str]:
    """`specserve <command> --help`'s options: flag -> its help text."""
    from specserve.service.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.option_strings[0]: a.help for a in sub._actions if a.option_strings and a.dest != "help"}


def test_worker_and_api_help_lists_only_the_flags_each_reads_with_defaults() -> None:
    worker, api, serve = _options("worker"), _options("api"), _options("serve")
    assert {"--port", "--api-keys", "--tool-call-parser", "--max-file-bytes"}.isdisjoint(worker)
    assert {"--max-num-seqs", "--dtype", "--health-port", "--prefix-routing", "--log-stats-interval"} <= set(
        worker
    )
    assert {"--max-num-seqs", "--dtype", "--health-port", "--speculative-method"}.isdisjoint(api)
    assert {"--port", "--api-keys", "--tool-call-parser", "--redis-url", "--served-model-name"} <= set(api)
    assert set(worker) | set(api) == set(serve)  # serve runs both
    assert "default 8000" in api["--port"] and "env SPECSERVE_PORT" in api["--port"]
    assert "default ngram" in worker["--speculative-method"]
    assert "default engine's" in worker["--max-num-seqs"]
    assert "default off" in worker["--access-log"]
    # every flag a subcommand takes is one its process reads, by the one list in service/config.py
    for command, flags in (("worker", worker), ("api", api)):
        assert {f"--{name.replace('_', '-')}" for name in cfg_mod.read_by(command)} == set(flags)


def test_the_worker_refuses_an_api_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from specserve.service.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["worker", "--port", "9000"])
    assert caught.value.code == 2 and "--port" in capsys.readouterr().err
