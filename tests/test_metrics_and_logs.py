"""vLLM-named metrics scraped from a real stack's /metrics after real requests, an
API-only process exporting no engine series, the access log and the periodic engine line."""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from valkey_helpers import api_stack, free_port, run, service_stack, wait_for

from specserve.service import config as cfg_mod
from specserve.service.launch import run as launch_run
from specserve.service.telemetry import StatsLine, Telemetry

pytest_plugins = ("valkey_fixtures",)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text page: (name, labels) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(page: dict, name: str, **labels: str) -> float:
    return page[(name, frozenset(labels.items()))]


async def _true(v: bool) -> bool:
    return v


def test_worker_exports_vllms_names_with_model_name_after_real_requests(valkey, tiny_model_dir):
    async def main():
        async with (
            api_stack(valkey.url, tiny_model_dir) as (base, worker, _client),
            aiohttp.ClientSession() as http,
        ):
            model = worker.engine.model_name
            usages = []
            for prompt in ("one two three", "the quick brown fox"):
                body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
                async with http.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    got = await r.json()
                    assert got["choices"][0]["finish_reason"] == "length"
                    usages.append(got["usage"])
            await worker._refresh_stats()
            async with http.get(f"{base}/metrics") as r:
                return model, usages, await r.text()

    model, usages, text = run(main())
    page = samples(text)
    m = {"model_name": model}
    assert value(page, "specserve:request_success_total", finished_reason="length", **m) == 2
    assert value(page, "specserve:prompt_tokens_total", **m) == sum(u["prompt_tokens"] for u in usages)
    assert value(page, "specserve:generation_tokens_total", **m) == sum(
        u["completion_tokens"] for u in usages
    )
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert value(page, f"specserve:{hist}_count", **m) == 2, hist
    # vLLM's TTFT buckets, so quantiles interpolate over the same edges as a vLLM server's
    assert value(page, "specserve:time_to_first_token_seconds_bucket", le="2560.0", **m) == 2
    assert value(page, "specserve:request_generation_tokens_sum", **m) == 10
    # Nothing runs any more: the scheduler gauges say so, with the model's name on them.
    assert value(page, "specserve:num_requests_running", **m) == 0
    assert value(page, "specserve:num_requests_waiting", **m) == 0
    assert 0 <= value(page, "specserve:kv_cache_usage_perc", **m) <= 1
    assert value(page, "specserve:num_preemptions_total", **m) >= 0  # the shared engine's, since it loaded
    assert value(page, "specserve_dead_letters") == 0
    # The names people already chart keep working beside vLLM's.
    assert value(page, "specserve_requests_total", status="finished") == 2
    assert value(page, "specserve_time_to_first_token_seconds_count") == 2


# vLLM v1's metric names (vllm/v1/metrics/loggers.py) that a vLLM dashboard reads, as a scrape shows them:
# counters with their _total, histograms by their _count.
VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_per_output_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
]


def test_metrics_prefix_vllm_exports_vllms_exact_names(valkey, tiny_model_dir):
    parser = cfg_mod.argparse.ArgumentParser()
    cfg_mod.add_arguments(parser)
    cfg = cfg_mod.from_args(parser.parse_args(["--metrics-prefix", "vllm"]), environ={})
    assert cfg.metrics_prefix == "vllm"
    assert cfg_mod.from_args(None, environ={"SPECSERVE_METRICS_PREFIX": "vllm"}).metrics_prefix == "vllm"
    with pytest.raises(ValueError, match="SPECSERVE_METRICS_PREFIX"):
        cfg_mod.from_args(None, environ={"SPECSERVE_METRICS_PREFIX": "sglang"})

    async def main():
        telemetry = Telemetry(metrics_prefix=cfg.metrics_prefix)
        async with service_stack(valkey.url, tiny_model_dir, prefix="vllmnames", telemetry=telemetry) as (
            worker,
            client,
        ):
            body = {"prompt": "one two three", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            results = [await client.wait((await client.enqueue(body)).id) for _ in range(2)]
            await worker._refresh_stats()
            return worker, results, telemetry.metrics_text().decode()

    worker, results, text = run(main())
    page = samples(text)
    names = {name for name, _ in page}
    assert [n for n in VLLM_NAMES if n not in names] == []
    assert not {n for n in names if n.startswith("specserve:")}  # the prefix is vLLM's alone
    m = {"model_name": worker.engine.model_name}
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(page, f"vllm:request_{phase}_time_seconds_count", **m) == 2, phase
    # inference is prefill and decode together, request by request
    total = value(page, "vllm:request_inference_time_seconds_sum", **m)
    parts = value(page, "vllm:request_prefill_time_seconds_sum", **m)
    parts += value(page, "vllm:request_decode_time_seconds_sum", **m)
    assert total == pytest.approx(parts)
    # one gap between each two outputs of a request: at most completion_tokens - 1 a request (fewer where a
    # step hands over several tokens)
    gaps = value(page, "vllm:inter_token_latency_seconds_count", **m)
    assert 2 <= gaps <= sum(r.usage["completion_tokens"] - 1 for r in results)
    info = next(labels for name, labels in page if name == "vllm:cache_config_info")
    info = dict(info)
    llm = worker.engine.engine
    assert info["block_size"] == str(llm.config.block_size)
    assert info["num_gpu_blocks"] == str(llm.block_manager.num_blocks)
    assert info["cache_dtype"] == "float32"
    assert value(page, "vllm:cache_config_info", **info) == 1


def test_spec_decode_counters_count_the_draft_tokens_requests_report(valkey, tiny_model_dir):
    spec = SPEC
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, engine_args=spec) as (worker, client):
            await worker._refresh_stats()  # the engine is shared with earlier tests: its counters run on
            before = worker.telemetry.metrics_text().decode()
            ids = [
                (await client.enqueue({"prompt": p, **params})).id
                for p in ("one two three one two three one two three", "abc abc abc abc")
            ]
            results = [await client.wait(i) for i in ids]
            await worker._refresh_stats()
            return worker.engine.model_name, results, before, worker.telemetry.metrics_text().decode()

    model, results, before, after = run(main())
    pages = samples(before), samples(after)

    def grew(name: str) -> float:
        return value(pages[1], name, model_name=model) - value(pages[0], name, model_name=model)

    proposed = sum(r.usage["draft_proposed"] for r in results)
    accepted = sum(r.usage["draft_accepted"] for r in results)
    assert proposed > 0
    assert grew("specserve:spec_decode_num_draft_tokens_total") == proposed
    assert grew("specserve:spec_decode_num_accepted_tokens_total") == accepted
    # the same by the method that proposed them: every draft here is the n-gram proposer's
    by = {"model_name": model, "method": "ngram"}
    grew_by = [
        value(pages[1], f"specserve:spec_decode_num_{kind}_tokens_by_method_total", **by)
        - value(pages[0], f"specserve:spec_decode_num_{kind}_tokens_by_method_total", **by)
        for kind in ("draft", "accepted")
    ]
    assert grew_by == [proposed, accepted]


