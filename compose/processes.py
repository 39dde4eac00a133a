"""Local child processes: start, kill, wait for ``ready``, tail their metrics, supervise.

Every start, kill, crash, restart and clean exit is appended to an events list
(the launcher's ``launcher.jsonl``), which ``compose.report`` reads to draw the
timeline and count kills and downtime.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from broker.errors import DdilocoError, TransportError
from broker.runtime import LAUNCHER_ENV
from learner.startup import STANDBY_ENV

MAX_CRASHES = 5  # a process that dies on its own more often than this ends the run


def free_port_pair() -> int:
    """A free port whose successor is free too (ROUTER on port, PUB on port + 1)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise TransportError("no free pair of ports on loopback")


class JsonlTail:
    """Read the complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        events = []
        for line in data[:end].splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return events


@dataclass
class Proc:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    log_file: IO[bytes] | None = None
    done: bool = False
    killed_by_us: bool = False
    restart_at: float | None = None
    kills: int = 0
    restarts: int = 0
    crashes: int = 0
    warm_spare: bool = False  # keep a spare process, imports done, to start from
    spare: subprocess.Popen[bytes] | None = None

    def _spawn(self, standby: bool) -> subprocess.Popen[bytes]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env, LAUNCHER_ENV: str(os.getpid())}
        if standby:
            env[STANDBY_ENV] = "1"
        return subprocess.Popen(
            self.args,
            stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            env=env,
            start_new_session=True,
        )

    def _take_spare(self) -> subprocess.Popen[bytes] | None:
        """The spare, told to go on as this process (with this process's environment
        now, e.g. a new rendezvous port), or None if it is gone."""
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        try:
            spare.stdin.write(json.dumps(self.env).encode() + b"\n")
            spare.stdin.close()
        except BrokenPipeError:
            return None
        return spare

    def start(self, events: list[dict[str, Any]]) -> None:
        """Start the process: in its warm spare if it has one (the spare's interpreter
        and imports are done), else fresh; then, with ``warm_spare``, the next spare."""
        self.close_files()
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115
        spare = self._take_spare()
        self.popen = spare or self._spawn(standby=False)
        if self.warm_spare:
            self.spare = self._spawn(standby=True)
        self.killed_by_us = False
        self.restart_at = None
        events.append(
            {"t": time.time(), "event": "process_start", "process": self.name, "warm": bool(spare)}
        )

    def close_spare(self) -> None:
        if self.spare is not None and self.spare.poll() is None:
            self.spare.kill()
            self.spare.wait(timeout=30)
        self.spare = None

    def close_files(self) -> None:
        if self.log_file:
            self.log_file.close()
        if self.popen and self.popen.stdout:
            self.popen.stdout.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, events: list[dict[str, Any]], reason: str) -> None:
        if self.alive():
            assert self.popen is not None
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
            self.killed_by_us = True
            self.kills += 1
            events.append(
                {"t": time.time(), "event": "process_kill", "process": self.name, "reason": reason}
            )

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for the process to print its ``ready`` line."""
        assert self.popen is not None and self.popen.stdout is not None
        deadline = time.monotonic() + timeout_s
        os.set_blocking(self.popen.stdout.fileno(), False)
        buf = b""
        while time.monotonic() < deadline:
            chunk = self.popen.stdout.read()
            if chunk:
                buf += chunk
                if b"ready" in buf:
                    return
            if self.popen.poll() is not None:
                raise DdilocoError(f"{self.name} exited at start; see {self.log_path}")
            time.sleep(0.05)
        raise DdilocoError(f"{self.name} not ready within {timeout_s}s; see {self.log_path}")


class Supervisor:
    """Restart what died, count crashes, and mark workers that finished.

    Workers (learners) run to completion: exit code 0 means finished. Services
    (the syncer) run until the launcher stops them, so any exit of theirs is a
    failure. A process we killed restarts after ``restart_s`` without counting
    as a crash, and so does one that ``ddiloco chaos`` killed (its pid is in
    ``external_kills``): that is a chaos kill too. One that died on its own
    counts as a crash, and ends the run past ``MAX_CRASHES`` or at once when
    ``crash_is_fatal`` (data parallel: a gloo group cannot take a member back).
    """

    def __init__(
        self,
        workers: list[Proc],
        services: list[Proc],
        events: list[dict[str, Any]],
        restart_s: float,
        crash_is_fatal: bool,
        console: Console,
    ) -> None:
        self.workers = workers
        self.services = services
        self.events = events
        self.restart_s = restart_s
        self.crash_is_fatal = crash_is_fatal
        self.console = console
        self.external_kills: set[int] = set()  # pids that ddiloco chaos killed

    def check(self, now: float) -> None:
        """One pass over all processes; ``now`` is ``time.monotonic()``."""
        for proc in self.workers:
            self._check(proc, now, may_finish=True)
        for proc in self.services:
            self._check(proc, now, may_finish=False)

    def _check(self, proc: Proc, now: float, may_finish: bool) -> None:
        if proc.done or proc.alive():
            return
        if proc.restart_at is None:
            assert proc.popen is not None
            code = proc.popen.returncode
            if may_finish and code == 0:
                proc.done = True
                self.events.append(
                    {"t": time.time(), "event": "process_exit", "process": proc.name, "code": 0}
                )
                return
            if proc.popen.pid in self.external_kills:
                proc.kills += 1
                self.events.append(
                    {
                        "t": time.time(),
                        "event": "process_kill",
                        "process": proc.name,
                        "reason": "chaos",
                        "by": "ddiloco chaos",
                    }
                )
            elif not proc.killed_by_us:
                self._crashed(proc, code)
            proc.restart_at = now + self.restart_s
        elif now >= proc.restart_at:
            proc.restarts += 1
            proc.start(self.events)
            self.events.append({"t": time.time(), "event": "process_restart", "process": proc.name})

    def _crashed(self, proc: Proc, code: int) -> None:
        proc.crashes += 1
        if proc.crashes > MAX_CRASHES:
            raise DdilocoError(f"{proc.name} crashed {proc.crashes} times; see {proc.log_path}")
        self.events.append(
            {"t": time.time(), "event": "process_crash", "process": proc.name, "code": code}
        )
        self.console.print(f"[red]{proc.name} exited with {code}; see {proc.log_path}")
        if self.crash_is_fatal:
            raise DdilocoError(f"{proc.name} failed; data parallel cannot continue")
