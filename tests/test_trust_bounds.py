"""syncer.trust by hand: the step, token and incarnation bounds, the credited
step time, the weight clip and the quarantine bar."""

from __future__ import annotations

import pytest

from broker.wire import Delta
from syncer.trust import (
    STEP_MARGIN,
    ReportLimits,
    check_report,
    clip_weights,
    credited_step_s,
    max_steps,
    quarantine_bar,
)

LIMITS = ReportLimits(step_floor=24, max_tokens_per_step=2048, max_clock_skew_s=60.0)
NOW = 1_700_000_000.0  # the syncer's wall clock, s


def report(c_steps: int = 12, c_tokens: int = 12 * 2048, incarnation: int = 0) -> Delta:
    return Delta(
        run_id="r",
        learner_id="a",
        incarnation=incarnation,
        seq=1,
        base_version=3,
        c_steps=c_steps,
        c_tokens=c_tokens,
    )


def check(d: Delta, age_s: float = 10.0, step_s: float | None = 0.5) -> str | None:
    return check_report(d, base_published_s=NOW - age_s, wall_s=NOW, step_s=step_s, limits=LIMITS)


def test_margin_is_two() -> None:
    assert STEP_MARGIN == 2.0  # the figures below are computed with it


@pytest.mark.parametrize(
    ("elapsed_s", "step_s", "expected"),
    [
        (10.0, 0.5, 24 + 2 * 20),  # 20 steps fit in 10 s at 0.5 s; margin 2
        (0.0, 0.5, 24),  # just published: the floor
        (-3.0, 0.5, 24),  # a clock step backwards never lowers the floor
        (10.0, None, 24),  # pace unknown: the floor
        (10.0, 0.0, 24),
        (3600.0, 2.0, 24 + 3600),
    ],
)
def test_max_steps(elapsed_s: float, step_s: float | None, expected: float) -> None:
    assert max_steps(elapsed_s, step_s, 24) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("d", "age_s", "step_s", "reason"),
    [
        (report(), 10.0, 0.5, None),
        (report(c_steps=64), 10.0, 0.5, None),  # 24 + 40: exactly the bound
        (report(c_steps=65, c_tokens=65), 10.0, 0.5, "too_many_steps"),
        (report(c_steps=24, c_tokens=24), 0.0, None, None),  # a new learner's first delta
        (report(c_steps=25, c_tokens=25), 0.0, None, "too_many_steps"),
        (report(c_steps=2**62, c_tokens=2**62), 10.0, 0.5, "too_many_steps"),
        (report(c_tokens=12 * 2048 + 1), 10.0, 0.5, "too_many_tokens"),
        (report(c_tokens=2**62), 10.0, 0.5, "too_many_tokens"),
        (report(incarnation=int((NOW + 60) * 1e9)), 10.0, 0.5, None),
        (report(incarnation=int((NOW + 61) * 1e9)), 10.0, 0.5, "future_incarnation"),
        (report(incarnation=2**63 - 1), 10.0, 0.5, "future_incarnation"),
    ],
)
def test_check_report(d: Delta, age_s: float, step_s: float | None, reason: str | None) -> None:
    assert check(d, age_s, step_s) == reason


@pytest.mark.parametrize(
    ("own", "roster", "expected"),
    [
        (None, [], None),  # nothing known
        (0.3, [], 0.3),
        (None, [0.2, 0.4, 0.6], 0.4),  # a newcomer: the roster's median pace
        (0.5, [0.2, 0.4, 0.5], 0.5),  # slower than the median: its own
        (0.25, [0.25, 0.4, 0.6], 0.25),  # faster, within the margin: its own
        (1e-9, [1e-9, 0.4, 0.6], 0.2),  # claims nanosecond steps: median / margin
    ],
)
def test_credited_step_s(own: float | None, roster: list[float], expected: float | None) -> None:
    assert credited_step_s(own, roster) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    ("weights", "factor", "expected"),
    [
        ([2500.0, 5000.0, 1800.0], 3.0, [2500.0, 5000.0, 1800.0]),  # within the clip
        ([1.0, 1.0, 2.0**124], 3.0, [1.0, 1.0, 3.0]),
        ([1.0, 2.0**124], 3.0, [1.0, 3.0]),  # two: the lower median sets the bar
        ([5.0], 3.0, [5.0]),
        ([1.0, 2.0, 3.0, 100.0], 3.0, [1.0, 2.0, 3.0, 6.0]),  # lower median 2
        ([1.0, 4.0, 4.0], 1.0, [1.0, 4.0, 4.0]),  # median 4: nothing above it
    ],
)
def test_clip_weights(weights: list[float], factor: float, expected: list[float]) -> None:
    assert clip_weights(weights, factor) == expected


def test_clipped_share_is_at_most_factor_over_factor_plus_n_minus_one() -> None:
    for n in range(2, 9):
        weights = clip_weights([1.0] * (n - 1) + [2.0**124], 3.0)
        assert weights[-1] / sum(weights) == pytest.approx(3.0 / (3.0 + n - 1))


@pytest.mark.parametrize(
    ("recent", "this_round", "window", "expected"),
    [
        ([], [1.0, 1.0, 1000.0], 4, 10.0),  # warm-up: the round's own median
        ([2.0], [1.0, 1000.0], 4, 20.0),  # warm-up: lower median of 1, 2, 1000
        ([1.0, 1.0, 1.0, 1.0], [50.0, 50.0, 50.0], 4, 10.0),  # W merged: only they
        ([1.0, 3.0, 3.0, 3.0], [50.0], 4, 30.0),
        ([1.0, 3.0], [], 4, 10.0),  # lower median of an even count
        ([], [0.0, 0.0, 5.0], 4, None),  # a median of 0: no scale, no bar
        ([], [], 4, None),
    ],
)
def test_quarantine_bar(
    recent: list[float], this_round: list[float], window: int, expected: float | None
) -> None:
    bar = quarantine_bar(recent, this_round, window, 10.0)
    assert bar == (None if expected is None else pytest.approx(expected))