def test_an_api_only_telemetry_exports_what_the_api_knows_and_no_engine_series(valkey, tiny_model_dir):
    """Before: an API pod exported the engine's gauges, stuck at 0, beside the workers' real ones."""
    from aiohttp import web

    from specserve.service.api import Api, ApiSettings

    async def main():
        async with (
            service_stack(valkey.url, tiny_model_dir) as (worker, client),
            aiohttp.ClientSession() as http,
        ):
            telemetry = Telemetry(engine_metrics=False)
            api = Api(client, telemetry, ApiSettings(), model_ready=lambda: worker.ready)
            runner = web.AppRunner(api.app(refresh_queue_stats=False), access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                base = f"http://127.0.0.1:{port}"
                async with http.post(f"{base}/v1/requests", json={"prompt": "hi", "max_tokens": 3}) as r:
                    assert r.status in (200, 201, 202), await r.text()
                async with http.get(f"{base}/metrics") as r:
                    return await r.text()
            finally:
                await runner.cleanup()
                telemetry.shutdown()

    text = run(main())
    names = {name for name, _ in samples(text)}
    assert "specserve_http_requests_total" in names and "specserve_queue_depth" in names
    engine_side = {n for n in names if n.startswith("specserve:")}
    engine_side |= names & {
        "specserve_running_requests",
        "specserve_waiting_requests",
        "specserve_batch_size",
        "specserve_kv_blocks_used",
        "specserve_kv_blocks_total",
        "specserve_preemptions_total",
        "specserve_draft_tokens_proposed_total",
        "specserve_dead_letters",
    }
    assert engine_side == set()


def test_the_api_process_is_started_without_engine_series(valkey, monkeypatch):
    """launch.run for `specserve api`: the same, end to end through the process's own wiring."""
    port = free_port()
    env = {"REDIS_URL": valkey.url, "SPECSERVE_PORT": str(port), "SPECSERVE_PREFIX": "apionly"}
    cfg = cfg_mod.from_args(None, environ=env)

    async def main():
        task = asyncio.create_task(launch_run(cfg, with_api=True, with_worker=False))
        try:
            async with aiohttp.ClientSession() as http:

                async def up() -> bool:
                    try:
                        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await wait_for(up, what="the API")
                async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                    return await r.text()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    names = {name for name, _ in samples(run(main()))}
    assert "specserve_queue_depth" in names
    assert not {n for n in names if n.startswith("specserve:")}
    assert "specserve_kv_blocks_total" not in names and "specserve_running_requests" not in names


# Not the speculative engine test_service_worker.py uses: the tiny engines are shared per process (by their
# arguments) and its test reads that engine's draft counters as if it were their only user.
SPEC = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}

ACCESS = re.compile(
    r"request_id=(?P<id>\S+) tenant=(?P<tenant>\S+) status=(?P<status>\S+) finish_reason=(?P<reason>\S+) "
    r"prompt_tokens=(?P<prompt>\d+) completion_tokens=(?P<completion>\d+) latency_s=(?P<latency>[\d.]+)$"
)


