"""Quorum and grace window, with the clock passed in by hand."""

from __future__ import annotations

import pytest

from broker.errors import DdilocoError
from syncer.quorum import Ema, Roster, Round, grace_window_s

NAN = float("nan")


# -- grace formula ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("gamma", "tau", "step", "quorum", "sync", "expected"),
    [
        (0.5, 2, 1.5, 0.4, 0.1, 1.25),  # 0.5 * (3 - 0.5)
        (0.9, 4, 0.25, 0.2, 0.3, 0.45),  # 0.9 * (1 - 0.5)
        (0.5, 2, 1.0, 1.5, 0.5, 0.0),  # overlap used up exactly
        (0.5, 2, 1.0, 3.0, 1.0, 0.0),  # negative: clamped at 0
        (0.0, 10, 1.0, 0.0, 0.0, 0.0),  # gamma 0: no grace
        (0.5, 0, 1.0, 0.0, 0.0, 0.0),  # no overlap: no grace
    ],
)
def test_grace_formula_by_hand(
    gamma: float, tau: float, step: float, quorum: float, sync: float, expected: float
) -> None:
    assert grace_window_s(gamma, tau, step, quorum, sync) == pytest.approx(expected)


# -- EMA -------------------------------------------------------------------------
def test_ema_by_hand() -> None:
    e = Ema(0.25)
    assert e.value is None
    assert e.update(4.0) == 4.0  # the first sample initialises
    assert e.update(8.0) == 5.0  # 0.25 * 8 + 0.75 * 4
    assert e.update(0.0) == 3.75
    one = Ema(1.0)
    one.update(3.0)
    assert one.update(7.0) == 7.0


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.01, NAN])
def test_ema_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        Ema(alpha)


# -- rounds ----------------------------------------------------------------------
def test_never_closes_before_k_distinct_learners() -> None:
    r = Round(gamma=0.5, tau_steps=2)
    live = {"a", "b", "c", "d"}
    r.add("a", 0.0)
    r.add("a", 1.0)
    r.add("b", 2.0)
    r.add("b", 3.0)  # duplicates do not count
    assert r.quorum_at(3) is None and r.close_at(1.0, quorum=3) is None
    for now in (3.0, 100.0, 1e9):
        assert not r.should_close(now, live, step_s=1.0, known=0, quorum=3)
        assert not r.should_close(
            now, {"a", "b"}, step_s=1.0, known=0, quorum=3
        )  # even if all live reported
        assert not r.should_close(now, live, step_s=None, known=0, quorum=3)
    r.add("c", 4.0)
    assert r.quorum_at(3) == 4.0 and r.opened_at == 0.0
    assert r.reporters == {"a", "b", "c"}


def test_waits_a_bounded_time_for_learners_that_never_joined() -> None:
    """Fewer learners than K ever joined (a run scaled below its quorum, or
    learners still starting): once every live one reported, the round waits
    ``absent_wait_s`` for the others, then closes instead of stalling for ever."""
    r = Round(gamma=0.5, tau_steps=2, absent_wait_s=5.0)
    r.add("a", 10.0)
    r.add("b", 11.0)
    assert not r.should_close(14.9, {"a", "b"}, step_s=1.0, known=2, quorum=3)
    assert r.should_close(15.0, {"a", "b"}, step_s=1.0, known=2, quorum=3)
    # A live learner that has not reported yet is still waited for (by quorum).
    assert not r.should_close(100.0, {"a", "b", "c"}, step_s=1.0, known=3, quorum=3)
    with pytest.raises(ValueError, match="absent wait"):
        Round(gamma=0.5, tau_steps=2, absent_wait_s=-1.0)


def test_closes_when_every_learner_went_silent() -> None:
    """The learners were stopped with a round short of quorum: it used to hold
    its deltas (unacknowledged) until the syncer itself stopped."""
    r = Round(gamma=0.5, tau_steps=2)
    r.add("a", 10.0)
    assert not r.should_close(11.0, {"a", "b", "c"}, step_s=1.0, known=3, quorum=3)
    assert r.should_close(30.0, set(), step_s=1.0, known=3, quorum=3)
    assert not Round(gamma=0.5, tau_steps=2).should_close(
        30.0, set(), step_s=1.0, known=0, quorum=3
    )


