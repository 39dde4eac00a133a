"""ZeroMQ transport against real sockets on loopback and a real consumer process."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import zmq

from broker.redis.server import free_port
from broker.transport import Backpressure, Inbound
from broker.wire import messages as wire
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, GlobalFragment, Heartbeat
from broker.zmq.learner import ZmqLearnerTransport
from broker.zmq.options import ZmqOptions
from broker.zmq.syncer import ZmqSyncerTransport
from tests.servers import take_globals, wait_until

pytestmark = pytest.mark.integration
RUN = "test"
PLAN = "0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent


def endpoint() -> str:
    # ROUTER on port, PUB on port + 1: find two free neighbours.
    while True:
        port = free_port()
        try:
            with zmq.Context() as ctx, ctx.socket(zmq.PUB) as s:
                s.bind(f"tcp://127.0.0.1:{port + 1}")
            return f"tcp://127.0.0.1:{port}"
        except zmq.ZMQError:
            continue


def delta(learner: str, seq: int, fragment: int, incarnation: int = 1) -> Delta:
    return Delta(
        run_id=RUN,
        learner_id=learner,
        incarnation=incarnation,
        seq=seq,
        fragment=fragment,
        plan_hash=PLAN,
        base_version=0,
        step=seq,
        c_steps=1,
        c_tokens=16,
        sent_at=time.time(),
        codec="fp32",
        numel=4,
        payload=torch.full((4,), float(seq)).numpy().tobytes(),
    )


def global_fragment(fragment: int, version: int) -> GlobalFragment:
    return GlobalFragment(
        run_id=RUN,
        fragment=fragment,
        plan_hash=PLAN,
        version=version,
        codec="fp32",
        numel=4,
        payload=torch.full((4,), float(version)).numpy().tobytes(),
        sent_at=time.time(),
    )


def wait_subscribed(syncer: ZmqSyncerTransport, learner: ZmqLearnerTransport) -> None:
    """Publish version 1 of fragment 0 until the learner's subscription takes it."""

    def first() -> bool:
        syncer.publish(global_fragment(0, 1))
        return bool(take_globals(learner, 0.05))

    wait_until(first, 10, what="subscription to connect")


class Consumer:
    """tests/transport_consumer.py as a real process that can be SIGKILLed."""

    def __init__(self, bind: str, db: Path, fragments: str = "0,1,2,3") -> None:
        self.bind, self.db, self.fragments = bind, db, fragments
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.transport_consumer",
                "--backend",
                "zmq",
                "--url",
                self.bind,
                "--run",
                RUN,
                "--db",
                str(self.db),
                "--fragments",
                self.fragments,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == b"ready"

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def counts(self) -> tuple[int, int]:
        if not self.db.exists():
            return 0, 0
        with sqlite3.connect(self.db, timeout=10) as db:
            total, distinct = db.execute(
                "SELECT COUNT(*), COUNT(DISTINCT learner || '/' || incarnation || '/' || seq)"
                " FROM applied"
            ).fetchone()
        return int(total), int(distinct)


def run_learner(bind: str | list[str], name: str, n: int, errors: list[BaseException]) -> None:
    try:
        binds = [bind] if isinstance(bind, str) else bind
        t = ZmqLearnerTransport(
            binds,
            RUN,
            name,
            1,
            4,
            syncer_shards=len(binds),
            options=ZmqOptions(max_unacked=64, ack_timeout_s=1.0),
        )
        try:
            for seq in range(1, n + 1):
                d = delta(name, seq, seq % 4)
                while True:
                    try:
                        t.send_delta(d)
                        break
                    except Backpressure:
                        t.poll(0.01)
            assert t.flush(120), f"{name}: {t.unacked} deltas never acknowledged"
        finally:
            t.close()
    except BaseException as e:  # surfaced by the test thread
        errors.append(e)


def send_from_learners(
    bind: str | list[str], learners: int, per_learner: int
) -> tuple[list[threading.Thread], list[BaseException]]:
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=run_learner, args=(bind, f"learner-{i}", per_learner, errors))
        for i in range(learners)
    ]
    for th in threads:
        th.start()
    return threads, errors


