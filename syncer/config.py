"""The syncer's config dataclasses. It knows fragments, never a model class:
the plan and the initial weights come from the initial model file."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from broker.checks import check_choice, check_id, check_int, check_positive, require
from broker.run.settings import RunSettings

# mean and radial weight learners by tokens and steps; trimmed_mean and
# coordinate_median are robust to a minority of bad learners and ignore weights.
AGGREGATIONS = ("mean", "radial", "trimmed_mean", "coordinate_median")
QUARANTINE_ACTIONS = ("clip", "refuse")
# The boundaries of the delta pipeline (receive -> merge -> checkpoint -> publish
# -> ack) where a fault test can kill or pause the syncer (SyncerConfig.crash_at, pause_at).
AUTO_SHARD = "auto"  # syncer_shard: the lowest free index (see SyncerConfig)
AUTO_ID = "auto"  # syncer_id: from its shard and host (see SyncerConfig)
CRASH_POINTS = ("after_receive", "after_update", "after_checkpoint", "before_ack")


@dataclass(frozen=True)
class OuterConfig:
    """Rounds, the outer optimizer, and how far the syncer trusts a learner's delta."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregation: str = "mean"  # mean, radial, trimmed_mean or coordinate_median (untrusted)
    trim_per_side: int = 1  # trimmed_mean: values dropped at each end of every coordinate
    grace_gamma: float = 0.5  # share of the overlap left after quorum that a round may wait
    staleness: int = 4  # S: versions kept per fragment for rebasing (chosen by measurement)
    weight_clip: float = 3.0  # cap each learner's token-step weight at this x the typical weight
    quarantine_factor: float = 10.0  # Q: bar on a delta's norm per step, x its fragment's median
    quarantine_window: int = 16  # W: the last merged terms per fragment whose median sets both
    quarantine_action: str = "clip"  # clip a delta above the bar down to it, or refuse it
    max_tokens_per_step: int = 1 << 24  # refuse a delta claiming more tokens per inner step
    max_clock_skew_s: float = 60.0  # how far ahead a learner's clock may be (for incarnations)
    max_learners: int = 0  # roster cap: ids joined by an accepted delta; 0: learners

    def __post_init__(self) -> None:
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_int("trim_per_side", self.trim_per_side)
        check_positive("outer_lr", self.outer_lr)
        require(0 <= self.outer_momentum < 1, f"outer_momentum={self.outer_momentum}: use [0, 1)")
        require(0 <= self.grace_gamma < 1, f"grace_gamma={self.grace_gamma}: use [0, 1)")
        require(type(self.staleness) is int, "staleness must be an integer")
        check_positive("staleness", self.staleness)
        check_positive("weight_clip", self.weight_clip)
        require(self.weight_clip > 1, f"weight_clip={self.weight_clip}: use > 1")
        check_positive("quarantine_factor", self.quarantine_factor)
        require(self.quarantine_factor > 1, f"quarantine_factor={self.quarantine_factor}: use > 1")
        check_int("quarantine_window", self.quarantine_window)
        check_choice("quarantine_action", self.quarantine_action, QUARANTINE_ACTIONS)
        check_int("max_tokens_per_step", self.max_tokens_per_step)
        check_positive("max_clock_skew_s", self.max_clock_skew_s, allow_zero=True)
        require(
            math.isfinite(self.max_clock_skew_s),
            f"max_clock_skew_s={self.max_clock_skew_s}: give a finite number of seconds",
        )
        check_int("max_learners", self.max_learners, minimum=0)


@dataclass
class SyncerConfig:
    run: RunSettings = field(default_factory=RunSettings)
    outer: OuterConfig = field(default_factory=OuterConfig)
    # Unique across hosts, the same after a restart on one.
    syncer_id: str = AUTO_ID  # its name in logs and Redis's group; auto: syncer-SHARD-HOST
    # Shard s serves the fragments p with p mod syncer_shards == s (broker.fragments),
    # from its own folder checkpoint_dir/shard-s when there are several. auto:
    # Redis leases an index; over ZeroMQ the syncer takes the first shard folder
    # of checkpoint_dir no live syncer holds (replicas share the folder).
    syncer_shard: str = "0"  # this syncer's index in [0, syncer_shards), or auto: the lowest free
    checkpoint_dir: str = "syncer-checkpoint"
    # A fragment's full state is written every this many of its rounds; the
    # rounds between append their compact change to a log (syncer/checkpoint.py).
    full_checkpoint_every: int = 16
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_file: str | None = None  # JSON lines of rounds and rejections
    # Without it, a syncer whose checkpoint folder lacks fragments the broker holds
    # globals of refuses to start: it would throw the run's progress away.
    new_epoch: bool = False  # start over from the initial model though the broker has globals
    # ZeroMQ runs keep globals in the syncer and its learners only: a syncer
    # without a checkpoint asks the learners that dial it what they hold, for up
    # to this long (they redial every 2 s), before it starts a new epoch.
    recall_s: float = 4.0  # ZeroMQ: seconds without a checkpoint to wait for learners' claims
    # ZeroMQ runs: a Redis URL whose leases and terms fence each shard's syncer,
    # as Redis runs' own Redis does (broker/redis/shards.py). Empty: none.
    lease_store: str = ""  # ZeroMQ runs: redis:// or rediss:// URL of the shards' leases
    crash_at: str = ""  # fault tests: SIGKILL this process the first time it reaches this point
    # Fault tests: SIGSTOP this process the first time it reaches this point (the
    # test acts on the world, say kills Redis, then SIGCONTs it).
    pause_at: str = ""

    def __post_init__(self) -> None:
        if self.syncer_id != AUTO_ID:
            check_id("syncer_id", self.syncer_id)
        check_int("metrics_port", self.metrics_port, minimum=0)
        check_int("full_checkpoint_every", self.full_checkpoint_every)
        check_positive("recall_s", self.recall_s, allow_zero=True)
        if self.crash_at:
            check_choice("crash_at", self.crash_at, CRASH_POINTS)
        if self.pause_at:
            check_choice("pause_at", self.pause_at, CRASH_POINTS)
        shards = self.run.syncer_shards
        require(
            self.syncer_shard == AUTO_SHARD
            or (self.syncer_shard.isdigit() and int(self.syncer_shard) < shards),
            f"syncer_shard={self.syncer_shard!r}: use {AUTO_SHARD} or an index in [0, {shards})",
        )
        cap = self.outer.max_learners
        require(
            cap == 0 or cap >= self.run.learners,
            f"max_learners={cap}: at least learners={self.run.learners} (0: learners)",
        )

    @property
    def roster_cap(self) -> int:
        """Learner ids the syncer counts at once (a silent one makes room for a new one)."""
        return self.outer.max_learners or self.run.learners
