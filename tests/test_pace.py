"""A learner's pace, read from its own deltas, and the step bound it sets
(docs/design.md, rule 4 under "Admission and merge rules").

By hand and against a reference written from the text: the pace a delta
shows (syncer.trust.delta_pace), the roster's cap, and check_report fed as
the intake feeds it. Then the syncer service: a burst of deltas with no
heartbeat at all (the clocks passed in), and live, over ZeroMQ and Redis, an
honest learner whose first deltas arrive in a burst after a slow admission
(never refused) and learners that claim more steps than their pace allows
(refused: too_many_steps).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from broker.connect import connect_learner
from broker.identity.keys import RunKeys
from broker.redis.server import RedisServer
from broker.transport import Inbound, LearnerTransport
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, Heartbeat
from compose.processes import free_port_pair
from syncer.quorum import PACE_WINDOW, Roster
from syncer.service import Syncer
from syncer.trust import (
    PaceMark,
    ReportLimits,
    check_report,
    delta_pace,
)
from tests.servers import run_keys, wait_until
from tests.test_syncer_service import Clock, events_of, make_syncer

TIMEOUT = 5.0  # the roster's heartbeat timeout
H = 12
LIMITS = ReportLimits(step_floor=2 * H, max_tokens_per_step=2**24, max_clock_skew_s=60.0)
T0 = 1_700_000_000.0  # wall clock when the base version was published (s)


# -- the pace a delta shows ----------------------------------------------------------
@pytest.mark.parametrize(
    ("mark", "delta", "pace", "new_mark"),
    [
        (None, (1, 5, 10.0), None, PaceMark(1, 5, 10.0)),  # a first delta: the mark
        (PaceMark(1, 5, 10.0), (1, 9, 12.0), 0.5, PaceMark(1, 9, 12.0)),  # 2 s, 4 steps
        # The same instant (a burst): 0 s a step, and the mark stays at the first.
        (PaceMark(1, 5, 10.0), (1, 9, 10.0), 0.0, PaceMark(1, 5, 10.0)),
        (PaceMark(1, 5, 10.0), (1, 5, 12.0), None, PaceMark(1, 5, 10.0)),  # a resend
        (PaceMark(1, 5, 10.0), (1, 3, 12.0), None, PaceMark(1, 5, 10.0)),  # sent earlier
        (PaceMark(2, 5, 10.0), (1, 99, 12.0), None, PaceMark(2, 5, 10.0)),  # older incarnation
        (PaceMark(1, 50, 10.0), (2, 3, 12.0), None, PaceMark(2, 3, 12.0)),  # a restart
        # A clock stepped back: no time passed.
        (PaceMark(1, 5, 10.0), (1, 9, 9.0), 0.0, PaceMark(1, 5, 10.0)),
    ],
)
def test_delta_pace(
    mark: PaceMark | None,
    delta: tuple[int, int, float],
    pace: float | None,
    new_mark: PaceMark,
) -> None:
    assert delta_pace(mark, *delta) == (pace, new_mark)


def roster_of(*names: str) -> Roster:
    roster = Roster(16, TIMEOUT, now=0.0)
    for name in names:
        roster.join(name, 0.0)
    return roster


def offer(
    roster: Roster, name: str, c_steps: int, step: int, wall_s: float, incarnation: int = 1
) -> str | None:
    """What the intake does with a delta on a base published at T0: bound it
    with the pace its learner's deltas (this one included) show, and record
    that pace if it is taken."""
    d = Delta(learner_id=name, incarnation=incarnation, step=step, c_steps=c_steps, c_tokens=1)
    step_s = roster.credited_step_s(name, incarnation=incarnation, step=step, wall_s=wall_s)
    reason = check_report(d, base_published_s=T0, wall_s=wall_s, step_s=step_s, limits=LIMITS)
    if reason is None:
        roster.paced(name, incarnation, step, wall_s)
    return reason


def test_a_claim_beyond_its_pace_is_refused() -> None:
    """A learner whose deltas come 1 s apart, 10 steps each (0.1 s a step): 5 s
    after its base was published it may claim 24 + 2 x 5 / 0.1 = 124 steps."""
    roster = roster_of("a")
    for i in range(1, 5):
        assert offer(roster, "a", 10 * i, 10 * i, T0 + i) is None
    assert roster.pace_times() == {"a": pytest.approx(0.1)}
    # Its next delta, at 5 s: 10 steps more (sample 0.1 s).
    assert offer(roster, "a", 125, 50, T0 + 5) == "too_many_steps"
    assert offer(roster, "a", 124, 50, T0 + 5) is None


def test_steps_advancing_faster_than_the_clock_buy_at_most_the_roster_cap() -> None:
    """x's steps advance 10^6 between deltas 1 s apart, as if it trained a step in
    a microsecond; its peers, 1 step a second. It is credited with half the
    roster's median pace (0.5 s), so 10 s after publication it may claim
    24 + 2 x 10 / 0.5 = 64 steps, not 10^6."""
    roster = roster_of("h0", "h1", "h2", "x")
    for i in range(1, 10):
        for name in ("h0", "h1", "h2"):
            assert offer(roster, name, i, i, T0 + i) is None
        assert offer(roster, "x", 1, 10**6 * i, T0 + i) is None  # its claims are modest
    assert offer(roster, "x", 10**6, 10**7, T0 + 10) == "too_many_steps"
    assert offer(roster, "x", 65, 10**7, T0 + 10) == "too_many_steps"
    assert offer(roster, "x", 64, 10**7, T0 + 10) is None
    # Alone, it is capped by its own median: one more, bigger jump buys no
    # more than twice what its pace so far allows (24 + 2 x 10 / 5e-7).
    alone = roster_of("x")
    for i in range(1, 10):
        assert offer(alone, "x", 1, 10**6 * i, T0 + i) is None
    assert offer(alone, "x", 4 * 10**7 + 25, 10**13, T0 + 10) == "too_many_steps"
    assert offer(alone, "x", 4 * 10**7 + 24, 10**13, T0 + 10) is None


def test_heartbeats_buy_no_steps() -> None:
    """A learner reporting nanosecond steps in its heartbeats was credited with
    them, and so with any step count. Heartbeats are liveness only now: its
    deltas' pace (1 s a step) bounds it, and its claim is refused."""
    roster = roster_of("a")
    for i in range(1, 4):
        roster.heard("a", float(i), step_time_s=1e-9)
        assert offer(roster, "a", i, i, T0 + i) is None
    assert offer(roster, "a", 10**6, 4, T0 + 4) == "too_many_steps"


