"""Who the syncer counts, and how many deltas make a round: the roster, the
learners rounds wait for, M and K. The one owner of K: rounds ask it."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from broker.run.settings import RunSettings, default_quorum
from syncer.quorum import Roster
from syncer.trust import PaceMark

log = logging.getLogger(__name__)


class Membership:
    """The roster (:class:`syncer.quorum.Roster`) and the run's quorum policy.

    M is the run's learners until a round waited for missing ones in vain (a
    cluster started with fewer), then the learners that joined, as they join,
    up to the run's. Never more: anyone can join the roster under made-up ids,
    and a K they raised would hold every round for reports they never send.
    K is ``quorum`` when set, else :func:`broker.run.settings.default_quorum` of M.
    """

    def __init__(
        self,
        run: RunSettings,
        roster_cap: int,
        now: float,
        members: Collection[str],
        marks: Mapping[str, PaceMark] | None = None,
    ):
        self.run = run
        self.roster = Roster(roster_cap, run.heartbeat_timeout_s, now, members, marks=marks)
        self.short_run = False  # fewer learners joined than the quorum expects

    def quorum(self) -> int:
        """K. Learners that die are the rounds' business (they do not wait for the
        dead); a restart keeps K, since the roster comes back with the checkpoint."""
        return self.run.quorum or default_quorum(self.learners())

    def learners(self) -> int:
        """M: see the class."""
        run = self.run
        return min(len(self.roster), run.learners) if self.short_run else run.learners

    def waited_for(self, now: float) -> set[str]:
        """The learners rounds wait for (:meth:`Roster.waited_for`)."""
        return self.roster.waited_for(now, self.run.sync_every)

    def full_round(self, now: float) -> int:
        """How many deltas make a full round: M, or the live learners (heard
        within the heartbeat timeout) when fewer, so the dead do not shrink
        every round's step for ever. Live, not waited for: a learner whose
        deltas are late is still training, and its next round will hold them."""
        live = len(self.roster.live(now))
        return min(self.learners(), live) if live else self.learners()

    def settle_short_run(self) -> str | None:
        """A round closed after waiting for learners that never joined: fewer run
        than the quorum expects. From now on M follows the learners that joined.
        Returns the advice to give, the first time only."""
        if self.short_run:
            return None
        quorum = self.quorum()
        self.short_run = True
        joined, run = len(self.roster), self.run
        if run.quorum:
            wait_s = run.gone_after_s
            advice = f"each round waits {wait_s:.0f} s for them: lower DDILOCO_QUORUM"
        else:
            advice = f"K is now {self.quorum()}, and follows the learners that join"
        log.warning(
            "only %d learner(s) joined, fewer than the quorum K=%d (of M=%d learners): %s",
            joined, quorum, run.learners, advice,
        )  # fmt: skip
        return advice
