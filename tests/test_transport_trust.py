"""Attacks on the learner side of both transports, over real sockets and a real Redis.

* A malformed global with a huge version (NaN weights, version 2^62) used to be
  recorded by the transport before the learner looked at it, so every real
  global after it was dropped as "older": the learner was locked out of its
  fragment. Now the comm thread validates first and only then the transport
  records the version.
* A delta the syncer refused used to be acknowledged like an applied one: the
  learner reported success while the run learned nothing. Now it is answered
  "refused, resync" and the learner fetches the fragment's latest global.
* With the syncer down, Redis trimmed unread deltas at the stream bound and
  nobody counted them. Now the bound drops what the syncer is done with first,
  and counts every unread entry it drops, on both sides.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch

from broker.connect import connect_learner, connect_syncer
from broker.fragments import FragmentPlan, ParamSpec
from broker.redis.frames import FIELD
from broker.redis.names import globals_stream_key, model_key
from broker.redis.server import RedisServer, free_port
from broker.transport import Inbound, LearnerTransport, SyncerTransport
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, GlobalFragment, encode, weights_checksum
from learner.comm import CommThread, DeltaEncoder
from learner.join import GlobalDecoder
from syncer.fragment_state import canonical
from tests.servers import take_globals, wait_until

RUN = "trust"
PLAN = FragmentPlan.build([ParamSpec("w", (4,), "float32")], 1, sync_every=4)


def good_global(version: int, epoch: int = 7) -> GlobalFragment:
    weights = torch.full((4,), float(version))
    return GlobalFragment(
        run_id=RUN, fragment=0, plan_hash=PLAN.plan_hash, epoch=epoch, version=version,
        codec=Codec(), numel=4, payload=Codec().encode(weights),
        weights_crc=weights_checksum(weights), sent_at=time.time(),
    )  # fmt: skip


def delta(seq: int) -> Delta:
    return Delta(
        run_id=RUN, learner_id="learner-0", incarnation=1, seq=seq, fragment=0,
        plan_hash=PLAN.plan_hash, base_epoch=7, base_version=1, step=4, c_steps=4,
        c_tokens=64, sent_at=time.time(), codec=Codec(), numel=4,
        payload=Codec().encode(torch.ones(4)),
    )  # fmt: skip


class Backend:
    """A syncer transport, a way to connect learners, and a way for an outsider to
    put a global where learners read globals."""

    def __init__(
        self,
        url: str,
        inject: Callable[[SyncerTransport, GlobalFragment], None],
    ) -> None:
        self.url = url
        self.syncer = connect_syncer(
            url, run_id=RUN, syncer_id="syncer-0", fragments=[0], identity_hold_s=15.0
        )
        self.inject = inject

    def learner(self) -> LearnerTransport:
        return connect_learner(
            self.url, run_id=RUN, learner_id="learner-0", incarnation=1, num_fragments=1
        )


@pytest.fixture(params=["zmq", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "zmq":
        # Over ZeroMQ only the syncer's sockets reach a learner: the hostile
        # global comes from a syncer with a bug (or one an attacker runs).
        b = Backend(f"zmq://127.0.0.1:{free_port()}", lambda syncer, g: syncer.publish(g))
        yield b
        b.syncer.close()
        return
    server = RedisServer(tmp_path / "redis")
    server.start()
    client = redis.Redis.from_url(server.url)

    def write_into_redis(_: SyncerTransport, g: GlobalFragment) -> None:
        # Anyone who can reach Redis: the globals stream and the snapshot key.
        frame = encode(g)
        client.xadd(globals_stream_key(RUN), {FIELD: frame})
        client.set(model_key(RUN, 0), frame)

    b = Backend(server.url, write_into_redis)
    try:
        yield b
    finally:
        b.syncer.close()
        client.close()
        server.stop()


def test_a_malformed_global_with_a_huge_version_locks_no_learner_out(backend: Backend) -> None:
    learner = backend.learner()
    comm = CommThread(
        learner,
        DeltaEncoder(Codec(), error_feedback=False),
        check=GlobalDecoder(PLAN, learner).decode,
        max_queued_bytes=2**20,
    )
    comm.start()
    newest: list[int] = []

    def reached(version: int) -> Callable[[], bool]:
        def check() -> bool:
            backend.syncer.receive(0.0)  # answers snapshot requests (ZeroMQ)
            newest.extend(stamp[1] for _, stamp, _ in comm.take_globals()[0])
            return bool(newest) and newest[-1] == version

        return check

    try:

        def published_v1() -> bool:
            backend.syncer.publish(good_global(1))
            return reached(1)()

        wait_until(published_v1, 15, interval_s=0.1, what="the learner to take version 1")
        nan = Codec().encode(torch.full((4,), float("nan")))
        backend.inject(backend.syncer, replace(good_global(2**62), payload=nan))
        wait_until(lambda: comm.globals_rejected["non_finite"] == 1, 10, what="the refusal")
        backend.syncer.publish(good_global(2))
        backend.syncer.publish(good_global(3))
        wait_until(reached(3), 15, what="the real versions after the bad one")
        assert 2**62 not in newest
    finally:
        comm.stop(flush_timeout_s=0.0)
        learner.close()


def test_changes_rebuild_the_syncers_versions_bit_for_bit_and_a_gap_takes_the_snapshot(
    backend: Backend,
) -> None:
    """Globals go out as int8 changes; a learner holds exactly the syncer's
    versions, and one that missed a change (or has no base) takes the snapshot."""
    codec = Codec("int8")
    gen = torch.Generator().manual_seed(0)
    versions = {0: torch.randn(4, generator=gen)}

    def publish(version: int, *, lost: bool = False) -> None:
        previous = versions[version - 1] if version else None
        master = versions.get(version - 1, torch.zeros(4)) + torch.randn(4, generator=gen) / 10
        held, publication = canonical(codec, master if version else versions[0], previous)
        versions[version] = held

        def message(payload: object, codec: Codec, change: bool) -> GlobalFragment:
            return replace(
                good_global(version), codec=codec, payload=payload,
                change_from=version - 1 if change else -1, weights_crc=weights_checksum(held),
            )  # fmt: skip

        snapshot = message(held.numpy().tobytes(), Codec(), change=False)
        sent = message(publication.payload, publication.codec, publication.is_change)
        if not lost:
            backend.syncer.publish(sent, snapshot=snapshot)

    learner = backend.learner()
    decoder = GlobalDecoder(PLAN, learner)
    comm = CommThread(learner, DeltaEncoder(Codec(), error_feedback=False), decoder.decode, 2**20)
    comm.start()
    newest: dict[int, torch.Tensor] = {}

    def holds(version: int) -> Callable[[], bool]:
        def check() -> bool:
            backend.syncer.receive(0.0)  # answers snapshot requests (ZeroMQ)
            newest.update({stamp[1]: flat for _, stamp, flat in comm.take_globals()[0]})
            return version in newest

        return check

    try:

        def published_v0() -> bool:
            publish(0)
            return holds(0)()

        wait_until(published_v0, 15, interval_s=0.2, what="the learner to take version 0")
        for version in (1, 2):
            publish(version)
            wait_until(holds(version), 15, what=f"version {version}")
            assert torch.equal(newest[version], versions[version])  # bit for bit
        publish(3, lost=True)  # a change this learner never sees
        publish(4)  # a change from 3: the learner holds 2
        wait_until(holds(4), 15, what="version 4 through the snapshot")
        assert torch.equal(newest[4], versions[4])
    finally:
        comm.stop(flush_timeout_s=0.0)
        learner.close()

    # A learner joining while changes are broadcast takes weights, never a change
    # (over ZeroMQ its subscription receives the changes while it waits).
    joiner = connect_learner(
        backend.url, run_id=RUN, learner_id="learner-1", incarnation=1, num_fragments=1
    )
    stop = threading.Event()

    def syncer_at_work() -> None:
        version = 5
        while not stop.is_set():
            publish(version)
            version += 1
            backend.syncer.receive(0.02)  # answers the joiner's snapshot requests

    worker = threading.Thread(target=syncer_at_work)
    worker.start()
    try:
        time.sleep(0.3)  # changes are flowing
        got = joiner.snapshot([0], timeout_s=15)
    finally:
        stop.set()
        worker.join()
        joiner.close()
    assert not got[0].is_change
    assert torch.equal(got[0].tensor(), versions[got[0].version])


def test_a_refused_delta_is_answered_refused_and_the_learner_resyncs(backend: Backend) -> None:
    backend.syncer.publish(good_global(5))
    learner = backend.learner()
    try:
        learner.send_delta(delta(seq=1))
        received: list[Inbound] = []

        def delivered() -> bool:
            learner.poll(0.01)
            received.extend(i for i in backend.syncer.receive(0.05) if i.token is not None)
            return bool(received)

        wait_until(delivered, 15, what="the delta to reach the syncer")
        backend.syncer.refuse(received[0], "future_version")
        resynced: list[GlobalFragment] = []

        def answered() -> bool:
            backend.syncer.receive(0.0)  # answers the snapshot request (ZeroMQ)
            resynced.extend(take_globals(learner, 0.05))
            return learner.unacked == 0 and bool(resynced)

        wait_until(answered, 15, what="the refusal and the resync")
        assert learner.stats.refused == {"future_version": 1}
        assert resynced[-1].version == 5  # the fragment's latest global
    finally:
        learner.close()


def test_deltas_dropped_unread_at_the_stream_bound_are_counted_on_both_sides(
    redis_server: RedisServer,
) -> None:
    url = f"{redis_server.url}?delta_stream_maxlen=10"
    syncer = connect_syncer(
        url, run_id=RUN, syncer_id="syncer-0", fragments=[0], identity_hold_s=15.0
    )
    learner = connect_learner(url, run_id=RUN, learner_id="learner-0", incarnation=1,
                              num_fragments=1)  # fmt: skip
    try:
        # The syncer keeps up: what it acked makes room, nothing unread is dropped.
        for seq in range(1, 9):
            learner.send_delta(delta(seq))
        items = wait_until(lambda: syncer.receive(0.1), 10, what="the first deltas")
        while len(items) < 8:
            items += syncer.receive(0.1)
        syncer.ack(items)
        for seq in range(9, 15):
            learner.send_delta(delta(seq))
        assert learner.unacked == 0 and learner.trimmed_unread == 0  # type: ignore[attr-defined]
        # The syncer stops reading: 25 more deltas into a bound of 10.
        for seq in range(15, 40):
            learner.send_delta(delta(seq))
        lost = learner.trimmed_unread  # type: ignore[attr-defined]
        assert lost >= 15
        got: list[Inbound] = []
        wait_until(
            lambda: got.extend(syncer.receive(0.1)) or syncer.stats.rejected["trimmed_unread"],
            10,
            what="the syncer to report the loss",
        )
        assert syncer.stats.rejected["trimmed_unread"] == lost
    finally:
        learner.close()
        syncer.close()


def test_a_new_epoch_is_followed_whatever_its_versions(backend: Backend) -> None:
    """A syncer that lost its state starts a new epoch at version 0: learners that
    hold version 9 of the old epoch take it (they would otherwise be locked out),
    and after it compare versions within the new epoch."""
    learner = backend.learner()
    taken: list[tuple[int, int]] = []

    def took(stamp: tuple[int, int]) -> Callable[[], bool]:
        def check() -> bool:
            backend.syncer.receive(0.0)
            taken.extend((g.epoch, g.version) for g in take_globals(learner, 0.05))
            return bool(taken) and taken[-1] == stamp

        return check

    try:

        def old_epoch() -> bool:
            backend.syncer.publish(good_global(9, epoch=7))
            return took((7, 9))()

        wait_until(old_epoch, 15, interval_s=0.1, what="version 9 of epoch 7")
        backend.syncer.publish(good_global(0, epoch=8))
        wait_until(took((8, 0)), 15, what="version 0 of the new epoch")
        backend.syncer.publish(good_global(1, epoch=8))
        wait_until(took((8, 1)), 15, what="version 1 of the new epoch")
    finally:
        learner.close()