def test_a_burst_only_loosens_the_bound() -> None:
    """A learner's deltas held back for 30 s (a slow admission), then all at one
    instant, their step counts far above the floor: not one is refused. The
    first sets the mark; the others show 0 s a step: no bound, with nothing
    on the roster to cap it. The interval after the burst counts all of it."""
    roster = roster_of("a")
    burst = T0 + 30
    for step in range(3, 300, 3):  # c_steps 3 ... 297, on the same base
        assert offer(roster, "a", step, step, burst) is None
    assert roster.pace_times() == {}  # a burst is no sample
    assert offer(roster, "a", 300, 300, burst + 0.3) is None
    assert roster.pace_times()["a"] == pytest.approx(0.3 / 297)  # from the burst's first


def test_a_burst_cannot_lift_the_roster_cap() -> None:
    """Three learners known at 0.5 s a step; x sends two deltas at one instant
    (0 s a step) and claims a million steps: credited with half the median
    pace, refused."""
    roster = roster_of("h0", "h1", "h2", "x")
    for i in range(1, 6):
        for name in ("h0", "h1", "h2"):
            assert offer(roster, name, i, i, T0 + 0.5 * i) is None
    assert offer(roster, "x", 1, 1, T0 + 3) is None
    assert offer(roster, "x", 10**6, 2, T0 + 3) == "too_many_steps"
    assert offer(roster, "x", 2 * H + 24, 2, T0 + 3) is None  # 24 + 2 x 3 / 0.25


def test_the_roster_cap_uses_each_members_median_not_its_fastest() -> None:
    """Every learner sent a burst after an outage (one sample of 1 ms a step each),
    then steady 0.5 s steps: the cap follows their medians, 0.5 s, not the
    bursts."""
    roster = roster_of("h0", "h1", "h2")
    for name in ("h0", "h1", "h2"):
        roster.paced(name, 1, 0, T0)
        roster.paced(name, 1, 1000, T0 + 1.0)  # the burst's: 1 ms a step
        for i in range(1, 6):
            roster.paced(name, 1, 1000 + i, T0 + 1.0 + 0.5 * i)
    assert roster.pace_times()["h0"] == pytest.approx(0.001)  # its own bound: lenient
    assert roster.typical_pace_times() == {n: 0.5 for n in ("h0", "h1", "h2")}
    assert roster.credited_step_s("newcomer") == 0.5
    assert roster.credited_step_s("h0") == 0.25  # its fastest, capped at the median / 2


