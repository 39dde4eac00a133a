"""Syncer shards under a large model's load, with synthetic learners.

    python -m benchmarks.scale [--smoke | --quick] [--out benchmarks/results/scale]

A synthetic learner is a process that does a learner's network work and
nothing else: it enrolls with the run's keys, joins as a learner that
starts from the run's initial model does (it holds version 0 of every
fragment, so it downloads no weights), sends each fragment's delta on the
schedule a learner of the given step time and H would (based on the newest
version of the fragment it has heard of), heartbeats every step and receives
the globals, reading their headers only (it holds no model, so it neither
decodes nor applies them). Its deltas are real encodings, in the
run's delta codec (int2+zstd at the defaults), of the deltas Adam makes of
Gaussian gradients (:func:`synthetic_delta`), made once per fragment before
the run and sent as they are every time: they compress to within 10% of a
trained model's delta (``tests/test_scale_bench.py`` checks it).

The syncers are the real service (``python -m syncer``), ``shards`` of them
(``--syncer-shards``), each owning the fragments ``p mod shards``, over
ZeroMQ (each shard binds its own port; learners list them all) or over one
Redis server (TLS and the run's users, AOF ``appendfsync always``, as in the
compose cluster), with the run's keys.

Reported per run (``scale-<mode>.json``):
- ``round_latency_p99_s``: the 99th percentile, over every round, of the time
  from a round's K-th delta to its global published (the syncer's
  ``quorum_to_publish_s``), and ``budget_s`` = tau x step time; the shards
  *sustain* the load when the first is at most the second, with no delta
  lost, over at least 50 rounds;
- ``lost_deltas``: deltas a learner handed over that no syncer acknowledged
  or refused by the end (each learner flushes before it leaves);
- ``syncer_bytes_per_param``: each shard's peak resident memory, less that of
  an idle interpreter with the syncer's imports, over the parameters of the
  fragments it owns (the largest over shards);
- ``checkpoint_mb_per_s``: bytes the shards wrote to their checkpoints and
  logs (their summaries' ``checkpoint_bytes``) per second of the run, in MB;
- ``redis_peak_bytes`` and ``redis_aof_mb_per_s``: the server's peak memory
  and the bytes its process wrote per second (the AOF), Redis runs only;
  ``redis_cpu_s_per_s``, the server's CPU seconds per second of the run, and
  ``redis_commands``, the seconds its commands took and their calls, by name
  (INFO commandstats; the rest of its CPU is TLS, the sockets and the AOF);
- per learner its CPU seconds per second and peak memory;
- ``learner_overhead``: what the library adds to a real learner's memory per
  parameter, beyond model, gradients and AdamW's state
  (:func:`learner_overhead`; 10M parameters in the smoke, 100M otherwise).

Besides the runs, ``shard_memory``: one shard's memory per parameter, with
no transport (:func:`shard_memory`): 40M parameters in the smoke, 250M in
``--quick``, 1B in the full mode.

With ``kill_shard_at_s``, shard 0 is SIGKILLed that many seconds in and
started again at once, from its checkpoint; ``shard_kill`` gives its outage
(from the kill to its first round after it) and each shard's rounds closed
within the outage: a shard that dies stops only its own fragments' rounds.

With ``lose_state`` the kill is a lost host: shard 0's checkpoint folder is
deleted before it starts again, and it rebuilds from the latest globals and
state Redis keeps.

Modes: ``--smoke`` (CI, about a minute): 10M parameters, P = 4, H = 4, M = 4,
steps of 0.25 s, two ZeroMQ shards. ``--quick``: 250M parameters, P = 24,
H = 24, M = 16, steps of 1 s, over Redis with one shard. Full: that load over
Redis and over ZeroMQ with one and two shards. ``--takeover``: the lost host
at 0.88M parameters (P = 4, H = 12, M = 4) and at the quick load's 250M.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from broker.cli_config import dataclass_to_args
from broker.connect import connect_learner
from broker.errors import Backpressure, MeasurementError
from broker.fragments import FragmentPlan, ParamSpec, owned_fragments, owner_shard
from broker.identity.keys import Identity
from broker.run.initial_model import write_initial_model
from broker.run.key_folder import make_keys
from broker.run.settings import RunSettings
from broker.transport import learner_id_of
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, Heartbeat

RUN_ID = "scale-bench"
TOKENS_PER_STEP = 16 * 128  # a learner's batch at the defaults (tokens per inner step)
# The synthetic deltas (synthetic_delta): Adam's steps on noisy Gaussian gradients.
ADAM_STEPS = 12  # the default H
GRADIENT_NOISE = 8.0  # the gradient noise's scale over the signal's (small batches)
DELTA_SCALE = 3e-3  # the default inner lr: only the shape sets the compressed size
MIN_ROUNDS = 50  # "sustains" holds over at least this many rounds


@dataclass(frozen=True)
class Load:
    """One run: the model, the schedule, the learners and the syncers."""

    params: int  # parameters of the model, cut into `fragments` equal tensors
    fragments: int  # P
    sync_every: int  # H
    learners: int  # M
    step_s: float  # each synthetic learner's inner-step time
    transport: str  # "zmq" or "redis"
    shards: int  # syncer processes, shard s owning the fragments p with p mod shards == s
    steps: int  # inner steps per learner
    pin_syncer: bool = False  # each shard on one core (taskset), for the per-core rate
    kill_shard_at_s: float = 0.0  # SIGKILL shard 0 this many s in, restarted at once; 0: never
    lose_state: bool = False  # the kill deletes shard 0's checkpoint folder too (a lost host)

    @property
    def name(self) -> str:
        size = f"{self.params / 1e6:g}M"
        pinned = "-pinned" if self.pin_syncer else ""
        killed = ("-lost" if self.lose_state else "-kill") if self.kill_shard_at_s else ""
        return f"{size}-{self.transport}-{self.shards}shard{pinned}{killed}"

    @property
    def rounds(self) -> int:
        """Rounds the schedule opens over the run (every fragment, every H steps)."""
        return self.fragments * (self.steps // self.sync_every)


# The learner's memory overhead is measured on a model of this many parameters.
LEARNER_PARAMS = {"smoke": 10_000_000, "quick": 100_000_000, "full": 100_000_000}
_QUICK = Load(250_000_000, 24, 24, 16, 1.0, "redis", 1, steps=24 * 6)
MODES: dict[str, list[Load]] = {
    "smoke": [Load(10_000_000, 4, 4, 4, 0.25, "zmq", 2, steps=4 * 14)],
    "quick": [_QUICK],
    "full": [replace(_QUICK, transport=t, shards=n) for t in ("redis", "zmq") for n in (1, 2)],
    # A syncer host lost (killed, its checkpoint folder deleted): the time to its
    # next round, rebuilt from Redis, against the state's size.
    "takeover": [
        Load(880_000, 4, 12, 4, 0.25, "redis", 1, 12 * 16, kill_shard_at_s=20, lose_state=True),
        replace(_QUICK, kill_shard_at_s=60, lose_state=True),
    ],
}


def owned_by(load: Load, shard: int) -> list[int]:
    """The fragments shard ``shard`` owns (:func:`broker.fragments.owned_fragments`)."""
    return owned_fragments(shard, load.shards, load.fragments)


def plan_of(load: Load) -> FragmentPlan:
    """``fragments`` tensors of equal size (the last takes the remainder): one per fragment."""
    each = load.params // load.fragments
    sizes = [each] * (load.fragments - 1) + [load.params - each * (load.fragments - 1)]
    specs = [ParamSpec(f"w{i}", (n,), "float32") for i, n in enumerate(sizes)]
    return FragmentPlan.build(specs, load.fragments, load.sync_every)


def synthetic_delta(numel: int, codec: Codec, seed: int) -> bytes:
    """What ``ADAM_STEPS`` Adam steps (lr 1, the defaults' betas) make of Gaussian
    gradients, times ``DELTA_SCALE``, encoded by ``codec``: a per-coordinate
    direction drawn N(0, 1) plus N(0, ``GRADIENT_NOISE``^2) noise each step.

    Not a plain Gaussian: int2+zstd packs one 17% smaller than a trained
    model's delta (Adam's normalised steps have lighter tails, so fewer values
    round to 0); these are within 10% of one (``tests/test_scale_bench.py``)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(numel, generator=g)
    m, v, delta = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    beta1, beta2 = 0.9, 0.999
    for t in range(1, ADAM_STEPS + 1):
        grad = direction + GRADIENT_NOISE * torch.randn(numel, generator=g)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        delta += (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt_() + 1e-8)
    return codec.encode(delta * DELTA_SCALE)


