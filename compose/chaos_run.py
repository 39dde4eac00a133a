"""``ddiloco chaos``: crash learner, syncer or Redis containers (or the processes
of a ``ddiloco local`` run) on a seeded Poisson schedule.

A crash is a SIGKILL of the target's main process: no handler runs, nothing
is flushed, as in a real crash. Who brings it back:

* a container of docker compose: chaos itself, ``restart_s`` later (the engine
  applies no restart policy to a container it was told to kill);
* a task of a swarm service: the swarm, which replaces the failed task;
* a process of ``ddiloco local``: its launcher, after its own ``--restart-s``.
  Chaos records each kill in the run folder's ``chaos.jsonl`` before it
  strikes, so the launcher counts the death as a chaos kill, not a crash.

With ``--lose-state`` a syncer's crash is the loss of its host: its
checkpoint folder is deleted right after the kill, before it comes back (a
container's shard folder in the checkpoint volume, through a throwaway
container of its image; a local syncer's ``checkpoint/``); so is a Redis
server's data folder (``/data``).

Target ``redis-primary`` (compose.sentinel.yaml) crashes whichever Redis
server is the primary now (it answers ROLE ``master``); ``redis`` either server.

Every kill, restart and refusal is one JSON line on stdout (and appended to
``--events``). Crashes arrive as a Poisson process with mean gap ``mtbf_s``;
each picks one running target uniformly. The schedule is pure
(:class:`CrashSchedule`), so a seed gives the same sequence of decisions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from broker.checks import check_choice, check_int, check_positive, require
from broker.errors import ConfigError, DdilocoError
from broker.identity.keys import REDIS_SENTINEL
from broker.identity.tls import TLS_CA
from broker.redis.users import SENTINEL_USER

log = logging.getLogger(__name__)

ROLES = ("learner", "syncer", "redis")
PRIMARY = "redis-primary"  # the Redis server that is the primary now
TARGETS = (*ROLES, PRIMARY, "any")
REDIS_SERVICES = ("redis", "redis-replica")  # compose.sentinel.yaml's two servers
PROCESSES_FILE = "processes.json"  # written by the ddiloco local launcher: name -> pid
CHAOS_FILE = "chaos.jsonl"  # the kills chaos made in a local run folder
_POLL_S = 0.2


@dataclass
class ChaosConfig:
    target: str = "learner"  # what crashes: learner, syncer, redis, redis-primary or any
    mtbf_s: float = 60.0  # mean seconds between crashes (Poisson, over all targets)
    restart_s: float = 10.0  # a killed compose container is started again after this
    duration_s: float = 300.0  # stop after this many seconds; 0: until interrupted
    max_kills: int = 0  # stop after this many crashes; 0: no limit
    seed: int = 0  # the schedule's random seed
    project: str = "ddiloco"  # the compose project or swarm stack whose containers crash
    local: str | None = None  # a ddiloco local run folder: crash its processes instead
    events: str | None = None  # also append the JSON events to this file
    # A syncer's or Redis server's crash takes its host's disk too: its checkpoint
    # or data folder is deleted before it comes back (a syncer then rebuilds
    # from Redis, docs/design.md; a server syncs from the primary).
    lose_state: bool = False

    def __post_init__(self) -> None:
        check_choice("target", self.target, TARGETS)
        check_positive("mtbf_s", self.mtbf_s)
        for name in ("restart_s", "duration_s"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_int("max_kills", self.max_kills, minimum=0)
        require(type(self.seed) is int, f"seed={self.seed!r}: must be an integer")
        require(bool(self.project), "project: name the compose project or swarm stack")


class CrashSchedule:
    """When the next crash is due and which target it hits; times in the caller's clock."""

    def __init__(self, mtbf_s: float, seed: int, start: float) -> None:
        self.mtbf_s = mtbf_s
        self.rng = random.Random(seed)
        self.next_at = start + self.rng.expovariate(1.0 / mtbf_s)

    def due(self, now: float, candidates: list[str]) -> str | None:
        """The target to crash now (one of ``candidates``), or None. A crash that
        falls due while no target is up is spent: the next gap starts now."""
        if now < self.next_at:
            return None
        self.next_at = now + self.rng.expovariate(1.0 / self.mtbf_s)
        if not candidates:
            return None
        return self.rng.choice(sorted(candidates))