def test_a_resend_does_not_make_a_learner_look_fast() -> None:
    """A delta resent (its ack was lost) arrives again later, with its old step:
    no sample, and the mark stays, so the next delta's interval is measured
    from the real one, not from the resend (which would make it look fast)."""
    roster = roster_of("a")
    for i in range(1, 11):
        roster.paced("a", 1, i, T0 + i)
        roster.paced("a", 1, i, T0 + i + 0.9)  # the resend
    assert list(roster.pace_s["a"]) == pytest.approx([1.0] * 9, rel=1e-5)


def test_a_restart_is_no_pace_sample() -> None:
    """A restarted learner (a new incarnation) starts from its saved step after a
    pause: the pause is no sample of its pace."""
    roster = roster_of("a")
    for i in range(1, 6):
        roster.paced("a", 1, i, T0 + 0.1 * i)
    roster.paced("a", 2, 5, T0 + 60)  # a minute later, from its saved step
    roster.paced("a", 2, 6, T0 + 60.1)
    assert list(roster.pace_s["a"]) == pytest.approx([0.1] * 5, rel=1e-5)


def test_a_first_interval_that_waited_to_join_and_a_busy_spell_do_not_slow_the_pace() -> None:
    """The first interval includes the learner's join (seconds); then 10 ms steps,
    a busy spell of 100 deltas at 50 ms, and 10 ms again: its pace is 10 ms
    throughout (an average, or a short window, refused its honest step counts
    after the spell). Samples older than the window are forgotten."""
    roster = roster_of("a")
    roster.paced("a", 1, 0, T0)
    t, step = T0 + 3.0, 1
    roster.paced("a", 1, step, t)
    for _ in range(10):
        t, step = t + 0.01, step + 1
        roster.paced("a", 1, step, t)
    for _ in range(100):
        t, step = t + 0.05, step + 1
        roster.paced("a", 1, step, t)
    assert roster.pace_times()["a"] == pytest.approx(0.01)
    for _ in range(PACE_WINDOW):
        t, step = t + 0.5, step + 1
        roster.paced("a", 1, step, t)
    assert roster.pace_times()["a"] == pytest.approx(0.5)


def test_samples_are_capped_at_the_heartbeat_timeout() -> None:
    roster = roster_of("a")
    roster.paced("a", 1, 0, T0)
    roster.paced("a", 1, 1, T0 + 60.0)  # paused for a minute
    assert roster.pace_times()["a"] == TIMEOUT


def test_only_members_have_a_pace() -> None:
    roster = roster_of("a")
    roster.paced("zz", 1, 0, T0)
    roster.paced("zz", 1, 10, T0 + 1)
    assert roster.pace_times() == {} and roster.credited_step_s("zz") is None


# -- against the rule as docs/design.md states it --------------------------------------
def reference_bound(
    taken: dict[str, list[tuple[int, int, float]]],
    name: str,
    delta: tuple[int, int, float],
    c_steps: int,
) -> bool:
    """Whether ``c_steps`` is within rule 4 as written, independently of the code:
    ``taken`` holds each learner's accepted deltas (incarnation, step, arrival),
    in the order taken; ``delta`` is ``name``'s new one."""

    def samples(history: list[tuple[int, int, float]]) -> tuple[list[float], tuple | None]:
        """Its samples, and the delta its pace is measured from."""
        out: list[float] = []
        since: tuple[int, int, float] | None = None
        for inc, step, at in history:
            if since is None or inc > since[0]:
                since = (inc, step, at)  # its first delta, or a new incarnation's
            elif inc == since[0] and step > since[1] and at > since[2]:
                out.append(min((at - since[2]) / (step - since[1]), TIMEOUT))
                since = (inc, step, at)
        return out[-PACE_WINDOW:], since

    own_samples, since = samples(taken.get(name, []))
    inc, step, at = delta
    if since is not None and inc == since[0] and step > since[1]:
        own_samples.append(min(max(0.0, at - since[2]) / (step - since[1]), TIMEOUT))
    typical = [statistics.median(s) for s in (samples(h)[0] for h in taken.values()) if s]
    median = statistics.median(typical) if typical else None
    own = min(own_samples) if own_samples else None
    if own is None and median is None:
        return c_steps <= 2 * H
    step_s = median if own is None else own if median is None else max(own, median / 2)
    if step_s == 0:
        return True
    return c_steps <= 2 * H + 2 * (at - T0) / step_s


