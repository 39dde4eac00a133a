"""The syncer service in-process against real ZeroMQ sockets: rounds, durability,
de-duplication across a restart, rejections, Prometheus metrics, and attacks on
its roster (driven through ``Syncer.handle`` with the clocks passed in)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from prometheus_client import generate_latest

from broker.errors import ConfigError
from broker.identity.keys import RunKeys
from broker.redis.names import changes_key, globals_stream_key, model_key, resume_key
from broker.redis.server import RedisServer, free_port
from broker.redis.users import SYNCER_USER
from broker.run.settings import GONE_AFTER_HEARTBEATS, RunSettings
from broker.transport import Inbound
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import Delta, GlobalFragment, Heartbeat
from broker.zmq.learner import ZmqLearnerTransport
from broker.zmq.options import ZmqOptions
from compose.processes import free_port_pair
from learner.config import WorkloadConfig
from learner.model import ModelConfig
from learner.workload import write_initial
from syncer.checkpoint import fragment_path, load_fragment, read_changes
from syncer.config import OuterConfig, SyncerConfig
from syncer.service import Syncer
from tests.servers import run_keys, take_globals, wait_until

pytestmark = pytest.mark.integration
TINY = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=16)


def make_syncer(
    tmp_path: Path,
    port: int,
    quorum: int = 2,
    grace_gamma: float = 0.0,
    learners: int = 2,
    clocks: tuple[Callable[[], float], Callable[[], float]] | None = None,
    outer: dict[str, Any] | None = None,
    url: str | None = None,
    **overrides: object,
) -> Syncer:
    """A syncer started from an initial model file, as `ddiloco init` writes it;
    ``clocks``: (monotonic, wall) to pass in instead of the real ones."""
    run = RunSettings(
        run_id="svc",
        url=url or f"zmq://127.0.0.1:{port}",
        learners=learners,
        quorum=quorum,
        fragments=2,
        sync_every=2,
        overlap=1,
        initial_model=str(tmp_path / "initial.safetensors"),
        keys=run_keys(),
    )
    if not Path(run.initial_model).exists():
        write_initial(run, WorkloadConfig(model=TINY))
    settings: dict[str, object] = dict(
        run=run,
        outer=OuterConfig(
            grace_gamma=grace_gamma, outer_lr=1.0, outer_momentum=0.0, **(outer or {})
        ),
        checkpoint_dir=str(tmp_path / "ck"),
        metrics_file=str(tmp_path / "events.jsonl"),
        # No learner here holds a version a fresh syncer could take back: none is
        # waited for (tests/test_recall.py and the fault tests wait, as deployed).
        recall_s=0.0,
    )
    settings.update(overrides)
    cfg = SyncerConfig(**settings)  # type: ignore[arg-type]
    if clocks is None:
        return Syncer(cfg)
    return Syncer(cfg, clock=clocks[0], wall_clock=clocks[1])


def snapshot(learner: ZmqLearnerTransport, syncer: Syncer) -> dict[int, GlobalFragment]:
    got: dict[int, GlobalFragment] = {}

    def complete() -> bool:
        syncer.step()
        got.update(learner.snapshot([0, 1], timeout_s=0.1))
        return len(got) == 2

    wait_until(complete, 20, what="snapshot")
    return got


def subscribed(learner: ZmqLearnerTransport, syncer: Syncer, held: GlobalFragment) -> None:
    """Wait until ``learner``'s subscription reaches the syncer's PUB (a learner's
    handshake waits for its enrollment; a broadcast before it is missed, and
    the learner would then fetch the round whole): the syncer announces the
    version the learner holds until the learner hears one."""
    heard = learner.stats.messages_received

    def announced() -> bool:
        syncer.transport.announce(held)
        syncer.step()
        learner.poll(0.02)
        return learner.stats.messages_received > heard

    wait_until(announced, 20, what="learner subscribed")


def delta_for(g: GlobalFragment, learner: str, seq: int, shift: float, **kw: object) -> Delta:
    """A learner that moved every weight of the fragment by -shift."""
    fields: dict[str, object] = dict(
        run_id="svc",
        learner_id=learner,
        incarnation=1,
        seq=seq,
        fragment=g.fragment,
        plan_hash=g.plan_hash,
        base_epoch=g.epoch,
        base_version=g.version,
        step=10,
        c_steps=2,  # H: a learner's first delta covers at most that
        c_tokens=100,
        sent_at=time.time(),
        codec="fp32",
        numel=g.numel,
        payload=Codec().encode(torch.full((g.numel,), shift)),
    )
    fields.update(kw)
    return Delta(**fields)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_round_checkpoint_publish_ack_and_exactly_once_across_restart(tmp_path: Path) -> None:
    port = free_port_pair()
    metrics_port = free_port()
    syncer = make_syncer(tmp_path, port, metrics_port=metrics_port)
    keys = RunKeys.load(run_keys(), "learner")
    a = ZmqLearnerTransport(
        [f"tcp://127.0.0.1:{port}"],
        "svc",
        "a",
        1,
        2,
        keys=keys,
        options=ZmqOptions(ack_timeout_s=0.3),
    )
    b = ZmqLearnerTransport(
        [f"tcp://127.0.0.1:{port}"],
        "svc",
        "b",
        1,
        2,
        keys=keys,
        options=ZmqOptions(ack_timeout_s=0.3),
    )
    try:
        start = snapshot(a, syncer)[0]
        assert start.version == 0
        w0 = start.tensor()
        subscribed(a, syncer, start)
        a.send_delta(delta_for(start, "a", 1, 0.1))
        b.send_delta(delta_for(start, "b", 1, 0.3))
        b.send_delta(delta_for(start, "b", 2, 0.3, plan_hash="ffffffffffffffff"))
        new: list[GlobalFragment] = []

        def published() -> bool:
            syncer.step()
            new.extend(take_globals(a, 0.01))
            b.poll(0.01)
            return any(g.version == 1 for g in new) and a.unacked == 0 and b.unacked == 0

        wait_until(published, 20, what="round 1 published and acked")
        g1 = next(g for g in new if g.version == 1 and g.fragment == 0)
        assert g1.is_change  # the default global codec sends changes
        v1 = apply_change(w0, g1.tensor())
        # lr 1, momentum 0: the new global is the mean of the learners' weights, to
        # within the default int2 codec's bf16 scale (2**-8 of the change).
        assert torch.allclose(v1, w0 - 0.2, atol=0.2 * 2**-8)
        assert fragment_path(tmp_path / "ck", 0).exists()
        assert syncer.metrics.rejected["wrong_plan"] == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'ddiloco_syncer_rounds_total{fragment="0"} 1.0' in body
        assert 'ddiloco_syncer_deltas_rejected_total{reason="wrong_plan"} 1.0' in body
        syncer.transport.close()
        syncer._lock.close()  # as when the process dies: its lock goes with it

        # Restart from the checkpoint: version 1 is back, and replaying an applied
        # delta (a learner that never saw the ack would resend it) is refused.
        restarted = make_syncer(tmp_path, port)
        assert restarted.states[0].version == 1
        assert torch.equal(restarted.states[0].weights, v1)
        a.send_delta(delta_for(start, "a", 1, 0.1))

        def replay_acked() -> bool:
            restarted.step()
            a.poll(0.01)
            return a.unacked == 0

        wait_until(replay_acked, 20, what="replay acknowledged")
        assert restarted.metrics.duplicates == 1 and restarted.metrics.deltas_applied == 0
        assert restarted.states[0].version == 1
        restarted.transport.close()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_round_closes_at_once_when_every_live_learner_reported(tmp_path: Path) -> None:
    port = free_port_pair()
    syncer = make_syncer(tmp_path, port, quorum=1, grace_gamma=0.9)
    a = ZmqLearnerTransport(
        [f"tcp://127.0.0.1:{port}"], "svc", "a", 1, 2, keys=RunKeys.load(run_keys(), "learner")
    )
    try:
        start = snapshot(a, syncer)[1]
        # A long step time would make the grace window long; with the only live
        # learner reported, the round must not wait for it.
        a.send_heartbeat(Heartbeat(run_id="svc", learner_id="a", step=1, step_time_s=100.0))
        a.send_delta(delta_for(start, "a", 1, 0.5))
        wait_until(
            lambda: (syncer.step(), syncer.metrics.rounds)[1] == 1, 10, what="round to close"
        )
        assert syncer.states[1].version == 1
    finally:
        syncer.transport.close()
        a.close()


# -- attacks on the roster, with the clocks passed in ----------------------------------
class Clock:
    """A clock that moves only when told to."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def delta_on(syncer: Syncer, learner: str, seq: int, shift: float, **kw: object) -> Inbound:
    """A delta of ``learner`` on fragment 0's current version, as received (no ack token)."""
    state = syncer.states[0]
    g = GlobalFragment(
        run_id="svc",
        fragment=0,
        plan_hash=syncer.plan.plan_hash,
        epoch=state.epoch,
        version=state.version,
        numel=state.numel,
    )
    return Inbound(delta_for(g, learner, seq, shift, **kw))


