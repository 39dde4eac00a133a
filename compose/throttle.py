"""``ddiloco throttle set|show|clear``: a WAN link for learners, with ``tc tbf``.

One rate limits a learner's link in both directions:

* upload: a token bucket filter (tbf) as the root qdisc of its interface;
* download: the interface's ingress traffic is redirected to an ``ifb``
  device whose root qdisc is a second tbf (tbf shapes only what leaves an
  interface; the ifb turns arriving traffic into leaving traffic).

The same commands run inside the learner's network namespace wherever it is:
a container (through ``docker exec`` as root; the compose file gives learners
NET_ADMIN and the image has iproute2), or a network namespace of a
``ddiloco local --netns`` run (through ``ip netns exec``, as root). Targets:
one container (``--container``), every learner container of a project
(the default), or every learner of a local run (``--local RUN_DIR``).

Rates are tc's: ``10mbit``, ``500kbit``, ``1gbit`` (bits per second, SI
prefixes) or ``2mbps`` (bytes per second). The bucket holds 20 ms at the rate
(at least 16 KiB) and a packet waits at most ``LATENCY_MS`` in the queue.
``netem`` (delay, loss) is not used: not every kernel has it.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.checks import require
from broker.errors import ConfigError, DdilocoError

IFB = "ifb-ddl"  # the ingress device created in each namespace
LATENCY_MS = 200
MIN_BURST_BYTES = 16 * 1024
NETNS_FILE = "netns.json"  # written by ddiloco local --netns: learner -> namespace, device

_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


def parse_rate(text: str) -> int:
    """Bits per second of a tc rate (``10mbit``, ``2mbps``); ValueError says what to write."""
    m = _RATE_RE.match(text.lower())
    if not m or m[2] not in _UNITS:
        raise ConfigError(
            f"rate={text!r}: give a number and one of {', '.join(_UNITS)}, e.g. 10mbit"
        )
    bits = int(float(m[1]) * _UNITS[m[2]])
    if bits < 8000:
        raise ConfigError(f"rate={text!r}: at least 8kbit")
    return bits


def burst_bytes(rate_bits: int) -> int:
    return max(MIN_BURST_BYTES, rate_bits // 8 // 50)


@dataclass
class ThrottleConfig:
    rate: str = ""  # set: the limit in each direction, e.g. 10mbit, 500kbit, 2mbps
    container: str | None = None  # one container, by name or id
    project: str = "ddiloco"  # else every learner container of this compose project or stack
    local: str | None = None  # else every learner of this ddiloco local --netns run folder

    def __post_init__(self) -> None:
        if self.rate:
            parse_rate(self.rate)
        require(
            not (self.container and self.local),
            "give --container or --local, not both",
        )


def set_commands(dev: str, rate_bits: int) -> list[list[str]]:
    """tc and ip commands that limit ``dev`` to ``rate_bits`` both ways (idempotent)."""
    tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst_bytes(rate_bits))]
    tbf += ["latency", f"{LATENCY_MS}ms"]
    return [
        ["tc", "qdisc", "replace", "dev", dev, "root", *tbf],
        ["sh", "-c", f"ip link show {IFB} >/dev/null 2>&1 || ip link add {IFB} type ifb"],
        ["ip", "link", "set", IFB, "up"],
        ["tc", "qdisc", "replace", "dev", IFB, "root", *tbf],
        ["sh", "-c", f"tc qdisc del dev {dev} ingress 2>/dev/null; true"],
        ["tc", "qdisc", "add", "dev", dev, "handle", "ffff:", "ingress"],
        f"tc filter add dev {dev} parent ffff: protocol all u32 match u32 0 0 "
        f"action mirred egress redirect dev {IFB}".split(),
    ]


def clear_commands(dev: str) -> list[list[str]]:
    """Remove every limit ``set_commands`` made; fine when there is none."""
    return [
        ["sh", "-c", f"tc qdisc del dev {dev} root 2>/dev/null; true"],
        ["sh", "-c", f"tc qdisc del dev {dev} ingress 2>/dev/null; true"],
        ["sh", "-c", f"ip link del {IFB} 2>/dev/null; true"],
    ]


def show_commands(dev: str) -> list[list[str]]:
    return [
        ["tc", "-j", "qdisc", "show", "dev", dev],
        ["sh", "-c", f"tc -j qdisc show dev {IFB} 2>/dev/null || echo []"],
    ]


def limits_of(up_json: str, down_json: str) -> dict[str, int | None]:
    """Bits per second each way from ``tc -j qdisc show`` of the device and the ifb."""

    def tbf_rate(text: str) -> int | None:
        for q in json.loads(text or "[]"):
            if q.get("kind") == "tbf" and q.get("root"):
                return int(q["options"]["rate"]) * 8  # tc reports bytes per second
        return None

    return {"up_bits": tbf_rate(up_json), "down_bits": tbf_rate(down_json)}


# -- where the commands run -------------------------------------------------------
Runner = Callable[[list[str]], str]  # runs one command in the target's namespace


@dataclass
class Link:
    name: str  # the learner or container
    dev: str  # its interface
    run: Runner


def _checked(args: list[str], what: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise DdilocoError(f"{what}: {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def local_links(folder: str) -> list[Link]:
    """The learners of a ``ddiloco local --netns`` run, each in its namespace."""
    path = Path(folder) / NETNS_FILE
    if not path.exists():
        raise ConfigError(f"{folder} has no {NETNS_FILE}: was it run with `ddiloco local --netns`?")
    learners: dict[str, dict[str, str]] = json.loads(path.read_text())
    links = []
    for name, where in sorted(learners.items()):

        def run(cmd: list[str], ns: str = where["netns"], name: str = name) -> str:
            return _checked(["ip", "netns", "exec", ns, *cmd], name)

        links.append(Link(name, where["dev"], run))
    return links


def container_links(container: str | None, project: str) -> list[Link]:
    """One container, or every learner container of a compose project or swarm stack."""
    import docker
    from docker.errors import DockerException, NotFound

    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except DockerException as e:
        raise ConfigError(
            f"no Docker engine answers ({e}): start one, or set DOCKER_HOST"
        ) from None
    if container:
        try:
            found = [client.containers.get(container)]
        except NotFound:
            raise ConfigError(f"no container {container!r}") from None
    else:
        found = []
        for label, service in (
            ("com.docker.compose.project", "com.docker.compose.service=learner"),
            ("com.docker.stack.namespace", f"com.docker.swarm.service.name={project}_learner"),
        ):
            found += client.containers.list(
                filters={"label": [f"{label}={project}", service]}, ignore_removed=True
            )
        if not found:
            raise ConfigError(f"no running learner container in project {project!r}")
    links = []
    for c in found:

        def run(cmd: list[str], c: Any = c) -> str:
            code, output = c.exec_run(cmd, user="root")
            text = output.decode(errors="replace")
            if code != 0:
                raise ConfigError(
                    f"{c.name}: {' '.join(cmd)} failed: {text.strip()} "
                    "(the container needs cap_add NET_ADMIN and iproute2)"
                )
            return text

        dev = _default_dev(run(["ip", "-j", "route", "show", "default"]))
        links.append(Link(c.name, dev, run))
    return links


def _default_dev(route_json: str) -> str:
    routes = json.loads(route_json or "[]")
    return str(routes[0]["dev"]) if routes else "eth0"


def links_of(cfg: ThrottleConfig) -> list[Link]:
    return local_links(cfg.local) if cfg.local else container_links(cfg.container, cfg.project)


def apply(action: str, cfg: ThrottleConfig) -> list[dict[str, Any]]:
    """Set, show or clear the limits of every target; one record per target."""
    if action == "set" and not cfg.rate:
        raise ConfigError("throttle set needs --rate, e.g. --rate 10mbit")
    records = []
    for link in links_of(cfg):
        if action == "set":
            for cmd in set_commands(link.dev, parse_rate(cfg.rate)):
                link.run(cmd)
        elif action == "clear":
            for cmd in clear_commands(link.dev):
                link.run(cmd)
        up, down = (link.run(cmd) for cmd in show_commands(link.dev))
        records.append({"target": link.name, "dev": link.dev, **limits_of(up, down)})
    return records