def test_the_bound_matches_the_written_rule_on_random_histories() -> None:
    """Three learners, one of them restarting now and then, deltas in bursts,
    resent, out of order and claiming any step count: the code and the rule
    as written agree on every delta."""
    rng = random.Random(11)
    roster = roster_of("a", "b", "c")
    taken: dict[str, list[tuple[int, int, float]]] = {}
    steps = dict.fromkeys("abc", 0)
    incarnations = dict.fromkeys("abc", 1)
    at = T0
    refused = 0
    for _ in range(2000):
        if rng.random() < 0.7:
            at += rng.choice([0.0, 0.0, 0.01, 0.1, 1.0, 30.0])
        name = rng.choice("abc")
        if rng.random() < 0.01:
            incarnations[name] += 1
            steps[name] = rng.randint(0, steps[name])
        jump = rng.choice([-3, 0, 1, 3, 12, 100, 10**6])
        step = max(0, steps[name] + jump)
        steps[name] = max(steps[name], step)
        c_steps = rng.choice([1, 12, 24, 25, 100, 1000, 10**6])
        delta = (incarnations[name], step, at)
        expected = reference_bound(taken, name, delta, c_steps)
        reason = offer(roster, name, c_steps, step, at, incarnation=incarnations[name])
        assert (reason is None) == expected, (name, delta, c_steps)
        if reason is None:
            taken.setdefault(name, []).append(delta)
        else:
            refused += 1
    assert 100 < refused < 1900  # both kinds of answer were exercised


def test_an_honest_learner_is_never_refused_however_its_deltas_arrive() -> None:
    """The claim of docs/design.md: an honest learner's deltas on one base are
    never refused, whatever their arrivals: held back and sent in bursts (a
    slow admission, an outage), delayed, some dropped (its outbox was full),
    as long as the first the syncer takes covers at most 2 H steps. Alone on
    the roster, and among peers of its pace."""
    rng = random.Random(5)
    for trial in range(300):
        step_s = rng.choice([0.001, 0.01, 0.1, 1.0])
        every = rng.choice([1, 3, 12])  # steps between its deltas (H / P)
        roster = roster_of("a", "p0", "p1") if trial % 2 else roster_of("a")
        for peer in roster.members - {"a"}:  # peers of its pace, known
            t = T0 - 100
            for i in range(20):
                t += step_s * rng.uniform(1, 1.5)
                roster.paced(peer, 1, i, t)
        applied_at = T0 + rng.uniform(0, 2)  # it applies the base after its publication
        sent = []
        t = applied_at
        for step in range(1, 250):  # fewer deltas than PACE_WINDOW samples
            t += step_s * rng.uniform(1, 3)  # never faster than its pace
            if step % every == 0 and (not sent or rng.random() > 0.2):  # some dropped
                sent.append((step, t))
        # Held back: everything sent before `release` arrives at `release`, at once.
        release = sent[0][1] + rng.choice([0.0, 0.5, 5.0, 60.0])
        arrivals = []
        for step, t_sent in sent:
            delay = rng.choice([0.0, 0.001, 0.01])
            arrivals.append((max(release, t_sent + delay), step))
        # Taken in arrival order; one instant's deltas in the order of their steps.
        for at, step in sorted(arrivals):
            reason = offer(roster, "a", step, step, at)
            assert reason is None, (trial, step_s, every, step, at - T0)


