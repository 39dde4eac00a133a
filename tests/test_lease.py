"""Learner slots (``LearnerTransport.lease``, ``--learner-id auto``) on both
transports, against a real redis-server and real ZeroMQ sockets on loopback."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from broker.connect import connect_learner, connect_syncer
from broker.identity.keys import Identity, RunKeys
from broker.redis.server import RedisServer, free_port
from broker.run.settings import RunSettings
from broker.transport import MAX_LEARNER_SLOTS, LearnerTransport, TransportError
from broker.wire import messages as wire
from broker.wire.messages import LeaseRequest
from learner.lease import SlotLease, shard_of
from tests.servers import run_keys, wait_until

pytestmark = pytest.mark.integration
RUN = "lease-test"
# Long enough to outlast each test; a fresh ZeroMQ authority makes newcomers
# wait half of it (holders of before reclaim their slots first).
TTL_S = 4.0


def zmq_url() -> str:
    while True:  # ROUTER on port, PUB on port + 1
        port = free_port()
        try:
            with zmq.Context() as ctx, ctx.socket(zmq.PUB) as s:
                s.bind(f"tcp://127.0.0.1:{port + 1}")
            return f"zmq://127.0.0.1:{port}"
        except zmq.ZMQError:
            continue


class Authority:
    """A syncer-side transport pumped by a thread: the lease authority (the first
    ZeroMQ syncer, or the Redis syncer that owns fragment 0)."""

    def __init__(self, url: str, keyed: bool = True, roster_cap: int = MAX_LEARNER_SLOTS) -> None:
        self.url = url
        self.roster_cap = roster_cap
        self._keys = RunKeys.load(run_keys(), "syncer") if keyed else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        transport = connect_syncer(
            self.url,
            run_id=RUN,
            syncer_id="s",
            fragments=[0],
            keys=self._keys,
            roster_cap=self.roster_cap,
            identity_hold_s=15.0,
        )
        self.stats = transport.stats

        def pump() -> None:
            while not self._stop.is_set():
                transport.receive(0.05)
            transport.close()

        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


@contextmanager
def keyed_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis with the run's ACL users."""
    server = RedisServer(tmp_path / "redis", keys=Path(run_keys()))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["redis", "zmq"])
def broker_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        if request.param == "redis":
            url = stack.enter_context(keyed_redis(tmp_path)).url
        else:
            url = zmq_url()
        authority = Authority(url)
        authority.start()
        stack.callback(authority.stop)
        yield url


IDENTITIES: dict[str, Identity] = {}  # a holder's key pair, as its state_dir keeps it


def learner(url: str, name: str, identity: Identity | None = None) -> LearnerTransport:
    """A learner process with the run's keys and the key pair of its holder."""
    return connect_learner(
        url, run_id=RUN, learner_id=name, incarnation=1, num_fragments=1,
        keys=RunKeys.load(run_keys(), "learner"),
        identity=identity or IDENTITIES.setdefault(name, Identity.new()),
    )  # fmt: skip


def test_holders_get_distinct_lowest_slots_and_keep_them(broker_url: str) -> None:
    clients = {h: learner(broker_url, h) for h in ("host-a", "host-b", "host-c")}
    try:
        slots = {h: t.lease(h, ttl_s=TTL_S, timeout_s=10) for h, t in clients.items()}
        assert sorted(slots.values()) == [0, 1, 2]
        # Renewing, or asking again after a restart (same holder), gives the same slot.
        for h, t in clients.items():
            assert t.lease(h, ttl_s=TTL_S, timeout_s=10) == slots[h]
        again = learner(broker_url, "host-b")  # restarted, its key pair kept
        assert again.lease("host-b", ttl_s=TTL_S, timeout_s=10) == slots["host-b"]
        again.close()
        # Another key under the same holder name (an impostor holding the join
        # secret) gets a slot of its own, never the holder's.
        impostor = learner(broker_url, "host-b", Identity.new())
        assert impostor.lease("host-b", ttl_s=TTL_S, timeout_s=10) not in slots.values()
        impostor.close()
    finally:
        for t in clients.values():
            t.close()


