"""The learner side's config dataclasses: what is trained, how, and by whom.

Groups that several commands share are their own dataclasses, nested (and
flattened onto flags and ``DDILOCO_*`` variables by :mod:`broker.cli_config`):
:class:`~broker.run.settings.RunSettings` (the whole run), :class:`WorkloadConfig`
(model and data: ``ddiloco init``, learners, the evaluator), :class:`TrainConfig`
(the inner loop), :class:`SyncConfig` (the learner's side of syncing) and
:class:`EvalConfig` (held-out evaluation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from broker.checks import check_id, check_int, check_positive, require
from broker.errors import ConfigError
from broker.run.settings import RunSettings
from broker.wire.codecs import Codec
from learner.model import ModelConfig

DEFAULT_WORKLOAD = "learner.workload:byte_gpt"


@dataclass(frozen=True)
class WorkloadConfig:
    """What is trained: the model, its data and the seed of both."""

    workload: str = DEFAULT_WORKLOAD  # module:factory returning a learner.workload.Workload
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"flag_prefix": "model_"})
    data: str | None = None  # text or token file; None: the Python standard library
    seed: int = 0  # initial weights and data order

    def __post_init__(self) -> None:
        module, sep, attr = self.workload.partition(":")
        require(
            bool(sep and module and attr),
            f"workload={self.workload!r}: use module:factory, e.g. {DEFAULT_WORKLOAD}",
        )
        require(type(self.seed) is int, f"seed={self.seed!r}: must be an integer")


@dataclass(frozen=True)
class TrainConfig:
    """The inner optimizer: AdamW, linear warmup then cosine decay to lr * min_lr_ratio."""

    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: no clipping

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_positive("lr", self.lr)
        for name in ("weight_decay", "grad_clip"):
            check_positive(name, getattr(self, name), allow_zero=True)
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio}: use [0, 1]")


@dataclass(frozen=True)
class SyncConfig:
    """How a learner takes part in syncing (the outer loop, learner side)."""

    error_feedback: bool = True  # carry what the codec dropped into the next delta
    flush_before_overwrite: bool = True  # send unsynced progress before a global replaces it
    keep_unsent: bool = True  # a global lands under the progress not sent yet
    mix_alpha: float = 0.0  # 0: overwrite with the global; else alpha*local + (1-alpha)*global
    finish_timeout_s: float = 10.0  # at the end, wait this long for the last deltas' acks
    sync_pause_every: int = 0  # measurement aid: sync pauses in the 2nd half of every 2N steps
    blocking: bool = False  # synchronous DiLoCo: wait for each fragment's new global
    max_queued_models: float = 2.0  # deltas waiting to be sent (copies of the model, >= 64 MiB)

    def __post_init__(self) -> None:
        require(0 <= self.mix_alpha < 1, f"mix_alpha={self.mix_alpha}: use [0, 1)")
        check_positive("max_queued_models", self.max_queued_models)
        check_positive("finish_timeout_s", self.finish_timeout_s, allow_zero=True)
        check_int("sync_pause_every", self.sync_pause_every, minimum=0)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation of the global model."""

    eval_every_s: float = 10.0  # the evaluator's period; 0: only at start and end
    eval_every: int = 0  # a learner without a syncer evaluates every this many steps; 0: ends
    eval_batches: int = 8
    eval_batch_size: int = 16
    # On a machine the learners share, evaluating while they train takes their
    # time: a copy of the model is written to TMPDIR instead (disk: one per evaluation).
    eval_deferred: bool = False  # copy the model at each evaluation; evaluate the copies at the end

    def __post_init__(self) -> None:
        check_positive("eval_every_s", self.eval_every_s, allow_zero=True)
        check_int("eval_every", self.eval_every, minimum=0)
        for name in ("eval_batches", "eval_batch_size"):
            check_int(name, getattr(self, name))


@dataclass(frozen=True)
class ProcessConfig:
    """What every learner-side process (learner, evaluator) needs to start."""

    torch_threads: int = 1  # two cores shared by several processes: one thread each
    join_timeout_s: float = 120.0  # wait this long for the syncer's snapshot at start

    def __post_init__(self) -> None:
        check_int("torch_threads", self.torch_threads)
        check_positive("join_timeout_s", self.join_timeout_s)


@dataclass(frozen=True)
class LearnerSettings:
    """What :class:`learner.library.DecoupledDiLoCo` is configured with: the
    run's shared settings, the learner's syncing options and its process
    options, each typed."""

    run: RunSettings = field(default_factory=RunSettings)
    sync: SyncConfig = field(default_factory=SyncConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)

    @classmethod
    def from_keywords(cls, **settings: Any) -> LearnerSettings:
        """Route keyword settings (the library's API) to the dataclass that
        defines each: one definition per setting; codecs may be given by name.
        ``TypeError`` for unknown names."""
        types_ = {"run": RunSettings, "sync": SyncConfig, "process": ProcessConfig}
        by_group: dict[str, dict[str, Any]] = {group: {} for group in types_}
        for name, value in settings.items():
            for group, tp in types_.items():
                if name in {f.name for f in dataclasses.fields(tp)}:
                    if isinstance(value, str) and name.endswith("_codec"):
                        value = Codec.parse(value)
                    by_group[group][name] = value
                    break
            else:
                known = sorted(f.name for tp in types_.values() for f in dataclasses.fields(tp))
                raise ConfigError(f"unknown setting {name!r}; known: {', '.join(known)}")
        return cls(**{group: tp(**by_group[group]) for group, tp in types_.items()})


@dataclass
class LearnerConfig:
    run: RunSettings = field(default_factory=RunSettings)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
    learner_id: str = "learner-0"
    resume_optimizer: bool = False  # keep the inner optimizer's state across restarts
    shard: int = 0  # this learner's slice of the training data ...
    num_shards: int = 1  # ... out of this many
    slowdown: float = 1.0  # >= 1: steps last this x the fastest compute (emulated hardware)
    state_dir: str | None = None  # progress file so a restarted learner resumes its schedule
    metrics_file: str | None = None  # JSON lines of progress
    metrics_port: int = 0  # 0: no Prometheus endpoint
    log_every: int = 10

    def __post_init__(self) -> None:
        check_id("learner_id", self.learner_id)
        check_int("log_every", self.log_every)
        check_int("num_shards", self.num_shards)
        for name in ("metrics_port", "shard"):
            check_int(name, getattr(self, name), minimum=0)
        require(
            self.shard < self.num_shards,
            f"shard={self.shard} must be in [0, num_shards={self.num_shards})",
        )
        require(self.slowdown >= 1, f"slowdown={self.slowdown}: use a factor >= 1")


@dataclass
class EvaluatorConfig:
    """The evaluator: subscribes to globals like a learner and reports held-out loss."""

    run: RunSettings = field(default_factory=RunSettings)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
    metrics_file: str | None = None  # JSON lines of evaluations


@dataclass
class InitConfig:
    """``ddiloco init``: write the initial global model and its fragment plan."""

    run: RunSettings = field(default_factory=RunSettings)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
