"""The syncer's one config dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.codecs import Codec, CodecError
from broker.config_checks import (
    check_choice,
    check_endpoint,
    check_id,
    check_positive,
    check_redis_url,
    require,
)
from learner.model import ModelConfig

TRANSPORTS = ("zmq", "redis")
AGGREGATIONS = ("mean", "radial")


@dataclass
class SyncerConfig:
    run_id: str = "default"
    syncer_id: str = "syncer-0"
    # transport
    transport: str = "zmq"
    zmq_bind: str = "tcp://127.0.0.1:5555"  # deltas in; globals are published on port + 1
    redis_url: str = "redis://127.0.0.1:6379/0"
    owned_fragments: tuple[int, ...] | None = None  # None: all of them
    # model (must match the learners': the fragment plan hash is checked)
    model: ModelConfig = field(default_factory=ModelConfig)
    fragments: int = 4
    sync_every: int = 12
    seed: int = 0
    # rounds
    quorum: int = 1  # K
    grace_gamma: float = 0.5
    overlap: int = 2  # tau, in learner steps
    staleness: int = 4  # S: versions kept per fragment for rebasing
    heartbeat_timeout_s: float = 10.0
    # outer optimizer
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregation: str = "mean"
    codec: str = "fp32"  # for published globals
    # defences
    quarantine_factor: float = 10.0  # reject a delta whose norm exceeds this x the median
    max_message_bytes: int = 256 * 1024 * 1024
    # durability and evaluation
    checkpoint_dir: str = "syncer-checkpoint"
    data: str | None = None  # held-out data for evaluation; None: the Python standard library
    eval_every_s: float = 0.0  # 0: never
    eval_batches: int = 8
    eval_batch_size: int = 16
    metrics_port: int = 0
    metrics_file: str | None = None  # JSON lines of rounds, evaluations and rejections

    def __post_init__(self) -> None:
        check_id("run_id", self.run_id)
        check_id("syncer_id", self.syncer_id)
        check_choice("transport", self.transport, TRANSPORTS)
        check_endpoint("zmq_bind", self.zmq_bind)
        check_redis_url("redis_url", self.redis_url)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        for name in ("fragments", "sync_every", "quorum", "staleness", "max_message_bytes"):
            require(isinstance(getattr(self, name), int), f"{name} must be an integer")
            check_positive(name, getattr(self, name))
        require(
            self.sync_every % self.fragments == 0,
            f"sync_every={self.sync_every} must be a multiple of fragments={self.fragments}",
        )
        require(0 <= self.grace_gamma < 1, f"grace_gamma={self.grace_gamma}: use [0, 1)")
        check_positive("overlap", self.overlap, allow_zero=True)
        check_positive("heartbeat_timeout_s", self.heartbeat_timeout_s)
        check_positive("outer_lr", self.outer_lr)
        require(0 <= self.outer_momentum < 1, f"outer_momentum={self.outer_momentum}: use [0, 1)")
        require(self.quarantine_factor > 1, f"quarantine_factor={self.quarantine_factor}: use > 1")
        check_positive("eval_every_s", self.eval_every_s, allow_zero=True)
        check_positive("metrics_port", self.metrics_port, allow_zero=True)
        if self.owned_fragments is not None:
            require(
                len(self.owned_fragments) > 0
                and all(0 <= p < self.fragments for p in self.owned_fragments),
                f"owned_fragments={self.owned_fragments}: use indices in [0, {self.fragments})",
            )
        try:
            Codec.parse(self.codec)
        except CodecError as e:
            raise ValueError(f"codec={self.codec!r}: {e}") from None
