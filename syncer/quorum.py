"""When to close a fragment's round: quorum K plus an adaptive grace window,
counting only the learners on the roster.

Pure state machines: the clock is passed in as ``now`` (seconds, any
monotonic origin), nothing sleeps. The event loop asks :meth:`Round.close_at`
for its next wake-up and :meth:`Round.should_close` whenever something happens,
with the live learners and step times of its :class:`Roster`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping

from broker.errors import ConfigError, DdilocoError
from syncer.trust import PaceMark, credited_step_s, delta_pace

# Pace samples (one per accepted delta that arrived after time passed) a
# member's pace is taken over: its fastest bounds its own step counts, its
# median is its say in the roster's cap on everyone's. Long enough to span a
# busy spell of a shared machine: a learner that sped up again (a neighbour's
# job ended) by more than STEP_MARGIN over every sample of a short window had
# its honest step counts refused as impossible (16 samples did, in a run on a
# loaded machine).
PACE_WINDOW = 256


class Ema:
    """Exponential moving average; the first sample initialises it."""

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ConfigError(f"EMA alpha must be in (0, 1], got {alpha}")
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

    The round opens with its first delta and reaches quorum with the K-th
    distinct learner (K is asked of the run's one owner of it,
    :class:`syncer.membership.Membership`, and given to every call). It closes
    at once when every live learner has reported, or when the grace window
    after quorum has passed. It never closes before K learners reported,
    unless fewer are live and every live one has: at once when at least K
    learners were once known (a round does not wait for the dead), else once
    it has been open ``absent_wait_s`` (it waits that long for learners that
    have not started yet, never for ever: a run scaled to fewer learners than
    its quorum still trains). With no learner live at all it closes at once.
    """

    def __init__(
        self,
        gamma: float,
        tau_steps: float,
        absent_wait_s: float = math.inf,
        ema_alpha: float = 0.2,
    ) -> None:
        if not 0 <= gamma < 1:
            raise ConfigError(f"grace gamma must be in [0, 1), got {gamma}")
        if not tau_steps >= 0:  # also refuses NaN
            raise ConfigError(f"tau must be >= 0, got {tau_steps}")
        if not absent_wait_s >= 0:
            raise ConfigError(f"absent wait must be >= 0, got {absent_wait_s}")
        self.absent_wait_s = absent_wait_s
        self.gamma = gamma
        self.tau_steps = tau_steps
        self.quorum_s = Ema(ema_alpha)
        self.sync_s = Ema(ema_alpha)
        self.arrivals: dict[str, float] = {}  # each reporter's first delta of the round

    @property
    def reporters(self) -> set[str]:
        return set(self.arrivals)

    @property
    def opened_at(self) -> float | None:
        return min(self.arrivals.values()) if self.arrivals else None

    def add(self, learner_id: str, now: float) -> None:
        self.arrivals.setdefault(learner_id, now)

    def quorum_at(self, quorum: int) -> float | None:
        """When the K-th distinct learner reported, or None before."""
        if quorum < 1:
            raise ConfigError(f"quorum must be >= 1, got {quorum}")
        times = sorted(self.arrivals.values())
        return times[quorum - 1] if len(times) >= quorum else None

    def grace_window_s(self, step_s: float | None) -> float:
        """The current window, 0 until a step time has been observed."""
        if step_s is None:
            return 0.0
        return grace_window_s(
            self.gamma, self.tau_steps, step_s, self.quorum_s.value or 0.0, self.sync_s.value or 0.0
        )

    def close_at(self, step_s: float | None, quorum: int) -> float | None:
        """When the grace window runs out, or None while quorum is not reached."""
        reached = self.quorum_at(quorum)
        if reached is None:
            return None
        return reached + self.grace_window_s(step_s)

    def should_close(
        self, now: float, live: Collection[str], step_s: float | None, known: int, quorum: int
    ) -> bool:
        """``live``: the learners the round waits for; ``known``: learners that
        joined. The service passes the roster's (:class:`Roster`), never raw
        heartbeats."""
        opened_at = self.opened_at
        if opened_at is None:
            return False
        if not live:
            # Every learner went silent (they finished, or were stopped): none
            # is coming to complete the round, so merge what arrived.
            return True
        all_live_reported = all(learner in self.arrivals for learner in live)
        # Fewer than K are alive and all of those reported. If K existed,
        # waiting for K would stall the fragment until the dead come back (or
        # forever, at the end of a run); if K never did, the missing ones may
        # still be starting, so wait for them, but not for ever.
        short = all_live_reported and len(live) < quorum
        if short and (quorum <= known or now - opened_at >= self.absent_wait_s):
            return True
        deadline = self.close_at(step_s, quorum)
        if deadline is None:
            return False
        return all_live_reported or now >= deadline

    def closed(self, sync_s: float, quorum: int) -> None:
        """Record the round's timings and start an empty one."""
        reached, opened_at = self.quorum_at(quorum), self.opened_at
        if reached is not None and opened_at is not None:
            self.quorum_s.update(reached - opened_at)
        self.sync_s.update(sync_s)
        self.arrivals = {}


