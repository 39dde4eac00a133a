"""The learner's one config dataclass."""

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

TRANSPORTS = ("zmq", "redis", "none")  # none: no syncer (data parallel under torchrun)


@dataclass
class LearnerConfig:
    run_id: str = "default"
    learner_id: str = "learner-0"
    # transport
    transport: str = "zmq"  # zmq, redis, or none (no syncer: data parallel under torchrun)
    zmq_endpoints: tuple[str, ...] = ("tcp://127.0.0.1:5555",)  # one per syncer
    redis_url: str = "redis://127.0.0.1:6379/0"
    # model and data
    model: ModelConfig = field(default_factory=ModelConfig)
    data: str | None = None  # text or token file; None: the Python standard library
    batch_size: int = 16
    seed: int = 0
    # inner optimizer: AdamW, linear warmup then cosine decay to lr * min_lr_ratio
    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # outer loop
    fragments: int = 4  # P
    sync_every: int = 12  # H, a multiple of P (chosen by measurement: benchmarks/README.md)
    overlap: int = 2  # tau: steps between sending a fragment and expecting its global
    codec: str = "int8"
    error_feedback: bool = True  # carry what the codec dropped into the next delta
    flush_before_overwrite: bool = True  # send unsynced progress before a global replaces it
    finish_timeout_s: float = 10.0  # at the end, wait this long for the last deltas' acks
    blocking: bool = False  # synchronous DiLoCo: wait for each fragment's new global
    mix_alpha: float = 0.0  # 0: overwrite with the global; else alpha*local + (1-alpha)*global
    # emulation and plumbing
    shard: int = 0  # this learner's slice of the training data ...
    num_shards: int = 1  # ... out of this many
    slowdown: float = 1.0  # >= 1: each step takes this many times longer
    join_timeout_s: float = 120.0  # wait this long for the syncer's snapshot at start
    state_dir: str | None = None  # progress file so a restarted learner resumes its schedule
    metrics_file: str | None = None  # JSON lines of progress
    torch_threads: int = 1
    max_message_bytes: int = 256 * 1024 * 1024
    ack_timeout_s: float = 5.0
    max_unacked: int = 64
    metrics_port: int = 0  # 0: no Prometheus endpoint
    log_every: int = 10
    sync_pause_every: int = 0  # measurement aid: sync pauses in the 2nd half of every 2N steps
    eval_every: int = (
        0  # transport none only: held-out loss every this many steps (0: start and end)
    )

    def __post_init__(self) -> None:
        check_id("run_id", self.run_id)
        check_id("learner_id", self.learner_id)
        check_choice("transport", self.transport, TRANSPORTS)
        require(len(self.zmq_endpoints) >= 1, "zmq_endpoints: give at least one syncer endpoint")
        for e in self.zmq_endpoints:
            check_endpoint("zmq_endpoints", e)
        check_redis_url("redis_url", self.redis_url)
        for name in (
            "batch_size",
            "steps",
            "fragments",
            "sync_every",
            "torch_threads",
            "max_message_bytes",
            "max_unacked",
            "log_every",
        ):
            require(isinstance(getattr(self, name), int), f"{name} must be an integer")
            check_positive(name, getattr(self, name))
        for name in ("lr", "ack_timeout_s"):
            check_positive(name, getattr(self, name))
        for name in (
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "overlap",
            "metrics_port",
            "eval_every",
            "sync_pause_every",
        ):
            check_positive(name, getattr(self, name), allow_zero=True)
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio}: use [0, 1]")
        require(
            self.sync_every % self.fragments == 0,
            f"sync_every={self.sync_every} must be a multiple of fragments={self.fragments}",
        )
        require(
            self.overlap < self.sync_every,
            f"overlap={self.overlap} must be smaller than sync_every={self.sync_every}",
        )
        require(
            0 <= self.shard < self.num_shards,
            f"shard={self.shard} must be in [0, num_shards={self.num_shards})",
        )
        check_positive("join_timeout_s", self.join_timeout_s)
        check_positive("finish_timeout_s", self.finish_timeout_s, allow_zero=True)
        require(0 <= self.mix_alpha < 1, f"mix_alpha={self.mix_alpha}: use [0, 1)")
        require(self.slowdown >= 1, f"slowdown={self.slowdown}: use a factor >= 1")
        try:
            Codec.parse(self.codec)
        except CodecError as e:
            raise ValueError(f"codec={self.codec!r}: {e}") from None
