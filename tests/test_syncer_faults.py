"""Fault tests of the syncer as a real process: SIGKILL at each boundary of its
delta pipeline (receive -> merge -> checkpoint -> publish -> ack), over real
ZeroMQ sockets and a real Redis with AOF.

The test process plays two learners with real transports (heartbeats, resends
of what is unacked): each sends a delta of each fragment whenever that
fragment has moved since its last one, ROUNDS deltas in all, and at the end
the syncer is told to drain (SIGUSR1, as ``ddiloco local`` does). Then every
delta must be acknowledged and in exactly one round: the syncer's event log
(both processes append to it) names each round's deltas, and only the round
the kill interrupted after its checkpoint is missing from it; the
checkpoint's versions count the rounds, so a round merged again would show.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from broker.connect import connect_learner, lease_shard
from broker.identity.keys import RunKeys
from broker.redis.frames import FIELD
from broker.redis.names import globals_stream_key
from broker.redis.server import RedisServer
from broker.run.initial_model import read_initial_model
from broker.run.settings import RunSettings
from broker.transport import LearnerTransport
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import Delta, GlobalFragment, Heartbeat, decode, weights_checksum
from compose.failover import FailoverRedis
from compose.processes import free_port_pair
from learner.config import WorkloadConfig
from learner.join import GlobalDecoder
from learner.library import MIN_QUEUED_BYTES
from learner.model import ModelConfig
from learner.workload import write_initial
from syncer.checkpoint import load_fragment, read_changes
from syncer.config import CRASH_POINTS, SyncerConfig
from tests.servers import run_keys, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
TINY = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=16)
FRAGMENTS = 2
ROUNDS = 3  # deltas per learner and fragment; the kill comes in the first round
SHIFTS = {"a": 0.01, "b": 0.03}  # what each learner moves every weight by, per delta


def run_flags(url: str, initial_model: Path) -> list[str]:
    """The settings syncer and learners share (``ddiloco syncer`` and ``ddiloco learner``)."""
    return [
        "--keys",
        run_keys(),
        "--run-id",
        "faults",
        "--url",
        url,
        "--learners",
        "2",
        "--quorum",
        "2",
        "--fragments",
        str(FRAGMENTS),
        "--sync-every",
        "2",
        "--overlap",
        "1",
        # Liveness and idle republishing within a second: a restart is seen soon.
        "--heartbeat-timeout-s",
        "1",
        "--initial-model",
        str(initial_model),
    ]


class SyncerProcess:
    """``ddiloco syncer`` as a child process on one checkpoint folder."""

    def __init__(self, tmp_path: Path, url: str) -> None:
        self.tmp_path = tmp_path
        self.url = url
        self.checkpoint_dir = tmp_path / "ck"
        self.events_path = tmp_path / "events.jsonl"
        self.initial_model = tmp_path / "initial.safetensors"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(tmp_path / "syncer.log", "ab")  # noqa: SIM115 (closed in stop())

    def start(self, *extra: str) -> None:
        """Start (or start again) the syncer. Its first start asks no learner for
        the run's latest globals (``--recall-s 0``, as ``ddiloco local`` starts
        it): its learners start after it and hold none."""
        if self.proc is None:
            extra = ("--recall-s", "0", *extra)
        args = [
            sys.executable,
            "-m",
            "compose.cli",
            "syncer",
            *run_flags(self.url, self.initial_model),
            "--grace-gamma",
            "0",
            "--outer-lr",
            "1",
            "--outer-momentum",
            "0",
            "--checkpoint-dir",
            str(self.checkpoint_dir),
            "--metrics-file",
            str(self.events_path),
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=self.log, env=env)

    def returncode(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(line) for line in self.events_path.read_text().splitlines()]

    def events_rounds(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == "round"]


def applied_keys(events: list[dict[str, Any]]) -> Counter[tuple[str, int, int]]:
    """How often each (learner, incarnation, seq) was merged into a global."""
    return Counter(tuple(k) for e in events if e["event"] == "round" for k in e["keys"])


@pytest.fixture
def compose_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """Redis as compose starts it: the run's users, TLS, AOF with appendfsync always."""
    server = RedisServer(tmp_path / "redis", keys=Path(run_keys()), tls=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["zmq", "redis"])
