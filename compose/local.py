"""``ddiloco local``: the main job. A syncer, an evaluator and M learners as local
processes, started from an initial model that the launcher writes first (what
``ddiloco init`` does).

No server to install: by default they talk ZeroMQ over loopback. The launcher
shows live progress, optionally kills learners on a Poisson schedule
(``--chaos-mtbf-s``) and restarts them after ``--restart-s``, and writes a run
folder (``--out``):

    summary.json       what happened, in numbers (see compose.report.summarise)
    metrics.jsonl      every event of every process, merged in time order
    initial-model.safetensors   the run's start: weights and fragment plan
    checkpoint/        the syncer's atomic per-fragment checkpoints
    plots/             loss against tokens; per-learner timeline with kills
    logs/              each process's stderr
    processes.json     name -> pid of every running process, for ``ddiloco chaos --local``

``--netns`` runs each learner in a network namespace of its own, joined to
this host by a veth pair (:mod:`compose.netns`), so that ``ddiloco throttle
--local RUN_DIR`` can limit its link as it would a container's;
``--link-rate 10mbit`` limits every learner's link from the start (both ways).
Data parallel's ranks then reach each other through the same links. The
summary gains ``link_bytes``: what each learner's interface sent and received,
from its counters (everything on the wire, protocol headers included).

``--mode diloco`` runs synchronous DiLoCo on the same settings (K = M, no
grace window, learners wait for each fragment's new global) and ``--mode ddp``
runs data parallel (gloo all-reduce every step) on the same model, data and
token budget, so every comparison is like for like. Under chaos, data parallel
is elastic as torchrun's restarts are: a killed rank stops the whole group,
which starts again after ``--restart-s`` from rank 0's last checkpoint.

``--join-at-step 0,0,100,100`` adds compute to a running job: learners 2 and 3
start once a running learner has logged step 100, and enroll as any learner
does (decoupled mode only).

``--warm-spares`` keeps one spare process per learner with its imports done;
a killed learner restarts in it, so a restart does not wait for Python and torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from broker.cli_config import dataclass_to_args, dataclass_values
from broker.connect import parse_url
from broker.errors import ConfigError
from broker.files import atomic_write
from broker.identity.keys import JOIN_SECRET
from broker.run.key_folder import make_keys
from broker.run.settings import NO_BROKER, RunSettings
from compose.chaos import ChaosSchedule
from compose.chaos_run import CHAOS_FILE, PROCESSES_FILE
from compose.live_view import LiveView
from compose.netns import LocalNetwork
from compose.processes import JsonlTail, Proc, Supervisor, free_port_pair
from compose.report import SUMMARY_KEYS, load_events, plot_run, summarise
from compose.throttle import ThrottleConfig, apply, parse_rate
from learner.config import (
    EvalConfig,
    EvaluatorConfig,
    LearnerConfig,
    SyncConfig,
    TrainConfig,
    WorkloadConfig,
)
from learner.workload import write_initial
from syncer.config import OuterConfig, SyncerConfig

MODES = ("decoupled", "diloco", "ddp")
# Data parallel: the group is one learner, under one id, that rank 0 (process
# learner-0) speaks for; every rank resumes from the checkpoint rank 0 keeps under it.
DP_GROUP_ID = "learner-0"
STOP_TIMEOUT_S = 120.0  # for each service to finish its last work when asked to stop


@dataclass
class LocalConfig:
    """``ddiloco local``: the shared settings of every service, plus the launcher's own."""

    run: RunSettings = field(default_factory=RunSettings)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mode: str = "decoupled"  # decoupled, diloco (synchronous, K = M) or ddp (data parallel)
    out: str | None = None  # the run folder; None: runs/<time>-<mode>
    chaos_mtbf_s: float = 0.0  # mean s between learner SIGKILLs (each learner Poisson); 0: off
    restart_s: float = 5.0  # delay before a killed process restarts
    warm_spares: bool = False  # a killed learner restarts in a spare process, imports done
    kill_syncer_at_s: float = 0.0  # SIGKILL the syncer once, this many s in; 0: never
    kill_learner_at_s: float = 0.0  # SIGKILL learner-0 once, this many s in; 0: never
    slowdown: tuple[float, ...] = ()  # per-learner step-time factors, e.g. 1,1,1.5,2; empty: 1
    join_at_step: tuple[int, ...] = ()  # per learner: start once one reached this step; 0: at once
    no_progress: bool = False  # plain log lines instead of a live table
    netns: bool = False  # each learner in its own network namespace (root; ddiloco throttle)
    link_rate: str = ""  # with --netns: every learner's link limited from the start, e.g. 10mbit

    def __post_init__(self) -> None:
        m = self.run.learners
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r}: choose one of {list(MODES)}")
        if self.slowdown and (len(self.slowdown) != m or any(f < 1 for f in self.slowdown)):
            raise ConfigError(f"slowdown={self.slowdown}: give {m} factors >= 1, e.g. 1,1,1.5,2")
        if self.join_at_step:
            if len(self.join_at_step) != m or any(s < 0 for s in self.join_at_step):
                raise ConfigError(
                    f"join_at_step={self.join_at_step}: give {m} steps >= 0, e.g. 0,0,100,100"
                )
            if 0 not in self.join_at_step:
                raise ConfigError(f"join_at_step={self.join_at_step}: one learner must start at 0")
            if self.mode != "decoupled" and any(self.join_at_step):
                # Synchronous DiLoCo waits for all M learners each round, and a data
                # parallel group is fixed at its start: neither takes a newcomer.
                raise ConfigError(f"join_at_step: mode={self.mode} cannot add learners mid-run")
        for name in ("chaos_mtbf_s", "restart_s", "kill_syncer_at_s", "kill_learner_at_s"):
            value = getattr(self, name)
            if not value >= 0:  # also refuses NaN
                raise ConfigError(f"{name}={value}: must be >= 0")
        if self.mode == "diloco" and self.run.quorum not in (0, m):
            raise ConfigError("mode=diloco is synchronous: its quorum is M; drop --quorum")
        if self.run.syncer_shards > 1:
            raise ConfigError(
                f"syncer_shards={self.run.syncer_shards}: `ddiloco local` runs one syncer; run "
                "shards with `ddiloco syncer --syncer-shard S` each, or in the compose cluster "
                "(DDILOCO_SYNCER_SHARDS)"
            )
        if self.mode == "ddp" and self.kill_syncer_at_s:
            raise ConfigError("mode=ddp has no syncer to kill: drop --kill-syncer-at-s")
        if self.netns and self.run.url != RunSettings.url:
            raise ConfigError("--netns needs the default ZeroMQ url: drop --url")
        if self.link_rate:
            if not self.netns:
                raise ConfigError("--link-rate limits the learners' own links: add --netns")
            parse_rate(self.link_rate)


