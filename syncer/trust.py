"""What the syncer believes of a learner's report: pure bounds and clips.

A delta carries figures the syncer cannot observe: the steps and tokens it
covers, the learner's incarnation, the version it started from. None is
taken on trust (docs/design.md, "Admission and merge rules"). Each is bounded here by what is
physically possible, a merged contribution's weight and size are clipped
against its peers', and nothing here does I/O or reads a clock: the caller
passes the time in.

The three defences, and the figure each one stops:

* :func:`check_report`: a forged ``c_steps`` (which would make a huge delta
  look small per step), ``c_tokens`` (which would buy weight) or incarnation
  (which would make the real learner's later deltas look like replays).
* :class:`TypicalSize`, twice per fragment: the weight cap (one learner
  carrying a round on its own weight) and the quarantine bar (one delta far
  larger per inner step than what its fragment usually receives).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from broker.wire.messages import Delta

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


class TypicalSize:
    """The typical size of one figure of a fragment's merged contributions (a
    norm per inner step, a token-step weight), and the limit ``factor`` times it.

    The rules, one each:

    * **Median**: the typical size is the *lower* median of the sample, so that
      in a sample of two the smaller value sets it: one forged large value can
      never raise the limit it is judged by.
    * **Sample**: the last ``window`` values that entered. Until ``window``
      have entered (warm-up) the round's own values join the sample, so the
      first round already has a limit that a minority cannot move.
    * **What enters**: a merged contribution's value, after any clipping (so a
      refused or clipped one can never raise the limit), and only when it is
      above 0 and at least ``1 / factor`` of the typical size before the round:
      zero or tiny decoys, however many, can neither pull the limit down nor
      make it disappear. Once a value has entered there is always a limit.
    """

    def __init__(self, window: int, factor: float, values: Iterable[float] = ()) -> None:
        if window < 1 or not factor > 1:
            raise ValueError(f"need window >= 1 and factor > 1, got {window} and {factor}")
        self.window = window
        self.factor = factor
        self.values: deque[float] = deque(values, maxlen=window)

    def _floor(self) -> float:
        """The smallest value that may enter: 1 / factor of the typical size."""
        return statistics.median_low(self.values) / self.factor if self.values else 0.0

    def _enters(self, value: float, floor: float) -> bool:
        return value > 0 and value >= floor and math.isfinite(value)

    def limit(self, this_round: Sequence[float]) -> float | None:
        """``factor`` times the typical size, with ``this_round``'s values in the
        sample during warm-up; None while no value above 0 was ever seen."""
        sample = list(self.values)
        if len(sample) < self.window:
            floor = self._floor()
            sample += [v for v in this_round if self._enters(v, floor)]
        return self.factor * statistics.median_low(sample) if sample else None

    def record(self, merged: Sequence[float]) -> None:
        """A closed round's merged values (one per learner), as they were merged."""
        floor = self._floor()
        self.values.extend(v for v in merged if self._enters(v, floor))
