"""Quorum and grace window, with the clock passed in by hand."""

from __future__ import annotations

import pytest

from syncer.quorum import Ema, Round, grace_window_s

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
    r = Round(quorum=3, gamma=0.5, tau_steps=2)
    live = {"a", "b", "c", "d"}
    r.add("a", 0.0)
    r.add("a", 1.0)
    r.add("b", 2.0)
    r.add("b", 3.0)  # duplicates do not count
    assert r.quorum_at is None and r.close_at(1.0) is None
    for now in (3.0, 100.0, 1e9):
        assert not r.should_close(now, live, step_s=1.0)
        assert not r.should_close(now, {"a", "b"}, step_s=1.0)  # even if all live reported
        assert not r.should_close(now, live, step_s=None)
    r.add("c", 4.0)
    assert r.quorum_at == 4.0 and r.opened_at == 0.0
    assert r.reporters == {"a", "b", "c"}


def test_closes_at_once_when_all_live_reported() -> None:
    r = Round(quorum=2, gamma=0.5, tau_steps=2)
    r.add("a", 10.0)
    r.add("b", 10.5)
    # Grace (no EMA yet): 0.5 * 2 * 4.0 = 4 s after quorum -> 14.5.
    assert r.close_at(step_s=4.0) == pytest.approx(14.5)
    assert not r.should_close(10.6, {"a", "b", "c"}, step_s=4.0)
    assert r.should_close(10.6, {"a", "b"}, step_s=4.0)
    # Dead learners are not waited for: live is a subset of reporters.
    assert r.should_close(10.6, {"b"}, step_s=4.0)
    r.add("c", 11.0)
    assert r.should_close(11.0, {"a", "b", "c"}, step_s=4.0)


def test_otherwise_closes_at_quorum_plus_grace() -> None:
    r = Round(quorum=2, gamma=0.5, tau_steps=2)
    live = {"a", "b", "c"}
    r.add("a", 0.0)
    r.add("b", 1.0)
    deadline = 1.0 + 0.5 * 2 * 3.0  # quorum_at + gamma * tau * step, no EMA yet
    assert r.close_at(step_s=3.0) == pytest.approx(deadline)
    assert not r.should_close(deadline - 1e-6, live, step_s=3.0)
    assert r.should_close(deadline, live, step_s=3.0)
    assert r.should_close(deadline + 5, live, step_s=3.0)
    # Without a step time the window is 0: close at quorum.
    assert r.grace_window_s(None) == 0.0
    assert r.close_at(step_s=None) == 1.0
    assert r.should_close(1.0, live, step_s=None)


def test_emas_updated_on_closed_and_feed_the_window() -> None:
    r = Round(quorum=2, gamma=0.5, tau_steps=2, ema_alpha=0.5)
    r.add("a", 0.0)
    r.add("b", 0.4)  # quorum after 0.4 s
    r.closed(sync_s=0.1)
    assert r.quorum_s.value == pytest.approx(0.4)
    assert r.sync_s.value == pytest.approx(0.1)
    assert r.reporters == set() and r.opened_at is None and r.quorum_at is None
    # 0.5 * (2 * 1.5 - (0.4 + 0.1)) = 1.25
    assert r.grace_window_s(1.5) == pytest.approx(1.25)
    r.add("b", 10.0)
    r.add("a", 11.2)  # quorum after 1.2 s
    assert r.close_at(1.5) == pytest.approx(11.2 + 1.25)
    r.closed(sync_s=0.3)
    assert r.quorum_s.value == pytest.approx(0.5 * 1.2 + 0.5 * 0.4)  # 0.8
    assert r.sync_s.value == pytest.approx(0.5 * 0.3 + 0.5 * 0.1)  # 0.2
    # 0.5 * (3 - 1.0) = 1.0; a slow quorum clamps the window at 0.
    assert r.grace_window_s(1.5) == pytest.approx(1.0)
    assert r.grace_window_s(0.4) == 0.0


def test_closed_without_quorum_records_only_sync() -> None:
    r = Round(quorum=3, gamma=0.5, tau_steps=2)
    r.add("a", 0.0)
    r.closed(sync_s=0.2)
    assert r.quorum_s.value is None
    assert r.sync_s.value == pytest.approx(0.2)
    assert r.opened_at is None and r.reporters == set()


def test_quorum_of_one_and_new_round_reopens() -> None:
    r = Round(quorum=1, gamma=0.5, tau_steps=2)
    r.add("a", 5.0)
    assert r.quorum_at == 5.0 and r.opened_at == 5.0
    r.closed(0.0)
    r.add("b", 9.0)
    assert r.opened_at == 9.0 and r.quorum_at == 9.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quorum": 0}, "quorum"),
        ({"quorum": -1}, "quorum"),
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
    args: dict[str, float] = {"quorum": 2, "gamma": 0.5, "tau_steps": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Round(**args)  # type: ignore[arg-type]


def test_does_not_wait_for_dead_learners_but_waits_for_unstarted_ones() -> None:
    r = Round(quorum=3, gamma=0.5, tau_steps=2)
    r.add("a", 0.0)
    r.add("b", 0.1)
    # Four learners were known, two are alive and both reported: close.
    assert r.should_close(0.2, live={"a", "b"}, step_s=1.0, known=4)
    # Only two learners ever existed (the others have not started): wait for K.
    assert not r.should_close(0.2, live={"a", "b"}, step_s=1.0, known=2)
    # A live learner has not reported: wait.
    assert not r.should_close(0.2, live={"a", "c"}, step_s=1.0, known=4)
