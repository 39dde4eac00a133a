"""A private redis-server on a free port, started as compose and the docs start
Redis (the run's ACL file and TLS when given keys; AOF with appendfsync
always), for benchmarks, local tools and tests.

Uses a ``redis-server`` of Redis 7 or later built with TLS (Debian's package):
ACL selectors (read-only key patterns) and TLS need it.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from broker.errors import ConfigError, TransportError
from broker.identity.keys import REDIS_ACL, REDIS_SYNCER
from broker.identity.tls import TLS_CA, redis_server_tls_args
from broker.redis.users import SYNCER_USER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


REDIS_MAJOR = 7


@functools.cache
def redis_server_binary() -> str:
    """The first ``redis-server`` on PATH (or Debian's) of Redis 7 or later."""
    seen = []
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), "/usr/bin"]:
        candidate = Path(folder) / "redis-server"
        if not os.access(candidate, os.X_OK):
            continue
        out = subprocess.run([candidate, "--version"], capture_output=True, text=True).stdout
        version = out.partition(" v=")[2].split(" ")[0]
        seen.append(f"{candidate} ({version or 'unknown'})")
        if version.split(".")[0].isdigit() and int(version.split(".")[0]) >= REDIS_MAJOR:
            return str(candidate)
    raise ConfigError(
        f"this needs redis-server {REDIS_MAJOR} or later with TLS (Debian: apt-get "
        f"install redis-server); found: {', '.join(seen) or 'none'}"
    )


class RedisServer:
    """A redis-server process with AOF (appendfsync always) in its own folder."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        password: str | None = None,
        keys: Path | None = None,
        tls: bool = False,
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password
        self.keys = keys  # a run key folder: its ACL users (and its certificate for TLS)
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kw) -> redis.Redis:
        """A redis-py client of this server: with the run's keys as the syncers'
        user (TLS checked against the run's CA)."""
        if self.keys and self.tls:
            kw.setdefault("ssl_ca_certs", str(self.keys / TLS_CA))
        if self.keys:
            kw.setdefault("username", SYNCER_USER)
            kw.setdefault("password", (self.keys / REDIS_SYNCER).read_text().strip())
        return redis.Redis.from_url(self.url, **kw)

    def start(self, timeout_s: float = 15.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            assert self.keys is not None, "TLS needs the run's keys (its certificate)"
            listen = redis_server_tls_args(self.keys, self.port)
        else:
            listen = ["--port", str(self.port)]
        args = [
            redis_server_binary(),
            *listen,
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
        if self.keys:
            args += ["--aclfile", str(self.keys / REDIS_ACL)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client(socket_timeout=1)
        last_error: list[redis.RedisError] = []  # why the last PING failed

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise TransportError(f"redis-server exited; see {self.workdir / 'redis.log'}")
            try:
                return bool(client.ping())
            except redis.RedisError as e:  # not up yet: asked again until the deadline
                last_error[:] = [e]
                return False

        deadline = time.monotonic() + timeout_s
        while not up():
            if time.monotonic() > deadline:
                raise TransportError(
                    f"redis-server did not answer PING within {timeout_s} s "
                    f"({last_error[0] if last_error else 'no reply'})"
                )
            time.sleep(0.02)
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
