"""When to kill what: the fault schedule of ``ddiloco local``, without any I/O.

Two sources of kills:

* Poisson learner failures (``--chaos-mtbf-s``): gaps between kills are
  exponential with mean ``mtbf_s``; each kill picks one of the M learners
  uniformly, so learners fail independently. A learner that is finished or
  already down does not fail again: its draw is spent and no kill results.
* One-shot scheduled kills (``--kill-syncer-at-s``, ``--kill-learner-at-s``),
  each fired once, at the first ``due`` at or after its time.

The launcher asks ``due(now, up)`` every tick and does the killing; keeping the
schedule pure makes seeded runs reproducible and the schedule unit-testable.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Kill:
    """One kill the launcher should carry out now."""

    process: str  # "syncer" or "learner-<i>"
    reason: str  # "chaos" or "scheduled", recorded in the process_kill event


class ChaosSchedule:
    """Seeded kill schedule; times are in the caller's clock (``time.monotonic()``)."""

    def __init__(
        self,
        learners: int,
        seed: int,
        start: float,
        mtbf_s: float = 0.0,
        kill_syncer_at_s: float = 0.0,
        kill_learner_at_s: float = 0.0,
    ) -> None:
        self.learners = learners
        self.mtbf_s = mtbf_s
        # seed + 1: the stream seeded runs have always used, so their kills stay put.
        self.rng = random.Random(seed + 1)
        self.next_kill = self._next_kill(start)
        self.syncer_kill_at = start + kill_syncer_at_s if kill_syncer_at_s else None
        self.learner_kill_at = start + kill_learner_at_s if kill_learner_at_s else None

    def _next_kill(self, now: float) -> float | None:
        return now + self.rng.expovariate(1.0 / self.mtbf_s) if self.mtbf_s > 0 else None

    def due(self, now: float, up: Sequence[bool]) -> list[Kill]:
        """The kills due at ``now``; ``up[i]``: learner i is running and not finished."""
        up = list(up)
        kills = []
        if self.next_kill is not None and now >= self.next_kill:
            # Draw the victim even when it is down, so one learner's state does
            # not shift the random stream, and with it every later kill.
            victim = self.rng.choice(range(self.learners))
            if up[victim]:
                kills.append(Kill(f"learner-{victim}", "chaos"))
                up[victim] = False
            self.next_kill = self._next_kill(now)
        if self.learner_kill_at is not None and now >= self.learner_kill_at:
            if up[0]:
                kills.append(Kill("learner-0", "scheduled"))
            self.learner_kill_at = None
        if self.syncer_kill_at is not None and now >= self.syncer_kill_at:
            kills.append(Kill("syncer", "scheduled"))
            self.syncer_kill_at = None
        return kills
