"""A learner (or evaluator) that starts before its broker waits for it: joining
keeps asking until the broker answers, within the join timeout."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from broker.connect import connect_learner, connect_syncer
from broker.fragments import FragmentPlan
from broker.redis.server import RedisServer, free_port
from broker.wire.messages import GlobalFragment, weights_checksum
from learner.join import GlobalDecoder, join_snapshot

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_join_waits_for_a_redis_that_starts_late(tmp_path: Path) -> None:
    plan = FragmentPlan.for_model(nn.Linear(3, 2), 1, 1)
    server = RedisServer(tmp_path / "redis", port=free_port())
    learner = connect_learner(
        f"{server.url}?socket_timeout_s=0.5", run_id="r", learner_id="a", incarnation=1,
        num_fragments=1,
    )  # fmt: skip
    numel = plan.fragment_numel(0)

    def start_and_publish() -> None:
        server.start()
        syncer = connect_syncer(
            server.url, run_id="r", syncer_id="s", fragments=[0], identity_hold_s=15.0
        )
        weights = torch.ones(numel)
        syncer.publish(
            GlobalFragment(run_id="r", fragment=0, plan_hash=plan.plan_hash, version=3,
                           codec="fp32", numel=numel, payload=weights.numpy().tobytes(),
                           weights_crc=weights_checksum(weights))
        )  # fmt: skip
        syncer.close()

    # Redis comes up while the learner is already asking for the snapshot.
    late = threading.Timer(2.0, start_and_publish)
    late.start()
    try:
        [(fragment, stamp, flat)] = join_snapshot(learner, GlobalDecoder(plan), timeout_s=30)
        assert fragment == 0 and stamp[1] == 3 and torch.equal(flat, torch.ones(numel))
    finally:
        late.join()
        learner.close()
        server.stop()