def test_closes_at_once_when_all_live_reported() -> None:
    r = Round(gamma=0.5, tau_steps=2)
    r.add("a", 10.0)
    r.add("b", 10.5)
    # Grace (no EMA yet): 0.5 * 2 * 4.0 = 4 s after quorum -> 14.5.
    assert r.close_at(step_s=4.0, quorum=2) == pytest.approx(14.5)
    assert not r.should_close(10.6, {"a", "b", "c"}, step_s=4.0, known=0, quorum=2)
    assert r.should_close(10.6, {"a", "b"}, step_s=4.0, known=0, quorum=2)
    # Dead learners are not waited for: live is a subset of reporters.
    assert r.should_close(10.6, {"b"}, step_s=4.0, known=0, quorum=2)
    r.add("c", 11.0)
    assert r.should_close(11.0, {"a", "b", "c"}, step_s=4.0, known=0, quorum=2)


def test_otherwise_closes_at_quorum_plus_grace() -> None:
    r = Round(gamma=0.5, tau_steps=2)
    live = {"a", "b", "c"}
    r.add("a", 0.0)
    r.add("b", 1.0)
    deadline = 1.0 + 0.5 * 2 * 3.0  # quorum_at + gamma * tau * step, no EMA yet
    assert r.close_at(step_s=3.0, quorum=2) == pytest.approx(deadline)
    assert not r.should_close(deadline - 1e-6, live, step_s=3.0, known=0, quorum=2)
    assert r.should_close(deadline, live, step_s=3.0, known=0, quorum=2)
    assert r.should_close(deadline + 5, live, step_s=3.0, known=0, quorum=2)
    # Without a step time the window is 0: close at quorum.
    assert r.grace_window_s(None) == 0.0
    assert r.close_at(step_s=None, quorum=2) == 1.0
    assert r.should_close(1.0, live, step_s=None, known=0, quorum=2)


def test_emas_updated_on_closed_and_feed_the_window() -> None:
    r = Round(gamma=0.5, tau_steps=2, ema_alpha=0.5)
    r.add("a", 0.0)
    r.add("b", 0.4)  # quorum after 0.4 s
    r.closed(sync_s=0.1, quorum=2)
    assert r.quorum_s.value == pytest.approx(0.4)
    assert r.sync_s.value == pytest.approx(0.1)
    assert r.reporters == set() and r.opened_at is None and r.quorum_at(2) is None
    # 0.5 * (2 * 1.5 - (0.4 + 0.1)) = 1.25
    assert r.grace_window_s(1.5) == pytest.approx(1.25)
    r.add("b", 10.0)
    r.add("a", 11.2)  # quorum after 1.2 s
    assert r.close_at(1.5, quorum=2) == pytest.approx(11.2 + 1.25)
    r.closed(sync_s=0.3, quorum=2)
    assert r.quorum_s.value == pytest.approx(0.5 * 1.2 + 0.5 * 0.4)  # 0.8
    assert r.sync_s.value == pytest.approx(0.5 * 0.3 + 0.5 * 0.1)  # 0.2
    # 0.5 * (3 - 1.0) = 1.0; a slow quorum clamps the window at 0.
    assert r.grace_window_s(1.5) == pytest.approx(1.0)
    assert r.grace_window_s(0.4) == 0.0


def test_closed_without_quorum_records_only_sync() -> None:
    r = Round(gamma=0.5, tau_steps=2)
    r.add("a", 0.0)
    r.closed(sync_s=0.2, quorum=3)
    assert r.quorum_s.value is None
    assert r.sync_s.value == pytest.approx(0.2)
    assert r.opened_at is None and r.reporters == set()


