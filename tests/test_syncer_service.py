"""The syncer service in-process against real ZeroMQ sockets: rounds, durability,
de-duplication across a restart, rejections, Prometheus metrics."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
import torch

from broker.codecs import Codec
from broker.settings import RunSettings
from broker.wire import Delta, GlobalFragment, Heartbeat
from broker.zmq_transport import ZmqLearnerTransport
from compose.processes import free_port_pair
from learner.config import WorkloadConfig
from learner.model import ModelConfig
from learner.workload import write_initial
from syncer.checkpoint import fragment_path
from syncer.config import OuterConfig, SyncerConfig
from syncer.service import Syncer
from tests.servers import free_port, wait_until

pytestmark = pytest.mark.integration
TINY = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=16)


def make_syncer(
    tmp_path: Path, port: int, quorum: int = 2, grace_gamma: float = 0.0, **overrides: object
) -> Syncer:
    """A syncer started from an initial model file, as `ddiloco init` writes it."""
    run = RunSettings(
        run_id="svc",
        url=f"zmq://127.0.0.1:{port}",
        learners=2,
        quorum=quorum,
        fragments=2,
        sync_every=2,
        overlap=1,
        initial_model=str(tmp_path / "initial.safetensors"),
    )
    if not Path(run.initial_model).exists():
        write_initial(run, WorkloadConfig(model=TINY))
    settings: dict[str, object] = dict(
        run=run,
        outer=OuterConfig(grace_gamma=grace_gamma, outer_lr=1.0, outer_momentum=0.0),
        checkpoint_dir=str(tmp_path / "ck"),
        metrics_file=str(tmp_path / "events.jsonl"),
    )
    settings.update(overrides)
    return Syncer(SyncerConfig(**settings))  # type: ignore[arg-type]


def snapshot(learner: ZmqLearnerTransport, syncer: Syncer) -> dict[int, GlobalFragment]:
    got: dict[int, GlobalFragment] = {}

    def complete() -> bool:
        syncer.step()
        got.update(learner.snapshot([0, 1], timeout_s=0.1))
        return len(got) == 2

    wait_until(complete, 20, what="snapshot")
    return got


def delta_for(g: GlobalFragment, learner: str, seq: int, shift: float, **kw: object) -> Delta:
    """A learner that moved every weight of the fragment by -shift."""
    fields: dict[str, object] = dict(
        run_id="svc",
        learner_id=learner,
        incarnation=1,
        seq=seq,
        fragment=g.fragment,
        plan_hash=g.plan_hash,
        base_version=g.version,
        step=10,
        c_steps=10,
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
    a = ZmqLearnerTransport([f"tcp://127.0.0.1:{port}"], "svc", "a", 1, 2, ack_timeout_s=0.3)
    b = ZmqLearnerTransport([f"tcp://127.0.0.1:{port}"], "svc", "b", 1, 2, ack_timeout_s=0.3)
    try:
        start = snapshot(a, syncer)[0]
        assert start.version == 0
        w0 = start.tensor()
        a.send_delta(delta_for(start, "a", 1, 0.1))
        b.send_delta(delta_for(start, "b", 1, 0.3))
        b.send_delta(delta_for(start, "b", 2, 0.3, plan_hash="ffffffffffffffff"))
        new: list[GlobalFragment] = []

        def published() -> bool:
            syncer.step()
            new.extend(a.poll(0.01))
            b.poll(0.01)
            return any(g.version == 1 for g in new) and a.unacked == 0 and b.unacked == 0

        wait_until(published, 20, what="round 1 published and acked")
        g1 = next(g for g in new if g.version == 1 and g.fragment == 0)
        # lr 1, momentum 0: the new global is the mean of the learners' weights.
        assert torch.allclose(g1.tensor(), w0 - 0.2, atol=1e-6)
        assert fragment_path(tmp_path / "ck", 0).exists()
        assert syncer.rejected["wrong_plan"] == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
        assert 'ddiloco_syncer_rounds_total{fragment="0"} 1.0' in body
        assert 'ddiloco_syncer_deltas_rejected_total{reason="wrong_plan"} 1.0' in body
        syncer.transport.close()

        # Restart from the checkpoint: version 1 is back, and replaying an applied
        # delta (a learner that never saw the ack would resend it) is refused.
        restarted = make_syncer(tmp_path, port)
        assert restarted.states[0].version == 1
        assert torch.equal(restarted.states[0].weights, g1.tensor())
        a.send_delta(delta_for(start, "a", 1, 0.1))

        def replay_acked() -> bool:
            restarted.step()
            a.poll(0.01)
            return a.unacked == 0

        wait_until(replay_acked, 20, what="replay acknowledged")
        assert restarted.duplicates == 1 and restarted.deltas_applied == 0
        assert restarted.states[0].version == 1
        restarted.transport.close()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_round_closes_at_once_when_every_live_learner_reported(tmp_path: Path) -> None:
    port = free_port_pair()
    syncer = make_syncer(tmp_path, port, quorum=1, grace_gamma=0.9)
    a = ZmqLearnerTransport([f"tcp://127.0.0.1:{port}"], "svc", "a", 1, 2)
    try:
        start = snapshot(a, syncer)[1]
        # A long step time would make the grace window long; with the only live
        # learner reported, the round must not wait for it.
        a.send_heartbeat(Heartbeat(run_id="svc", learner_id="a", step=1, step_time_s=100.0))
        a.send_delta(delta_for(start, "a", 1, 0.5))
        wait_until(lambda: (syncer.step(), syncer.rounds)[1] == 1, 10, what="round to close")
        assert syncer.states[1].version == 1
    finally:
        syncer.transport.close()
        a.close()
