"""A ZeroMQ syncer that lost its checkpoint takes the run's latest version back
from its learners (broker/zmq/recall.py), over real sockets under the run's
keys: what it takes is what the syncers signed, whatever an insider sends."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from broker.identity.keys import RunKeys
from broker.run.key_folder import make_keys
from broker.wire.codecs import Codec
from broker.wire.messages import GlobalFragment, Heartbeat, weights_checksum
from broker.zmq.learner import ZmqLearnerTransport
from broker.zmq.syncer import ZmqSyncerTransport
from tests.servers import wait_until
from tests.test_zmq_transport import PLAN, RUN, endpoint

pytestmark = pytest.mark.integration


def weights(version: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + version


def published(version: int, change: bool) -> GlobalFragment:
    """Version ``version`` of fragment 0 as a syncer publishes it: the weights,
    or the fp32 change from the version before."""
    flat = weights(version) - weights(version - 1) if change else weights(version)
    return GlobalFragment(
        run_id=RUN, fragment=0, plan_hash=PLAN, epoch=7, version=version,
        change_from=version - 1 if change else -1, weights_crc=weights_checksum(weights(version)),
        codec=Codec(), numel=4, payload=Codec().encode(flat), sent_at=1.0,
    )  # fmt: skip


class Holder:
    """A learner's transport and what it holds: the last global it took, and
    the weights it made (as learner.join.GlobalDecoder keeps them)."""

    def __init__(self, transport: ZmqLearnerTransport) -> None:
        self.transport = transport
        self.global_: GlobalFragment | None = None
        self.weights: torch.Tensor | None = None
        transport.answer_recalls(self.held)

    def held(self, fragment: int, with_weights: bool) -> list[GlobalFragment]:
        if self.global_ is None or self.weights is None:
            return []
        if not with_weights:
            return [self.global_.without_weights()]
        return [self.global_, self.global_.held_form(self.weights)]  # the change, its version

    def take(self) -> bool:
        for g in self.transport.poll(0.05):
            self.transport.accepted(g)
            self.global_, self.weights = g, weights(g.version)
        return self.global_ is not None and self.global_.version == 3


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    return make_keys(tmp_path / "keys")


def keyed_syncer(bind: str, keys_dir: Path) -> ZmqSyncerTransport:
    keys = RunKeys.load(keys_dir, "syncer")
    return ZmqSyncerTransport(bind, RUN, [0], keys=keys, identity_hold_s=15.0)


def test_a_syncer_without_its_checkpoint_takes_the_signed_latest_back_not_an_insiders(
    keys_dir: Path,
) -> None:
    """Two learners hold version 3 (taken as a change): one honest, one an
    enrolled insider that claims a later version and hands over weights of its
    own with a checksum to match, after a change of its own (to steer the
    successor's momentum). The successor asks the insider first (the newest
    claim), finds the run's signature holds for neither, counts both, and
    takes the honest learner's version 3 with the state published with it and
    the signed change that made it."""
    bind = endpoint()
    first = keyed_syncer(bind, keys_dir)
    learner_keys = RunKeys.load(keys_dir, "learner")
    holders = [
        Holder(ZmqLearnerTransport([bind], RUN, f"learner-{i}", 1, 1, keys=learner_keys))
        for i in range(2)
    ]
    successor = None
    state = msgpack.packb({"epoch": 7, "version": 3, "applied": {"learner-0": [1, 9]}})
    try:

        def all_hold_v3() -> bool:
            first.publish(published(2, change=False), resume=b"")
            first.publish(published(3, change=True), published(3, False), resume=state)
            first.receive(0.01)  # enrollments
            return all([h.take() for h in holders])

        wait_until(all_hold_v3, 20, what="version 3 at both learners")
        honest, insider = holders
        forged = weights(3) + 100.0  # the insider's own weights, as version 9

        def lie(fragment: int, with_weights: bool) -> list[GlobalFragment]:
            assert insider.global_ is not None
            header = replace(insider.global_, payload=b"", version=9)
            if not with_weights:
                return [header.without_weights()]
            # A change of its own to steer the successor's momentum, then its weights.
            steer = replace(insider.global_, version=9, change_from=8, payload=Codec().encode(
                torch.full((4,), 1e6)
            ))  # fmt: skip
            return [steer, replace(header.held_form(forged), weights_crc=weights_checksum(forged))]

        insider.transport.answer_recalls(lie)
        first.close()
        successor = keyed_syncer(bind, keys_dir)
        stop = threading.Event()

        def learners_loop() -> None:  # as their comm threads do: beat, poll, answer
            while not stop.is_set():
                for i, h in enumerate(holders):
                    h.transport.send_heartbeat(Heartbeat(run_id=RUN, learner_id=f"learner-{i}"))
                    h.transport.poll(0.02)

        loop = threading.Thread(target=learners_loop)
        loop.start()
        try:
            points = successor.resume_points([0], wait_s=4.0)
        finally:
            stop.set()
            loop.join()
    finally:
        for h in holders:
            h.transport.close()
        first.close()
        if successor is not None:
            successor.close()
    latest, resume, last_change = points[0]
    assert (latest.epoch, latest.version) == (7, 3)
    assert torch.equal(latest.tensor(), weights(3))
    assert resume == state
    # The honest learner's change from version 2, signed: what the momentum is estimated from.
    assert last_change is not None and (last_change.version, last_change.change_from) == (3, 2)
    assert torch.equal(last_change.tensor(), weights(3) - weights(2))
    assert successor.stats.rejected["recall_refused"] == 2  # the insider's change and weights