def _proc_figure(text: str, key: str) -> int:
    """The number after ``key:`` in a /proc file's text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _rss_bytes(pid: int) -> int:
    return 1024 * _proc_figure(Path(f"/proc/{pid}/status").read_text(), "VmRSS")  # in kB


def _written_bytes(pid: int) -> int:
    return _proc_figure(Path(f"/proc/{pid}/io").read_text(), "write_bytes")


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _command_usec(server: Any) -> dict[str, tuple[int, int]]:
    """Microseconds each Redis command has taken so far, and its calls, by name."""
    stats = _redis_info(server, "commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(s["usec"]), int(s["calls"]))
        for name, s in stats.items()
    }


class Sampler(threading.Thread):
    """Peak resident memory of some processes, sampled every ``period_s``."""

    def __init__(self, pids: list[int], period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pids, self.period_s = pids, period_s
        self.peak = dict.fromkeys(pids, 0)
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            for pid in self.pids:
                with contextlib.suppress(OSError):  # gone
                    self.peak[pid] = max(self.peak[pid], _rss_bytes(pid))


def idle_syncer_rss() -> int:
    """Resident memory of an interpreter with the syncer's imports and nothing else."""
    code = "import syncer.service, pathlib; print(pathlib.Path('/proc/self/status').read_text())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return 1024 * _proc_figure(out.stdout, "VmRSS")  # in kB