@pytest.mark.timeout(180)
def test_ten_thousand_deltas_from_four_learners_exactly_once(tmp_path: Path) -> None:
    bind = endpoint()
    consumer = Consumer(bind, tmp_path / "applied.sqlite")
    consumer.start()
    try:
        threads, errors = send_from_learners(bind, 4, 2500)
        for th in threads:
            th.join(timeout=170)
        assert not errors, errors
        assert consumer.counts() == (10_000, 10_000)
    finally:
        consumer.stop()


@pytest.mark.timeout(240)
def test_consumer_sigkilled_and_restarted_applies_every_delta_once(tmp_path: Path) -> None:
    bind = endpoint()
    consumer = Consumer(bind, tmp_path / "applied.sqlite")
    consumer.start()
    rng = random.Random(7)
    try:
        threads, errors = send_from_learners(bind, 4, 1000)
        for kill in range(3):
            target = rng.randint(500, 1200) * (kill + 1)
            wait_until(lambda t=target: consumer.counts()[0] >= t, 60, what=f"{target} applied")
            consumer.kill()
            consumer.start()
        for th in threads:
            th.join(timeout=200)
        assert not errors, errors
        assert consumer.counts() == (4000, 4000)
    finally:
        consumer.stop()


@pytest.mark.timeout(30)
def test_backpressure_while_no_syncer_then_resend_after_it_starts(tmp_path: Path) -> None:
    bind = endpoint()
    learner = ZmqLearnerTransport(
        [bind], RUN, "l0", 1, 4, options=ZmqOptions(max_unacked=8, ack_timeout_s=0.2)
    )
    try:
        for seq in range(1, 9):
            learner.send_delta(delta("l0", seq, 0))
        with pytest.raises(Backpressure):
            learner.send_delta(delta("l0", 9, 0))
        learner.send_heartbeat(Heartbeat(run_id=RUN, learner_id="l0", step=9))
        assert learner.stats.messages_sent == 0  # IMMEDIATE: nothing queued to nobody
        syncer = ZmqSyncerTransport(bind, RUN, [0, 1, 2, 3], identity_hold_s=15.0)
        try:
            got: dict[int, int] = {}
            arrivals: list[Delta | Heartbeat] = []

            def delivered() -> bool:
                learner.poll(0.02)
                items = syncer.receive(0.02)
                for i in items:
                    if isinstance(i.message, (Delta, Heartbeat)):
                        arrivals.append(i.message)
                    if isinstance(i.message, Delta):
                        got[i.message.seq] = got.get(i.message.seq, 0) + 1
                syncer.ack(items)
                return learner.unacked == 0

            wait_until(delivered, 20, what="all deltas acknowledged")
            assert sorted(got) == list(range(1, 9))
            # Heartbeats are liveness only: the one sent to nobody is not owed.
            assert not any(isinstance(m, Heartbeat) and m.step == 9 for m in arrivals)
        finally:
            syncer.close()
    finally:
        learner.close()


@pytest.mark.timeout(30)
def test_late_joiner_gets_latest_snapshot_then_later_versions() -> None:
    bind = endpoint()
    syncer = ZmqSyncerTransport(bind, RUN, [0, 1, 2], identity_hold_s=15.0)
    learner = None
    try:
        for version in range(1, 4):
            for p in range(3):
                syncer.publish(global_fragment(p, version * 10 + p))
        learner = ZmqLearnerTransport([bind], RUN, "late", 1, 3)
        result: dict[int, GlobalFragment] = {}

        def serve() -> None:
            while len(result) < 3:
                syncer.receive(0.02)

        server = threading.Thread(target=serve)
        server.start()
        result.update(learner.snapshot([0, 1, 2], timeout_s=10))
        server.join(timeout=10)
        assert {p: g.version for p, g in result.items()} == {0: 30, 1: 31, 2: 32}
        assert result[1].tensor().tolist() == [31.0] * 4

        # Globals published after the snapshot arrive in order through PUB/SUB.
        def next_versions() -> dict[int, int]:
            syncer.publish(global_fragment(0, 40))
            return {g.fragment: g.version for g in take_globals(learner, 0.05)}

        assert wait_until(next_versions, 10, what="version 40 over PUB/SUB") == {0: 40}
    finally:
        if learner:
            learner.close()
        syncer.close()