def heartbeat(learner: str, step_time_s: float = 0.05) -> Inbound:
    return Inbound(
        Heartbeat(run_id="svc", learner_id=learner, incarnation=1, step=1, step_time_s=step_time_s)
    )


def events_of(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(60)
def test_fake_heartbeats_neither_hold_a_round_open_nor_make_a_quorum(tmp_path: Path) -> None:
    """Attack: heartbeats under ten made-up ids, claiming 5 s steps. Before: they
    were live learners, so a round waited for them (up to a grace window their
    step times had stretched to 4.5 s); and once they went quiet they still
    counted as known learners, so a round closed with two of K = 3 reports
    ("fewer live than K <= known"). Now only the roster counts: the round waits
    for the third real learner, then closes the moment it reports."""
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    syncer = make_syncer(
        tmp_path, free_port_pair(), quorum=3, learners=3, grace_gamma=0.9, clocks=(clock, wall)
    )
    fakes = [heartbeat(f"fake-{i}", step_time_s=5.0) for i in range(10)]
    try:
        syncer.handle(fakes)
        clock.t = 106.0  # the fakes have gone quiet; a and b report
        syncer.handle([delta_on(syncer, "a", 1, 0.1), delta_on(syncer, "b", 1, 0.1)])
        assert syncer.metrics.rounds == 0 and syncer.states[0].pending_learners == ["a", "b"]
        clock.t = 107.0
        # 1 s steps: a and b are waited for while their deltas are 2 H = 4 s old.
        syncer.handle([heartbeat("a", 1.0), heartbeat("b", 1.0)])
        assert syncer.metrics.rounds == 0  # two of K = 3: no quorum
        clock.t = 108.0  # the fakes are back, and c reports
        syncer.handle(
            [*fakes, heartbeat("a", 1.0), heartbeat("b", 1.0), delta_on(syncer, "c", 1, 0.1)]
        )
        assert syncer.metrics.rounds == 1 and syncer.states[0].version == 1  # at once
        assert syncer.metrics.heartbeats_ignored == 20
        summary = syncer.summary()
        assert summary["heartbeats_ignored"] == 20 and summary["roster"] == ["a", "b", "c"]
        assert syncer.live_learners(108.0) == {"a", "b", "c"}
    finally:
        syncer.transport.close()


@pytest.mark.timeout(60)
def test_a_cluster_started_below_its_quorum_still_merges_and_says_why(tmp_path: Path) -> None:
    """M = 4 (K = 3) but two learners run: rounds used to wait for the third for
    ever, so nothing was merged. Now a round whose every live learner reported
    waits three heartbeat timeouts for the missing, closes, and the syncer says so
    once; from then on K follows the learners that joined (K = 2 of 2)."""
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    syncer = make_syncer(tmp_path, free_port_pair(), quorum=0, learners=4, clocks=(clock, wall))
    wait_s = GONE_AFTER_HEARTBEATS * syncer.cfg.run.heartbeat_timeout_s
    try:
        syncer.handle([delta_on(syncer, "a", 1, 0.1), delta_on(syncer, "b", 1, 0.1)])
        # Slow steps (5 s, the most a heartbeat is credited with): a and b are
        # waited for while their deltas are 2 H x 5 = 20 s old.
        for t in range(101, int(100.0 + wait_s)):  # both alive and heard
            clock.t = t
            syncer.handle([heartbeat("a", 5.0), heartbeat("b", 5.0)])
        assert syncer.metrics.rounds == 0 and syncer.quorum() == 3
        clock.t = 100.0 + wait_s
        syncer.handle([heartbeat("a", 5.0), heartbeat("b", 5.0)])
        assert syncer.metrics.rounds == 1 and syncer.states[0].version == 1
        assert syncer.quorum() == 2
        syncer.handle([delta_on(syncer, "a", 2, 0.1)])
        assert syncer.metrics.rounds == 1
        syncer.handle([delta_on(syncer, "b", 2, 0.1)])
        assert syncer.metrics.rounds == 2  # at once: K = 2 reported, no grace (gamma 0)
        warnings = [e for e in events_of(tmp_path) if e["event"] == "short_run"]
        assert [(e["roster"], e["quorum"]) for e in warnings] == [(2, 3)]
    finally:
        syncer.transport.close()


@pytest.mark.timeout(60)
def test_made_up_ids_on_the_roster_cannot_raise_the_quorum(tmp_path: Path) -> None:
    """Attack: ten made-up ids each get one delta accepted (the roster has room
    for 64, as the compose file gives it), then only send heartbeats. Had K
    followed the roster up (M = 13, K = 12), every round would wait for their
    reports for ever: they are live and never report. K stays M - 1 = 3, so the
    honest learners' round closes at their quorum."""
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    syncer = make_syncer(
        tmp_path, free_port_pair(), quorum=0, learners=4, clocks=(clock, wall),
        outer={"max_learners": 64},
    )  # fmt: skip
    fakes = [f"fake-{i}" for i in range(10)]
    try:
        syncer.handle([delta_on(syncer, name, 1, 0.1) for name in fakes])
        assert len(syncer.roster) == 10 and syncer.quorum() == 3
        rounds = syncer.metrics.rounds
        clock.t = 101.0
        beats = [heartbeat(name) for name in fakes]
        honest = [delta_on(syncer, name, 1, 0.1) for name in ("a", "b", "c")]
        syncer.handle([*beats, *honest])
        assert syncer.quorum() == 3 and syncer.metrics.rounds == rounds + 1  # at once: grace 0
    finally:
        syncer.transport.close()


@pytest.mark.timeout(60)
def test_every_refusal_is_counted_by_reason(tmp_path: Path) -> None:
    """Attacks on a run of two learners, each refused and counted: a made-up id
    while both learners are alive (roster_full; before, any id was taken in),
    a learner claiming nanosecond steps in its heartbeats and then a million
    steps in a delta (too_many_steps; before, no bound), a delta 1000x its
    peer's (quarantined, with the refuse option), and a replay (a duplicate,
    acked, counted beside the refusals). A new id is taken in once a member
    has been silent past the heartbeat timeout."""
    clock, wall = Clock(1.0), Clock(1_700_000_000.0)
    syncer = make_syncer(
        tmp_path, free_port_pair(), clocks=(clock, wall), outer={"quarantine_action": "refuse"}
    )
    try:
        syncer.handle(
            [heartbeat("a"), delta_on(syncer, "a", 1, 0.1), delta_on(syncer, "b", 1, 0.1)]
        )
        # a joined with its delta, so its heartbeat of the same batch counts
        assert syncer.metrics.rounds == 1 and syncer.metrics.heartbeats_ignored == 0
        clock.t = 2.0
        syncer.handle([heartbeat("z"), delta_on(syncer, "z", 1, 0.1)])
        assert (
            syncer.metrics.rejected == {"roster_full": 1} and syncer.metrics.heartbeats_ignored == 1
        )
        clock.t = 3.0
        syncer.handle([heartbeat("a", 1e-9), heartbeat("b", 0.5)])
        syncer.handle([delta_on(syncer, "a", 2, 0.1, c_steps=10**6, c_tokens=10**6)])
        syncer.handle([delta_on(syncer, "b", 1, 0.1)])  # replayed: already applied
        assert syncer.metrics.rejected["too_many_steps"] == 1 and syncer.metrics.duplicates == 1
        clock.t = 4.0
        syncer.handle([delta_on(syncer, "a", 3, 0.1), delta_on(syncer, "b", 2, 100.0)])
        assert syncer.metrics.rounds == 2 and syncer.metrics.rejected["quarantined"] == 1
        assert syncer.states[0].applied["b"] == (1, 1)  # its refused delta used no key
        for t in range(5, 20, 4):  # a heard all along, b silent since 4.0
            clock.t = float(t)
            syncer.handle([heartbeat("a")])
        clock.t = 20.0  # z may take b's place
        syncer.handle([heartbeat("a"), delta_on(syncer, "z", 2, 0.1)])
        assert sorted(syncer.roster.members) == ["a", "z"]
        syncer.shutdown()  # merges z's delta, writes the summary
    finally:
        syncer.transport.close()
    events = events_of(tmp_path)
    summary = next(e for e in events if e["event"] == "summary")
    by_reason = {"roster_full": 1, "too_many_steps": 1, "quarantined": 1}
    assert summary["rejected_by_reason"] == by_reason
    assert summary["deltas_rejected"] == 3 and summary["duplicates"] == 1
    assert summary["heartbeats_ignored"] == 1 and summary["roster"] == ["a", "z"]
    rejects = sorted(e["reason"] for e in events if e["event"] == "reject")
    assert rejects == sorted(by_reason)
    assert [e["replaced"] for e in events if e["event"] == "roster_replace"] == ["b"]
    body = generate_latest(syncer.metrics.prometheus.registry).decode()
    assert 'ddiloco_syncer_deltas_rejected_total{reason="quarantined"} 1.0' in body
    assert "ddiloco_syncer_deltas_duplicate_total 1.0" in body
    assert "ddiloco_syncer_heartbeats_ignored_total 1.0" in body


def test_two_syncers_cannot_share_a_checkpoint_folder(tmp_path: Path) -> None:
    first = make_syncer(tmp_path, free_port_pair())
    try:
        with pytest.raises(ValueError, match="in use by another syncer"):
            make_syncer(tmp_path, free_port_pair())
    finally:
        first.shutdown()
    second = make_syncer(tmp_path, free_port_pair())  # free again once the first is gone
    second.shutdown()


def test_a_syncer_without_its_checkpoint_rebuilds_from_redis_and_never_throws_a_run_away(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A syncer restarted on an empty checkpoint folder used to start over at
    version 0 while the run's globals sat in Redis, then to refuse to start.
    Now it rebuilds from the latest global and state Redis keeps, in the same
    epoch; where Redis has the global but not that state (a run of an earlier
    release) it refuses, unless told to start a new epoch."""
    first = make_syncer(tmp_path, 0, url=redis_server.url)
    epoch, version = first.states[0].epoch, first.states[0].version
    weights = first.states[0].weights.clone()
    first.shutdown()
    rebuilt = make_syncer(tmp_path, 0, url=redis_server.url, checkpoint_dir=str(tmp_path / "a"))
    assert (rebuilt.states[0].epoch, rebuilt.states[0].version) == (epoch, version)
    assert torch.equal(rebuilt.states[0].weights, weights)
    rebuilt.shutdown()
    admin = redis.Redis.from_url(
        redis_server.url,
        username=SYNCER_USER,
        password=RunKeys.load(run_keys(), "syncer").redis_password,
    )
    resume_keys = [resume_key("svc", p) for p in (0, 1)]
    admin.delete(*resume_keys)  # as a run of an earlier release left Redis
    with pytest.raises(ConfigError, match="already has globals"):
        make_syncer(tmp_path, 0, url=redis_server.url, checkpoint_dir=str(tmp_path / "b"))
    again = make_syncer(tmp_path, 0, url=redis_server.url)  # its own folder: same epoch
    assert again.states[0].epoch == epoch
    again.shutdown()
    admin.delete(*resume_keys)
    told = make_syncer(
        tmp_path, 0, url=redis_server.url, checkpoint_dir=str(tmp_path / "b"), new_epoch=True
    )
    assert told.states[0].epoch != epoch
    told.shutdown()


def test_a_successor_writes_nothing_redis_holds_before_its_first_round(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A syncer that takes a shard over from Redis (its host's disk lost) serves
    without writing the weights Redis holds again (1 GB at 250M parameters):
    its next change follows the list Redis holds. The rebuilt version's state
    goes to its own folder beside the rounds (4 bytes per parameter, where the
    first round wrote 8 on its path), and the first round appends its record
    after it."""
    first = make_syncer(tmp_path, 0, url=redis_server.url)
    first.handle([delta_on(first, "a", 1, 0.1), delta_on(first, "b", 1, 0.1)])
    assert first.states[0].version == 1
    first.shutdown()
    admin = redis.Redis.from_url(
        redis_server.url,
        username=SYNCER_USER,
        password=RunKeys.load(run_keys(), "syncer").redis_password,
    )
    weights, stream = admin.get(model_key("svc", 0)), admin.xlen(globals_stream_key("svc"))
    listed = admin.llen(changes_key("svc", 0))
    successor = make_syncer(tmp_path, 0, url=redis_server.url, checkpoint_dir=str(tmp_path / "a"))
    try:
        assert successor.states[0].version == 1
        assert admin.get(model_key("svc", 0)) == weights
        assert admin.xlen(globals_stream_key("svc")) == stream  # nothing published
        successor.handle([delta_on(successor, "a", 2, 0.1), delta_on(successor, "b", 2, 0.1)])
        assert successor.states[0].version == 2
        assert admin.get(model_key("svc", 0)) == weights  # the change went to the list
        assert admin.llen(changes_key("svc", 0)) == listed + 1
        saved = load_fragment(tmp_path / "a", 0)
        assert saved is not None and saved[1]["version"] == 1
        assert set(saved[0]) == {"version.1"}  # no master, no momentum: the version is both
        assert [r[0] for r in read_changes(tmp_path / "a", 0)] == [2]
    finally:
        successor.shutdown()
