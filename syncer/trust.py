"""What the syncer believes of a learner's report: pure bounds and clips.

A delta carries figures the syncer cannot observe: the steps and tokens it
covers, the learner's incarnation, the version it started from. None is
taken on trust (DESIGN.md section 6). Each is bounded here by what is
physically possible, a merged contribution's weight and size are clipped
against its peers', and nothing here does I/O or reads a clock: the caller
passes the time in.

The three defences, and the figure each one stops:

* :func:`check_report`: a forged ``c_steps`` (which would make a huge delta
  look small per step), ``c_tokens`` (which would buy weight) or incarnation
  (which would make the real learner's later deltas look like replays).
* :func:`clip_weights`: one learner carrying a round on its own weight.
* :func:`quarantine_bar`: one delta far larger than what its fragment usually
  receives.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from broker.wire import Delta

# How much faster than its measured pace a learner may seem to have trained.
# Step times are averages of noisy samples and a learner may speed up (a
# neighbour process ends), so the bound leaves this much room; applied again
# against the roster's median pace (see credited_step_s), an honest learner up
# to STEP_MARGIN**2 = 4x faster than the median is never refused.
STEP_MARGIN = 2.0

REASON_STEPS = "too_many_steps"
REASON_TOKENS = "too_many_tokens"
REASON_INCARNATION = "future_incarnation"


@dataclass(frozen=True)
class ReportLimits:
    """The run's physical limits on what one delta may claim."""

    # Steps any delta may cover whatever the clock says, so that a learner
    # whose pace is not known yet (its first delta) is never refused: the
    # service uses 2 H, twice the steps between two sends of one fragment.
    step_floor: int
    max_tokens_per_step: int
    max_clock_skew_s: float


def credited_step_s(own: float | None, roster: Sequence[float]) -> float | None:
    """The step time a learner is credited with when its step count is bounded.

    ``own`` is its measured step time (an average of its heartbeats),
    ``roster`` those of every learner on the roster. Heartbeats are
    self-reported, so a learner is never credited with more than STEP_MARGIN
    times the roster's median pace: one claiming nanosecond steps would
    otherwise be allowed any step count. Without its own figure a learner is
    credited with the median; None when nothing is known at all.
    """
    median = statistics.median(roster) if roster else None
    if own is None:
        return median
    if median is None:
        return own
    return max(own, median / STEP_MARGIN)


def max_steps(elapsed_s: float, step_s: float | None, step_floor: int) -> float:
    """The most inner steps a learner can have made on a version ``elapsed_s`` old.

    A learner counts ``c_steps`` from when it applied its base version, which
    is after the syncer published it, so the steps fit into the time since
    publication; STEP_MARGIN leaves room for a learner faster than its average.
    """
    if step_s is None or not step_s > 0:
        return float(step_floor)
    return step_floor + STEP_MARGIN * max(0.0, elapsed_s) / step_s


def check_report(
    delta: Delta,
    *,
    base_published_s: float,
    wall_s: float,
    step_s: float | None,
    limits: ReportLimits,
) -> str | None:
    """Why a delta's figures are impossible, or None if they are credible.

    ``base_published_s`` and ``wall_s`` are the syncer's wall clock (seconds)
    when the delta's base version was published and now; ``step_s`` is the
    step time credited to the learner (:func:`credited_step_s`).
    """
    # Incarnations are the learner's start time in ns: one from the future
    # would make every later delta of the real learner look like a replay.
    if delta.incarnation > (wall_s + limits.max_clock_skew_s) * 1e9:
        return REASON_INCARNATION
    if delta.c_steps > max_steps(wall_s - base_published_s, step_s, limits.step_floor):
        return REASON_STEPS
    if delta.c_tokens > delta.c_steps * limits.max_tokens_per_step:
        return REASON_TOKENS
    return None


def clip_weights(weights: Sequence[float], factor: float) -> list[float]:
    """Cap each weight at ``factor`` times the round's lower median weight.

    Token-step weighting favours learners that did more, which is right while
    the figures are honest; the cap bounds what a forged figure can buy: with
    n contributions, none gets more than factor / (factor + n - 1) of the
    round, whatever it reports. The *lower* median, so that in a round of two
    the bar is set by the smaller weight, not by the mean with a forged one.
    Weights within the cap are unchanged.
    """
    cap = factor * statistics.median_low(weights)
    return [min(w, cap) for w in weights]


def quarantine_bar(
    recent: Sequence[float], this_round: Sequence[float], window: int, factor: float
) -> float | None:
    """The largest norm per step a delta of this round may have, or None (no bar).

    ``recent``: the norms per step of the fragment's last merged deltas (at
    most ``window``; only merged ones, so refused deltas can never move the
    bar); ``this_round``: those of the round being closed. The bar is
    ``factor`` times the lower median of the last ``window`` merged norms. Until
    that many exist (warm-up), the round's own deltas join the sample, so even
    the first round has a bar that a minority of outliers cannot move. A
    median of 0 gives no scale to compare with: no bar.
    """
    samples = list(recent) if len(recent) >= window else [*recent, *this_round]
    if not samples:
        return None
    reference = statistics.median_low(samples)
    return factor * reference if reference > 0 else None