@pytest.mark.timeout(30)
def test_a_request_that_could_not_go_out_is_tried_again_without_backing_off() -> None:
    """A learner asks before its connection is up (a restart asks at once): the
    request is not sent, so it must not wait out the backoff meant for requests
    that went out (it did: every restarted learner trained 0.5 s late)."""
    bind = endpoint()
    learner = ZmqLearnerTransport([bind], RUN, "early", 1, 1)
    syncer = None
    try:
        learner.resync(0)
        learner.poll(0.0)  # no syncer: the request cannot go out
        due, retry_s = learner._awaiting[0]
        assert learner.stats.bytes_sent == 0
        assert due - time.monotonic() <= 0.02 and retry_s == 0.5  # soon, backoff untouched
        syncer = ZmqSyncerTransport(bind, RUN, [0], identity_hold_s=15.0)
        syncer.publish(global_fragment(0, 7))

        def answered() -> list[GlobalFragment]:
            syncer.receive(0.0)
            return take_globals(learner, 0.02)

        assert [g.version for g in wait_until(answered, 10, what="the snapshot")] == [7]
        assert learner.stats.bytes_sent > 0
    finally:
        learner.close()
        if syncer:
            syncer.close()


@pytest.mark.timeout(30)
def test_subscriber_that_missed_messages_notices_the_gap_and_resyncs() -> None:
    bind = endpoint()
    syncer = ZmqSyncerTransport(
        bind, RUN, [0], options=ZmqOptions(send_hwm=1), identity_hold_s=15.0
    )
    learner = ZmqLearnerTransport([bind], RUN, "gappy", 1, 1)
    try:
        learner._subs[0].setsockopt(zmq.RCVHWM, 1)  # drop freely on the receive side too
        wait_subscribed(syncer, learner)
        for version in range(2, 2001):
            syncer.publish(global_fragment(0, version))
        seen: list[int] = []

        def caught_up() -> bool:
            seen.extend(g.version for g in take_globals(learner, 0.02))
            syncer.receive(0.0)  # answers the snapshot request
            return bool(seen) and seen[-1] == 2000

        wait_until(caught_up, 15, what="learner to reach version 2000")
        assert learner.gaps >= 1
        assert seen == sorted(seen)
    finally:
        learner.close()
        syncer.close()


@pytest.mark.timeout(30)
def test_every_version_that_arrived_between_two_polls_is_offered() -> None:
    """Globals are changes, each from the version before it: a learner that did not
    poll while a dozen arrived (it was joining) needs all of them. Only the newest
    4 were kept, so it could apply none, trained on its join version and had its
    first deltas refused as stale."""
    bind = endpoint()
    syncer = ZmqSyncerTransport(bind, RUN, [0], identity_hold_s=15.0)
    learner = ZmqLearnerTransport([bind], RUN, "busy", 1, 1)
    try:
        wait_subscribed(syncer, learner)
        for version in range(2, 14):
            syncer.publish(global_fragment(0, version))
        time.sleep(0.3)  # all of them reach the learner's socket before it polls
        assert [g.version for g in take_globals(learner, 1.0)] == list(range(2, 14))
        assert learner.gaps == 0 and not learner._awaiting
    finally:
        learner.close()
        syncer.close()


@pytest.mark.timeout(30)
def test_bad_frames_are_counted_and_good_deltas_still_arrive() -> None:
    bind = endpoint()
    syncer = ZmqSyncerTransport(
        bind, RUN, [0, 1], options=ZmqOptions(max_message_bytes=1024), identity_hold_s=15.0
    )
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(bind)
    try:
        good = wire.encode(delta("l0", 1, 0))
        big = Delta(**{**delta("l0", 2, 0).__dict__, "numel": 1000, "payload": bytes(4000)})
        raw.send(b"garbage!" * 8)
        raw.send(good[:-3])  # truncated
        raw.send(good[:20] + bytes([good[20] ^ 0xFF]) + good[21:])  # corrupt
        raw.send(wire.encode(big))  # over the 1 KiB limit
        raw.send(wire.encode(delta("l0", 3, 5)))  # fragment not owned here
        raw.send(wire.encode(Delta(**{**delta("l0", 4, 0).__dict__, "run_id": "other"})))
        raw.send(wire.encode(global_fragment(0, 1)))  # wrong direction
        raw.send_multipart([b"a", b"b"])  # two frames
        raw.send(wire.encode(Heartbeat(run_id=RUN, learner_id="l0", step=3, sent_at=1.0)))
        raw.send(good)
        got: list[wire.Message] = []

        def all_in() -> bool:
            got.extend(i.message for i in syncer.receive(0.05))
            return sum(syncer.stats.rejected.values()) >= 8 and len(got) >= 2

        wait_until(all_in, 10, what="every frame to be handled")
        assert [type(m).__name__ for m in got] == ["Heartbeat", "Delta"]
        r = syncer.stats.rejected
        assert r["bad_magic"] == 1 and r["truncated"] == 1 and r["bad_checksum"] == 1
        assert r["too_large"] == 1 and r["not_owned"] == 1 and r["wrong_run"] == 1
        assert r["unexpected_kind"] == 1 and r["bad_envelope"] == 1
    finally:
        raw.close(0)
        ctx.term()
        syncer.close()


