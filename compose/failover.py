"""A Redis that fails over, as compose/compose.sentinel.yaml runs it, on this
host's loopback: a primary and a replica, each started by compose/redis-node.sh
(the script the compose file runs), and three Sentinels with the configuration
`ddiloco keys sentinel` writes, with the run's keys and TLS. For tests and
benchmarks (python -m benchmarks.failover)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from broker.errors import TransportError
from broker.identity.keys import REDIS_SENTINEL
from broker.identity.tls import TLS_CA
from broker.redis.link import Failed, transient_call
from broker.redis.sentinel import DEFAULT_SERVICE, sentinel_conf
from broker.redis.server import free_port, redis_server_binary
from broker.redis.users import SENTINEL_USER

REDIS_NODE = Path(__file__).resolve().parent / "redis-node.sh"


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TransportError(f"no {what} within {timeout_s} s")
        time.sleep(0.1)


class FailoverRedis:
    """Servers ``a`` (the first primary) and ``b``, and three Sentinels."""

    def __init__(self, workdir: Path, keys: Path) -> None:
        self.workdir = workdir
        self.keys = keys
        self.ports = {"a": free_port(), "b": free_port()}
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.sentinels: list[subprocess.Popen[bytes]] = []
        self._password = (keys / REDIS_SENTINEL).read_text().strip()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"rediss+sentinel://{hosts}/{DEFAULT_SERVICE}/0"

    def node_dir(self, name: str) -> Path:
        return self.workdir / name

    def start(self) -> None:
        """The servers first, then the Sentinels: their first look at the
        primary finds its replica (they look again only every 10 s)."""
        self.start_node("a")
        self.start_node("b")
        _wait(lambda: self.replica_in_sync("b"), 30, "replica in sync")
        for i, port in enumerate(self.sentinel_ports):
            folder = self.workdir / f"sentinel-{i}"
            folder.mkdir(parents=True)
            conf = sentinel_conf(self.keys, ("127.0.0.1", self.ports["a"]), port)
            conf += f"bind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
            (folder / "sentinel.conf").write_text(conf)
            args = [redis_server_binary(), str(folder / "sentinel.conf"), "--sentinel"]
            self.sentinels.append(subprocess.Popen(args))
        self.wait_settled()

    def start_node(self, name: str) -> None:
        """Start server ``name`` with compose's script, on its port and folder."""
        folder = self.node_dir(name)
        folder.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PATH": f"{Path(redis_server_binary()).parent}{os.pathsep}{os.environ['PATH']}",
            "DDILOCO_REDIS_NODE": f"127.0.0.1:{self.ports[name]}",
            "DDILOCO_REDIS_PRIMARY": f"127.0.0.1:{self.ports['a']}",
            "DDILOCO_SENTINELS": ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports),
            "DDILOCO_REDIS_FILES": str(self.keys),
            "DDILOCO_REDIS_DATA": str(folder),
        }
        log = open(folder / "node.log", "ab")  # noqa: SIM115 (the child holds it)
        self.nodes[name] = subprocess.Popen(
            ["sh", str(REDIS_NODE), "--bind", "127.0.0.1", "--logfile", str(folder / "redis.log")],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip

    def client(self, name: str) -> redis.Redis:
        """Server ``name`` as the servers' user."""
        return self._as_servers(self.ports[name])

    def sentinel(self, i: int) -> redis.Redis:
        return self._as_servers(self.sentinel_ports[i])

    def _as_servers(self, port: int) -> redis.Redis:
        return redis.Redis(
            port=port, username=SENTINEL_USER, password=self._password,
            ssl=True, ssl_ca_certs=str(self.keys / TLS_CA), socket_timeout=2,
        )  # fmt: skip

    def primary(self) -> str | None:
        """The server every Sentinel names the primary, if they agree."""
        named = set()
        for i in range(len(self.sentinel_ports)):
            ask = functools.partial(
                self.sentinel(i).sentinel_get_master_addr_by_name, DEFAULT_SERVICE
            )
            address = transient_call(ask)
            if not isinstance(address, tuple):  # down, or none known
                return None
            named.add(int(address[1]))
        found = [n for n, p in self.ports.items() if {p} == named]
        return found[0] if found else None

    def replica_in_sync(self, name: str) -> bool:
        client = self.client(name)
        info = transient_call(lambda: client.info("replication"))
        if isinstance(info, Failed):  # down or loading
            return False
        return info.get("role") == "slave" and info.get("master_link_status") == "up"

    def wait_settled(self, timeout_s: float = 60) -> str:
        """Until the Sentinels agree on a primary whose replica is in sync and
        known to every Sentinel; the primary's name."""

        def settled() -> bool:
            primary = self.primary()
            if primary is None:
                return False
            other = next(n for n in self.ports if n != primary)
            if not self.replica_in_sync(other):
                return False
            return all(
                len(self.sentinel(i).execute_command("SENTINEL", "REPLICAS", DEFAULT_SERVICE)) > 0
                for i in range(len(self.sentinel_ports))
            )

        _wait(settled, timeout_s, "primary with a replica in sync")
        primary = self.primary()
        assert primary is not None
        return primary

    def kill(self, name: str, lose_data: bool = False) -> None:
        """SIGKILL server ``name`` (its script exec'd redis-server); with
        ``lose_data`` its folder goes too, as with a lost host."""
        proc = self.nodes[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if lose_data:
            shutil.rmtree(self.node_dir(name))

    def stop(self) -> None:
        for proc in [*self.nodes.values(), *self.sentinels]:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