# -- the synthetic learner ------------------------------------------------------------
def synthetic_learner(spec: dict[str, Any], results: Any) -> None:
    """One learner's network work for ``spec["steps"]`` steps; puts its figures on ``results``."""
    torch.set_num_threads(1)
    run = RunSettings(**spec["run"])
    plan = FragmentPlan.from_json(spec["plan"])
    folder, learner_id, shards = Path(spec["folder"]), spec["learner_id"], spec["shards"]
    payloads = {p: (folder / f"delta-{p}.bin").read_bytes() for p in range(plan.num_fragments)}
    numel = {p: plan.fragment_numel(p) for p in range(plan.num_fragments)}
    incarnation = time.time_ns()
    transport = connect_learner(
        run.url, run_id=run.run_id, learner_id=learner_id, incarnation=incarnation,
        num_fragments=plan.num_fragments, syncer_shards=run.syncer_shards,
        max_message_bytes=plan.max_message_bytes, keys=run.run_keys("learner"),
        identity=Identity.new(),
    )  # fmt: skip
    # It joins as a learner that starts from the run's initial model does: it
    # holds version 0 of every fragment (the shards just started), so it
    # downloads no weights. The epoch of each shard's lineage comes from one
    # fragment's snapshot per shard.
    first = transport.snapshot(list(range(min(shards, plan.num_fragments))), 60.0)
    header_of_shard = {owner_shard(p, shards): g.without_weights() for p, g in first.items()}
    stamp = {}
    for p in range(plan.num_fragments):
        held = replace(header_of_shard[owner_shard(p, shards)], fragment=p, version=0)
        stamp[p] = (held.epoch, held.version)
        transport.accepted(held)
    sent = backpressured = refused = seq = 0
    last_sent = [0] * plan.num_fragments
    start = time.monotonic()
    for step in range(1, spec["steps"] + 1):
        for p in plan.fragments_due(step):
            seq += 1
            epoch, version = stamp[p]
            delta = Delta(
                run_id=run.run_id, learner_id=learner_id, incarnation=incarnation, seq=seq,
                fragment=p, plan_hash=plan.plan_hash, base_epoch=epoch, base_version=version,
                step=step, c_steps=step - last_sent[p],
                c_tokens=(step - last_sent[p]) * TOKENS_PER_STEP, sent_at=time.time(),
                codec=run.delta_codec, numel=numel[p], payload=payloads[p],
            )  # fmt: skip
            try:
                transport.send_delta(delta)
                sent += 1
                last_sent[p] = step
            except Backpressure:
                backpressured += 1  # its progress goes out with the next delta, as a learner's
        transport.send_heartbeat(
            Heartbeat(
                run_id=run.run_id, learner_id=learner_id, incarnation=incarnation, step=step,
                tokens=step * TOKENS_PER_STEP, step_time_s=spec["step_s"], sent_at=time.time(),
            )
        )  # fmt: skip
        until = start + step * spec["step_s"]
        while (left := until - time.monotonic()) > 0:
            for g in transport.poll(left):
                if (g.epoch, g.version) > stamp[g.fragment]:
                    stamp[g.fragment] = (g.epoch, g.version)
                    transport.accepted(g)
            refused += len(transport.refused_fragments())
    delivered = transport.flush(timeout_s=60.0)
    lost = transport.unacked
    stats = transport.stats
    transport.close()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.monotonic() - start
    results.put(
        {
            "learner": learner_id,
            "deltas_sent": sent,
            "backpressured": backpressured,
            "refusals": refused,
            "delivered": delivered,
            "lost_deltas": lost,
            "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received,
            "cpu_per_s": round((usage.ru_utime + usage.ru_stime) / wall, 3),
            "peak_rss_bytes": usage.ru_maxrss * 1024,
        }
    )


