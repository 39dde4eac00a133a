"""When to close a fragment's round: quorum K plus an adaptive grace window.

Pure state machine: the clock is passed in as ``now`` (seconds, any
monotonic origin), nothing sleeps. The event loop asks :meth:`Round.close_at`
for its next wake-up and :meth:`Round.should_close` whenever something happens.
"""

from __future__ import annotations

from collections.abc import Collection


class Ema:
    """Exponential moving average; the first sample initialises it."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None

    def update(self, sample: float) -> float:
        self.value = (
            sample if self.value is None else (self.alpha * sample + (1 - self.alpha) * self.value)
        )
        return self.value


def grace_window_s(
    gamma: float, tau_steps: float, step_s: float, quorum_s: float, sync_s: float
) -> float:
    """xi_grace = gamma * max(0, tau * xi_step - (xi_quorum + xi_sync)).

    Waiting longer than the learners' overlap (tau steps) would make them
    train on a stale fragment, so the window is what is left of the overlap
    after reaching quorum and syncing, scaled down by gamma < 1.
    """
    return gamma * max(0.0, tau_steps * step_s - (quorum_s + sync_s))


class Round:
    """One fragment's open round of deltas.

    The round opens with its first delta, reaches quorum with the K-th
    distinct learner, and closes at once when every live learner has
    reported, or when the grace window after quorum has passed. It never
    closes before K learners reported, unless at least K learners were once
    known, fewer are live now, and every live one has: a round does not wait
    for the dead (but does wait for learners that have not started yet).
    """

    def __init__(self, quorum: int, gamma: float, tau_steps: float, ema_alpha: float = 0.2) -> None:
        if quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {quorum}")
        if not 0 <= gamma < 1:
            raise ValueError(f"grace gamma must be in [0, 1), got {gamma}")
        if not tau_steps >= 0:  # also refuses NaN
            raise ValueError(f"tau must be >= 0, got {tau_steps}")
        self.quorum = quorum
        self.gamma = gamma
        self.tau_steps = tau_steps
        self.quorum_s = Ema(ema_alpha)
        self.sync_s = Ema(ema_alpha)
        self.reporters: set[str] = set()
        self.opened_at: float | None = None
        self.quorum_at: float | None = None

    def add(self, learner_id: str, now: float) -> None:
        if self.opened_at is None:
            self.opened_at = now
        self.reporters.add(learner_id)
        if self.quorum_at is None and len(self.reporters) >= self.quorum:
            self.quorum_at = now

    def grace_window_s(self, step_s: float | None) -> float:
        """The current window, 0 until a step time has been observed."""
        if step_s is None:
            return 0.0
        return grace_window_s(
            self.gamma, self.tau_steps, step_s, self.quorum_s.value or 0.0, self.sync_s.value or 0.0
        )

    def close_at(self, step_s: float | None) -> float | None:
        """When the grace window runs out, or None while quorum is not reached."""
        if self.quorum_at is None:
            return None
        return self.quorum_at + self.grace_window_s(step_s)

    def should_close(
        self, now: float, live: Collection[str], step_s: float | None, known: int = 0
    ) -> bool:
        """``live``: learners heard from recently; ``known``: learners ever heard from."""
        if self.opened_at is None:
            return False
        all_live_reported = all(learner in self.reporters for learner in live)
        if live and all_live_reported and len(live) < self.quorum <= known:
            # K learners existed but fewer are alive now, and all of those
            # reported: waiting for K would stall the fragment until the dead
            # come back (or forever, at the end of a run).
            return True
        deadline = self.close_at(step_s)
        if deadline is None:
            return False
        return all_live_reported or now >= deadline

    def closed(self, sync_s: float) -> None:
        """Record the round's timings and start an empty one."""
        if self.quorum_at is not None and self.opened_at is not None:
            self.quorum_s.update(self.quorum_at - self.opened_at)
        self.sync_s.update(sync_s)
        self.reporters = set()
        self.opened_at = None
        self.quorum_at = None
