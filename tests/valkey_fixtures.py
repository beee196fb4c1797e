"""Fixtures for the queue and service tests: real valkey-server processes and the shared tiny engine.

Load them in a test module with `pytest_plugins = ("valkey_fixtures",)` (conftest.py is the engine's);
helpers that are not fixtures live in valkey_helpers.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from valkey_helpers import TINY, TinyEngines

from specserve.queue.embedded import EmbeddedValkey


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[EmbeddedValkey]:
    """A private valkey-server on a free loopback port with AOF on, data in tmp_path."""
    server = EmbeddedValkey(tmp_path / "valkey").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiny_engines() -> TinyEngines:
    return TINY
