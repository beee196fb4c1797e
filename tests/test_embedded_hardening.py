"""The embedded valkey-server's data at rest and its memory cap: the AOF holds every prompt, so
its folder is the owner's alone, and a full server refuses writes instead of evicting queued work."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import redis
from valkey_helpers import run, spawn_cli

from specserve.queue.embedded import EmbeddedValkey
from specserve.service.config import ServiceConfig
from specserve.service.launch import URL_FILE, resolve_redis

pytest_plugins = ("valkey_fixtures",)


def _modes(root: Path) -> dict[str, int]:
    modes = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        modes[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return modes


def test_data_folder_and_files_are_the_owners_alone(tmp_path: Path) -> None:
    data = tmp_path / "valkey"
    # What an older version left: a world-readable folder and files.
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "old.aof").write_text("*1\r\n$4\r\nPING\r\n")
    (data / "old.aof").chmod(0o644)
    old_umask = os.umask(0o022)  # a typical login umask: the server's own files must not inherit it
    try:
        with EmbeddedValkey(data) as server:
            client = redis.Redis.from_url(server.url)
            client.xadd("specserve:requests", {"id": "r1", "body": '{"prompt": "a secret prompt"}'})
            client.execute_command("BGREWRITEAOF")  # new AOF files, written by the server itself
            while client.info("persistence")["aof_rewrite_in_progress"]:
                time.sleep(0.01)
            client.close()
            modes = _modes(data)
    finally:
        os.umask(old_umask)
    assert any(name.startswith("appendonlydir/") for name in modes), modes  # the AOF is there
    assert "valkey.log" in modes
    for name, mode in modes.items():
        is_dir = name == "." or (data / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))


def test_memory_is_capped_and_never_evicted(tmp_path: Path) -> None:
    with EmbeddedValkey(tmp_path / "v", maxmemory="3mb") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("maxmemory")["maxmemory"] == str(3 * 1024 * 1024)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.xadd("specserve:requests", {"id": "queued-first", "body": "{}"})
        refused = None
        for i in range(10_000):
            try:
                client.set(f"filler:{i}", "x" * 4096)
            except redis.exceptions.OutOfMemoryError as e:
                refused = e
                break
        assert refused is not None  # full: writes are refused...
        assert client.xlen("specserve:requests") == 1  # ...and nothing queued was evicted to make room
        client.close()


def test_serve_starts_the_embedded_server_with_the_configured_cap(tmp_path: Path) -> None:
    cfg = ServiceConfig(data_dir=str(tmp_path / "data"), embedded_maxmemory="64mb")

    async def main() -> tuple[str, EmbeddedValkey | None]:
        return await resolve_redis(cfg, start_embedded=True)

    url, server = run(main())
    assert server is not None
    try:
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.config_get("maxmemory")["maxmemory"] == str(64 * 1024 * 1024)
        client.close()
        assert stat.S_IMODE((tmp_path / "data" / URL_FILE).stat().st_mode) == 0o600  # it holds the password
        assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700
    finally:
        asyncio.run(asyncio.to_thread(server.stop))


def test_the_cli_says_plainly_that_redis_is_full(valkey, tmp_path: Path) -> None:
    client = redis.Redis.from_url(valkey.url)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 256 * 1024)
    try:
        for i in range(10_000):
            client.set(f"filler:{i}", "x" * 4096)
    except redis.exceptions.OutOfMemoryError:
        pass
    log = tmp_path / "enqueue.log"
    proc = spawn_cli(["enqueue", "hello", "--id", "full-1"], {"REDIS_URL": valkey.url}, log)
    assert proc.wait(60) == 3
    out = log.read_text()
    assert "Redis is out of memory" in out and "Traceback" not in out
    assert not client.exists("specserve:req:full-1")
    client.close()
