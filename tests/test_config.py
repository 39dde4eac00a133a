"""Config dataclasses: defaults are valid, each bad value names its field."""

from __future__ import annotations

from typing import Any

import pytest

from broker import config_checks
from learner.config import LearnerConfig
from learner.model import ModelConfig
from syncer.config import SyncerConfig

NAN = float("nan")


def test_defaults_valid() -> None:
    lc = LearnerConfig()
    sc = SyncerConfig()
    ModelConfig()
    # Learner and syncer agree on the plan by default.
    assert (lc.fragments, lc.sync_every, lc.model) == (sc.fragments, sc.sync_every, sc.model)
    assert (sc.outer_lr, sc.outer_momentum) == (0.7, 0.9)


def test_valid_non_defaults() -> None:
    LearnerConfig(transport="redis", codec="int4+zstd@128", mix_alpha=0.5, fragments=3,
                  sync_every=9, overlap=8, warmup_steps=0, weight_decay=0.0,
                  zmq_endpoints=("tcp://syncer-0:5555", "tcp://10.0.0.2:6000"),
                  redis_url="rediss://user:pw@host:6380/1", min_lr_ratio=1.0)
    SyncerConfig(aggregation="radial", owned_fragments=(0, 3), quorum=3, grace_gamma=0.0,
                 outer_momentum=0.0, staleness=1, codec="bf16+lz4", redis_url="unix:///s")


LEARNER_BAD: list[tuple[str, Any]] = [
    ("run_id", ""),
    ("run_id", "has space"),
    ("run_id", "x" * 65),
    ("learner_id", "a/b"),
    ("learner_id", 3),
    ("transport", "kafka"),
    ("zmq_endpoints", ()),
    ("zmq_endpoints", ("udp://host:1",)),
    ("zmq_endpoints", ("tcp://host",)),
    ("zmq_endpoints", ("tcp://host:123456",)),
    ("redis_url", "http://localhost:6379"),
    ("redis_url", None),
    ("batch_size", 0),
    ("batch_size", -4),
    ("batch_size", 2.5),
    ("steps", 0),
    ("fragments", 0),
    ("sync_every", 0),
    ("torch_threads", 0),
    ("max_message_bytes", 0),
    ("max_unacked", 0),
    ("log_every", 0),
    ("lr", 0.0),
    ("lr", -1e-3),
    ("lr", NAN),
    ("lr", "3e-3"),
    ("ack_timeout_s", 0),
    ("warmup_steps", -1),
    ("weight_decay", -0.1),
    ("grad_clip", -1.0),
    ("overlap", -1),
    ("metrics_port", -1),
    ("min_lr_ratio", -0.1),
    ("min_lr_ratio", 1.5),
    ("min_lr_ratio", NAN),
    ("mix_alpha", 1.0),
    ("mix_alpha", -0.5),
    ("mix_alpha", NAN),
    ("slowdown", 0.5),
    ("slowdown", NAN),
    ("codec", "int3"),
    ("codec", "int8@7"),
]


@pytest.mark.parametrize(("field", "value"), LEARNER_BAD)
def test_learner_bad_value_names_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        LearnerConfig(**{field: value})


def test_learner_cross_field_checks() -> None:
    with pytest.raises(ValueError, match=r"sync_every=10 .*fragments=4"):
        LearnerConfig(fragments=4, sync_every=10)
    with pytest.raises(ValueError, match="overlap=24"):
        LearnerConfig(sync_every=24, overlap=24)
    LearnerConfig(sync_every=24, overlap=23)


SYNCER_BAD: list[tuple[str, Any]] = [
    ("run_id", ""),
    ("syncer_id", "no spaces"),
    ("transport", "nats"),
    ("zmq_bind", "tcp://*"),
    ("zmq_bind", "ipc:///tmp/x"),
    ("redis_url", "localhost:6379"),
    ("aggregation", "median"),
    ("fragments", 0),
    ("fragments", 2.0),
    ("sync_every", -24),
    ("quorum", 0),
    ("staleness", 0),
    ("max_message_bytes", 0),
    ("grace_gamma", 1.0),
    ("grace_gamma", -0.1),
    ("grace_gamma", NAN),
    ("overlap", -1),
    ("heartbeat_timeout_s", 0.0),
    ("heartbeat_timeout_s", NAN),
    ("outer_lr", 0.0),
    ("outer_lr", -0.7),
    ("outer_lr", "0.7"),
    ("outer_momentum", 1.0),
    ("outer_momentum", -0.1),
    ("quarantine_factor", 1.0),
    ("quarantine_factor", NAN),
    ("eval_every_s", -1.0),
    ("metrics_port", -1),
    ("owned_fragments", ()),
    ("owned_fragments", (4,)),
    ("owned_fragments", (-1,)),
    ("codec", "fp64"),
]


@pytest.mark.parametrize(("field", "value"), SYNCER_BAD)
def test_syncer_bad_value_names_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SyncerConfig(**{field: value})


def test_syncer_cross_field_checks() -> None:
    with pytest.raises(ValueError, match=r"sync_every=6 .*fragments=4"):
        SyncerConfig(fragments=4, sync_every=6)
    SyncerConfig(fragments=2, sync_every=6, owned_fragments=(1,))


@pytest.mark.parametrize(
    ("field", "value"),
    [("vocab_size", 0), ("seq_len", 0), ("n_layer", 0), ("n_head", 0), ("d_model", -1)],
)
def test_model_bad_value_names_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_model_head_divisibility() -> None:
    with pytest.raises(ValueError, match=r"d_model \(130\).*n_head \(4\)"):
        ModelConfig(d_model=130, n_head=4)


def test_check_helpers_directly() -> None:
    config_checks.check_positive("x", 1)
    config_checks.check_positive("x", 0, allow_zero=True)
    for bad, allow_zero in ((0, False), (-1, True), (NAN, True), (True, False), ("1", True)):
        with pytest.raises(ValueError, match="^x="):
            config_checks.check_positive("x", bad, allow_zero=allow_zero)  # type: ignore[arg-type]
    config_checks.check_endpoint("e", "tcp://a.b-c:1")
    config_checks.check_id("i", "A-z_0.9:x")
    with pytest.raises(ValueError, match="^c="):
        config_checks.check_choice("c", "z", ("a", "b"))