@pytest.mark.timeout(240)
def test_two_syncers_share_fragments_and_one_restarts_with_nothing_lost(tmp_path: Path) -> None:
    """Fragment p belongs to syncer p % 2; syncer 1 is SIGKILLed twice and resumes."""
    binds = [endpoint(), endpoint()]
    even = Consumer(binds[0], tmp_path / "even.sqlite", fragments="0,2")
    odd = Consumer(binds[1], tmp_path / "odd.sqlite", fragments="1,3")
    even.start()
    odd.start()
    try:
        threads, errors = send_from_learners(binds, 4, 1000)
        for target in (600, 1400):
            wait_until(lambda t=target: odd.counts()[0] >= t, 60, what=f"{target} odd applied")
            odd.kill()
            odd.start()
        for th in threads:
            th.join(timeout=200)
        assert not errors, errors
        assert even.counts() == (2000, 2000) and odd.counts() == (2000, 2000)
        for consumer, parity in ((even, 0), (odd, 1)):
            with sqlite3.connect(consumer.db) as db:
                fragments = {row[0] for row in db.execute("SELECT DISTINCT fragment FROM applied")}
            assert fragments == {parity, parity + 2}
    finally:
        even.stop()
        odd.stop()


@contextmanager
def serving(syncer: ZmqSyncerTransport) -> Iterator[None]:
    """The syncer answers requests (snapshots) in a thread while the block runs."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            syncer.receive(0.02)

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield
    finally:
        stop.set()
        server.join(timeout=10)


def test_a_joiner_holding_the_current_weights_is_not_sent_them() -> None:
    """A learner that starts from the run's initial model downloaded it whole at
    every join: 3.4 MB per learner of a 300-step run's 19 MB on a 10 Mbit/s link."""
    bind = endpoint()
    syncer = ZmqSyncerTransport(bind, RUN, [0, 1], identity_hold_s=15.0)
    learner = None
    n = 100_000
    weights = {p: torch.randn(n, generator=torch.Generator().manual_seed(p)) for p in (0, 1)}

    def version(p: int, v: int, payload: torch.Tensor, change_from: int = -1) -> GlobalFragment:
        return GlobalFragment(
            run_id=RUN, fragment=p, plan_hash=PLAN, version=v, sent_at=time.time(),
            weights_crc=wire.weights_checksum(weights[p]), codec="fp32", numel=n,
            payload=Codec().encode(payload), change_from=change_from,
        )  # fmt: skip

    try:
        # Fragment 0's latest version went out as a change, with its weights as the snapshot.
        syncer.publish(version(0, 5, torch.zeros(n), 4), snapshot=version(0, 5, weights[0]))
        syncer.publish(version(1, 3, weights[1]))
        published = syncer.stats.bytes_sent
        learner = ZmqLearnerTransport([bind], RUN, "joiner", 1, 2)
        with serving(syncer):
            # It holds fragment 0's current weights, and other weights of fragment 1.
            held = {0: weights[0].clone(), 1: weights[1] + 1}
            result = learner.snapshot([0, 1], timeout_s=10, held=held)
        assert {p: (g.version, g.is_change) for p, g in result.items()} == {
            0: (5, False),
            1: (3, False),
        }
        for p in (0, 1):
            assert torch.equal(result[p].tensor(), weights[p])
            assert wire.weights_checksum(result[p].tensor()) == result[p].weights_crc
        # Only fragment 1's weights crossed the network.
        assert 4 * n < syncer.stats.bytes_sent - published < 4 * n + 2_000
    finally:
        if learner:
            learner.close()
        syncer.close()


