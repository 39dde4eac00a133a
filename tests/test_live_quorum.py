"""K follows the live learners when no quorum is given (a scaled cluster, the end
of a run): the pure rule on a round, and the syncer that applies it."""

from __future__ import annotations

from pathlib import Path

import pytest

from compose.processes import free_port_pair
from syncer.quorum import Round
from tests.test_syncer_service import Clock, delta_on, heartbeat, make_syncer


def test_a_lower_quorum_is_reached_at_once_a_higher_one_never_taken_back() -> None:
    r = Round(quorum=3, gamma=0.0, tau_steps=2)
    r.add("a", now=1.0)
    r.add("b", now=2.0)
    assert r.quorum_at is None
    r.set_quorum(2, now=3.0)  # a learner left: two of K = 2
    assert r.quorum_at == 3.0
    r.set_quorum(4, now=4.0)  # two joined: the quorum reached stays reached
    assert r.quorum_at == 3.0 and r.should_close(4.0, {"a", "b"}, step_s=0.1)
    with pytest.raises(ValueError):
        r.set_quorum(0, now=5.0)


def test_an_empty_round_reaches_no_quorum() -> None:
    r = Round(quorum=3, gamma=0.0, tau_steps=2)
    r.set_quorum(1, now=1.0)
    assert r.quorum_at is None and not r.should_close(1.0, set(), step_s=None)


@pytest.mark.timeout(60)
def test_syncer_quorum_follows_learners_joining_and_leaving(tmp_path: Path) -> None:
    clock, wall = Clock(100.0), Clock(1_700_000_000.0)
    # quorum 0: K = live - 1. M = 2 is only what the run expects; the roster has room.
    syncer = make_syncer(
        tmp_path,
        free_port_pair(),
        quorum=0,
        learners=2,
        grace_gamma=0.5,
        clocks=(clock, wall),
        outer={"max_learners": 8},
    )
    try:
        # Four learners joined (scaled from the 2 expected): K = 3.
        syncer.handle([delta_on(syncer, name, 1, 0.1) for name in "abcd"])
        assert syncer.rounds == 1  # every live learner reported: at once
        syncer.handle([heartbeat(name, 1.0) for name in "abcd"])
        syncer.handle([delta_on(syncer, name, 2, 0.1) for name in "ab"])
        assert syncer.rounds == 1  # two of K = 3
        syncer.handle([delta_on(syncer, "c", 2, 0.1)])
        # Three of K = 3: quorum, then a grace window for d (live, not reported).
        assert syncer.rounds == 1 and syncer.states[0].round.quorum_at == 100.0
        clock.t = 102.0
        syncer.handle([heartbeat(name, 1.0) for name in "abcd"])
        assert syncer.rounds == 2  # the window (gamma * tau * step = 1 s) ran out

        # d leaves: once its heartbeat is older than the timeout, K = 2.
        clock.t = 102.0 + syncer.cfg.run.heartbeat_timeout_s + 1
        syncer.handle([heartbeat(name, 1.0) for name in "abc"])
        syncer.handle([delta_on(syncer, name, 3, 0.1) for name in "ab"])
        assert syncer.states[0].round.quorum == 2 and syncer.states[0].round.quorum_at is not None

        # Every learner leaves with progress pending: K falls to 1 and the
        # round merges without them, with no signal from outside.
        clock.t += syncer.cfg.run.heartbeat_timeout_s + 1
        syncer.handle([])
        assert syncer.rounds == 3 and syncer.states[0].pending_learners == []
    finally:
        syncer.transport.close()
