"""`specserve serve | worker | api | enqueue | status`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from contextlib import aclosing
from typing import Any, TypeVar

import orjson

from specserve.queue.wire import FINISHED
from specserve.service import config as config_mod

CONNECTION = {"redis_url", "prefix", "data_dir", "result_ttl"}


def version() -> str:
    """The installed distribution's version; the package's own where it runs from a tree not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("specserve")
    except PackageNotFoundError:
        import specserve

        return specserve.__version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve", description="Queue-native LLM serving over Redis Streams")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="embedded Redis (unless REDIS_URL) + worker + API, one process")
    config_mod.add_arguments(serve)
    worker = sub.add_parser("worker", help="pull requests from Redis and run them on the engine")
    config_mod.add_arguments(worker, only=config_mod.read_by("worker"))
    api = sub.add_parser("api", help="the HTTP API alone (no engine)")
    config_mod.add_arguments(api, only=config_mod.read_by("api"))

    enq = sub.add_parser("enqueue", help="add a request; print its id (or its result with --wait)")
    config_mod.add_arguments(enq, only=CONNECTION)
    enq.add_argument("prompt", nargs="?", help="prompt text")
    enq.add_argument("--messages", help="chat messages as JSON instead of a prompt")
    enq.add_argument("--body", help="the whole request body as JSON")
    enq.add_argument("--id", help="request id (enqueue is idempotent by id)")
    enq.add_argument("--model")
    enq.add_argument("--max-tokens", type=int)
    enq.add_argument("--temperature", type=float)
    enq.add_argument("--top-p", type=float)
    enq.add_argument("--top-k", type=int)
    enq.add_argument("--seed", type=int)
    enq.add_argument("--stop", action="append")
    enq.add_argument("--ignore-eos", action="store_true", default=None)
    enq.add_argument("--speculation", help='"auto", "off" or a number of draft tokens')
    enq.add_argument("--timeout", type=float, help="seconds before the request expires unstarted")
    how = enq.add_mutually_exclusive_group()
    how.add_argument("--wait", action="store_true", help="wait and print the result as JSON")
    how.add_argument("--stream", action="store_true", help="print the text as it is generated")

    st = sub.add_parser("status", help="print a request's status and result as JSON")
    config_mod.add_arguments(st, only=CONNECTION)
    st.add_argument("id")
    st.add_argument("--wait", action="store_true", help="wait until it ends")
    models = sub.add_parser(
        "models", help="list the model architectures and GGUF tensor types this engine reads, or describe one"
    )
    models.add_argument(
        "model", nargs="?", help="HF model dir or .gguf file: its architecture, context and chat template"
    )
    return p


def _describe(model: str) -> int:
    """One model, from its config and tokenizer (no weights read)."""
    from specserve.models.config import ModelConfig
    from specserve.models.loader import load_tokenizer, read_config

    header = ModelConfig.from_hf(read_config(model))
    has_template = load_tokenizer(model).chat_template is not None
    template = "yes" if has_template else "none (chat requests are refused; pass --chat-template to chat)"
    sys.stdout.write(
        f"model: {model}\nmodel_type: {header.model_type}\n"
        f"context: {header.max_position_embeddings} tokens\nchat template: {template}\n"
    )
    return 0


def _models() -> int:
    from specserve.models.config import ARCHITECTURES, FAMILIES
    from specserve.models.loader import GGUF_ARCHITECTURES, GGUF_QUANT_TYPES

    gguf = {model_type: arch for arch, (model_type, _) in GGUF_ARCHITECTURES.items()}
    rows = [("architecture", "model_type", "GGUF", "what differs from Llama")]
    for arch, model_type in sorted(ARCHITECTURES.items()):
        fam = FAMILIES[model_type]
        notes = [name for name, on in vars(fam).items() if on] or ["-"]
        rows.append((arch, model_type, gguf.get(model_type, "-"), ", ".join(notes)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3] + "\n")
    sys.stdout.write(f"\nGGUF tensor types read: {' '.join(GGUF_QUANT_TYPES)}\n")
    return 0


def _deadline(timeout: float) -> float:
    """--timeout follows the API's rule for `timeout` (a number of seconds in (0, 30 days])."""
    from specserve.service.gateway import deadline_after
    from specserve.service.http import ApiError

    try:
        return deadline_after(timeout)
    except ApiError as e:
        raise SystemExit(f"error: --{e.message}") from None