class LocalRun:
    def __init__(self, cfg: LocalConfig) -> None:
        self.cfg = cfg
        self.m = cfg.run.learners
        self.mode = cfg.mode
        self.out = Path(cfg.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.mode}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a file; give a folder for the run")
        if (self.out / "summary.json").exists():
            raise ConfigError(f"--out {self.out} already holds a finished run; pick another folder")
        for sub in ("logs", "learners", "state", "plots"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        self.port = free_port_pair()
        learner_names = [f"learner-{i}" for i in range(self.m)]
        self.network = LocalNetwork.create(learner_names) if cfg.netns else None
        self.run_settings = self._run_settings()
        self.events: list[dict[str, Any]] = []
        self.syncer: Proc | None = None
        self.evaluator: Proc | None = None
        self.learners: list[Proc] = []
        self.console = Console(stderr=True)

    def _run_settings(self) -> RunSettings:
        """The run's settings as every service of this run gets them."""
        run = self.cfg.run
        url = run.url
        if self.mode == "ddp":
            url = NO_BROKER
        elif parse_url(url).backend == "zmq" and url == RunSettings.url:
            # The default: a private pair of free loopback ports, so that runs
            # (and tests) on one machine never collide. With namespaces, the
            # bridge's address, which every namespace reaches.
            host = self.network.host_address if self.network else "127.0.0.1"
            url = f"zmq://{host}:{self.port}"
        quorum = self.m if self.mode == "diloco" else run.quorum
        # The run folder's own initial model, written at start, unless the user
        # gave one (e.g. from `ddiloco init` or a pretrained model): then that one.
        initial = run.initial_model
        if initial == RunSettings.initial_model:
            initial = str(self.out / "initial-model.safetensors")
        elif not Path(initial).is_file():
            raise ConfigError(
                f"--initial-model {initial}: no such file; write it with `ddiloco init`"
            )
        # Likewise the run folder's own keys, made at the first start, unless
        # the user gave a key folder, made one where the default points (`ddiloco
        # keys` here), or runs --insecure. Every process gets the folder's full path.
        keys = str(Path(run.keys).expanduser().resolve())
        default_unmade = not (Path(keys) / JOIN_SECRET).exists()
        if run.keys == RunSettings.keys and default_unmade and not run.insecure:
            keys = str(self.out / "keys")
            if not (self.out / "keys" / JOIN_SECRET).exists():
                make_keys(keys)
        return dataclasses.replace(
            run, url=url, quorum=quorum, initial_model=initial, run_id=self._run_id(), keys=keys
        )

    def _run_id(self) -> str:
        """The given run id, or one of this run's own: two runs on one broker must never
        mix. It is kept in the run folder, so running the same folder again (after an
        interruption) goes on with the same id."""
        if self.cfg.run.run_id != RunSettings.run_id:
            return self.cfg.run.run_id
        kept = self.out / "run-id"
        if kept.exists():
            return kept.read_text().strip()
        run_id = f"local-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        kept.write_text(run_id + "\n")
        return run_id

    # -- the services' configs -----------------------------------------------------
    def _command(
        self, name: str, service: str, cfg: Any, env: dict[str, str] | None = None
    ) -> Proc:
        args = [sys.executable, "-m", "compose.cli", service, *dataclass_to_args(cfg)]
        if self.network is not None and name in self.network.namespaces:
            args = self.network.command(name, args)
        return Proc(name, args, self.out / "logs" / f"{name}.log", env=env or {})

    def syncer_proc(self, first_start: bool = False) -> Proc:
        """The syncer. Its first start asks no learner for the run's latest globals
        (``--recall-s 0``): the learners start after it, so none holds any; a restart
        (a chaos kill that lost the folder) asks them as a user's syncer would."""
        outer = self.cfg.outer
        if self.mode == "diloco":
            outer = dataclasses.replace(outer, grace_gamma=0.0)  # nothing to wait for: K = M
        cfg = SyncerConfig(
            run=self.run_settings,
            outer=outer,
            checkpoint_dir=str(self.out / "checkpoint"),
            metrics_file=str(self.out / "syncer.jsonl"),
        )
        if first_start:
            cfg = dataclasses.replace(cfg, recall_s=0.0)
        return self._command("syncer", "syncer", cfg)

    def evaluator_proc(self) -> Proc:
        cfg = EvaluatorConfig(
            run=self.run_settings,
            workload=self.cfg.workload,
            eval=self.cfg.eval,
            metrics_file=str(self.out / "evaluator.jsonl"),
        )
        return self._command("evaluator", "evaluator", cfg)

    def learner_proc(self, i: int) -> Proc:
        name = f"learner-{i}"
        steps = self.run_settings.steps
        cfg = LearnerConfig(
            run=self.run_settings,
            workload=self.cfg.workload,
            train=self.cfg.train,
            # Synchronous DiLoCo: each learner waits for each fragment's new global.
            sync=dataclasses.replace(self.cfg.sync, blocking=self.mode == "diloco"),
            learner_id=DP_GROUP_ID if self.mode == "ddp" else name,
            # Data parallel's checkpoint: weights, optimizer, step and tokens.
            resume_optimizer=self.mode == "ddp",
            shard=0 if self.mode == "ddp" else i,  # data parallel: torchrun ranks shard
            num_shards=1 if self.mode == "ddp" else self.m,
            slowdown=self.cfg.slowdown[i] if self.cfg.slowdown else 1.0,
            state_dir=str(self.out / "state"),
            metrics_file=str(self.out / "learners" / f"{name}.jsonl"),
            log_every=5,  # a finer curve than the default
            # Data parallel has no evaluator: the learners report ten points of the curve.
            eval=dataclasses.replace(self.cfg.eval, eval_every=max(1, steps // 10))
            if self.mode == "ddp"
            else self.cfg.eval,
        )
        env: dict[str, str] = {}
        if self.mode == "ddp":
            env = {
                "MASTER_ADDR": "127.0.0.1",  # rank 0 holds the rendezvous store
                "MASTER_PORT": str(self.port),
                "WORLD_SIZE": str(self.m),
                "RANK": str(i),
                "LOCAL_RANK": str(i),
            }
            if self.network is not None:  # ranks meet through their own links
                env["MASTER_ADDR"] = self.network.address("learner-0")
                env["GLOO_SOCKET_IFNAME"] = self.network.device(name)
        proc = self._command(name, "learner", cfg, env)
        proc.warm_spare = self.cfg.warm_spares
        return proc

    # -- the run -----------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            if self.network is not None:
                self.network.write(self.out)
                if self.cfg.link_rate:
                    apply("set", ThrottleConfig(rate=self.cfg.link_rate, local=str(self.out)))
            return self._run()
        finally:
            if self.network is not None:
                self.network.close()

    def _write_processes(self, procs: list[Proc], written: dict[str, int]) -> dict[str, int]:
        """processes.json, when a pid changed: what ``ddiloco chaos --local`` strikes."""
        pids = {p.name: p.popen.pid for p in procs if p.popen is not None and p.alive()}
        if pids != written:
            atomic_write(self.out / PROCESSES_FILE, json.dumps(pids).encode())
        return pids

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.time()
        self.events.append(
            {
                "t": started,
                "event": "run_start",
                "mode": self.mode,
                # Codecs as their names: the launcher's events are JSON lines.
                "config": json.loads(json.dumps(dataclass_values(cfg), default=str))
                | {
                    "run_id": self.run_settings.run_id,
                    "url": self.run_settings.url,
                },
            }
        )
        services: list[Proc] = []
        if self.mode != "ddp":
            # The syncer's start: the same initial model file whoever connects first.
            if cfg.run.initial_model == RunSettings.initial_model:
                write_initial(self.run_settings, cfg.workload)
            self.syncer = self.syncer_proc(first_start=True)
            self.syncer.start(self.events)
            self.syncer.args = self.syncer_proc().args  # what a restart runs
            self.syncer.wait_ready(120)
            self.evaluator = self.evaluator_proc()
            self.evaluator.start(self.events)
            services = [self.syncer, self.evaluator]
        self.learners = [self.learner_proc(i) for i in range(self.m)]
        join_at = cfg.join_at_step or (0,) * self.m
        waiting = {i for i in range(self.m) if join_at[i]}  # newcomers, not started yet
        running = [p for i, p in enumerate(self.learners) if i not in waiting]
        for proc in running:
            proc.start(self.events)
        by_name = {p.name: p for p in self.learners + services}
        supervisor = Supervisor(
            running,  # newcomers join it as they start
            services,
            self.events,
            restart_s=cfg.restart_s,
            crash_is_fatal=self.mode == "ddp",
            console=self.console,
        )
        chaos = ChaosSchedule(
            self.m,
            seed=cfg.workload.seed,
            start=time.monotonic(),
            mtbf_s=cfg.chaos_mtbf_s,
            kill_syncer_at_s=cfg.kill_syncer_at_s,
            kill_learner_at_s=cfg.kill_learner_at_s,
        )
        tails = {
            p.name: JsonlTail(self.out / "learners" / f"{p.name}.jsonl") for p in self.learners
        }
        chaos_tail = JsonlTail(self.out / CHAOS_FILE)  # kills by ddiloco chaos --local
        pids: dict[str, int] = {}
        service_tails = [JsonlTail(self.out / f"{p.name}.jsonl") for p in services]
        view = LiveView(self.m, self.run_settings.steps)
        live = (
            None
            if cfg.no_progress or not self.console.is_terminal
            else Live(view.table(), console=self.console, refresh_per_second=2)
        )
        last_line = 0.0
        furthest_step = 0  # the most steps any learner has logged: newcomers start from it
        finished = False
        try:
            if live:
                live.start()
            while not all(p.done for p in self.learners):
                now = time.monotonic()
                supervisor.external_kills |= {
                    int(e["pid"]) for e in chaos_tail.read() if e.get("event") == "kill"
                }
                if self.mode == "ddp":  # before the supervisor restarts a rank on its own
                    self._elastic_restart(supervisor.external_kills)
                supervisor.check(now)
                pids = self._write_processes(self.learners + services, pids)
                up = [p.alive() and not p.done for p in self.learners]
                if self.mode == "ddp":  # a group fails as one: only a whole group is up
                    up = [all(up)] * self.m
                for kill in chaos.due(now, up):
                    victim = by_name[kill.process]
                    victim.kill(self.events, kill.reason)
                    if victim is self.syncer:
                        victim.restart_at = now + cfg.restart_s
                for name, tail in tails.items():
                    for e in (new := tail.read()):
                        if e.get("event") == "step":
                            furthest_step = max(furthest_step, int(e["step"]))
                    view.update_learner(name, new)
                for i in sorted(i for i in waiting if furthest_step >= join_at[i]):
                    waiting.remove(i)
                    self.learners[i].start(self.events)
                    running.append(self.learners[i])
                for tail in service_tails:
                    view.update_syncer(tail.read())
                view.kills = sum(p.kills for p in self.learners)
                view.restarts = sum(p.restarts for p in self.learners)
                if live:
                    live.update(view.table())
                elif time.monotonic() - last_line > 10:
                    print(view.line(), file=sys.stderr, flush=True)
                    last_line = time.monotonic()
                time.sleep(0.2)
            finished = True
        finally:
            with uninterrupted():
                if live:
                    live.stop()
                self._stop_all(finished)
        self.events.append({"t": time.time(), "event": "run_end"})
        return self._report()

    def _elastic_restart(self, external_kills: set[int]) -> None:
        """Elastic data parallel, as torchrun's elastic restarts: when a rank is killed,
        the launcher stops every rank; the supervisor starts them all again after
        ``--restart-s`` (they were stopped in the same pass), on a fresh rendezvous
        port, and they resume from rank 0's last checkpoint (weights, optimizer,
        step, tokens: saved at the same steps as a decoupled learner's progress).
        The steps since that checkpoint are lost and run again. Detection is
        immediate: the launcher killed the rank itself, or saw ``ddiloco chaos``
        do it. A rank that died on its own is a crash, which ends the run."""

        def down() -> list[Proc]:
            return [
                p
                for p in self.learners
                if not p.done and p.restart_at is None and p.popen is not None
                and p.popen.poll() not in (None, 0)
            ]  # fmt: skip

        killed = [
            p for p in down() if p.killed_by_us or (p.popen and p.popen.pid in external_kills)
        ]
        if not killed:
            return
        self.events.append(
            {"t": time.time(), "event": "group_stop", "failed": [p.name for p in killed]}
        )
        port = free_port_pair()
        for proc in self.learners:
            proc.env["MASTER_PORT"] = str(port)
            if proc.alive():
                proc.kill(self.events, "group_stop")
        # Ranks that died of their group's failure before they were stopped, also
        # while this loop stopped the others (a rank sees a killed peer's socket
        # close within milliseconds): stopped all the same, not crashes.
        for proc in down():
            if proc not in killed and not proc.killed_by_us:
                proc.killed_by_us = True
                self.events.append(
                    {"t": time.time(), "event": "process_kill", "process": proc.name,
                     "reason": "group_stop"}
                )  # fmt: skip

    def _stop_all(self, finished: bool) -> None:
        """Stop every process. After a finished run, in the order that makes the last
        evaluation see the final model: the syncer merges what is pending (SIGUSR1)
        and keeps serving, the evaluator takes its final snapshot (SIGTERM), then the
        syncer writes its totals and exits (SIGTERM)."""
        for proc in self.learners:
            proc.close_spare()
            if proc.alive():
                proc.kill(self.events, "shutdown")
        syncer, evaluator = self.syncer, self.evaluator
        if finished and syncer is not None and syncer.alive() and syncer.popen is not None:
            tail = JsonlTail(self.out / "syncer.jsonl")
            tail.offset = (self.out / "syncer.jsonl").stat().st_size
            syncer.popen.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while time.monotonic() < deadline and syncer.alive():
                if any(e["event"] == "drained" for e in tail.read()):
                    break
                time.sleep(0.05)
        for service in (evaluator, syncer):
            if service is None or service.popen is None or not service.alive():
                continue
            service.popen.send_signal(signal.SIGTERM)
            try:
                service.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                service.kill(self.events, "shutdown timeout")
        for proc in self.learners + [p for p in (syncer, evaluator) if p is not None]:
            proc.close_files()

    def _report(self) -> dict[str, Any]:
        launcher_events = self.out / "launcher.jsonl"
        launcher_events.write_text("".join(json.dumps(e) + "\n" for e in self.events))
        events = load_events(self.out)
        with open(self.out / "metrics.jsonl", "w") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")
        summary = summarise(
            events,
            mode=self.mode,
            learners=self.m,
            steps=self.run_settings.steps,
            fragments=self.run_settings.fragments,
        )
        if self.network is not None:
            summary["link_bytes"] = self.network.counters()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_run(events, self.out / "plots")
        return summary


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGTERM and Ctrl-C ignored inside: a second one (a supervisor that
    signals the whole group, then the launcher) must not cut the stop short
    and leave services running. The stop is bounded all the same: each
    service gets STOP_TIMEOUT_S, then SIGKILL."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_local(cfg: LocalConfig) -> int:
    # SIGTERM (timeout, a benchmark or supervisor stopping the run) unwinds as
    # Ctrl-C does: every process of the run is stopped and its namespaces removed,
    # where the default action would leave them running.
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        run = LocalRun(cfg)
        summary = run.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    console = Console()
    console.print(f"[bold]run folder[/bold] {run.out}")
    for k in SUMMARY_KEYS:
        v = summary.get(k)
        console.print(f"  {k:20s} {v:.4g}" if isinstance(v, float) else f"  {k:20s} {v}")
    return 0