def test_access_log_has_one_line_per_request_with_tenant_status_tokens_and_latency(
    valkey, tiny_model_dir, caplog
):
    caplog.set_level(logging.INFO, logger="specserve.access")

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, access_log=True) as (_worker, client):
            ran = await client.enqueue({"prompt": "hello", "max_tokens": 4}, tenant="acme")
            expired = await client.enqueue({"prompt": "late", "max_tokens": 4, "deadline": 1.0})
            results = {i: await client.wait(i) for i in (ran.id, expired.id)}
            lines = lambda: [r.getMessage() for r in caplog.records if r.name == "specserve.access"]  # noqa: E731
            await wait_for(lambda: _true(len(lines()) >= 2), what="access lines")
            return ran.id, expired.id, results, lines()

    ran, expired, results, lines = run(main())
    parsed = {m["id"]: m for m in map(ACCESS.match, lines) if m}
    assert set(parsed) == {ran, expired} and len(lines) == 2, lines
    a = parsed[ran]
    assert (a["tenant"], a["status"], a["reason"]) == ("acme", "finished", "length")
    assert int(a["completion"]) == results[ran].usage["completion_tokens"] == 4
    assert int(a["prompt"]) == results[ran].usage["prompt_tokens"] and float(a["latency"]) > 0
    b = parsed[expired]  # never ran: no tenant was given, no tokens
    assert (b["tenant"], b["status"], b["completion"]) == ("-", results[expired].status, "0")


def test_access_log_is_off_by_default(valkey, tiny_model_dir, caplog):
    caplog.set_level(logging.DEBUG, logger="specserve.access")

    async def main():
        async with service_stack(valkey.url, tiny_model_dir) as (_worker, client):
            added = await client.enqueue({"prompt": "hello", "max_tokens": 2})
            await client.wait(added.id)
            await asyncio.sleep(0.1)

    run(main())
    assert [r for r in caplog.records if r.name == "specserve.access"] == []


def test_engine_line_reports_throughput_batch_kv_and_draft_acceptance(valkey, tiny_model_dir):
    spec = SPEC
    now = [100.0]

    async def main():
        async with service_stack(valkey.url, tiny_model_dir, engine_args=spec) as (worker, client):
            await worker._refresh_stats()  # the engine is shared with earlier tests: its counters run on
            line = StatsLine(worker.telemetry, clock=lambda: now[0])
            idle, busy = line.line()
            # a fixed depth: "auto" on an engine shared with earlier tests may have learnt to draft nothing
            params = {"prompt": "abc abc abc abc abc", "max_tokens": 20, "ignore_eos": True, "temperature": 0}
            params["speculation"] = 2
            result = await client.wait((await client.enqueue(params)).id)
            await worker._refresh_stats()
            now[0] += 10.0
            return (idle, busy), line.line(), result

    (idle, idle_busy), (text, busy), result = run(main())
    assert not idle_busy and "Avg generation throughput: 0.0 tokens/s" in idle
    assert busy
    assert f"Avg generation throughput: {result.usage['completion_tokens'] / 10:.1f} tokens/s" in text
    assert f"Avg prompt throughput: {result.usage['prompt_tokens'] / 10:.1f} tokens/s" in text
    assert "Running: 0 reqs, Waiting: 0 reqs" in text and "KV cache usage: " in text
    proposed, accepted = result.usage["draft_proposed"], result.usage["draft_accepted"]
    assert proposed > 0
    assert f"Draft acceptance rate: {100 * accepted / proposed:.1f}% ({accepted}/{proposed} tokens)" in text


def test_engine_line_is_logged_every_interval_and_flags_parse(caplog):
    from specserve.service.telemetry import log_stats_every

    caplog.set_level(logging.DEBUG, logger="specserve.stats")

    async def main():
        telemetry = Telemetry()
        task = asyncio.create_task(log_stats_every(telemetry, 0.05))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        telemetry.shutdown()

    asyncio.run(main())
    lines = [r for r in caplog.records if r.name == "specserve.stats"]
    assert len(lines) >= 2 and all(r.levelno == logging.DEBUG for r in lines)  # idle: DEBUG, as vLLM does
    assert "Running: 0 reqs" in lines[0].getMessage()

    import argparse

    parser = argparse.ArgumentParser()
    cfg_mod.add_arguments(parser)
    cfg = cfg_mod.from_args(parser.parse_args(["--log-stats-interval", "0", "--access-log"]), environ={})
    assert cfg.log_stats_interval == 0 and cfg.access_log and cfg.worker_config().access_log
    cfg = cfg_mod.from_args(parser.parse_args([]), environ={"SPECSERVE_ACCESS_LOG": "1"})
    assert cfg.log_stats_interval == 10 and cfg.access_log
    with pytest.raises(ValueError, match="SPECSERVE_LOG_STATS_INTERVAL"):
        cfg_mod.from_args(parser.parse_args([]), environ={"SPECSERVE_LOG_STATS_INTERVAL": "-1"})