def broker_url(request: pytest.FixtureRequest) -> str:
    if request.param == "zmq":
        # Resend after half a second: the restarted syncer gets the unacked deltas soon.
        return f"zmq://127.0.0.1:{free_port_pair()}?ack_timeout_s=0.5"
    return str(request.getfixturevalue("compose_redis").url)


def delta_on(g: GlobalFragment, learner: str, seq: int) -> Delta:
    """Learner ``learner``'s delta on global ``g``: every weight moved by its shift."""
    return Delta(
        run_id="faults",
        learner_id=learner,
        incarnation=1,
        seq=seq,
        fragment=g.fragment,
        plan_hash=g.plan_hash,
        base_epoch=g.epoch,
        base_version=g.version,
        step=2 * seq,
        c_steps=2,
        c_tokens=100,
        sent_at=time.time(),
        codec=Codec("fp32"),
        numel=g.numel,
        payload=Codec("fp32").encode(torch.full((g.numel,), SHIFTS[learner])),
    )


def write_initial_model(tmp_path: Path) -> None:
    """The initial model of the run both fault tests drive."""
    run = RunSettings(
        run_id="faults",
        learners=2,
        fragments=FRAGMENTS,
        sync_every=2,
        overlap=1,
        initial_model=str(tmp_path / "initial.safetensors"),
    )
    write_initial(run, WorkloadConfig(model=TINY))


def test_crash_at_names_a_pipeline_boundary() -> None:
    assert SyncerConfig(crash_at="before_ack").crash_at == "before_ack"
    with pytest.raises(ValueError, match="crash_at='after_merge': choose one of"):
        SyncerConfig(crash_at="after_merge")


def ready_lines(syncer: SyncerProcess) -> int:
    return (syncer.tmp_path / "syncer.log").read_text().count("ready\n")


class TwoLearners:
    """The two learners the pipeline fault tests play, with real transports:
    each sends a delta of each fragment whenever that fragment has moved since
    its last one, ROUNDS deltas of each in all."""

    def __init__(self, url: str, syncer: SyncerProcess) -> None:
        self.syncer = syncer
        self.transports: dict[str, LearnerTransport] = {
            name: connect_learner(
                url,
                run_id="faults",
                learner_id=name,
                incarnation=1,
                num_fragments=FRAGMENTS,
                keys=RunKeys.load(run_keys(), "learner"),
            )  # fmt: skip
            for name in SHIFTS
        }
        # What each learner holds, as real learners keep it: it answers a ZeroMQ
        # syncer that lost its checkpoint.
        plan = read_initial_model(syncer.initial_model).plan
        self.decoders = {name: GlobalDecoder(plan, t) for name, t in self.transports.items()}
        self.latest: dict[int, GlobalFragment] = {}
        self.seqs = dict.fromkeys(SHIFTS, 0)
        self.fragment_of: dict[tuple[str, int, int], int] = {}  # every delta sent
        self.last_base: dict[tuple[str, int], int] = {}  # (learner, fragment): its last base

    def turn(self) -> None:
        """One turn of the learners' loop."""
        for name, transport in self.transports.items():
            # As real learners do: a restarted syncer counts a learner as live
            # only once heard from, and closes a round without the silent ones.
            transport.send_heartbeat(
                Heartbeat(run_id="faults", learner_id=name, incarnation=1, step_time_s=0.05)
            )
            for g in transport.poll(0.05):  # also resends what is unacked
                self.decoders[name].decode(g)
                if g.fragment not in self.latest or g.version > self.latest[g.fragment].version:
                    self.latest[g.fragment] = g
            for p, g in self.latest.items():
                sent = sum(1 for key, q in self.fragment_of.items() if key[0] == name and q == p)
                if sent < ROUNDS and self.last_base.get((name, p), -1) < g.version:
                    self.seqs[name] += 1
                    transport.send_delta(delta_on(g, name, self.seqs[name]))
                    self.fragment_of[(name, 1, self.seqs[name])] = p
                    self.last_base[(name, p)] = g.version

    def applied_in_checkpoint(self) -> bool:
        """Every delta sent is recorded as applied by the checkpoint of its fragment."""
        saved = [durable_state(self.syncer.checkpoint_dir, p) for p in range(FRAGMENTS)]
        applied = [s[1]["applied"] if s else {} for s in saved]
        return all(
            (inc, seq) <= tuple(applied[p].get(learner, (0, 0)))
            for (learner, inc, seq), p in self.fragment_of.items()
        )

    def all_sent_and_acked(self) -> bool:
        if len(self.fragment_of) < len(SHIFTS) * FRAGMENTS * ROUNDS:
            return False
        # The learners are done: merge what waits for a quorum that cannot come.
        # (Redis acks a learner's delta when it is in the stream, not merged.)
        assert self.syncer.proc is not None
        self.syncer.proc.send_signal(signal.SIGUSR1)
        return all(t.unacked == 0 for t in self.transports.values()) and (
            self.applied_in_checkpoint()
        )

    def hold_the_checkpoint(self) -> bool:
        """Each fragment's latest global is its checkpoint's version: none frozen."""
        saved = [durable_state(self.syncer.checkpoint_dir, p) for p in range(FRAGMENTS)]
        return all(s and s[1]["version"] == self.latest[p].version for p, s in enumerate(saved))

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()