def test_an_announced_version_is_fetched_only_by_learners_that_lack_it() -> None:
    """An idle fragment was published again whole every heartbeat timeout: while
    4 learners started, each received the whole model (3.4 MB) again every 5 s."""
    bind = endpoint()
    syncer = ZmqSyncerTransport(bind, RUN, [0, 1], identity_hold_s=15.0)
    learner = None
    n = 100_000
    weights = torch.randn(n, generator=torch.Generator().manual_seed(0))

    def version(p: int, v: int) -> GlobalFragment:
        return GlobalFragment(
            run_id=RUN, fragment=p, plan_hash=PLAN, version=v, sent_at=time.time(),
            weights_crc=wire.weights_checksum(weights), codec="fp32", numel=n,
            payload=Codec().encode(weights),
        )  # fmt: skip

    try:
        with serving(syncer):
            syncer.publish(version(0, 3))
            syncer.publish(version(1, 1))  # before the learner subscribed: it misses it
            learner = ZmqLearnerTransport([bind], RUN, "l", 1, 2)
            held = learner.snapshot([0], timeout_s=10)[0]  # it holds fragment 0's version only
            learner.accepted(held)
            before = syncer.stats.bytes_sent

            def fetched() -> list[GlobalFragment]:
                syncer.announce(version(0, 3))
                syncer.announce(version(1, 1))
                return take_globals(learner, 0.05)

            got = wait_until(fetched, 10, what="fragment 1 fetched after its announcement")
            assert [(g.fragment, g.version) for g in got] == [(1, 1)]
            assert torch.equal(got[0].tensor(), weights)
            learner.accepted(got[0])
            # Held now, both announcements cost a header each, and nothing is fetched.
            assert take_globals(learner, 0.3) == []
            syncer.announce(version(1, 1))
            assert take_globals(learner, 0.3) == []
            # Fragment 1's weights went out once; fragment 0's never.
            assert 4 * n < syncer.stats.bytes_sent - before < 5 * n
    finally:
        if learner:
            learner.close()
        syncer.close()


def test_a_newer_version_is_answered_within_the_snapshot_interval() -> None:
    """A learner that joined at version 3 and missed the change to 4 (its subscription
    was not live yet) asks again at once. The interval must not make it wait: its
    deltas from version 3 would go stale in the meantime (a run refused all of one
    learner's 32 deltas so). Asking again for the version it was just sent is
    still limited."""
    bind = endpoint()
    syncer = ZmqSyncerTransport(
        bind, RUN, [0], options=ZmqOptions(snapshot_interval_s=30.0), identity_hold_s=15.0
    )
    syncer.publish(global_fragment(0, 3))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(bind)
    request = wire.encode(wire.SnapshotRequest(run_id=RUN, learner_id="x", fragments=[0]))

    def answer() -> GlobalFragment | None:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            syncer.receive(0.05)
            if raw.poll(0):
                msg = wire.decode(b"".join(raw.recv_multipart()))
                assert isinstance(msg, GlobalFragment)
                return msg
        return None

    try:
        raw.send(request)
        first = answer()
        assert first is not None and first.version == 3
        raw.send(request)
        assert answer() is None and syncer.stats.rate_limited == 1
        syncer.publish(global_fragment(0, 4))
        raw.send(request)
        newer = answer()
        assert newer is not None and newer.version == 4
        raw.send(request)
        assert answer() is None and syncer.stats.rate_limited == 2
    finally:
        raw.close(0)
        ctx.term()
        syncer.close()


