"""--served-model-name: the names /v1/models lists, requests may give and responses echo, and the metrics'
model_name label; a stopped worker's model leaves /v1/models within two of its heartbeats."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from valkey_helpers import free_port, run, service_stack, wait_for

from specserve.service import config as cfg_mod
from specserve.service.api import Api, ApiSettings

pytest_plugins = ("valkey_fixtures",)


def test_the_flag_takes_several_names_and_the_variable_commas_or_spaces() -> None:
    parser = cfg_mod.argparse.ArgumentParser()
    cfg_mod.add_arguments(parser)
    ns = parser.parse_args(["--model", "/models/m.gguf", "--served-model-name", "chat", "chat-v2"])
    cfg = cfg_mod.from_args(ns, environ={})
    assert cfg.served_model_names() == ["chat", "chat-v2"]
    assert cfg.worker_config().served_model_names == ("chat", "chat-v2")
    assert cfg.api_settings(cfg.served_model_names()).served_models == ["chat", "chat-v2"]
    env = {"SPECSERVE_SERVED_MODEL_NAME": "a, b c", "SPECSERVE_MODEL": "/m"}
    assert cfg_mod.from_args(None, environ=env).served_model_names() == ["a", "b", "c"]
    # unset, the model is served under --model as given, as vLLM does
    assert cfg_mod.from_args(None, environ={"SPECSERVE_MODEL": "/m"}).served_model_names() == ["/m"]
    assert cfg_mod.from_args(None, environ={}).served_model_names() == []


def _page(text: str) -> set[tuple[str, str]]:
    return {
        (s.name, s.labels["model_name"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "model_name" in s.labels
    }


def test_served_names_in_models_responses_and_metrics_and_a_stopped_workers_model_leaves(
    valkey, tiny_model_dir
):
    names = ("tiny-chat", "tiny")
    # claim timeout 0.4 s: heartbeats every 0.1 s, so the worker's word holds 0.2 s
    worker_cfg = {"served_model_names": names, "claim_timeout_s": 0.4}

    async def main():
        async with (
            service_stack(valkey.url, tiny_model_dir, prefix="names", **worker_cfg) as (worker, client),
            aiohttp.ClientSession() as http,
        ):
            runner = web.AppRunner(Api(client, worker.telemetry, ApiSettings()).app(), access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            base = f"http://127.0.0.1:{port}"
            try:
                async with http.get(f"{base}/v1/models") as r:
                    listed = (await r.json())["data"]
                assert [m["id"] for m in listed] == sorted(names)
                assert {m["root"] for m in listed} == {str(tiny_model_dir)}
                assert {m["max_model_len"] for m in listed} == {worker.engine.max_model_len}
                body = {"model": "tiny", "prompt": "one two", "max_tokens": 3, "temperature": 0}
                async with http.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["model"] == "tiny"
                # the file path is no longer a name the model answers to
                by_path = {**body, "model": str(tiny_model_dir)}
                async with http.post(f"{base}/v1/completions", json=by_path) as r:
                    assert r.status == 404 and (await r.json())["error"]["param"] == "model"
                await worker._refresh_stats()
                async with http.get(f"{base}/metrics") as r:
                    page = _page(await r.text())
                assert ("specserve:request_success_total", "tiny-chat") in page
                assert ("specserve:num_requests_running", "tiny-chat") in page
                assert {label for _, label in page} == {"tiny-chat"}

                await worker.drain(timeout=0)
                await worker.close()

                async def gone() -> bool:
                    async with http.get(f"{base}/v1/models") as r:
                        return (await r.json())["data"] == []

                await wait_for(gone, timeout=5, what="the stopped worker's model to leave /v1/models")
            finally:
                await runner.cleanup()

    run(main())
