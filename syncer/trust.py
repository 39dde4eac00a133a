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
  (which would make the real learner's later deltas look like replays). The
  steps are bounded by the time since the delta's base version was published,
  at the pace the learner's own deltas show (:func:`delta_pace`), capped by
  its peers' (:func:`credited_step_s`, :func:`max_steps`).
* :class:`TypicalSize`, twice per fragment: the weight cap (one learner
  carrying a round on its own weight) and the quarantine bar (one delta far
  larger per inner step than what its fragment usually receives).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from broker.errors import ConfigError
from broker.wire.messages import Delta

# How much faster than its measured pace a learner may seem to have trained.
# A pace is measured between deltas whose arrival times carry network and
# queueing noise, and a learner may speed up (a neighbour process ends), so the
# bound leaves this much room; applied again against the roster's median pace
# (see credited_step_s), an honest learner up to STEP_MARGIN**2 = 4x faster
# than the median is never refused.
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


@dataclass(frozen=True)
class PaceMark:
    """Where a learner's pace is measured from: the incarnation and step of its
    newest accepted delta, and when that delta (or the first of the same
    instant) arrived, on the syncer's wall clock (the one versions are dated
    by: a pace divides the time since a publication)."""

    incarnation: int
    step: int
    at_s: float


def delta_pace(
    mark: PaceMark | None, incarnation: int, step: int, now: float
) -> tuple[float | None, PaceMark | None]:
    """The pace a learner's delta shows, and the mark its next delta is measured from.

    The pace is the syncer's time per step of the learner's since its previous
    delta: ``(now - mark.at_s) / (step - mark.step)``, seconds per step. Both
    figures are the learner's own deltas', so no other message has to arrive
    first. A burst (deltas held back, by a slow admission, an outage, a syncer
    restart, then sent together) looks fast, down to 0 for deltas of the same
    instant: a pace only ever makes the step bound more lenient the faster it
    is, so a burst can never get an honest delta refused. A learner cannot
    lift its own bound that way past the roster's (:func:`credited_step_s`).

    None when the delta shows no pace: the learner's first delta, or that of a
    new incarnation (a restart), which starts a mark; a delta of an older
    incarnation or of no later step (a resend, another fragment's delta sent
    earlier). The mark moves only once time has passed, so that the deltas of
    one instant count towards the next interval's steps (the interval after a
    burst is measured from its first delta: the pace over the whole burst).
    """
    if mark is None or incarnation > mark.incarnation:
        return None, PaceMark(incarnation, step, now)
    if incarnation < mark.incarnation or step <= mark.step:
        return None, mark
    pace = max(0.0, now - mark.at_s) / (step - mark.step)
    if now > mark.at_s:
        return pace, PaceMark(incarnation, step, now)
    return pace, mark


def restart_marks(
    applied: Mapping[str, tuple[int, int]], merged_step: Mapping[str, int], published_s: float
) -> dict[str, PaceMark]:
    """Where each learner's pace is measured from after a restart, from what one
    fragment's checkpoint (or rebuilt state) knows: its incarnation, the
    newest step of its merged there (``applied``, ``merged_step``), as of the
    fragment's current version's publication (no earlier than that delta
    arrived: a pace measured from it is, if anything, faster than the
    learner's, so an honest learner's first delta after an outage is bounded
    by the time it trained, not refused at the floor)."""
    return {
        learner: PaceMark(applied[learner][0], step, published_s)
        for learner, step in merged_step.items()
        if learner in applied
    }


def newest_marks(marks: Iterable[Mapping[str, PaceMark]]) -> dict[str, PaceMark]:
    """Per learner, the newest of the marks (the latest incarnation, then step)."""
    newest: dict[str, PaceMark] = {}
    for found in marks:
        for learner, mark in found.items():
            held = newest.get(learner)
            if held is None or (mark.incarnation, mark.step) > (held.incarnation, held.step):
                newest[learner] = mark
    return newest


def credited_step_s(own: float | None, roster: Sequence[float]) -> float | None:
    """The step time a learner is credited with when its step count is bounded.

    ``own`` is its own pace (the fastest its recent deltas showed, this one's
    included: :func:`delta_pace`), ``roster`` the typical pace of every learner
    on the roster (each its median). A pace is the learner's own figures, so a
    learner is never credited with more than STEP_MARGIN times the roster's
    median pace: one whose steps advance a million between two deltas would
    otherwise be allowed any step count. The roster's figures are medians, not
    fastest paces, so that the bursts every learner sends after an outage do
    not lift that cap for everyone. Without its own figure a learner is
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
    publication: ``step_floor + STEP_MARGIN * elapsed_s / step_s``. STEP_MARGIN
    leaves room for a learner faster than its measured pace. Pace unknown
    (None): the floor. A pace of 0 (a burst, with nothing on the roster to
    cap it): no bound.
    """
    if step_s is None or math.isnan(step_s):
        return float(step_floor)
    if step_s <= 0:
        return math.inf
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
    step time credited to the learner for this delta (:func:`credited_step_s`
    of the pace its deltas, this one included, show).
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
            raise ConfigError(f"need window >= 1 and factor > 1, got {window} and {factor}")
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
