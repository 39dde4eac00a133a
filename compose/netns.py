"""Network namespaces for the learners of ``ddiloco local --netns``.

Each learner process runs in a namespace of its own, joined to this host by a
veth pair whose host end is on one bridge; the syncer binds the bridge's
address. Traffic between a learner and the syncer then crosses a real link
that ``ddiloco throttle --local RUN_DIR`` can limit with ``tc``, as a
container's would be, without Docker.

Addresses come from one free /24 of 10.200.0.0/13 (a /24 no interface of this
host uses); names carry a short random tag, so concurrent runs never collide.
Everything is removed by :meth:`LocalNetwork.close` (deleting a namespace
deletes its veth pair). Needs root.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from broker.errors import ConfigError, DdilocoError
from compose.throttle import NETNS_FILE


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise DdilocoError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def _used_prefixes() -> set[str]:
    """The first three octets of every IPv4 address on this host."""
    used = set()
    for iface in json.loads(_ip("-j", "addr") or "[]"):
        for a in iface.get("addr_info", []):
            if a.get("family") == "inet":
                used.add(a["local"].rsplit(".", 1)[0])
    return used


@dataclass
class LocalNetwork:
    """A bridge and one namespace per learner; build with :meth:`create`."""

    tag: str
    prefix: str  # the /24's first three octets
    namespaces: dict[str, str] = field(default_factory=dict)  # learner -> namespace

    @property
    def bridge(self) -> str:
        return f"ddl{self.tag}br"

    @property
    def host_address(self) -> str:
        """Where the syncer binds: the bridge's address."""
        return f"{self.prefix}.1"

    @classmethod
    def create(cls, learners: list[str], rng: random.Random | None = None) -> LocalNetwork:
        if os.geteuid() != 0:
            raise ConfigError("--netns needs root (network namespaces and veth pairs)")
        if len(learners) > 250:
            raise ConfigError("--netns: at most 250 learners (one /24)")
        rng = rng or random.Random()
        used = _used_prefixes()
        free = [f"10.{b}.{c}" for b in range(200, 208) for c in range(256)]
        free = [p for p in free if p not in used]
        net = cls(tag=f"{rng.randrange(16**4):04x}", prefix=rng.choice(free))
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.host_address}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
            for i, name in enumerate(learners):
                net._add(i, name)
        except BaseException:
            net.close()
            raise
        return net

    def _add(self, i: int, learner: str) -> None:
        ns, host_end, ns_end = f"ddl{self.tag}-{i}", f"ddl{self.tag}h{i}", f"ddl{self.tag}n{i}"
        _ip("netns", "add", ns)
        self.namespaces[learner] = ns
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", host_end, "master", self.bridge, "up")
        _ip("link", "set", ns_end, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{self.address(learner)}/24", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.host_address)

    def device(self, learner: str) -> str:
        return f"ddl{self.tag}n{self.namespaces[learner].rsplit('-', 1)[1]}"

    def address(self, learner: str) -> str:
        return f"{self.prefix}.{int(self.namespaces[learner].rsplit('-', 1)[1]) + 2}"

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes each learner's interface has sent and received (its counters:
        everything on the wire, protocol headers included)."""
        counts = {}
        for learner, ns in self.namespaces.items():
            (link,) = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", self.device(learner)))
            stats = link["stats64"]
            counts[learner] = {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]}
        return counts

    def command(self, learner: str, args: list[str]) -> list[str]:
        """``args`` run inside ``learner``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[learner], *args]

    def write(self, folder: Path) -> None:
        """The run folder's record of namespaces, for ``ddiloco throttle --local``."""
        record = {
            name: {"netns": ns, "dev": self.device(name)} for name, ns in self.namespaces.items()
        }
        (folder / NETNS_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def close(self) -> None:
        """Delete the namespaces (and with them the veth pairs) and the bridge."""
        for ns in self.namespaces.values():
            i = ns.rsplit("-", 1)[1]
            for args in (("link", "del", f"ddl{self.tag}h{i}"), ("netns", "del", ns)):
                with contextlib.suppress(RuntimeError):  # gone with the namespace, or never made
                    _ip(*args)
        self.namespaces.clear()
        with contextlib.suppress(RuntimeError):  # not created
            _ip("link", "del", self.bridge)
