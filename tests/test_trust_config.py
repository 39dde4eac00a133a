"""The syncer's trust settings: defaults, bad values that name their setting,
the roster cap, and their flags."""

from __future__ import annotations

import pytest

from broker.cli_config import add_dataclass_args, dataclass_from_args
from broker.run.settings import RunSettings
from syncer.config import OuterConfig, SyncerConfig

NAN = float("nan")


def test_defaults() -> None:
    outer = OuterConfig()
    assert (outer.weight_clip, outer.quarantine_factor, outer.quarantine_window) == (3.0, 10.0, 16)
    assert outer.quarantine_action == "clip" and outer.trim_per_side == 1
    assert outer.max_tokens_per_step == 2**24 and outer.max_clock_skew_s == 60.0
    assert SyncerConfig().roster_cap == RunSettings().learners


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("aggregation", "geometric_median"),
        ("trim_per_side", 0),
        ("trim_per_side", 1.5),
        ("weight_clip", 0.5),
        ("weight_clip", 1.0),
        ("weight_clip", NAN),
        ("weight_clip", "3"),
        ("quarantine_factor", 1.0),
        ("quarantine_factor", NAN),
        ("quarantine_window", 0),
        ("quarantine_window", 2.0),
        ("quarantine_action", "drop"),
        ("max_tokens_per_step", 0),
        ("max_tokens_per_step", 1.5),
        ("max_clock_skew_s", -1.0),
        ("max_clock_skew_s", NAN),
        ("max_clock_skew_s", float("inf")),
        ("max_learners", -1),
    ],
)
def test_bad_value_names_its_setting(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        OuterConfig(**{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("aggregation", ["mean", "radial", "trimmed_mean", "coordinate_median"])
def test_aggregations(aggregation: str) -> None:
    assert OuterConfig(aggregation=aggregation).aggregation == aggregation


def test_roster_cap() -> None:
    run = RunSettings(learners=4)
    assert SyncerConfig(run=run).roster_cap == 4
    assert SyncerConfig(run=run, outer=OuterConfig(max_learners=9)).roster_cap == 9
    with pytest.raises(ValueError, match=r"max_learners=3.*learners=4"):
        SyncerConfig(run=run, outer=OuterConfig(max_learners=3))


def test_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, SyncerConfig)
    args = parser.parse_args(
        [
            "--quarantine-action",
            "refuse",
            "--max-learners",
            "8",
            "--max-tokens-per-step",
            "4096",
            "--aggregation",
            "trimmed_mean",
            "--trim-per-side",
            "2",
        ]
    )
    cfg = dataclass_from_args(SyncerConfig, args)
    assert cfg.outer == OuterConfig(
        quarantine_action="refuse",
        max_learners=8,
        max_tokens_per_step=4096,
        aggregation="trimmed_mean",
        trim_per_side=2,
    )
    assert "typical weight" in parser.format_help()  # the field comment is the help