def test_an_expired_slot_goes_to_the_next_holder(broker_url: str) -> None:
    a, b = learner(broker_url, "a"), learner(broker_url, "b")
    try:
        assert b.lease("b", ttl_s=TTL_S, timeout_s=10) == 0
        assert a.lease("a", ttl_s=0.5, timeout_s=10) == 1
        expires = time.monotonic() + 0.5
        # a stops renewing: once its lease ran out, a newcomer takes slot 1.
        wait_until(lambda: time.monotonic() > expires + 0.1, 5, what="a's lease to run out")
        c = learner(broker_url, "c")
        assert c.lease("c", ttl_s=TTL_S, timeout_s=10) == 1
        # a comes back: its slot is taken, so it gets the lowest free one.
        assert a.lease("a", ttl_s=TTL_S, timeout_s=10, held_slot=1) == 2
        c.close()
    finally:
        a.close()
        b.close()


def test_a_held_slot_is_granted_when_free(broker_url: str) -> None:
    a = learner(broker_url, "a")
    try:
        assert a.lease("a", ttl_s=TTL_S, timeout_s=10, held_slot=5) == 5
        b = learner(broker_url, "b")
        assert b.lease("b", ttl_s=TTL_S, timeout_s=10) == 0
        b.close()
    finally:
        a.close()


def test_no_authority_is_a_transport_error_within_the_timeout(tmp_path: Path) -> None:
    for url in (f"redis://127.0.0.1:{free_port()}/0?socket_timeout_s=0.5", zmq_url()):
        t = learner(url, "a")
        started = time.monotonic()
        with pytest.raises(TransportError):
            t.lease("a", ttl_s=TTL_S, timeout_s=1.5)
        assert time.monotonic() - started < 5
        t.close()


def test_redis_leases_survive_a_redis_restart(tmp_path: Path) -> None:
    """The slots live in the syncer; Redis restarted (without the members' ACL
    users, which the learners enroll again for) changes nothing."""
    with keyed_redis(tmp_path) as server:
        authority = Authority(server.url)
        authority.start()
        a = learner(server.url, "a")
        try:
            assert a.lease("a", ttl_s=TTL_S, timeout_s=10) == 0
            server.kill()  # SIGKILL: only the AOF survives
            server.start()
            b = learner(server.url, "b")
            assert b.lease("b", ttl_s=TTL_S, timeout_s=10) == 1
            assert a.lease("a", ttl_s=TTL_S, timeout_s=10, held_slot=0) == 0
            b.close()
        finally:
            a.close()
            authority.stop()


def test_zmq_authority_restart_lets_holders_reclaim_first() -> None:
    authority = Authority(zmq_url())
    authority.start()
    a, b = learner(authority.url, "a"), learner(authority.url, "b")
    try:
        assert a.lease("a", ttl_s=TTL_S, timeout_s=10) == 0
        authority.stop()
        authority.start()  # a new syncer process knows no leases
        # A newcomer gets nothing while the leases of before may still run ...
        with pytest.raises(TransportError):
            b.lease("b", ttl_s=TTL_S, timeout_s=TTL_S / 4)
        # ... but a holder renewing its slot gets it back at once.
        assert a.lease("a", ttl_s=TTL_S, timeout_s=1, held_slot=0) == 0
        assert b.lease("b", ttl_s=TTL_S, timeout_s=10) == 1
    finally:
        a.close()
        b.close()
        authority.stop()


