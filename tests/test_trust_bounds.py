"""syncer.trust by hand: the step, token and incarnation bounds, the credited
step time, and the typical size behind the weight cap and the quarantine bar."""

from __future__ import annotations

import random

import pytest

from broker.wire.messages import Delta
from syncer.trust import (
    STEP_MARGIN,
    ReportLimits,
    TypicalSize,
    check_report,
    credited_step_s,
    max_steps,
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
        (10.0, 0.0, float("inf")),  # a burst with no roster pace to cap it: no bound
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
        (1e-9, [1e-9, 0.4, 0.6], 0.2),  # steps a million apart: median / margin
        (0.0, [0.4, 0.4, 0.6], 0.2),  # a burst (0 s between deltas): median / margin
        (0.0, [], 0.0),  # a burst, nothing to cap it: no bound (max_steps)
    ],
)
def test_credited_step_s(own: float | None, roster: list[float], expected: float | None) -> None:
    assert credited_step_s(own, roster) == (None if expected is None else pytest.approx(expected))


def reference_limit(
    entered: list[float], this_round: list[float], window: int, factor: float
) -> float | None:
    """The limit as docs/design.md states it, written independently of the code:
    factor x the lower median of the last ``window`` values that entered, with
    the round's own values in the sample while fewer than ``window`` entered;
    a round value joins only if above 0 and at least the window's lower median
    / factor."""
    last = entered[-window:]
    sample = list(last)
    if len(last) < window:
        floor = sorted(last)[(len(last) - 1) // 2] / factor if last else 0.0
        sample += [v for v in this_round if v > 0 and v >= floor]
    if not sample:
        return None
    return factor * sorted(sample)[(len(sample) - 1) // 2]


@pytest.mark.parametrize(
    ("entered", "this_round", "window", "expected"),
    [
        ([], [1.0, 1.0, 1000.0], 4, 10.0),  # warm-up: the round's own lower median
        ([2.0], [1.0, 1000.0], 4, 20.0),  # warm-up: lower median of 1, 2, 1000
        ([1.0, 1.0, 1.0, 1.0], [50.0, 50.0, 50.0], 4, 10.0),  # W entered: only they
        ([1.0, 3.0, 3.0, 3.0], [50.0], 4, 30.0),
        ([1.0, 3.0], [], 4, 10.0),  # lower median of an even count
        ([], [1.0, 2.0**124], 4, 10.0),  # two: the smaller sets it
        ([], [0.0, 0.0, 5.0], 4, 50.0),  # zeros carry no scale: never in the sample
        ([4.0], [0.1, 0.1, 0.1], 4, 40.0),  # decoys below 1/factor of it do not join
        ([], [], 4, None),
    ],
)
def test_typical_size_limit(
    entered: list[float], this_round: list[float], window: int, expected: float | None
) -> None:
    sizes = TypicalSize(window, 10.0, entered)
    limit = sizes.limit(this_round)
    assert limit == (None if expected is None else pytest.approx(expected))
    assert limit == reference_limit(entered, this_round, window, 10.0)


def test_typical_size_matches_the_written_rule_on_random_rounds() -> None:
    """Rounds of random sizes, decoys (zeros and tiny values) among them: the
    class and the written rule agree on every limit, and what enters is what
    the rule lets in."""
    rng = random.Random(7)
    sizes = TypicalSize(16, 3.0)
    entered: list[float] = []
    for _ in range(200):
        this_round = [rng.lognormvariate(0, 0.5) for _ in range(rng.randint(1, 6))]
        this_round += [rng.choice([0.0, 1e-6, 1e-3]) for _ in range(rng.randint(0, 3))]
        assert sizes.limit(this_round) == reference_limit(entered, this_round, 16, 3.0)
        floor = sorted(entered[-16:])[(len(entered[-16:]) - 1) // 2] / 3.0 if entered else 0.0
        entered += [v for v in this_round if v > 0 and v >= floor]
        sizes.record(this_round)
        assert list(sizes.values) == entered[-16:]


def test_decoys_can_neither_lower_nor_remove_the_limit() -> None:
    """Zero or tiny values, however many and for however long, leave the limit
    where honest values put it; the limit never disappears once one was set."""
    sizes = TypicalSize(16, 10.0, [1.0] * 16)
    for _ in range(100):
        sizes.record([0.0, 1e-9, 1e-3, 0.05])
        assert sizes.limit([0.0, 1e-9]) == pytest.approx(10.0)
    # Warm-up with one honest value: decoys of the round still cannot join.
    warm = TypicalSize(16, 10.0, [2.0])
    assert warm.limit([0.0, 0.0, 0.0, 0.01]) == pytest.approx(20.0)


def test_a_capped_share_is_at_most_factor_over_factor_plus_n_minus_one() -> None:
    """The weight cap's bound: with n terms of which n - 1 are alike, one forged
    weight gets at most factor / (factor + n - 1) of the round."""
    for n in range(2, 9):
        weights = [1.0] * (n - 1) + [2.0**124]
        cap = TypicalSize(16, 3.0).limit(weights)
        assert cap is not None
        capped = [min(w, cap) for w in weights]
        assert capped[-1] / sum(capped) == pytest.approx(3.0 / (3.0 + n - 1))