class EventLog:
    """JSON lines on stdout (unless ``echo`` is False) and, optionally, appended to a file."""

    def __init__(self, path: str | None, echo: bool = True) -> None:
        self.path = Path(path) if path else None
        self.echo = echo
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time(), "event": event, **fields}
        line = json.dumps(record)
        if self.echo:
            print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        return record


class Targets(Protocol):
    def running(self, roles: tuple[str, ...]) -> dict[str, str]:
        """name -> role of every target that is up now."""

    def kill(self, name: str, lose_state: bool) -> dict[str, Any]:
        """SIGKILL ``name``'s main process (and, ``lose_state``, delete a syncer's
        checkpoint folder or a Redis server's data); what to record about it."""

    def restart(self, name: str) -> str | None:
        """Bring ``name`` back if chaos is the one to; who does (for the log)."""


class LocalTargets:
    """The processes of a ``ddiloco local`` run, found through its processes.json."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        if not (self.folder / PROCESSES_FILE).exists():
            raise ConfigError(
                f"{self.folder} has no {PROCESSES_FILE}: is `ddiloco local --out {folder}` running?"
            )
        self.record = EventLog(str(self.folder / CHAOS_FILE), echo=False)

    @staticmethod
    def role(name: str) -> str:
        return "learner" if name.startswith("learner-") else name

    def _pids(self) -> dict[str, int]:
        try:
            pids = json.loads((self.folder / PROCESSES_FILE).read_text())
            return {name: int(pid) for name, pid in pids.items()}
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                # A pid of the launcher's, not one the system reused.
                return b"compose.cli" in f.read()
        except OSError:
            return False

    def running(self, roles: tuple[str, ...]) -> dict[str, str]:
        return {
            name: self.role(name)
            for name, pid in self._pids().items()
            if self.role(name) in roles and self._alive(pid)
        }

    def kill(self, name: str, lose_state: bool) -> dict[str, Any]:
        pid = self._pids()[name]
        # Recorded first: the launcher must find it when it sees the death.
        self.record.write("kill", process=name, pid=pid, reason="chaos")
        # If it died in between, the record stands: the launcher restarts it anyway.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        record: dict[str, Any] = {"process": name, "pid": pid, "role": self.role(name)}
        if lose_state and self.role(name) == "syncer":
            # Gone before the launcher's restart (--restart-s later).
            shutil.rmtree(self.folder / "checkpoint", ignore_errors=True)
            record["lost_state"] = str(self.folder / "checkpoint")
        return record

    def restart(self, name: str) -> str | None:
        return "launcher"


class DockerTargets:
    """The containers of one compose project or swarm stack, through the Docker SDK."""

    def __init__(self, project: str) -> None:
        import docker
        from docker.errors import DockerException

        try:
            self.client = docker.from_env(timeout=30)
            self.client.ping()
        except DockerException as e:
            host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
            raise ConfigError(
                f"no Docker engine answers at {host} ({e}): start one, or set DOCKER_HOST"
            ) from None
        self.project = project

    def _containers(self) -> list[Any]:
        found = []
        for label in ("com.docker.compose.project", "com.docker.stack.namespace"):
            # A container removed between the listing and its inspection (a kill,
            # a swarm replacing a task) is left out, not an error.
            found += self.client.containers.list(
                filters={"label": f"{label}={self.project}"}, ignore_removed=True
            )
        return found

    def role(self, container: Any) -> str | None:
        labels = container.labels
        service = labels.get("com.docker.compose.service") or labels.get(
            "com.docker.swarm.service.name", ""
        ).removeprefix(f"{self.project}_")
        if service in REDIS_SERVICES:
            return "redis"
        return service if service in ROLES else None

    def running(self, roles: tuple[str, ...]) -> dict[str, str]:
        out = {}
        for c in self._containers():
            role = self.role(c)
            if role in roles:
                out[c.name] = role
            elif PRIMARY in roles and role == "redis" and self._is_primary(c):
                out[c.name] = PRIMARY
        return out

    @staticmethod
    def _is_primary(c: Any) -> bool:
        """Whether Redis server ``c`` answers ROLE as the primary (asked as the
        servers' user, whose password the sentinel profile gives it)."""
        ask = (
            f"redis-cli --tls --cacert /tls/{TLS_CA} --user {SENTINEL_USER} "
            f'--pass "$(cat /tls/{REDIS_SENTINEL})" --no-auth-warning --raw ROLE | head -n 1'
        )
        code, out = c.exec_run(["sh", "-c", ask], user="redis")
        return code == 0 and out.decode(errors="replace").strip() == "master"

    def kill(self, name: str, lose_state: bool) -> dict[str, Any]:
        c = self.client.containers.get(name)
        c.kill(signal="SIGKILL")
        record = {
            "container": name,
            "container_id": c.id[:12],
            "hostname": c.attrs["Config"]["Hostname"],
            "role": self.role(c),
        }
        if lose_state and record["role"] == "syncer":
            record["lost_state"] = self._delete(c, self._checkpoint_folder(c))
        elif lose_state and record["role"] == "redis":
            record["lost_state"] = self._delete(c, "/data")
        return record

    def _delete(self, c: Any, folder: str) -> str:
        """Delete what the dead container ``c`` holds in ``folder`` (of a volume),
        from a throwaway container of its image with its volumes; the folder."""
        self.client.containers.run(
            c.image.id, entrypoint=["sh", "-c", f'rm -rf "{folder}"/* "{folder}"/.lock'],
            volumes_from=[c.id], user="0", remove=True, network_mode="none",
        )  # fmt: skip
        return folder

    def _checkpoint_folder(self, c: Any) -> str:
        """The dead syncer container ``c``'s shard folder of its checkpoint volume
        (shared with the other shards' replicas)."""
        # An entry without "=" is a variable passed through unset.
        env = dict(e.partition("=")[::2] for e in c.attrs["Config"]["Env"] or [])
        folder = env.get("DDILOCO_CHECKPOINT_DIR") or "syncer-checkpoint"
        logs = c.logs(stdout=True, stderr=True).decode(errors="replace")
        # run_syncer's first line names its shard: "syncer ID, shard S of N, ..."
        found = re.findall(r"shard (\d+) of (\d+), owns fragments", logs)
        if found and int(found[-1][1]) > 1:
            folder = f"{folder}/shard-{found[-1][0]}"
        return folder

    def restart(self, name: str) -> str | None:
        from docker.errors import NotFound

        try:
            c = self.client.containers.get(name)
        except NotFound:
            return None  # removed meanwhile (compose down, a replaced swarm task)
        if "com.docker.swarm.task.id" in c.labels:
            return "swarm"  # the swarm replaces the task with a new container
        c.reload()
        if c.status == "running":
            return "engine"
        c.start()
        return "chaos"


def run_chaos(cfg: ChaosConfig) -> int:
    log_ = EventLog(cfg.events)
    roles = ROLES if cfg.target == "any" else (cfg.target,)
    targets: Targets
    try:
        targets = LocalTargets(cfg.local) if cfg.local else DockerTargets(cfg.project)
    except DdilocoError as e:
        log_.write("refused", reason=str(e))
        return 2
    if not targets.running(roles):
        where = cfg.local or f"project {cfg.project}"
        log_.write("refused", reason=f"no running {'/'.join(roles)} target in {where}")
        return 2
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    start = time.monotonic()
    schedule = CrashSchedule(cfg.mtbf_s, cfg.seed, start)
    log_.write("start", **{k: v for k, v in vars(cfg).items() if k != "events"})
    # name -> when to bring it back, and what its kill recorded (role, host name)
    restarts: dict[str, tuple[float, dict[str, Any]]] = {}
    kills = 0

    def finished(now: float) -> bool:
        return (
            stop["now"]
            or (cfg.duration_s > 0 and now - start >= cfg.duration_s)
            or (cfg.max_kills > 0 and kills >= cfg.max_kills)
        )

    while True:
        now = time.monotonic()
        for name, (at, killed) in list(restarts.items()):
            if now >= at or stop["now"]:  # stopped: leave nothing down
                del restarts[name]
                by = targets.restart(name)
                if by is not None:
                    # The kill's role and host name: the reporter maps a restart
                    # to its learner as it maps the kill.
                    same = {k: killed[k] for k in ("role", "hostname") if k in killed}
                    log_.write("restart", target=name, by=by, **same)
        if finished(now):
            if not restarts:
                break
        else:
            up = targets.running(roles)
            victim = schedule.due(now, [n for n in up if n not in restarts])
            if victim is not None:
                record = targets.kill(victim, cfg.lose_state)
                kills += 1
                log_.write("kill", target=victim, signal="SIGKILL", **record)
                restarts[victim] = (now + cfg.restart_s, record)
        time.sleep(_POLL_S)
    log_.write("end", kills=kills, seconds=round(time.monotonic() - start, 1))
    return 0