def test_slot_lease_renews_and_reports_a_lost_slot(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    lost = threading.Event()
    run = RunSettings(
        run_id=RUN, url=server.url, fragments=1, sync_every=1, overlap=0, insecure=True
    )
    authority = Authority(server.url, keyed=False)
    authority.start()
    lease = SlotLease(run, "host-a", None, on_lost=lost.set, ttl_s=0.6)
    try:
        assert lease.take(timeout_s=10) == 0
        wait_until(lambda: lease.renewals >= 2, 10, what="two renewals")
        # Another holder took the slot (here: without keys, a newcomer naming it
        # just after the authority restarted): the next renewal notices, and the
        # learner is told to stop.
        authority.stop()
        authority.start()
        thief = connect_learner(
            server.url, run_id=RUN, learner_id="host-b", incarnation=1, num_fragments=1
        )
        assert thief.lease("host-b", ttl_s=60, timeout_s=10, held_slot=0) == 0
        wait_until(lost.is_set, 10, what="the lost slot to be reported")
        thief.close()
    finally:
        lease.close()
        authority.stop()
        server.stop()


def test_shards_wrap_round_robin() -> None:
    assert [shard_of(s, 4) for s in range(6)] == [0, 1, 2, 3, 0, 1]


def test_a_peer_cannot_hold_a_slot_for_ever_or_take_them_all(broker_url: str) -> None:
    """Attack: a lease of a year, or of a slot beyond the bound, is refused by the
    requester's transport and, sent by hand over ZeroMQ, rejected and counted by
    the authority, which keeps granting slots to others."""
    a = learner(broker_url, "a")
    try:
        with pytest.raises(ValueError, match="out of bounds"):
            a.lease("a", ttl_s=365 * 86400.0, timeout_s=1)
        with pytest.raises(ValueError, match="out of bounds"):
            a.lease("a", ttl_s=TTL_S, timeout_s=1, held_slot=MAX_LEARNER_SLOTS)
        assert a.lease("a", ttl_s=TTL_S, timeout_s=10) == 0
    finally:
        a.close()


@pytest.mark.parametrize("backend", ["redis", "zmq"])
def test_join_secret_keys_cannot_pin_slots_past_the_roster_cap(
    backend: str, tmp_path: Path
) -> None:
    """Attack: a holder of the join secret enrolls one key per slot and takes
    every slot it can. It gets the slots up to the roster cap (it may add
    learners up to it, as the threat model says), none past it: the refusals
    are counted, and a slot that runs out goes to the next key."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(keyed_redis(tmp_path)).url if backend == "redis" else zmq_url()
        authority = Authority(url, roster_cap=2)
        authority.start()
        stack.callback(authority.stop)
        squatters = [learner(url, f"squat-{i}", Identity.new()) for i in range(4)]
        for t in squatters:
            stack.callback(t.close)
        assert squatters[0].lease("squat-0", ttl_s=TTL_S, timeout_s=10) == 0
        assert squatters[1].lease("squat-1", ttl_s=TTL_S, timeout_s=10) == 1
        for i in (2, 3):
            with pytest.raises(TransportError):
                squatters[i].lease(f"squat-{i}", ttl_s=TTL_S, timeout_s=1)
        assert authority.stats.rejected["no_free_slot"] >= 2
        # squat-0 renews for 0.5 s and then stops: its slot goes to the next key.
        assert squatters[0].lease("squat-0", ttl_s=0.5, timeout_s=10, held_slot=0) == 0
        time.sleep(0.6)
        assert squatters[2].lease("squat-2", ttl_s=TTL_S, timeout_s=10) == 0


def test_the_zmq_authority_rejects_leases_out_of_bounds() -> None:
    url = zmq_url()
    syncer = connect_syncer(url, run_id=RUN, syncer_id="s", fragments=[0], identity_hold_s=15.0)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(url.replace("zmq://", "tcp://"))
    try:
        for ttl_s, held in [(365 * 86400.0, -1), (TTL_S, MAX_LEARNER_SLOTS)]:
            forged = LeaseRequest(run_id=RUN, holder="greedy", held_slot=held, ttl_s=ttl_s)
            dealer.send(wire.encode(forged))
        wait_until(
            lambda: syncer.receive(0.05) == [] and syncer.stats.rejected["bad_lease"] == 2,
            10,
            what="both forged leases rejected",
        )
        honest = connect_learner(  # --insecure, as the syncer above
            url, run_id=RUN, learner_id="honest", incarnation=1, num_fragments=1
        )
        pump = threading.Thread(target=lambda: [syncer.receive(0.05) for _ in range(100)])
        pump.start()
        assert honest.lease("honest", ttl_s=TTL_S, timeout_s=10) == 0
        pump.join()
        honest.close()
    finally:
        dealer.close(linger=0)
        ctx.term()
        syncer.close()
