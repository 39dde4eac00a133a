"""The syncer's config dataclasses. It knows fragments, never a model class:
the plan and the initial weights come from the initial model file."""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.config_checks import check_choice, check_id, check_int, check_positive, require
from broker.settings import RunSettings

AGGREGATIONS = ("mean", "radial")


@dataclass(frozen=True)
class OuterConfig:
    """Rounds and the outer optimizer."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregation: str = "mean"  # or "radial": radial-directional averaging
    grace_gamma: float = 0.5  # share of the overlap left after quorum that a round may wait
    staleness: int = 4  # S: versions kept per fragment for rebasing
    quarantine_factor: float = 10.0  # refuse a delta whose norm exceeds this x the median

    def __post_init__(self) -> None:
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_positive("outer_lr", self.outer_lr)
        require(0 <= self.outer_momentum < 1, f"outer_momentum={self.outer_momentum}: use [0, 1)")
        require(0 <= self.grace_gamma < 1, f"grace_gamma={self.grace_gamma}: use [0, 1)")
        require(type(self.staleness) is int, "staleness must be an integer")
        check_positive("staleness", self.staleness)
        require(self.quarantine_factor > 1, f"quarantine_factor={self.quarantine_factor}: use > 1")


@dataclass
class SyncerConfig:
    run: RunSettings = field(default_factory=RunSettings)
    outer: OuterConfig = field(default_factory=OuterConfig)
    syncer_id: str = "syncer-0"
    owned_fragments: tuple[int, ...] | None = None  # None: all of them
    checkpoint_dir: str = "syncer-checkpoint"
    metrics_port: int = 0  # 0: no Prometheus endpoint
    metrics_file: str | None = None  # JSON lines of rounds and rejections

    def __post_init__(self) -> None:
        check_id("syncer_id", self.syncer_id)
        check_int("metrics_port", self.metrics_port, minimum=0)
        if self.owned_fragments is not None:
            require(
                len(self.owned_fragments) > 0
                and len(set(self.owned_fragments)) == len(self.owned_fragments)
                and all(0 <= p < self.run.fragments for p in self.owned_fragments),
                f"owned_fragments={self.owned_fragments}: use indices in [0, {self.run.fragments})",
            )
