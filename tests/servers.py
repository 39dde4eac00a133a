"""Helpers of the integration tests: polling, taking globals, one key folder.

The Redis server they start is :class:`broker.redis.server.RedisServer`, the
one the benchmarks use.
"""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def take_globals(transport, timeout_s: float) -> list:
    """Poll a learner transport and accept every global, as a learner does once it
    has validated them (so that later versions compare with these)."""
    found = transport.poll(timeout_s)
    for g in found:
        transport.accepted(g)
    return found


@functools.cache
def run_keys() -> str:
    """One run key folder (``ddiloco keys``) for the tests' services, made once
    per test process: the services run with keys, as they do by default."""
    from broker.run.key_folder import make_keys

    return str(make_keys(Path(tempfile.mkdtemp(prefix="ddiloco-keys-")) / "keys"))
