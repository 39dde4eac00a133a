from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from broker.redis.server import RedisServer

torch.set_num_threads(1)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis on a free port, killed after the test."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()