class Roster:
    """The learners a syncer counts: liveness, quorum and step times come from them only.

    A learner id joins with its first accepted delta (the syncer answers no
    snapshot request itself, the transport does, so a delta is the first
    thing of a learner it can vouch for); after a restart the roster is the
    learners whose deltas the checkpoint records as applied. At most ``cap``
    ids are on it, so made-up ids cannot grow the syncer's memory or out-vote
    the learners; when it is full, a new id takes the place of the member
    silent the longest, and only if that one has been silent for longer than
    the heartbeat timeout (a learner replaced under a new id gets its slot, a
    live one is never displaced).

    Heartbeats of ids not on the roster are ignored: they neither keep a
    learner live nor count towards "every live learner reported" nor feed step
    times, so forged heartbeats can neither hold a round open, nor stretch its
    grace window, nor stand in for a quorum.
    """

    def __init__(
        self,
        cap: int,
        heartbeat_timeout_s: float,
        now: float,
        members: Collection[str] = (),
        ema_alpha: float = 0.1,
        marks: Mapping[str, PaceMark] | None = None,
    ) -> None:
        """``members`` and ``marks``: what a restarted syncer's checkpoint knows
        (:func:`syncer.trust.restart_marks`)."""
        if cap < 1:
            raise ConfigError(f"roster cap must be >= 1, got {cap}")
        self.cap = cap
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ema_alpha = ema_alpha
        self.members: set[str] = set(members)
        # Restored members are not live until heard from (a restart must not
        # wait for the dead), but count as silent only from now on.
        self.created_at = now
        self.last_heard: dict[str, float] = {}
        self.last_delta: dict[str, float] = {}  # when each member's last delta was accepted
        self._last_message: float | None = None  # when anyone was last heard from
        self.step_s: dict[str, Ema] = {}  # the step times its heartbeats report
        # Each member's pace, read from its accepted deltas (syncer.trust.delta_pace):
        # the mark the next is measured from, and the last PACE_WINDOW samples.
        self.pace_s: dict[str, deque[float]] = {}
        self._pace_mark: dict[str, PaceMark] = dict(marks or {})
        # Members whose mark is still the restart's: the interval from it spans
        # the outage, and the deltas that come first were mostly made before it
        # (sent again once acks stopped), so it bounds its delta but is no sample.
        self._restart_marked: set[str] = set(self._pace_mark)
        self._typical: dict[str, float] = {}  # the median of each member's samples

    def __contains__(self, learner: str) -> bool:
        return learner in self.members

    def __len__(self) -> int:
        return len(self.members)

    def _silent_since(self, learner: str) -> float:
        return self.last_heard.get(learner, self.created_at)

    def _evictable(self, now: float) -> str | None:
        """The member a newcomer may replace when the roster is full, if any."""
        if not self.members:
            return None
        quietest = min(self.members, key=lambda name: (self._silent_since(name), name))
        if now - self._silent_since(quietest) > self.heartbeat_timeout_s:
            return quietest
        return None

    def admits(self, learner: str, now: float) -> bool:
        """Whether a delta of ``learner`` may be taken: it is on the roster, or
        there is room, or a silent member can make room."""
        return (
            learner in self.members
            or len(self.members) < self.cap
            or self._evictable(now) is not None
        )

    def _excuse_silence(self, now: float) -> None:
        """Nobody at all was heard from for longer than the heartbeat timeout:
        the syncer could not hear (its broker failed over or restarted, or it
        was stopped), not every learner died at once. The members that were
        live when it went quiet are live again for what was left of their
        timeout, and their deltas as recent: else the first learner heard from
        after the outage was the only live one, rounds closed on its deltas
        alone at once, versions raced ahead, and every other learner's deltas
        from the outage came in stale (65 refused after a Sentinel failover in
        compose, the learners' progress of those 11 s thrown away)."""
        last, self._last_message = self._last_message, now
        if last is None or now - last <= self.heartbeat_timeout_s:
            return
        silence = now - last
        for times in (self.last_heard, self.last_delta):
            for member in times:
                times[member] += silence

    def join(self, learner: str, now: float) -> str | None:
        """An accepted delta: the learner is on the roster, and live. Returns the
        member it displaced, if any."""
        self._excuse_silence(now)
        evicted = None
        if learner not in self.members and len(self.members) >= self.cap:
            evicted = self._evictable(now)
            if evicted is None:
                raise DdilocoError(f"roster full ({self.cap}): {learner} cannot join")
            self.members.discard(evicted)
            self.last_heard.pop(evicted, None)
            self.last_delta.pop(evicted, None)
            self.step_s.pop(evicted, None)
            self.pace_s.pop(evicted, None)
            self._pace_mark.pop(evicted, None)
            self._restart_marked.discard(evicted)
            self._typical.pop(evicted, None)
        self.members.add(learner)
        self.last_heard[learner] = now
        self.last_delta[learner] = now
        return evicted

    def heard(self, learner: str, now: float, step_time_s: float = 0.0) -> bool:
        """A heartbeat; False (and nothing recorded) if ``learner`` is not on the roster.

        Heartbeats are liveness only: the member is live, and the step time it
        reports, capped at the heartbeat timeout (one stalled step, or a lying
        peer, must not stretch every grace window past the time a dead learner
        takes to be noticed), feeds ``step_times``, an average per member, for
        the grace window and the rounds' wait (:meth:`waited_for`). Nothing a
        heartbeat says bounds a delta: a member's pace is read from its deltas
        (:meth:`paced`), so no rule depends on which of the two came first.
        """
        if learner not in self.members:
            return False
        self._excuse_silence(now)
        self.last_heard[learner] = now
        if step_time_s > 0:
            ema = self.step_s.setdefault(learner, Ema(self.ema_alpha))
            ema.update(min(step_time_s, self.heartbeat_timeout_s))
        return True

    def paced(self, learner: str, incarnation: int, step: int, wall_s: float) -> None:
        """A member's delta was accepted, arriving at ``wall_s`` (the syncer's wall
        clock): the pace it shows (:func:`syncer.trust.delta_pace`)
        joins its samples, capped at the heartbeat timeout (a learner paused
        for longer is not slower than that when it goes on). A sample of 0 (a
        delta of the same instant as its previous one) bounds that delta only
        (:meth:`credited_step_s`) and is not kept: the interval after it counts
        those steps. Nor is the interval from a restart's mark (see
        ``_restart_marked``): deltas made before the outage and sent again after
        it show an honest learner as slow as the outage was long, which bound
        its next deltas (made during the outage, covering it) at the floor."""
        if learner not in self.members:
            return
        held = self._pace_mark.get(learner)
        pace, mark = delta_pace(held, incarnation, step, wall_s)
        if mark is not None:
            self._pace_mark[learner] = mark
        if learner in self._restart_marked:
            if mark is not held:  # measured from this delta from now on
                self._restart_marked.discard(learner)
            return
        if pace is not None and pace > 0:
            window = self.pace_s.setdefault(learner, deque(maxlen=PACE_WINDOW))
            window.append(min(pace, self.heartbeat_timeout_s))
            self._typical[learner] = statistics.median(window)

    def live(self, now: float) -> set[str]:
        """Members heard from (heartbeat or accepted delta) within the heartbeat timeout."""
        timeout = self.heartbeat_timeout_s
        return {name for name, t in self.last_heard.items() if now - t <= timeout}

    def waited_for(self, now: float, sync_every: int) -> set[str]:
        """The live members a round waits for: those whose deltas still arrive,
        the last one accepted within 2 x ``sync_every`` (H) x the step time the
        member's heartbeats report (a member sends a delta of every fragment
        each H steps). Heartbeats alone keep a member on the roster, not in
        the wait: a learner that stopped sending, or anyone heartbeating under
        its id, cannot hold rounds open for longer than that. Without a step
        time reported yet, live is enough."""
        waited = set()
        times = self.step_times()
        for name in self.live(now):
            step_s = times.get(name)
            since = now - self.last_delta.get(name, -math.inf)
            if step_s is None or since <= 2 * sync_every * step_s:
                waited.add(name)
        return waited

    def credited_step_s(
        self,
        learner: str,
        *,
        incarnation: int | None = None,
        step: int | None = None,
        wall_s: float | None = None,
    ) -> float | None:
        """The step time ``learner`` is credited with (:func:`syncer.trust.credited_step_s`):
        the fastest pace of its recent deltas and, given the ``incarnation``
        and ``step`` of its delta arriving at ``wall_s``, of that one too; never
        faster than half the roster's median typical pace."""
        window = self.pace_s.get(learner)
        own = min(window) if window else None
        if incarnation is not None and step is not None and wall_s is not None:
            pace, _ = delta_pace(self._pace_mark.get(learner), incarnation, step, wall_s)
            if pace is not None:
                pace = min(pace, self.heartbeat_timeout_s)
                own = pace if own is None else min(own, pace)
        return credited_step_s(own, list(self._typical.values()))

    def step_times(self) -> dict[str, float]:
        """Each member's reported step time (its heartbeats'), where one is known."""
        return {name: e.value for name, e in self.step_s.items() if e.value is not None}

    def pace_times(self) -> dict[str, float]:
        """Each member's fastest pace its deltas showed (see :meth:`paced`), where known."""
        return {name: min(window) for name, window in self.pace_s.items() if window}

    def typical_pace_times(self) -> dict[str, float]:
        """Each member's typical pace (the median of its samples), where known."""
        return dict(self._typical)

    def median_step_s(self) -> float | None:
        """The roster's typical step time (the grace window's xi_step): the median
        of the members' own averages, so one lying member cannot move it far."""
        times = list(self.step_times().values())
        return statistics.median(times) if times else None