def test_snapshot_requests_cost_one_fragment_per_peer_and_interval() -> None:
    """The attack: one 4 kB request listing fragment 0 4096 times made the syncer queue
    4096 copies of the fragment (866 MB); three such clients took it to 2.85 GB."""
    bind = endpoint()
    syncer = ZmqSyncerTransport(
        bind, RUN, [0, 1], options=ZmqOptions(snapshot_interval_s=30.0), identity_hold_s=15.0
    )
    syncer.publish(global_fragment(0, 3))
    syncer.publish(global_fragment(1, 3))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(bind)
    try:
        request = wire.SnapshotRequest(run_id=RUN, learner_id="x", fragments=[0] * 4096)
        for _ in range(3):
            raw.send(wire.encode(request))
        raw.send(wire.encode(wire.SnapshotRequest(run_id=RUN, learner_id="x", fragments=[])))

        def all_handled() -> bool:
            syncer.receive(0.05)
            r = syncer.stats.rejected
            return r["snapshot_duplicate"] == 3 * 4095 and syncer.stats.rate_limited == 2 + 1

        wait_until(all_handled, 10, what="the requests to be handled")
        answers: list[GlobalFragment] = []
        while raw.poll(500):
            msg = wire.decode(b"".join(raw.recv_multipart()))  # the parts make a frame
            assert isinstance(msg, GlobalFragment)
            answers.append(msg)
        # Fragment 0 once (the other requests within the interval got nothing more),
        # fragment 1 once for the request of all fragments.
        assert sorted(g.fragment for g in answers) == [0, 1]
    finally:
        raw.close(0)
        ctx.term()
        syncer.close()


def test_terms_admit_the_highest_taken_and_refuse_lower_ones() -> None:
    from broker.transport import Terms, TransportStats

    stats = TransportStats()
    terms = Terms(stats)
    assert terms.admits(0, 0) and terms.admits(0, 2) and terms.admits(0, 2)
    assert not terms.admits(0, 1) and stats.rejected["lower_term"] == 1
    assert terms.admits(1, 1)  # each key its own
    assert terms.admits(0, 3) and not terms.admits(0, 2)
    assert stats.rejected["lower_term"] == 2


@pytest.mark.timeout(60)
def test_a_syncer_whose_shard_was_taken_over_is_not_heard() -> None:
    """A syncer that wakes after another took its shard over (a later term)
    publishes and acknowledges from the same endpoint: the learner, which took
    the successor's term, takes neither its globals nor its acks (an ack of a
    delta the run never merged would lose it); the successor's ack counts."""
    from dataclasses import replace

    bind = endpoint()
    syncers = [ZmqSyncerTransport(bind, RUN, [0], identity_hold_s=15.0, term=2)]
    learner = ZmqLearnerTransport([bind], RUN, "l", 1, 1)
    refused = learner.stats.rejected
    try:

        def heard(syncer: ZmqSyncerTransport, version: int, term: int) -> bool:
            syncer.publish(replace(global_fragment(0, version), term=term))
            return bool(take_globals(learner, 0.05))

        def received(syncer: ZmqSyncerTransport) -> list[Inbound]:
            learner.poll(0.02)  # resends what is due
            return syncer.receive(0.05)

        wait_until(lambda: heard(syncers[0], 5, 2), 10, what="the successor's global")
        syncers[0].close()
        woken = ZmqSyncerTransport(bind, RUN, [0], identity_hold_s=15.0, term=1)
        syncers.append(woken)

        def refused_a_global() -> bool:
            assert not heard(woken, 6, 1), "a global of a lower term was taken"
            return refused["lower_term"] > 0

        wait_until(refused_a_global, 10, what="the woken syncer's global to be refused")
        learner.send_delta(delta("l", 1, 0))
        got = wait_until(lambda: received(woken), 10, what="the delta at the woken syncer")
        before = refused["lower_term"]
        woken.ack(got)
        wait_until(
            lambda: take_globals(learner, 0.05) == [] and refused["lower_term"] > before,
            10,
            what="the woken syncer's ack to be refused",
        )
        assert learner.unacked == 1  # still owed: resent to whoever holds the shard
        woken.close()
        back = ZmqSyncerTransport(bind, RUN, [0], identity_hold_s=15.0, term=2)
        syncers.append(back)
        back.ack(wait_until(lambda: received(back), 20, what="the delta resent"))
        wait_until(
            lambda: take_globals(learner, 0.05) == [] and learner.unacked == 0,
            10,
            what="the successor's ack",
        )
    finally:
        learner.close()
        for syncer in syncers:
            syncer.close()