def play_to_the_end(learners: TwoLearners, keep_going: Callable[[], bool]) -> None:
    """Turn the learners' loop (``keep_going``, true once the syncer may finish)
    until every delta is sent and acked, then until they hold the checkpoint's
    versions."""
    wait_until(
        lambda: keep_going() and learners.all_sent_and_acked(),
        90, interval_s=0.3, what="every delta sent and acked",
    )  # fmt: skip
    wait_until(
        lambda: (keep_going() or True) and learners.hold_the_checkpoint(),
        10, what="the learners to get the last globals",
    )  # fmt: skip


def check_applied_once(
    learners: TwoLearners, unlogged: int, refusable: frozenset[str] = frozenset()
) -> None:
    """Nothing acknowledged lost, nothing merged twice, every version published
    once, and the learners' last globals are the checkpoint's weights; ``unlogged``:
    rounds durable but never logged (a kill between checkpoint and log);
    ``refusable``: reasons a refusal may have (none by default)."""
    syncer, fragment_of = learners.syncer, learners.fragment_of
    assert learners.applied_in_checkpoint()  # nothing acknowledged lost
    events = syncer.events()
    refused = [e for e in events if e["event"] == "reject" and e["reason"] not in refusable]
    assert not refused, "acknowledged, then refused"
    keys = applied_keys(events)
    assert max(keys.values()) == 1, "a delta merged twice"
    assert set(keys) <= set(fragment_of)
    missing = set(fragment_of) - set(keys)
    for p in range(FRAGMENTS):
        saved = durable_state(syncer.checkpoint_dir, p)
        assert saved is not None
        weights, meta = saved
        logged = [e["version"] for e in events if e["event"] == "round" and e["fragment"] == p]
        assert len(logged) == len(set(logged)), "a version published twice"
        # Each round adds one version: a round merged again would add one more.
        unlogged -= meta["version"] - len(logged)
        assert learners.latest[p].version == meta["version"]
        # The learners' last global makes exactly the checkpoint's version (a
        # change names the checksum of the weights it makes).
        assert learners.latest[p].weights_crc == weights_checksum(weights)
    assert unlogged == 0
    # The unlogged round's deltas are all of one fragment, applied (checked above).
    assert len({fragment_of[key] for key in missing}) <= 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_syncer_killed_at_a_pipeline_boundary_loses_nothing_and_applies_nothing_twice(
    tmp_path: Path, broker_url: str, crash_at: str
) -> None:
    write_initial_model(tmp_path)
    syncer = SyncerProcess(tmp_path, broker_url)
    syncer.start("--crash-at", crash_at)
    learners = TwoLearners(broker_url, syncer)
    restarts = 0

    def keep_going() -> bool:
        """One turn of the learners' loop; restart the syncer once it was killed."""
        nonlocal restarts
        code = syncer.returncode()
        if code is not None:
            assert code == -signal.SIGKILL and restarts == 0, f"syncer exited with {code}"
            restarts += 1
            syncer.start()  # the same folder, without --crash-at
        learners.turn()
        return True

    try:
        play_to_the_end(learners, lambda: keep_going() and ready_lines(syncer) >= 2)
    finally:
        learners.close()
        syncer.stop()

    assert restarts == 1, f"the syncer never reached {crash_at}"
    # Killed after its checkpoint, one round is durable but never logged.
    check_applied_once(learners, 1 if crash_at in ("after_checkpoint", "before_ack") else 0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("successor", ["same_host", "another_host"])
def test_a_syncer_whose_checkpoint_folder_is_lost_resumes_from_redis_in_the_same_epoch(
    tmp_path: Path, compose_redis: RedisServer, successor: str
) -> None:
    """The syncer's host is lost between a round's publish and its acks (SIGKILL,
    then its checkpoint folder deleted): a new syncer finds no checkpoint,
    rebuilds each fragment from the latest global and state Redis keeps, in the
    same epoch (not the initial model), and the run goes on with nothing
    acknowledged lost and nothing applied twice (the unacked deltas the lost
    round merged come again and are known). On another host (another syncer
    id: another consumer of the group) it takes the dead one's pending deltas
    at once under its term, not after claim_idle_s (here 600 s, past the test)."""
    url = f"{compose_redis.url}?claim_idle_s=600"
    elsewhere = ["--syncer-id", "elsewhere"] if successor == "another_host" else []
    learners, _ = play_through_a_lost_host(tmp_path, url, *elsewhere)
    # A rebuilt fragment keeps only its latest version: a delta on an older one
    # (sent while the syncer was down) is refused stale, as docs/design.md says.
    check_applied_once(learners, 1, refusable=frozenset({"stale"}))


def play_through_a_lost_host(
    tmp_path: Path, url: str, *restart_args: str
) -> tuple[TwoLearners, list[int]]:
    """Kill the syncer between a round's publish and its acks, delete its
    checkpoint folder (the host and its disk are gone), start another
    (``restart_args``) and play the learners to the end. It must rebuild in
    the same epoch. The learners, and the fragments whose killed round's
    global reached them before the folder went."""
    write_initial_model(tmp_path)
    syncer = SyncerProcess(tmp_path, url)
    syncer.start("--crash-at", "before_ack")
    learners = TwoLearners(url, syncer)
    epochs: dict[int, int] = {}
    lost_round_held = []

    def keep_going() -> bool:
        if syncer.returncode() is not None and not epochs:
            for _ in range(5):  # what the kill let out has arrived by now
                learners.turn()
            epochs.update({p: g.epoch for p, g in learners.latest.items()})
            logged = {(e["fragment"], e["version"]) for e in syncer.events_rounds()}
            for p in range(FRAGMENTS):  # the killed round's version, if it got out
                saved = durable_state(syncer.checkpoint_dir, p)
                version = -1 if saved is None else saved[1]["version"]
                if version > 0 and (p, version) not in logged:
                    lost_round_held.extend([p] if learners.latest[p].version == version else [])
            shutil.rmtree(syncer.checkpoint_dir)  # the host and its disk are gone
            syncer.start(*restart_args)
        learners.turn()
        return True

    try:
        play_to_the_end(learners, lambda: keep_going() and ready_lines(syncer) >= 2)
    finally:
        learners.close()
        syncer.stop()
    assert {p: g.epoch for p, g in learners.latest.items()} == epochs  # the same lineage
    # Every version past the first went out as a change, which Redis and the
    # learners keep: the momentum goes on from the one that made a version
    # taken back (the first version has none, and no momentum either).
    said = re.search(
        r"rebuilt from the run's latest globals \((.*)\), .*momentum estimated from the "
        r"last change for (.*), from zero",
        (tmp_path / "syncer.log").read_text(),
    )
    assert said is not None
    made_by_a_change = [int(p) for p, v in re.findall(r"(\d+)@v(\d+)", said[1]) if int(v) > 0]
    assert said[2] == (str(made_by_a_change) if made_by_a_change else "none")
    return learners, lost_round_held


@pytest.mark.timeout(180)
def test_a_zmq_syncer_whose_checkpoint_folder_is_lost_takes_the_learners_latest_back(
    tmp_path: Path,
) -> None:
    """Over ZeroMQ no broker keeps globals: the syncer's host is lost between
    a round's publish and its acks (SIGKILL, its checkpoint folder deleted),
    and a new syncer asks the learners what they hold, checks the run's
    signature on their latest version and takes it back with the state
    published with it, in the same epoch. Nothing acknowledged is lost and
    nothing applied twice. Whether the lost round's global reached the
    learners before the kill is up to the kernel: if it did, the rebuilt
    state knows its deltas when they come again (not merged twice); if not,
    they are merged anew on the version before."""
    url = f"zmq://127.0.0.1:{free_port_pair()}?ack_timeout_s=0.5"
    learners, lost_round_held = play_through_a_lost_host(tmp_path, url)
    check_applied_once(learners, len(lost_round_held), refusable=frozenset({"stale"}))


def globals_in_redis(server: RedisServer) -> list[GlobalFragment]:
    """Every global on the run's globals stream, in the order it was written."""
    client = server.client()
    try:
        entries = client.xrange(globals_stream_key("faults"))
    finally:
        client.close()
    return [decode(fields[FIELD]) for _, fields in entries]


def frozen_in_first_round(syncer: SyncerProcess, learners: TwoLearners) -> None:
    """Drive the learners until ``syncer`` (started with ``--pause-at``) stops itself."""
    proc = syncer.proc
    assert proc is not None
    wait_until(
        lambda: learners.turn() or stopped(proc.pid),
        60, interval_s=0.1, what="the active syncer frozen in its first round",
    )  # fmt: skip


def assert_fenced_once(syncer: SyncerProcess) -> None:
    """The syncer woke under term 1 after another took its shard: one write
    refused, and its log says why."""
    fenced = [e for e in syncer.events() if e["event"] == "fenced"]
    assert len(fenced) == 1 and fenced[0]["refused_writes"] == 1 and fenced[0]["term"] == 1
    assert "another syncer took it over" in (syncer.tmp_path / "syncer.log").read_text()


@pytest.mark.timeout(180)
def test_a_syncer_frozen_past_its_lease_is_fenced_when_it_wakes(
    tmp_path: Path, compose_redis: RedisServer
) -> None:
    """Split brain. The active syncer freezes in the middle of a round (SIGSTOP
    after its merge) for longer than its lease; a standby with a checkpoint
    folder of its own (another host) waits, taking nothing, then takes the
    shard under the next term, rebuilds from Redis and serves the learners.
    Let go (SIGCONT), the old syncer goes on to publish its round: Redis
    refuses the write (its term is not the shard's), the syncer counts it and
    stops. It published and acknowledged nothing more, and every delta is in
    the new syncer's lineage exactly once."""
    url = compose_redis.url
    write_initial_model(tmp_path)
    (tmp_path / "standby").mkdir()
    shutil.copy(tmp_path / "initial.safetensors", tmp_path / "standby" / "initial.safetensors")
    active = SyncerProcess(tmp_path, url)
    active.start("--pause-at", "after_update")
    standby = SyncerProcess(tmp_path / "standby", url)
    learners = TwoLearners(url, active)
    try:
        frozen_in_first_round(active, learners)
        standby.start()
        learners.syncer = standby
        wait_until(
            lambda: learners.turn() or ready_lines(standby) >= 1,
            60, interval_s=0.1, what="the standby to take the shard",
        )  # fmt: skip
        wait_until(
            lambda: learners.turn() or len(standby.events_rounds()) >= 2,
            60, interval_s=0.1, what="the standby's rounds",
        )  # fmt: skip
        active.proc.send_signal(signal.SIGCONT)
        assert active.proc.wait(timeout=30) == 2  # it stopped, saying why
        wait_until(
            lambda: (learners.turn() or True) and learners.all_sent_and_acked(),
            90, interval_s=0.3, what="every delta sent and acked",
        )  # fmt: skip
        wait_until(
            lambda: (learners.turn() or True) and learners.hold_the_checkpoint(),
            10, what="the learners to get the last globals",
        )  # fmt: skip
    finally:
        learners.close()
        standby.stop()
        active.stop()

    assert_fenced_once(active)
    assert (
        "rebuilt from the run's latest globals" in (tmp_path / "standby" / "syncer.log").read_text()
    )
    # One lineage: each fragment's versions on the stream go up one at a time,
    # and no version was published twice with other weights.
    published: dict[tuple[int, int], int] = {}
    for g in globals_in_redis(compose_redis):
        assert published.setdefault((g.fragment, g.version), g.weights_crc) == g.weights_crc
    check_applied_once(learners, 0)


@pytest.mark.timeout(180)
def test_a_zmq_syncer_frozen_past_its_lease_writes_nothing_when_it_wakes(
    tmp_path: Path, compose_redis: RedisServer
) -> None:
    """Split brain over ZeroMQ, with a lease store (a Redis as compose starts
    it). The active syncer freezes in the middle of a round (SIGSTOP after its
    merge) past its lease, and a syncer of another host takes the shard under
    the next term. Let go (SIGCONT), the old syncer writes nothing: no
    checkpoint, no global, no ack; it counts the refused write and stops."""
    url = f"zmq://127.0.0.1:{free_port_pair()}?ack_timeout_s=0.5"
    write_initial_model(tmp_path)
    active = SyncerProcess(tmp_path, url)
    active.start("--pause-at", "after_update", "--lease-store", compose_redis.url)
    learners = TwoLearners(url, active)
    successor = lease_shard(
        url, lease_store=compose_redis.url, run_id="faults", syncer_shards=1,
        holder="another-host:1", ttl_s=3.0, keys=RunKeys.load(run_keys(), "syncer"),
    )  # fmt: skip
    assert successor is not None
    try:
        frozen_in_first_round(active, learners)
        written = {f: f.stat().st_mtime_ns for f in active.checkpoint_dir.rglob("*")}
        versions = {p: g.version for p, g in learners.latest.items()}
        unacked = {n: t.unacked for n, t in learners.transports.items()}
        assert sum(unacked.values()) > 0  # the frozen round's deltas
        assert successor.take(timeout_s=30, only=0) == 0 and successor.term == 2
        active.proc.send_signal(signal.SIGCONT)
        wait_until(
            lambda: learners.turn() or active.returncode() is not None,
            30, interval_s=0.1, what="the woken syncer to stop",
        )  # fmt: skip
        assert active.returncode() == 2  # it stopped, saying why
        for _ in range(10):  # anything it sent would have arrived by now
            learners.turn()
    finally:
        successor.close()
        learners.close()
        active.stop()

    assert_fenced_once(active)
    assert {f: f.stat().st_mtime_ns for f in active.checkpoint_dir.rglob("*")} == written
    assert {p: g.version for p, g in learners.latest.items()} == versions
    assert {n: t.unacked for n, t in learners.transports.items()} == unacked
    assert not active.events_rounds()  # the frozen round was never finished


def joiner_versions(url: str) -> dict[int, int]:
    """The version of each fragment a learner joining now reads from the broker."""
    joiner = connect_learner(
        url, run_id="faults", learner_id="joiner", incarnation=1,
        num_fragments=FRAGMENTS, keys=RunKeys.load(run_keys(), "learner"),
    )  # fmt: skip
    try:
        snapshot = joiner.snapshot(list(range(FRAGMENTS)), timeout_s=10)
    finally:
        joiner.close()
    return {p: g.version for p, g in snapshot.items()}


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pause_at", CRASH_POINTS)
def test_redis_killed_at_a_pipeline_boundary_loses_nothing_and_freezes_no_fragment(
    tmp_path: Path, compose_redis: RedisServer, pause_at: str
) -> None:
    """Redis as compose starts it (the run's redis.acl, TLS, AOF always) is
    SIGKILLed and restarted while the syncer stands at each boundary of its
    pipeline: nothing acknowledged is lost or merged twice, every round goes
    on, and a joiner reads each fragment's latest version from Redis."""
    server = compose_redis
    write_initial_model(tmp_path)
    syncer = SyncerProcess(tmp_path, server.url)
    syncer.start("--pause-at", pause_at)
    learners = TwoLearners(server.url, syncer)
    redis_restarts = 0

    def keep_going() -> bool:
        """One turn of the learners' loop; kill and restart Redis while the syncer
        stands at ``pause_at``, then let it go on."""
        nonlocal redis_restarts
        assert syncer.proc is not None and syncer.returncode() is None
        if stopped(syncer.proc.pid):
            server.kill()
            server.start()  # the same port, folder and flags
            redis_restarts += 1
            syncer.proc.send_signal(signal.SIGCONT)
        learners.turn()
        return True

    try:
        play_to_the_end(learners, keep_going)
        joined = joiner_versions(server.url)
    finally:
        learners.close()
        syncer.stop()

    assert redis_restarts == 1, f"the syncer never reached {pause_at}"
    check_applied_once(learners, 0)
    assert joined == {p: g.version for p, g in learners.latest.items()}
    assert "NOPERM" not in (server.workdir / "redis.log").read_text()


@pytest.fixture
def failover_redis(tmp_path: Path) -> Iterator[FailoverRedis]:
    """A primary, a replica and three Sentinels, as compose.sentinel.yaml runs them."""
    cluster = FailoverRedis(tmp_path / "redis", Path(run_keys()))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_lost_redis_primary_fails_over_and_the_run_loses_nothing(
    tmp_path: Path, failover_redis: FailoverRedis
) -> None:
    """The primary's host is lost (SIGKILL, its data deleted) while the syncer
    stands between publishing a round and acknowledging its deltas; it comes
    back empty 3 s later. The Sentinels promote the replica, the syncer and the
    learners follow it, the old primary comes back as its replica: nothing any
    learner delivered is lost, nothing merged twice, every round goes on, and
    a joiner reads each fragment's latest version."""
    cluster = failover_redis
    write_initial_model(tmp_path)
    syncer = SyncerProcess(tmp_path, cluster.url)
    syncer.start("--pause-at", "before_ack")
    learners = TwoLearners(cluster.url, syncer)
    killed_at: list[float] = []

    def keep_going() -> bool:
        assert syncer.proc is not None and syncer.returncode() is None
        if not killed_at and stopped(syncer.proc.pid):
            cluster.kill("a", lose_data=True)
            killed_at.append(time.monotonic())
            syncer.proc.send_signal(signal.SIGCONT)
        if len(killed_at) == 1 and time.monotonic() > killed_at[0] + 3:
            cluster.start_node("a")  # an empty host: it must not come back as the primary
            killed_at.append(time.monotonic())
        learners.turn()
        return True

    try:
        play_to_the_end(learners, keep_going)
        assert cluster.wait_settled() == "b"
        joined = joiner_versions(cluster.url)
    finally:
        learners.close()
        syncer.stop()

    assert len(killed_at) == 2, "the syncer never paused before its ack"
    check_applied_once(learners, 0)
    assert joined == {p: g.version for p, g in learners.latest.items()}
    assert "as a replica" in (cluster.node_dir("a") / "node.log").read_text()


def durable_state(directory: Path, p: int) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """Fragment p's durable state as a restart reads it (syncer/checkpoint.py),
    rebuilt here: the full state's current version and small state, then each
    logged round's change applied as learners apply it, and its small state."""
    saved = load_fragment(directory, p)
    if saved is None:
        return None
    tensors, meta = saved
    weights = tensors[f"version.{meta['version']}"]
    for version, change, logged in read_changes(directory, p):
        if version > meta["version"]:
            codec = Codec.parse(logged["codec"])
            weights = apply_change(weights, codec.decode(change, weights.numel()))
            meta = logged
    return weights, meta


# -- SIGSTOP: a process frozen for 30 s, then let go ---------------------------------
PAUSE_S = 30.0  # part of the target: longer than every timeout on the way
MAX_UNACKED = 4  # small, so that a 30 s outage fills the learners' bounded queues


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


@pytest.mark.timeout(420)
def test_syncer_learner_and_redis_each_frozen_30s_the_run_goes_on_and_loses_nothing(
    tmp_path: Path, compose_redis: RedisServer
) -> None:
    """SIGSTOP for 30 s, then SIGCONT, of the syncer, then of Redis, then of a
    learner, in one run of two real learners. After each the run goes on (new
    rounds, learners step on); in the end every delta in Redis was acked by the
    syncer, none merged twice, both learners delivered everything, and their
    queues and memory stayed bounded while the broker or the syncer was gone."""
    redis_server = compose_redis
    url = f"{redis_server.url}?max_unacked={MAX_UNACKED}"
    write_initial_model(tmp_path)
    syncer = SyncerProcess(tmp_path, url)
    syncer.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    learners: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"learner-{i}.jsonl" for i in range(2)]
    for i in range(2):
        args = [
            sys.executable,
            "-m",
            "compose.cli",
            "learner",
            *run_flags(url, syncer.initial_model),
            *("--model-seq-len", "16", "--model-n-layer", "1"),
            *("--model-n-head", "2", "--model-d-model", "16"),
            *("--batch-size", "4", "--warmup-steps", "1", "--log-every", "1"),
            # Paced, and more steps than the test lasts: both outlive the three
            # pauses (learner-1 sits out one) and stop when asked (SIGTERM).
            *("--steps", "100000", "--slowdown", "20"),
            *("--learner-id", f"learner-{i}", "--shard", str(i), "--num-shards", "2"),
            *("--finish-timeout-s", "60", "--metrics-file", str(logs[i])),
        ]
        out = open(tmp_path / f"learner-{i}.out", "wb")  # noqa: SIM115 (the child holds it)
        learners.append(subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=out, env=env))

    def steps_of(i: int) -> int:
        return max((e["step"] for e in jsonl(logs[i]) if e["event"] == "step"), default=0)

    def rounds_after(t: float) -> int:
        return sum(1 for e in syncer.events() if e["event"] == "round" and e["t"] > t)

    try:
        wait_until(lambda: min(steps_of(0), steps_of(1)) >= 20, 120, what="both learners training")
        wait_until(lambda: rounds_after(0) >= 2, 60, what="the first rounds")
        assert redis_server.proc is not None and syncer.proc is not None
        rss_before = rss_bytes(learners[0].pid)
        # learner-1 last: it must outlive the other pauses and then its own.
        for name, pid in [
            ("syncer", syncer.proc.pid),
            ("redis", redis_server.proc.pid),
            ("learner-1", learners[1].pid),
        ]:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(PAUSE_S)  # the fault itself: the process is frozen this long
            os.kill(pid, signal.SIGCONT)
            resumed_at, step_at = time.time(), steps_of(1)
            wait_until(lambda t=resumed_at: rounds_after(t) >= 2, 90, what=f"rounds after {name}")
            wait_until(lambda s=step_at: steps_of(1) > s + 5, 90, what=f"learner-1 after {name}")
            assert learners[1].poll() is None, f"learner-1 ended during the {name} pause"
            if name == "redis":  # learner-0 ran through both outages: what did they cost it?
                assert learners[0].poll() is None, "learner-0 ended before the redis pause did"
                rss_after = rss_bytes(learners[0].pid)
        for proc in learners:
            proc.terminate()  # a graceful stop: the learner sends what it has, then exits 0
        for proc in learners:
            proc.wait(timeout=120)
        # The learners are done: merge what waits for them, then stop the syncer.
        syncer.proc.send_signal(signal.SIGUSR1)
        client = redis_server.client()  # the syncers' user

        def all_acked() -> bool:
            """Every delta in the streams delivered to the syncer and acked by it."""
            for key in client.scan_iter(match="ddiloco:faults:deltas:*"):
                last = client.xinfo_stream(key)["last-generated-id"]
                for group in client.xinfo_groups(key):
                    if group["pending"] or group["last-delivered-id"] != last:
                        return False
            return True

        wait_until(all_acked, 30, what="the syncer to ack every delta in redis")
        client.close()
    finally:
        for proc in learners:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        syncer.stop()

    done = [e for log in logs for e in jsonl(log) if e["event"] == "done"]
    assert len(done) == 2 and all(e["delivered"] and e["stopped_early"] for e in done), done
    assert all(p.returncode == 0 for p in learners)
    events = syncer.events()
    keys = applied_keys(events)
    assert keys and max(keys.values()) == 1, "a delta merged twice"
    # A learner frozen for 30 s comes back on old versions: only staleness may refuse.
    assert {e["reason"] for e in events if e["event"] == "reject"} <= {"stale"}
    # Bounded: the transport holds at most MAX_UNACKED deltas, the comm thread at
    # most its byte bound (for this small model, the floor) of raw deltas.
    steps = [e for log in logs for e in jsonl(log) if e["event"] == "step"]
    assert max(e["unacked"] for e in steps) <= MAX_UNACKED
    assert max(e["queued_bytes"] for e in steps) <= MIN_QUEUED_BYTES
    assert rss_after - rss_before < 64 * 2**20, (rss_before, rss_after)
