"""The fault schedule of ``ddiloco local`` as a pure object: seeded, no processes."""

from __future__ import annotations

import random

from compose.chaos import ChaosSchedule, Kill

M = 4
ALL_UP = [True] * M


def fire(chaos: ChaosSchedule, draws: int, up: list[bool]) -> list[tuple[float, list[Kill]]]:
    """Call ``due`` exactly at each Poisson kill time, ``draws`` times."""
    out = []
    for _ in range(draws):
        assert chaos.next_kill is not None
        now = chaos.next_kill
        out.append((now, chaos.due(now, up)))
    return out


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    a = fire(ChaosSchedule(M, seed=7, start=100.0, mtbf_s=30.0), 50, ALL_UP)
    b = fire(ChaosSchedule(M, seed=7, start=100.0, mtbf_s=30.0), 50, ALL_UP)
    c = fire(ChaosSchedule(M, seed=8, start=100.0, mtbf_s=30.0), 50, ALL_UP)
    assert a == b
    assert a != c


def test_schedule_is_the_seed_plus_one_stream() -> None:
    """Seeded runs keep their kills: gap, victim, gap, victim... from Random(seed + 1)."""
    rng = random.Random(3 + 1)
    expected = []
    now = 10.0 + rng.expovariate(1 / 20.0)
    for _ in range(20):
        expected.append((now, [Kill(f"learner-{rng.choice(range(M))}", "chaos")]))
        now += rng.expovariate(1 / 20.0)
    assert fire(ChaosSchedule(M, seed=3, start=10.0, mtbf_s=20.0), 20, ALL_UP) == expected


def test_mean_gap_is_the_mtbf() -> None:
    # 20000 exponential gaps: the mean's standard error is 0.7 % of the MTBF,
    # so 5 % is seven standard errors away.
    chaos = ChaosSchedule(M, seed=0, start=0.0, mtbf_s=12.0)
    times = [now for now, _ in fire(chaos, 20000, ALL_UP)]
    assert abs(times[-1] / len(times) - 12.0) < 0.05 * 12.0


def test_victims_are_uniform_over_learners() -> None:
    chaos = ChaosSchedule(M, seed=1, start=0.0, mtbf_s=1.0)
    counts = {f"learner-{i}": 0 for i in range(M)}
    for _, kills in fire(chaos, 8000, ALL_UP):
        (kill,) = kills
        counts[kill.process] += 1
    # 2000 expected each, standard deviation about 39: 300 is over seven of them.
    assert all(abs(n - 2000) < 300 for n in counts.values()), counts


def test_finished_or_dead_learners_do_not_fail_again() -> None:
    up = [False, True, False, True]
    fired = fire(ChaosSchedule(M, seed=2, start=0.0, mtbf_s=5.0), 400, up)
    victims = {k.process for _, kills in fired for k in kills}
    assert victims == {"learner-1", "learner-3"}
    # A draw that lands on a down learner is spent: no kill, and the clock moves on.
    assert any(kills == [] for _, kills in fired)
    times = [now for now, _ in fired]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_nobody_up_nobody_killed() -> None:
    fired = fire(ChaosSchedule(M, seed=2, start=0.0, mtbf_s=5.0), 100, [False] * M)
    assert all(kills == [] for _, kills in fired)


def test_nothing_is_due_before_the_next_kill() -> None:
    chaos = ChaosSchedule(M, seed=5, start=0.0, mtbf_s=50.0)
    assert chaos.next_kill is not None
    first = chaos.next_kill
    assert chaos.due(first - 1e-6, ALL_UP) == []
    assert chaos.next_kill == first
    assert len(chaos.due(first, ALL_UP)) == 1


def test_no_kills_when_mtbf_is_zero() -> None:
    chaos = ChaosSchedule(M, seed=0, start=0.0, mtbf_s=0.0)
    assert chaos.next_kill is None
    assert all(chaos.due(t, ALL_UP) == [] for t in (0.0, 1.0, 1e3, 1e9))


def test_one_shot_kills_fire_once_at_their_time() -> None:
    chaos = ChaosSchedule(M, seed=0, start=100.0, kill_syncer_at_s=20.0, kill_learner_at_s=30.0)
    assert chaos.due(119.9, ALL_UP) == []
    assert chaos.due(120.0, ALL_UP) == [Kill("syncer", "scheduled")]
    assert chaos.due(125.0, ALL_UP) == []
    assert chaos.due(130.0, ALL_UP) == [Kill("learner-0", "scheduled")]
    assert chaos.due(1e6, ALL_UP) == []


def test_one_shot_kills_due_together_late() -> None:
    """A late tick fires both; learner-0 is named once even if chaos picked it too."""
    chaos = ChaosSchedule(
        1, seed=0, start=0.0, mtbf_s=1.0, kill_syncer_at_s=1.0, kill_learner_at_s=1.0
    )
    assert chaos.due(1e6, [True]) == [Kill("learner-0", "chaos"), Kill("syncer", "scheduled")]


def test_scheduled_learner_kill_is_spent_when_learner_0_is_down() -> None:
    chaos = ChaosSchedule(M, seed=0, start=0.0, kill_learner_at_s=5.0)
    assert chaos.due(5.0, [False, True, True, True]) == []
    assert chaos.due(6.0, ALL_UP) == []