# -- one run ----------------------------------------------------------------------
def _start_syncer(
    load: Load, run: RunSettings, shard: int, folder: Path, log_file: Any
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "syncer", *dataclass_to_args(run)]
    cmd += [
        f"--syncer-id=syncer-{shard}",
        f"--syncer-shard={shard}",
        f"--checkpoint-dir={folder / 'checkpoint'}",
        f"--metrics-file={folder / f'syncer-{shard}.jsonl'}",
    ]
    if load.pin_syncer:
        cmd = ["taskset", "-c", str(shard % (os.cpu_count() or 1)), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"ready":
        raise MeasurementError(f"syncer {shard} did not start; see {folder / 'syncers.log'}")
    return proc


def measure(load: Load, workdir: Path) -> dict[str, Any]:
    from broker.redis.server import RedisServer, free_port

    folder = workdir / load.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    keys = make_keys(folder / "keys")
    plan = plan_of(load)
    print(f"{load.name}: writing the initial model and the deltas", flush=True)
    weights = {
        s.name: torch.randn(s.numel, generator=torch.Generator().manual_seed(i)) * 0.02
        for i, s in enumerate(plan.specs)
    }
    write_initial_model(folder / "initial-model.safetensors", plan, weights)
    del weights
    base = RunSettings()
    for p in range(load.fragments):
        payload = synthetic_delta(plan.fragment_numel(p), base.delta_codec, seed=1000 + p)
        (folder / f"delta-{p}.bin").write_bytes(payload)
    with contextlib.ExitStack() as cleanup:
        redis_server = None
        if load.transport == "redis":
            redis_server = RedisServer(folder / "redis", keys=keys, tls=True)
            redis_server.start()
            cleanup.callback(redis_server.stop)
            url = redis_server.url
        else:
            url = "zmq://" + ",".join(f"127.0.0.1:{free_port()}" for _ in range(load.shards))
        run = replace(
            base, run_id=RUN_ID, url=url, learners=load.learners, fragments=load.fragments,
            sync_every=load.sync_every, steps=load.steps, syncer_shards=load.shards,
            keys=str(folder / "keys"),
            initial_model=str(folder / "initial-model.safetensors"),
        )  # fmt: skip
        log_file = cleanup.enter_context(open(folder / "syncers.log", "ab"))
        syncers: list[subprocess.Popen[bytes]] = []
        cleanup.callback(_stop_all, syncers)
        for shard in range(load.shards):
            syncers.append(_start_syncer(load, run, shard, folder, log_file))
        restart = functools.partial(_start_syncer, load, run, 0, folder, log_file)
        row = _drive(load, run, plan, folder, syncers, redis_server, restart)
    return _report(load, run, plan, folder, row)


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process that still runs, then wait for it (kill after 120 s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _redis_info(server: Any, section: str) -> dict[str, Any]:
    """INFO ``section``, waiting out a server busy with its AOF (a long timeout)."""
    return dict(server.client(socket_timeout=300, socket_connect_timeout=300).info(section))


def _drive(
    load: Load,
    run: RunSettings,
    plan: FragmentPlan,
    folder: Path,
    syncers: list[subprocess.Popen[bytes]],
    redis_server: Any,
    restart_shard_0: Callable[[], subprocess.Popen[bytes]],
) -> dict[str, Any]:
    """Run the synthetic learners against the started syncers (shard 0 killed
    and restarted at ``load.kill_shard_at_s``); the run's raw figures."""
    redis_pid = int(_redis_info(redis_server, "server")["process_id"]) if redis_server else None
    syncer_pids = [s.pid for s in syncers]  # a restarted shard's new process is not sampled
    sampler = Sampler(syncer_pids + ([redis_pid] if redis_pid else []))
    sampler.start()
    redis_written_before = _written_bytes(redis_pid) if redis_pid else 0
    redis_cpu_before = _cpu_s(redis_pid) if redis_pid else 0.0
    commands_before = _command_usec(redis_server) if redis_pid else {}
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    spec = {
        "run": {f.name: getattr(run, f.name) for f in fields(run)},
        "plan": plan.to_json(),
        "folder": str(folder),
        "shards": load.shards,
        "steps": load.steps,
        "step_s": load.step_s,
    }
    learners = [
        ctx.Process(
            target=synthetic_learner, args=(spec | {"learner_id": learner_id_of(m)}, results)
        )
        for m in range(load.learners)
    ]
    print(
        f"{load.name}: {load.learners} learners, {load.steps} steps of {load.step_s} s", flush=True
    )
    started = time.monotonic()
    for proc in learners:
        proc.start()
    kill: dict[str, float] = {}
    checkpoint = folder / "checkpoint"
    lost = (checkpoint / "shard-0" if load.shards > 1 else checkpoint) if load.lose_state else None
    if load.kill_shard_at_s:
        killer = threading.Thread(
            target=_kill_and_restart,
            args=(load.kill_shard_at_s, syncers, restart_shard_0, kill, lost),
        )
        killer.start()
    rows = [results.get(timeout=load.steps * load.step_s + 600) for _ in learners]
    if load.kill_shard_at_s:
        killer.join()
    for proc in learners:
        proc.join()
    seconds = time.monotonic() - started
    redis_written = _written_bytes(redis_pid) - redis_written_before if redis_pid else 0
    redis_cpu = _cpu_s(redis_pid) - redis_cpu_before if redis_pid else 0.0
    redis_commands = None
    if redis_pid:
        redis_commands = {}
        for name, (usec, calls) in _command_usec(redis_server).items():
            usec_before, calls_before = commands_before.get(name, (0, 0))
            if calls > calls_before:
                redis_commands[name] = {
                    "s": round((usec - usec_before) / 1e6, 2),
                    "calls": calls - calls_before,
                }
    redis_peak = int(_redis_info(redis_server, "memory")["used_memory_peak"]) if redis_pid else None
    _stop_all(syncers)
    sampler.stop_event.set()
    sampler.join()
    return {
        "rows": rows,
        "seconds": seconds,
        "redis_written": redis_written if redis_pid else None,
        "redis_cpu": redis_cpu if redis_pid else None,
        "redis_commands": redis_commands,
        "redis_peak": redis_peak,
        "syncer_peaks": [sampler.peak[pid] for pid in syncer_pids],
        "kill": kill,
    }


def _kill_and_restart(
    at_s: float,
    syncers: list[subprocess.Popen[bytes]],
    restart: Callable[[], subprocess.Popen[bytes]],
    times: dict[str, float],
    lost: Path | None,
) -> None:
    """SIGKILL shard 0 ``at_s`` seconds from now and start it again at once
    (from its checkpoint; without it, its folder ``lost`` deleted, from Redis);
    the wall-clock times of both go in ``times``."""
    time.sleep(at_s)
    syncers[0].kill()
    syncers[0].wait()
    times["killed_at"] = time.time()
    if lost is not None:
        shutil.rmtree(lost)
    syncers[0] = restart()
    times["restarted_at"] = time.time()


def _report(
    load: Load, run: RunSettings, plan: FragmentPlan, folder: Path, raw: dict[str, Any]
) -> dict[str, Any]:
    """A run's figures, from its raw ones and the syncers' metrics files."""
    rows, seconds = raw["rows"], raw["seconds"]
    idle = idle_syncer_rss()
    latencies, summaries, applied = [], [], 0
    round_times: list[list[float]] = [[] for _ in range(load.shards)]
    # Every round, with quorum or not (a restarted syncer closes rounds on the
    # learners heard from so far, before all are back).
    any_round_times: list[list[float]] = [[] for _ in range(load.shards)]
    for shard in range(load.shards):
        for line in (folder / f"syncer-{shard}.jsonl").read_text().splitlines():
            e = json.loads(line)
            # Terms merged, by round (written as it closes): a killed shard writes
            # no summary. A learner's deltas folded into one term count once.
            applied += e["included"] if e["event"] == "round" else 0
            if e["event"] == "round":
                any_round_times[shard].append(e["t"])
            if e["event"] == "round" and e.get("quorum_to_publish_s") is not None:
                latencies.append(e["quorum_to_publish_s"])
                round_times[shard].append(e["t"])
            elif e["event"] == "summary":
                summaries.append(e)
    per_shard_params = [
        sum(plan.fragment_numel(p) for p in owned_by(load, s)) for s in range(load.shards)
    ]
    p99 = _percentile(latencies, 0.99)
    lost = sum(r["lost_deltas"] for r in rows)
    budget = run.overlap * load.step_s  # tau steps: what a round's global may take
    return {
        "load": asdict(load) | {"name": load.name},
        "rounds": len(latencies),
        "round_latency_p99_s": p99,
        "round_latency_median_s": _percentile(latencies, 0.5),
        "budget_s": budget,
        "sustains": p99 is not None
        and p99 <= budget
        and lost == 0
        and len(latencies) >= MIN_ROUNDS,
        "lost_deltas": lost,
        "deltas_sent": sum(r["deltas_sent"] for r in rows),
        "deltas_applied": applied,
        # Resent deltas already applied (a killed shard's learners resend).
        "duplicates": sum(s["duplicates"] for s in summaries),
        "deltas_rejected": sum(s["deltas_rejected"] for s in summaries),
        "rejected_by_reason": [s["rejected_by_reason"] for s in summaries],
        "syncer_peak_rss_bytes": raw["syncer_peaks"],
        "idle_interpreter_rss_bytes": idle,
        "syncer_bytes_per_param": max(
            (peak - idle) / n for peak, n in zip(raw["syncer_peaks"], per_shard_params, strict=True)
        ),
        "checkpoint_mb_per_s": sum(s["checkpoint_bytes"] for s in summaries) / seconds / 1e6,
        "redis_peak_bytes": raw["redis_peak"],
        "redis_aof_mb_per_s": (
            None if raw["redis_written"] is None else raw["redis_written"] / seconds / 1e6
        ),
        "redis_cpu_s_per_s": None if raw["redis_cpu"] is None else raw["redis_cpu"] / seconds,
        "redis_commands": raw["redis_commands"],
        "delta_bytes_per_param": (folder / "delta-0.bin").stat().st_size / plan.fragment_numel(0),
        "seconds": seconds,
        "shard_kill": _outage(raw["kill"], round_times, any_round_times) if raw["kill"] else None,
        "learners": rows,
    }


def _outage(
    kill: dict[str, float], round_times: list[list[float]], any_round_times: list[list[float]]
) -> dict[str, Any]:
    """Shard 0's outage, from its kill to its first round at quorum after it (and
    to its first round of any size), and each shard's rounds closed within it."""
    killed_at = kill["killed_at"]
    back = min((t for t in round_times[0] if t > killed_at), default=None)
    first = min((t for t in any_round_times[0] if t > killed_at), default=None)
    end = back if back is not None else math.inf
    return {
        "killed_at": killed_at,
        "restart_ready_s": kill["restarted_at"] - killed_at,
        "first_round_s": None if first is None else first - killed_at,
        "outage_s": None if back is None else back - killed_at,
        "rounds_in_outage_by_shard": [
            sum(1 for t in times if killed_at < t < end) for times in round_times
        ],
    }


def learner_overhead(params: int, workdir: Path) -> dict[str, Any]:
    """What the library adds to a learner's memory per parameter: the resident
    memory of a process training a model of ``params`` parameters (fp32, AdamW,
    so model, gradients and optimizer state are 16 bytes per parameter) before
    it is wrapped, against its peak over 3 x H steps wrapped in
    :class:`~learner.library.DecoupledDiLoCo` at the defaults, against a local
    syncer. Run in a child process, so that nothing else is in its memory."""
    return _in_child(_learner_overhead, params, str(workdir))


def _in_child(target: Any, *args: Any) -> dict[str, Any]:
    """``target(*args, results)`` in a fresh process; the row it puts on ``results``
    (RuntimeError if it exits without one)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, results))
    child.start()
    while True:
        try:
            row: dict[str, Any] = results.get(timeout=1.0)
            break
        except queue.Empty:
            if not child.is_alive():
                exitcode = child.exitcode
                raise MeasurementError(
                    f"{target.__name__} exited ({exitcode}) with no figures"
                ) from None
    child.join()
    return row


def _learner_overhead(params: int, workdir: str, results: Any) -> None:
    from broker.redis.server import free_port
    from learner.library import DecoupledDiLoCo, local_syncer

    torch.set_num_threads(1)
    width = 1024
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)

    def train_step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay: counted in the 16 bytes

    train_step()  # gradients and both Adam moments exist from here on
    sampler = Sampler([os.getpid()], period_s=0.05)
    sampler.start()
    time.sleep(0.3)
    unwrapped = sampler.peak[os.getpid()]
    settings = RunSettings()
    url = f"zmq://127.0.0.1:{free_port()}"
    folder = Path(workdir) / "learner-overhead"
    folder.mkdir(parents=True, exist_ok=True)
    keys = str(folder / "keys")
    with (
        local_syncer(model, url, folder, learners=1, quorum=1, keys=keys),
        DecoupledDiLoCo(model, url, learners=1, quorum=1, keys=keys) as sync,
    ):
        for _ in range(3 * settings.sync_every):
            train_step()
            sync.step(weight=x.shape[0])
            time.sleep(0.05)  # the comm thread's sends and the globals' arrival
    time.sleep(0.3)
    sampler.stop_event.set()
    sampler.join()
    wrapped = sampler.peak[os.getpid()]
    results.put(
        {
            "params": numel,
            "unwrapped_rss_bytes": unwrapped,
            "wrapped_peak_rss_bytes": wrapped,
            "overhead_bytes_per_param": round((wrapped - unwrapped) / numel, 2),
        }
    )


@dataclass(frozen=True)
class MemoryLoad:
    """A memory-only run: one shard's fragment states driven as the service
    drives them, without transport or learners."""

    params: int  # of the fragments the shard owns
    fragments: int  # P
    sync_every: int  # H
    learners: int  # M deltas per round
    rounds: int  # per fragment


MEMORY = {
    # 40M in the smoke: at 10M the resident memory's noise (tens of MB) is as
    # large as what is measured (8 to 15 bytes per parameter from run to run).
    "smoke": MemoryLoad(40_000_000, 4, 4, 4, 6),
    "quick": MemoryLoad(250_000_000, 24, 24, 16, 6),
    "full": MemoryLoad(1_000_000_000, 24, 24, 16, 6),
}


def shard_memory(load: MemoryLoad) -> dict[str, Any]:
    """A shard's memory per parameter of its fragments: ``fragments`` fragment
    states (:class:`syncer.fragment_state.FragmentState`, the defaults, one
    pool of packed rows as the service has) through ``rounds`` rounds each of
    ``learners`` int2+zstd deltas (:func:`synthetic_delta`), on bases spread
    over the kept versions (learner m's on the version m mod S behind, so that
    every kept change enters the close), each round closed and its
    checkpoint state taken, fragment after fragment as their rounds close in
    turn. ``held_bytes_per_param``: resident memory after the rounds, less
    that before the states were made; ``peak_bytes_per_param``: the peak
    during the rounds, less the same. In a child process, so that nothing
    else is in its memory."""
    return _in_child(_shard_memory, load)


def _shard_memory(load: MemoryLoad, results: Any) -> None:
    from syncer.buffers import PackedRows
    from syncer.config import OuterConfig
    from syncer.fragment_state import ACCEPTED, FragmentState

    torch.set_num_threads(1)
    status = Path("/proc/self/status")
    run = RunSettings(
        learners=load.learners, quorum=load.learners,
        fragments=load.fragments, sync_every=load.sync_every,
    )  # fmt: skip
    outer = OuterConfig(max_tokens_per_step=1 << 20)
    each = load.params // load.fragments
    payload = synthetic_delta(each, run.delta_codec, seed=0)
    FragmentState(0, torch.zeros(4096), outer, run, published_s=0.0)  # compiles the close
    before = 1024 * _proc_figure(status.read_text(), "VmRSS")
    rows = PackedRows(each, run.delta_codec)
    states = []
    for p in range(load.fragments):
        weights = 0.02 * torch.randn(each, generator=torch.Generator().manual_seed(p))
        states.append(FragmentState(p, weights, outer, run, published_s=0.0, rows=rows))
        del weights
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on (VmHWM)
    refused = 0
    started = time.monotonic()
    for r in range(load.rounds):
        wall_s = 10.0 * (r + 1)
        for state in states:
            for m in range(load.learners):
                base = max(state.version - m % outer.staleness, state.versions.kept[0])
                delta = Delta(
                    run_id=RUN_ID, learner_id=f"learner-{m}", incarnation=1, seq=r + 1,
                    fragment=state.fragment, base_version=base, step=load.sync_every * (r + 1),
                    c_steps=load.sync_every, c_tokens=load.sync_every * TOKENS_PER_STEP,
                    codec=run.delta_codec, numel=each, payload=payload,
                )  # fmt: skip
                offered = state.offer(
                    delta, state.decode(delta), None, 0.0, wall_s=wall_s, step_s=None
                )
                refused += offered != ACCEPTED
            state.close(wall_s + 1.0, load.learners)
            state.state()  # what a checkpoint reads (written straight from these tensors)
    text = status.read_text()
    held, peak = (1024 * _proc_figure(text, key) - before for key in ("VmRSS", "VmHWM"))
    results.put(
        {
            "load": asdict(load),
            "held_bytes_per_param": round(held / load.params, 2),
            "peak_bytes_per_param": round(peak / load.params, 2),
            "packed_rows": len(rows.scales),
            "refused_deltas": refused,
            "seconds": round(time.monotonic() - started, 1),
        }
    )


def _percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (the nearest rank at or above it), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: 10M parameters, two ZeroMQ shards")
    which.add_argument("--quick", action="store_true", help="250M parameters over Redis, one shard")
    which.add_argument(
        "--takeover", action="store_true", help="a lost syncer host at 0.88M and 250M, over Redis"
    )
    ap.add_argument("--out", default="benchmarks/results/scale")
    args = ap.parse_args(argv)
    mode = next((m for m in ("smoke", "quick", "takeover") if getattr(args, m)), "full")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="ddiloco-scale-"))
    runs = []
    try:
        for load in MODES[mode]:
            runs.append(measure(load, workdir))
            shown = {k: v for k, v in runs[-1].items() if k != "learners"}
            print(json.dumps(shown, indent=1), flush=True)
        memory = learner = None  # the takeover runs measure the outage only
        if mode != "takeover":
            memory = shard_memory(MEMORY[mode])
            print(json.dumps({"shard_memory": memory}), flush=True)
            learner = learner_overhead(LEARNER_PARAMS[mode], workdir)
            print(json.dumps({"learner_overhead": learner}), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    path = out / f"scale-{mode}.json"
    report = {
        "benchmark": "scale",
        "mode": mode,
        "runs": runs,
        "shard_memory": memory,
        "learner_overhead": learner,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