def _body(ns: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = orjson.loads(ns.body) if ns.body else {}
    if ns.prompt is not None:
        body["prompt"] = ns.prompt
    if ns.messages:
        body["messages"] = orjson.loads(ns.messages)
    spec = ns.speculation
    fields = {
        "model": ns.model,
        "max_tokens": ns.max_tokens,
        "temperature": ns.temperature,
        "top_p": ns.top_p,
        "top_k": ns.top_k,
        "seed": ns.seed,
        "stop": ns.stop,
        "ignore_eos": ns.ignore_eos,
        "speculation": int(spec) if spec is not None and spec.isdigit() else spec,
        "deadline": _deadline(ns.timeout) if ns.timeout is not None else None,
    }
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


async def _client(cfg: config_mod.ServiceConfig):
    from specserve.queue.client import QueueClient
    from specserve.queue.connection import open_redis
    from specserve.service.launch import resolve_redis

    url, _ = await resolve_redis(cfg, start_embedded=False)
    return QueueClient(
        await open_redis(url, cfg.seed_nodes()),
        cfg.queue_keys(),
        ttl_ms=int(cfg.result_ttl * 1000),
        durable=cfg.durability(),
    )


def _print(data: Any) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


async def _enqueue(ns: argparse.Namespace, cfg: config_mod.ServiceConfig) -> int:
    from redis.exceptions import OutOfMemoryError

    from specserve.queue.wire import WireError

    async with await _client(cfg) as client:
        try:
            added = await client.enqueue(_body(ns), ns.id)
        except WireError as e:
            sys.stderr.write(f"error: {e}\n")
            return 2
        except OutOfMemoryError:
            sys.stderr.write(
                "error: Redis is out of memory (maxmemory reached); nothing was queued, retry later\n"
            )
            return 3
        if ns.stream:
            async with aclosing(client.stream(added.id)) as deltas:
                async for d in deltas:
                    sys.stdout.write(d.text)
                    sys.stdout.flush()
                    if d.final is not None and d.final.status != FINISHED:
                        sys.stderr.write(f"\n{d.final.status}: {d.final.error or d.final.finish_reason}\n")
                        return 1
            sys.stdout.write("\n")
        elif ns.wait:
            result = await client.wait(added.id)
            _print(result.to_dict())
            return _exit_code(result.status)
        else:
            _print({"id": added.id, "status": added.status, "created": added.created})
    return 0


async def _status(ns: argparse.Namespace, cfg: config_mod.ServiceConfig) -> int:
    async with await _client(cfg) as client:
        result = await client.wait(ns.id) if ns.wait else await client.result(ns.id)
        if result is None:
            sys.stderr.write(f"no request {ns.id!r}\n")
            return 1
        _print(result.to_dict())
    return _exit_code(result.status) if ns.wait else 0


def _exit_code(status: str) -> int:
    """A script that waits for a request learns from the exit code whether it produced its output."""
    return 0 if status == FINISHED else 1


T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """The service's event loop: uvloop where it installs (a Redis or HTTP round trip costs about half the
    Python of asyncio's loop), asyncio's own elsewhere."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, ns.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg = config_mod.from_args(ns)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if ns.command == "models":
        try:
            return _describe(ns.model) if ns.model else _models()
        except (ValueError, OSError) as e:  # the model: one line, not a traceback
            sys.stderr.write(f"error: {e}\n")
            return 2
    if ns.command in ("serve", "worker", "api"):
        from specserve.engine.cpu_tuning import default_wait_policy

        default_wait_policy()  # before anything loads torch, and libgomp with it
        from specserve.models.config import UnsupportedModel
        from specserve.service.launch import run

        if ns.command != "api":
            from specserve.engine.config import EngineConfig
            from specserve.engine.preflight import preflight

            try:  # the settings against the model's config and the machine, before a weight is read
                preflight(EngineConfig.from_kwargs(**cfg.engine_kwargs()))
            except (ValueError, OSError) as e:
                sys.stderr.write(f"error: {e}\n")
                return 2
        try:
            run_loop(run(cfg, with_api=ns.command != "worker", with_worker=ns.command != "api"))
        except (UnsupportedModel, FileNotFoundError) as e:  # the model: one line, not a traceback
            sys.stderr.write(f"error: {e}\n")
            return 2
        return 0
    if ns.command == "enqueue":
        return run_loop(_enqueue(ns, cfg))
    return run_loop(_status(ns, cfg))


if __name__ == "__main__":
    sys.exit(main())