# -- the syncer service, clocks passed in ----------------------------------------------
def delta_of(syncer: Syncer, learner: str, seq: int, step: int, c_steps: int, p: int = 0) -> Delta:
    """A delta of ``learner`` on fragment ``p``'s current version."""
    state = syncer.states[p]
    return Delta(
        run_id="svc", learner_id=learner, incarnation=1, seq=seq, fragment=p,
        plan_hash=syncer.plan.plan_hash, base_epoch=state.epoch, base_version=state.version,
        step=step, c_steps=c_steps, c_tokens=c_steps, sent_at=time.time(), codec=Codec(),
        numel=state.numel, payload=Codec().encode(torch.full((state.numel,), 1e-3)),
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_a_burst_without_any_heartbeat_is_taken(tmp_path: Path) -> None:
    """The syncer service, its clocks passed in: a learner's first deltas, 30 s
    after version 0 was published, arrive together without a heartbeat (they
    used to meet the bare floor of 2 H = 4 steps and be refused), in an order
    the transport chose (Redis reads stream by stream), then one more 0.2 s
    later. Every one is taken."""
    clock, wall = Clock(1.0), Clock(T0)
    syncer = make_syncer(tmp_path, free_port_pair(), clocks=(clock, wall))
    try:
        published = syncer.states[0].published_at[0]
        clock.t, wall.t = 31.0, published + 30
        burst = [delta_of(syncer, "a", seq, 4 * seq, 4 * seq, p=seq % 2) for seq in range(1, 21)]
        syncer.handle([Inbound(d) for d in sorted(burst, key=lambda d: (d.fragment, -d.seq))])
        clock.t, wall.t = 31.2, published + 30.2
        syncer.handle([Inbound(delta_of(syncer, "a", 21, 84, 84, p=1))])
        assert syncer.metrics.rejected == {}
        assert syncer.roster.pace_times()["a"] == pytest.approx(0.2 / 80)  # from the first
        # A claim beyond even that pace is refused: 4 + 2 x 30.4 / 0.0025 steps.
        clock.t, wall.t = 31.4, published + 30.4
        syncer.handle([Inbound(delta_of(syncer, "a", 22, 88, 10**6, p=0))])
        assert syncer.metrics.rejected == {"too_many_steps": 1}
    finally:
        syncer.transport.close()


@pytest.mark.timeout(60)
def test_a_restarted_syncer_bounds_a_first_delta_by_the_learners_pace_not_the_floor(
    tmp_path: Path,
) -> None:
    """A learner's delta at step 40 is merged; the syncer restarts from its
    checkpoint (a rebuild from the broker or the learners loads the same small
    state). The learner's first delta after the 30 s outage covers 60 steps,
    past the floor of 2 H = 4: its pace since its last merged delta (30 s for
    60 steps) bounds it, and it is taken (it was refused at the floor, and its
    learner's progress thrown away). A claim past even that pace is refused.
    The interval from the restart's mark bounds that delta but is no sample of
    the learner's pace (below)."""
    clock, wall = Clock(1.0), Clock(T0)
    first = make_syncer(tmp_path, free_port_pair(), quorum=1, learners=1, clocks=(clock, wall))
    first.handle([Inbound(delta_of(first, "a", 1, 40, 4))])
    assert first.states[0].version == 1 and first.metrics.rejected == {}
    first.shutdown()
    clock.t, wall.t = 31.0, wall.t + 30
    second = make_syncer(tmp_path, free_port_pair(), quorum=1, learners=1, clocks=(clock, wall))
    try:
        second.handle([Inbound(delta_of(second, "a", 2, 100, 60))])
        assert second.metrics.rejected == {}
        assert "a" not in second.roster.pace_times()
        clock.t, wall.t = clock.t + 1, wall.t + 1  # 1 s for 1 step: its pace from here
        second.handle([Inbound(delta_of(second, "a", 3, 101, 10**6))])
        assert second.metrics.rejected == {"too_many_steps": 1}
    finally:
        second.transport.close()


def test_deltas_sent_again_after_a_restart_do_not_make_their_learner_look_slow(
    tmp_path: Path,
) -> None:
    """A learner's delta at step 40 is merged, then the syncer dies. The
    learner's next delta (step 44, made just before) is sent again once the
    syncer is back 30 s later: from the restart's mark it shows 7.5 s a step.
    Had that been a sample of the learner's pace, its next delta, made over
    the outage (60 steps on a version as old), would be bounded by it and
    refused; it is taken."""
    clock, wall = Clock(1.0), Clock(T0)
    first = make_syncer(tmp_path, free_port_pair(), quorum=1, learners=1, clocks=(clock, wall))
    first.handle([Inbound(delta_of(first, "a", 1, 40, 4))])
    first.shutdown()
    clock.t, wall.t = 31.0, wall.t + 30
    second = make_syncer(tmp_path, free_port_pair(), quorum=1, learners=1, clocks=(clock, wall))
    try:
        second.handle([Inbound(delta_of(second, "a", 2, 44, 4))])  # made before the outage
        clock.t, wall.t = clock.t + 0.1, wall.t + 0.1
        second.handle([Inbound(delta_of(second, "a", 3, 104, 60))])  # made over it
        assert second.metrics.rejected == {}
    finally:
        second.transport.close()


# -- live, over both transports ----------------------------------------------------
@pytest.fixture(params=["zmq", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A broker URL: a ZeroMQ endpoint, or a private Redis (acks fast over ZeroMQ,
    so that the deltas a syncer drops before the learner's enrollment come
    again within the test's seconds)."""
    if request.param == "zmq":
        yield f"zmq://127.0.0.1:{free_port_pair()}?ack_timeout_s=0.3"
        return
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def live_learner(url: str, name: str) -> LearnerTransport:
    return connect_learner(
        url, run_id="svc", learner_id=name, incarnation=1, num_fragments=2,
        keys=RunKeys.load(run_keys(), "learner"),
    )  # fmt: skip


def taken_up_to(syncer: Syncer, learner: str, seqs: dict[int, int]) -> bool:
    """Whether each fragment's newest delta ``seqs[p]`` of ``learner`` was answered:
    pending in its round, or refused."""
    syncer.step()
    for p, seq in seqs.items():
        pending = syncer.states[p].admission.pending.get((learner, 0))
        if (pending is None or pending.key[1] < seq) and not syncer.metrics.rejected:
            return False
    return True


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_live_an_honest_burst_after_a_slow_admission_is_not_refused(
    url: str, tmp_path: Path
) -> None:
    """A learner trains 40 steps in 1 s while the syncer does not run (it has not
    admitted the learner yet: over Redis its writes wait in the learner, over
    ZeroMQ its enrollment waits), sending a delta each step and no heartbeat;
    then the syncer runs and takes them in a burst. Its step counts reach 40,
    ten times the floor of 2 H: none is refused."""
    syncer = make_syncer(tmp_path, 0, url=url)  # K = 2: the rounds stay open
    learner = live_learner(url, "a")
    try:
        start = time.monotonic()
        for step in range(1, 41):
            learner.send_delta(delta_of(syncer, "a", step, step, step, p=step % 2))
            time.sleep(max(0.0, start + 0.025 * step - time.monotonic()))

        def taken() -> bool:
            learner.poll(0.01)  # over Redis: writes what waited for the admission
            return taken_up_to(syncer, "a", {0: 40, 1: 39})

        wait_until(taken, 20, what="the burst to be taken")
        assert syncer.metrics.rejected == {}
    finally:
        learner.close()
        syncer.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_live_claims_beyond_the_pace_are_refused(url: str, tmp_path: Path) -> None:
    """Two learners send a delta of a fragment every 20 ms or so, each covering
    the 2 steps since their last of it: h one step at a time, x with its
    steps advancing 10^9 a delta (its own pace would allow 10^6 steps in a
    millisecond), and heartbeats reporting nanosecond steps. x's claim of
    10^6 steps is refused (too_many_steps): its heartbeats count for nothing,
    and its pace is capped at half the roster's median. h is never refused."""
    syncer = make_syncer(tmp_path, 0, url=url)
    learners = {name: live_learner(url, name) for name in ("h", "x")}
    try:
        for i in range(1, 21):
            for name, learner in learners.items():
                step = i if name == "h" else 10**9 * i
                claim = 10**6 if (name, i) == ("x", 20) else 2
                learner.send_delta(delta_of(syncer, name, i, step, claim, p=i % 2))
                if name == "x":
                    learner.send_heartbeat(
                        Heartbeat(
                            run_id="svc", learner_id="x", incarnation=1, step=step,
                            step_time_s=1e-9,
                        )
                    )  # fmt: skip
                learner.poll(0.0)
            deadline = time.monotonic() + 0.02
            while time.monotonic() < deadline:
                syncer.handle(syncer.transport.receive(0.005))

        def answered() -> bool:
            for learner in learners.values():
                learner.poll(0.01)
            syncer.step()
            return syncer.metrics.rejected["too_many_steps"] > 0

        wait_until(answered, 20, what="x's claim to be answered")
        assert syncer.metrics.rejected == {"too_many_steps": 1}
        syncer.metrics.events.close()
        refusals = [e for e in events_of(tmp_path) if e["event"] == "reject"]
        assert [(e["learner"], e["fragment"]) for e in refusals] == [("x", 0)]
    finally:
        for learner in learners.values():
            learner.close()
        syncer.shutdown()