def test_quorum_of_one_and_new_round_reopens() -> None:
    r = Round(gamma=0.5, tau_steps=2)
    r.add("a", 5.0)
    assert r.quorum_at(1) == 5.0 and r.opened_at == 5.0
    r.closed(0.0, quorum=1)
    r.add("b", 9.0)
    assert r.opened_at == 9.0 and r.quorum_at(1) == 9.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gamma": 1.0}, "gamma"),
        ({"gamma": -0.1}, "gamma"),
        ({"gamma": NAN}, "gamma"),
        ({"tau_steps": -1}, "tau"),
        ({"tau_steps": NAN}, "tau"),
        ({"ema_alpha": 0.0}, "alpha"),
        ({"ema_alpha": 2.0}, "alpha"),
    ],
)
def test_invalid_args_raise(kwargs: dict[str, float], match: str) -> None:
    args: dict[str, float] = {"gamma": 0.5, "tau_steps": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Round(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("quorum", [0, -1])
def test_a_quorum_below_one_raises(quorum: int) -> None:
    with pytest.raises(ValueError, match="quorum"):
        Round(gamma=0.5, tau_steps=2).quorum_at(quorum)


def test_does_not_wait_for_dead_learners_but_waits_for_unstarted_ones() -> None:
    r = Round(gamma=0.5, tau_steps=2)
    r.add("a", 0.0)
    r.add("b", 0.1)
    # Four learners were known, two are alive and both reported: close.
    assert r.should_close(0.2, live={"a", "b"}, step_s=1.0, known=4, quorum=3)
    # Only two learners ever existed (the others have not started): wait for K.
    assert not r.should_close(0.2, live={"a", "b"}, step_s=1.0, known=2, quorum=3)
    # A live learner has not reported: wait.
    assert not r.should_close(0.2, live={"a", "c"}, step_s=1.0, known=4, quorum=3)


# -- the roster -----------------------------------------------------------------
TIMEOUT = 5.0


def roster_of(*names: str, cap: int = 4, now: float = 0.0) -> Roster:
    roster = Roster(cap, TIMEOUT, now=now)
    for name in names:
        roster.join(name, now)
    return roster


def test_only_members_heartbeats_count() -> None:
    roster = roster_of("a", "b")
    assert roster.heard("a", 1.0, step_time_s=0.5)
    assert not roster.heard("zz", 1.0, step_time_s=0.01)  # not on the roster
    assert "zz" not in roster and len(roster) == 2
    assert roster.live(1.0) == {"a", "b"}
    assert roster.live(5.5) == {"a"}  # b was last heard at 0 (its delta)
    assert roster.step_times() == {"a": 0.5}


def test_step_times_are_capped_at_the_timeout_and_the_median_resists_one_liar() -> None:
    roster = roster_of("a", "b", "c")
    for name, step in (("a", 0.2), ("b", 0.3), ("c", 1000.0)):
        roster.heard(name, 1.0, step_time_s=step)
    assert roster.step_times()["c"] == TIMEOUT
    assert roster.median_step_s() == pytest.approx(0.3)
    roster.heard("a", 1.1, step_time_s=0.0)  # no sample: nothing changes
    assert roster.step_times()["a"] == pytest.approx(0.2)
    assert roster_of().median_step_s() is None


def test_a_full_roster_admits_a_newcomer_only_in_place_of_a_silent_member() -> None:
    roster = roster_of("a", "b", cap=2)
    assert not roster.admits("c", 1.0)
    with pytest.raises(DdilocoError, match="roster full"):
        roster.join("c", 1.0)
    roster.heard("a", 4.0)
    # b was silent since 0: at 5.0 it is not yet past the timeout, at 5.1 it is.
    assert not roster.admits("c", 5.0)
    assert roster.admits("c", 5.1) and roster.admits("a", 5.1)
    assert roster.join("c", 5.1) == "b"
    assert set(roster.members) == {"a", "c"} and roster.live(5.1) == {"a", "c"}
    assert roster.join("a", 5.2) is None  # already a member


def test_restored_members_are_not_live_but_not_evictable_at_once() -> None:
    roster = Roster(2, TIMEOUT, now=100.0, members={"a", "b"})
    assert len(roster) == 2 and roster.live(100.0) == set()
    assert not roster.admits("c", 104.0)  # silent only since the restart
    assert roster.admits("c", 105.5)


def test_bad_roster_cap() -> None:
    with pytest.raises(ValueError, match="cap"):
        Roster(0, TIMEOUT, now=0.0)


def test_fake_heartbeats_neither_hold_a_round_open_nor_make_a_quorum() -> None:
    """Attack: heartbeats under made-up ids. Counted as live, they kept a round
    open (not every live learner had reported) and stretched its grace window
    (their step times fed xi_step); remembered as known learners after they
    stopped, they let a round close with fewer than K real learners (fewer are
    live than K <= known). The roster ignores them."""
    roster = roster_of("a", "b", "c", cap=4)
    fakes = [f"fake-{i}" for i in range(10)]
    for name in fakes:
        assert not roster.heard(name, 1.0, step_time_s=TIMEOUT)
    live = roster.live(1.0)
    assert live == {"a", "b", "c"} and len(roster) == 3 and roster.median_step_s() is None
    held = Round(gamma=0.5, tau_steps=2)
    for name in ("a", "b", "c"):
        held.add(name, 1.0)
    assert held.should_close(1.0, live, roster.median_step_s(), len(roster), quorum=2)

    # Quorum K = 3, only a and b ever joined; the fakes went quiet long ago.
    two = roster_of("a", "b", cap=4)
    for name in fakes:
        two.heard(name, 0.0)
    r = Round(gamma=0.5, tau_steps=2)
    r.add("a", 10.0)
    r.add("b", 10.0)
    for now in (10.0, 100.0, 1e6):
        two.heard("a", now)
        two.heard("b", now)
        assert not r.should_close(now, two.live(now), two.median_step_s(), len(two), quorum=3)


def test_heartbeats_alone_do_not_hold_rounds_open() -> None:
    """Attack: a learner stops sending deltas (it died, or it is a forger using
    its id) while heartbeats under its id go on. Rounds waited for it as live:
    2 rounds instead of 6 in a live run. Now a member is waited for only while
    its deltas arrive, its last within 2 H x the step time it reports; the
    heartbeats keep it on the roster."""
    h, step_s = 12, 0.5
    roster = Roster(2, TIMEOUT, 0.0)
    r = Round(gamma=0.5, tau_steps=2)
    for name in ("a", "b"):
        roster.join(name, 0.0)
    for i in range(1, 21):  # both report their step time: 0.5 s
        for name in ("a", "b"):
            roster.heard(name, now=i * step_s, step_time_s=step_s)
    assert roster.waited_for(i * step_s, h) == {"a", "b"}
    # From here on only a's deltas arrive; b's heartbeats go on.
    now = 2 * h * step_s + 0.1
    for name in ("a", "b"):
        roster.heard(name, now=now, step_time_s=step_s)
    roster.join("a", now)
    assert roster.live(now) == {"a", "b"}  # still on the roster, heard
    assert roster.waited_for(now, h) == {"a"}
    r.add("a", now)
    waited = roster.waited_for(now, h)
    assert r.should_close(now, waited, roster.median_step_s(), len(roster), quorum=2)
    # Its deltas arrive again: waited for again.
    roster.join("b", now + 1.0)
    assert roster.waited_for(now + 1.0, h) == {"a", "b"}


def test_a_silence_of_everyone_is_the_syncers_not_the_learners() -> None:
    """Three members live, one long dead; then nobody is heard from for 12 s
    (the broker failing over). The first one heard from after it is not the
    only live one: those live when it went quiet are live for what was left
    of their timeout, and still waited for; the dead one stays dead. A
    learner's silence alone (the others heard) still counts."""
    roster = Roster(8, TIMEOUT, now=0.0)
    for name in ("dead", "a", "b", "c"):
        roster.join(name, 0.0)
    for t in range(1, 12):  # a, b and c heard every second; "dead" no more
        for name in ("a", "b", "c"):
            roster.heard(name, float(t), step_time_s=0.5)
    for name in ("a", "b", "c"):
        roster.join(name, 11.0)  # a delta each
    roster.heard("a", 23.0)  # after 12 s of silence
    assert roster.live(23.0) == {"a", "b", "c"}
    assert roster.waited_for(23.0, sync_every=4) == {"a", "b", "c"}
    assert roster.live(23.5 + TIMEOUT) == set()  # all quiet since
    roster.heard("b", 24.0)  # heard: no silence of everyone, c's counts
    assert "c" not in roster.live(29.0 + TIMEOUT)
