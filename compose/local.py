"""``ddiloco local``: the main job. A syncer and M learners as local processes.

No server to install: by default they talk ZeroMQ over loopback. The launcher
shows live progress, optionally kills learners on a Poisson schedule
(``--chaos-mtbf-s``) and restarts them after ``--restart-s``, and writes a run
folder (``--out``):

    summary.json       what happened, in numbers (see compose.report.summarise)
    metrics.jsonl      every event of every process, merged in time order
    checkpoint/        the syncer's atomic per-fragment checkpoints
    plots/             loss against tokens; per-learner timeline with kills
    logs/              each process's stderr

``--mode diloco`` runs synchronous DiLoCo on the same settings (K = M, no
grace window, learners wait for each fragment's new global) and ``--mode ddp``
runs data parallel (gloo all-reduce every step) on the same model, data and
token budget, so every comparison is like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from compose.report import SUMMARY_KEYS, load_events, plot_run, summarise

MODES = ("decoupled", "diloco", "ddp")
MAX_CRASHES = 5  # a process that dies on its own more often than this ends the run


def add_local_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learners", type=int, default=4, help="M learners")
    p.add_argument(
        "--quorum",
        type=int,
        default=None,
        help="K deltas that close a round (default: M-1, at least 1; M in diloco)",
    )
    p.add_argument("--fragments", type=int, default=4, help="P fragments")
    p.add_argument(
        "--sync-every", type=int, default=12, help="H inner steps between syncs of a fragment"
    )
    p.add_argument("--overlap", type=int, default=2, help="tau: steps a fragment's sync may take")
    p.add_argument(
        "--codec", default="int8", help="delta codec: fp32, bf16, int8, int4 [+zstd|+lz4]"
    )
    p.add_argument(
        "--downlink-codec", default="fp32", help="codec of the published globals (syncer --codec)"
    )
    p.add_argument("--transport", choices=("zmq", "redis"), default="zmq")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--steps", type=int, default=300, help="inner steps per learner")
    p.add_argument("--batch-size", type=int, default=16, help="per learner")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--outer-lr", type=float, default=None, help="default: see syncer config")
    p.add_argument("--outer-momentum", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="run folder (default: runs/<time>-<mode>)")
    p.add_argument(
        "--chaos-mtbf-s",
        type=float,
        default=0.0,
        help="mean seconds between learner SIGKILLs while all M run (each learner fails "
        "independently, Poisson); 0: off",
    )
    p.add_argument(
        "--restart-s", type=float, default=5.0, help="delay before a killed process restarts"
    )
    p.add_argument(
        "--kill-syncer-at-s",
        type=float,
        default=0.0,
        help="SIGKILL the syncer once, this many seconds in (0: never); restarts after --restart-s",
    )
    p.add_argument(
        "--kill-learner-at-s",
        type=float,
        default=0.0,
        help="SIGKILL learner-0 once, this many seconds in (0: never); restarts after --restart-s",
    )
    p.add_argument(
        "--slowdown",
        default="",
        help="per-learner slowdown factors, e.g. 1,1,1.5,2 (default: all 1)",
    )
    p.add_argument("--mode", choices=MODES, default="decoupled")
    p.add_argument("--eval-every-s", type=float, default=10.0)
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--n-layer", type=int, default=4, help="model depth")
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--sync-pause-every",
        type=int,
        default=0,
        help="measurement aid: learners pause syncing every other N steps (0: never)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="plain log lines instead of a live table"
    )


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
    raise RuntimeError("no free pair of ports on loopback")


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

    def start(self, events: list[dict[str, Any]]) -> None:
        self.close_files()
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        self.popen = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            env=env,
            start_new_session=True,
        )
        self.killed_by_us = False
        self.restart_at = None
        events.append({"t": time.time(), "event": "process_start", "process": self.name})

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
                raise RuntimeError(f"{self.name} exited at start; see {self.log_path}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready within {timeout_s}s; see {self.log_path}")


class LocalRun:
    def __init__(self, args: argparse.Namespace) -> None:
        if args.learners < 1:
            raise ValueError(f"--learners={args.learners}: use at least 1")
        self.args = args
        self.m = args.learners
        self.mode = args.mode
        self.out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{args.mode}")
        if (self.out / "summary.json").exists():
            raise ValueError(f"--out {self.out} already holds a finished run; pick another folder")
        for sub in ("logs", "learners", "state", "plots"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        self.slowdown = self._slowdowns(args.slowdown)
        if args.quorum is None:
            self.quorum = self.m if self.mode == "diloco" else max(1, self.m - 1)
        else:
            self.quorum = args.quorum
        if not 1 <= self.quorum <= self.m:
            raise ValueError(f"--quorum={self.quorum}: use 1..{self.m}")
        if self.mode == "diloco" and self.quorum != self.m:
            raise ValueError("--mode diloco is synchronous: its quorum is M; drop --quorum")
        if self.mode == "ddp" and (
            args.chaos_mtbf_s or args.kill_syncer_at_s or args.kill_learner_at_s
        ):
            raise ValueError("--mode ddp has no fault tolerance to test: drop the chaos options")
        self.port = free_port_pair()
        self.events: list[dict[str, Any]] = []
        self.syncer: Proc | None = None
        self.learners: list[Proc] = []
        self.rng = random.Random(args.seed + 1)
        self.console = Console(stderr=True)

    def _slowdowns(self, text: str) -> list[float]:
        if not text:
            return [1.0] * self.m
        factors = [float(x) for x in text.split(",")]
        if len(factors) != self.m or any(f < 1 for f in factors):
            raise ValueError(f"--slowdown {text!r}: give {self.m} factors >= 1, e.g. 1,1,1.5,2")
        return factors

    # -- process command lines -------------------------------------------------
    def _common(self) -> list[str]:
        a = self.args
        return [
            "--run-id",
            "local",
            "--fragments",
            str(a.fragments),
            "--sync-every",
            str(a.sync_every),
            "--overlap",
            str(a.overlap),
            "--seed",
            str(a.seed),
            "--model-d-model",
            str(a.d_model),
            "--model-n-layer",
            str(a.n_layer),
            "--model-n-head",
            str(a.n_head),
            "--model-seq-len",
            str(a.seq_len),
        ]

    def _transport(self) -> list[str]:
        a = self.args
        if a.transport == "redis":
            return ["--transport", "redis", "--redis-url", a.redis_url]
        return ["--transport", "zmq"]

    def syncer_proc(self) -> Proc:
        a = self.args
        args = [
            sys.executable,
            "-m",
            "compose.cli",
            "syncer",
            *self._common(),
            *self._transport(),
            "--zmq-bind",
            f"tcp://127.0.0.1:{self.port}",
            "--quorum",
            str(self.quorum),
            "--checkpoint-dir",
            str(self.out / "checkpoint"),
            "--metrics-file",
            str(self.out / "syncer.jsonl"),
            "--eval-every-s",
            str(a.eval_every_s),
            "--heartbeat-timeout-s",
            "5",
        ]
        args += ["--codec", a.downlink_codec]
        if self.mode == "diloco":
            args += ["--grace-gamma", "0"]
        if a.outer_lr is not None:
            args += ["--outer-lr", str(a.outer_lr)]
        if a.outer_momentum is not None:
            args += ["--outer-momentum", str(a.outer_momentum)]
        return Proc("syncer", args, self.out / "logs" / "syncer.log")

    def learner_proc(self, i: int) -> Proc:
        a = self.args
        name = f"learner-{i}"
        args = [
            sys.executable,
            "-m",
            "compose.cli",
            "learner",
            *self._common(),
            "--learner-id",
            name,
            "--steps",
            str(a.steps),
            "--batch-size",
            str(a.batch_size),
            "--lr",
            str(a.lr),
            "--codec",
            a.codec,
            "--slowdown",
            str(self.slowdown[i]),
            "--metrics-file",
            str(self.out / "learners" / f"{name}.jsonl"),
            "--state-dir",
            str(self.out / "state"),
            "--log-every",
            "5",
            "--sync-pause-every",
            str(a.sync_pause_every),
        ]
        env: dict[str, str] = {}
        if self.mode == "ddp":
            args += ["--transport", "none", "--eval-every", str(max(1, a.steps // 10))]
            env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.port),
                "WORLD_SIZE": str(self.m),
                "RANK": str(i),
                "LOCAL_RANK": str(i),
            }
        else:
            args += [
                *self._transport(),
                "--zmq-endpoints",
                f"tcp://127.0.0.1:{self.port}",
                "--shard",
                str(i),
                "--num-shards",
                str(self.m),
            ]
            if self.mode == "diloco":
                args += ["--blocking", "true"]
        return Proc(name, args, self.out / "logs" / f"{name}.log", env=env)

    # -- the run -----------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        started = time.time()
        self.events.append(
            {
                "t": started,
                "event": "run_start",
                "mode": self.mode,
                "args": {k: v for k, v in vars(a).items() if k != "func"},
            }
        )
        if self.mode != "ddp":
            self.syncer = self.syncer_proc()
            self.syncer.start(self.events)
            self.syncer.wait_ready(120)
        self.learners = [self.learner_proc(i) for i in range(self.m)]
        for proc in self.learners:
            proc.start(self.events)
        next_kill = self._next_kill(time.monotonic())
        syncer_kill_at = time.monotonic() + a.kill_syncer_at_s if a.kill_syncer_at_s else None
        learner_kill_at = time.monotonic() + a.kill_learner_at_s if a.kill_learner_at_s else None
        tails = {
            p.name: JsonlTail(self.out / "learners" / f"{p.name}.jsonl") for p in self.learners
        }
        syncer_tail = JsonlTail(self.out / "syncer.jsonl")
        view = _Progress(self.m, a.steps)
        live = (
            None
            if a.no_progress or not self.console.is_terminal
            else Live(view.table(), console=self.console, refresh_per_second=2)
        )
        last_line = 0.0
        try:
            if live:
                live.start()
            while not all(p.done for p in self.learners):
                now = time.monotonic()
                self._supervise(now)
                if next_kill is not None and now >= next_kill:
                    # Learners fail independently: pick any of the M; a learner
                    # that is finished or already down does not fail again.
                    victim = self.rng.choice(self.learners)
                    if victim.alive() and not victim.done:
                        victim.kill(self.events, "chaos")
                    next_kill = self._next_kill(now)
                if learner_kill_at is not None and now >= learner_kill_at:
                    if not self.learners[0].done:
                        self.learners[0].kill(self.events, "scheduled")
                    learner_kill_at = None
                if syncer_kill_at is not None and now >= syncer_kill_at and self.syncer:
                    self.syncer.kill(self.events, "scheduled")
                    self.syncer.restart_at = now + a.restart_s
                    syncer_kill_at = None
                for name, tail in tails.items():
                    view.update_learner(name, tail.read())
                view.update_syncer(syncer_tail.read())
                view.kills = sum(p.kills for p in self.learners)
                view.restarts = sum(p.restarts for p in self.learners)
                if live:
                    live.update(view.table())
                elif time.monotonic() - last_line > 10:
                    print(view.line(), file=sys.stderr, flush=True)
                    last_line = time.monotonic()
                time.sleep(0.2)
        finally:
            if live:
                live.stop()
            self._stop_all()
        self.events.append({"t": time.time(), "event": "run_end"})
        return self._report(started)

    def _next_kill(self, now: float) -> float | None:
        mtbf = self.args.chaos_mtbf_s
        return now + self.rng.expovariate(1.0 / mtbf) if mtbf > 0 else None

    def _supervise(self, now: float) -> None:
        procs = self.learners + ([self.syncer] if self.syncer else [])
        for proc in procs:
            if proc.done or proc.alive():
                continue
            if proc.restart_at is None:
                assert proc.popen is not None
                code = proc.popen.returncode
                if proc is not self.syncer and code == 0:
                    proc.done = True
                    self.events.append(
                        {"t": time.time(), "event": "process_exit", "process": proc.name, "code": 0}
                    )
                    continue
                if not proc.killed_by_us:
                    proc.crashes += 1
                    if proc.crashes > MAX_CRASHES:
                        raise RuntimeError(
                            f"{proc.name} crashed {proc.crashes} times; see {proc.log_path}"
                        )
                    self.events.append(
                        {
                            "t": time.time(),
                            "event": "process_crash",
                            "process": proc.name,
                            "code": code,
                        }
                    )
                    self.console.print(f"[red]{proc.name} exited with {code}; see {proc.log_path}")
                    if self.mode == "ddp":
                        raise RuntimeError(f"{proc.name} failed; data parallel cannot continue")
                proc.restart_at = now + self.args.restart_s
            elif now >= proc.restart_at:
                proc.restarts += 1
                proc.start(self.events)
                self.events.append(
                    {"t": time.time(), "event": "process_restart", "process": proc.name}
                )

    def _stop_all(self) -> None:
        for proc in self.learners:
            if proc.alive():
                proc.kill(self.events, "shutdown")
        if self.syncer and self.syncer.popen and self.syncer.alive():
            # SIGTERM: merge what is pending, evaluate, write totals.
            self.syncer.popen.send_signal(signal.SIGTERM)
            try:
                self.syncer.popen.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.syncer.kill(self.events, "shutdown timeout")
        for proc in self.learners + ([self.syncer] if self.syncer else []):
            proc.close_files()

    def _report(self, started: float) -> dict[str, Any]:
        launcher_events = self.out / "launcher.jsonl"
        launcher_events.write_text("".join(json.dumps(e) + "\n" for e in self.events))
        events = load_events(self.out)
        with open(self.out / "metrics.jsonl", "w") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")
        summary = summarise(
            events, mode=self.mode, learners=self.m, steps=self.args.steps, quorum=self.quorum
        )
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_run(events, self.out / "plots")
        return summary


class _Progress:
    """The live view: per-learner progress and the global model's state."""

    def __init__(self, m: int, steps: int) -> None:
        self.steps = steps
        self.learners: dict[str, dict[str, Any]] = {f"learner-{i}": {} for i in range(m)}
        self.eval_loss: float | None = None
        self.first_eval: float | None = None
        self.rounds: list[float] = []
        self.kills = 0
        self.restarts = 0

    def update_learner(self, name: str, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e["event"] in ("step", "done", "start"):
                self.learners[name].update({k: v for k, v in e.items() if k != "event"})
                self.learners[name]["state"] = e["event"]
            if e["event"] == "eval":
                self._eval(e["loss"])

    def _eval(self, loss: float) -> None:
        self.eval_loss = loss
        if self.first_eval is None:
            self.first_eval = loss

    def update_syncer(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e["event"] == "eval":
                self._eval(e["loss"])
            elif e["event"] == "round":
                self.rounds.append(e["t"])

    def fragments_per_s(self) -> float:
        recent = [t for t in self.rounds if t > time.time() - 10]
        return len(recent) / 10

    def table(self) -> Table:
        loss = (
            "-" if self.eval_loss is None else f"{self.eval_loss:.3f} (start {self.first_eval:.3f})"
        )
        t = Table(
            title=f"global eval loss {loss}   fragments/s {self.fragments_per_s():.1f}   "
            f"kills {self.kills}   restarts {self.restarts}"
        )
        for col in ("learner", "step", "steps/s", "train loss", "state"):
            t.add_column(col)
        for name, s in self.learners.items():
            t.add_row(
                name,
                f"{s.get('step', 0)}/{self.steps}",
                f"{s.get('steps_per_s', 0):.1f}",
                f"{s['loss']:.3f}" if "loss" in s else "-",
                s.get("state", "starting"),
            )
        return t

    def line(self) -> str:
        steps = " ".join(f"{s.get('step', 0)}" for s in self.learners.values())
        loss = "-" if self.eval_loss is None else f"{self.eval_loss:.3f}"
        return (
            f"eval loss {loss} | steps {steps} of {self.steps} | "
            f"fragments/s {self.fragments_per_s():.1f} | kills {self.kills}"
        )


def run_local(args: argparse.Namespace) -> int:
    run = LocalRun(args)
    summary = run.run()
    console = Console()
    console.print(f"[bold]run folder[/bold] {run.out}")
    for k in SUMMARY_KEYS:
        v = summary.get(k)
        console.print(f"  {k:20s} {v:.4g}" if isinstance(v, float) else f"  {k:20s} {v}")
    return 0
