"""Attacks by a misbehaving or forged learner on one fragment's state machine.

Each test's docstring says what the attack is and what it did to the syncer
before the trust rules (syncer.trust, the quarantine window of merged deltas);
the assertions are what must hold now. The clock is passed in by hand. The
roster's attacks (made-up ids, fake heartbeats) are in test_quorum.py and
test_syncer_service.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from broker.run.settings import RunSettings
from broker.wire.codecs import Codec
from broker.wire.messages import Delta
from syncer.config import OuterConfig
from syncer.fragment_state import ACCEPTED, DUPLICATE, FragmentState
from syncer.quorum import Roster
from syncer.trust import ReportLimits
from tests.syncer_settings import syncer_settings

torch.set_num_threads(1)

N = 16
W0 = np.linspace(-1.0, 1.0, N)
T0 = 1_700_000_000.0  # wall clock when version 0 was published (s)
H = 12  # steps between two sends of a fragment
HONEST_TOKENS_PER_STEP = 2048


def params(**over: Any) -> tuple[OuterConfig, RunSettings]:
    values: dict[str, Any] = dict(
        quorum=3,
        grace_gamma=0.5,
        overlap=2,
        staleness=4,
        outer_lr=1.0,  # lr 1, no momentum: the new global is W0 minus the merged gradient
        outer_momentum=0.0,
        aggregation="mean",
        codec=Codec.parse("fp32"),
        limits=ReportLimits(step_floor=2 * H, max_tokens_per_step=2**24, max_clock_skew_s=60.0),
        weight_clip=3.0,
        quarantine_factor=10.0,
        quarantine_window=16,
        quarantine_action="clip",
    )
    values.update(over)
    return syncer_settings(**values)


def direction(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(0, 1, N)
    return v / np.linalg.norm(v)


def send(
    state: FragmentState,
    learner: str,
    seq: int,
    vector: np.ndarray,
    *,
    c_steps: int = H,
    c_tokens: int | None = None,
    incarnation: int = 1,
    wall_s: float | None = None,
    step_s: float | None = 0.5,
) -> str:
    d = Delta(
        learner_id=learner,
        incarnation=incarnation,
        seq=seq,
        base_version=state.version,
        step=seq * H,
        c_steps=c_steps,
        c_tokens=c_steps * HONEST_TOKENS_PER_STEP if c_tokens is None else c_tokens,
        numel=N,
    )
    arrive = state.published_at[state.version] + H * 0.5 if wall_s is None else wall_s
    t = torch.tensor(vector, dtype=torch.float32)
    return state.offer(d, t, None, 0.0, wall_s=arrive, step_s=step_s)


def honest(state: FragmentState, seq: int, learners: int = 3) -> None:
    """Honest learners: H steps, norm 1 per step, all roughly the same direction."""
    for i in range(learners):
        vector = H * (direction(0) + 0.1 * direction(100 + i))
        vector *= H / np.linalg.norm(vector)
        assert send(state, f"h{i}", seq, vector) == ACCEPTED


def close(state: FragmentState) -> Any:
    return state.close(state.published_at[state.version] + H * 0.5 + 1.0)


def test_forged_step_count_cannot_hide_a_huge_delta() -> None:
    """Attack: a delta 1000x the honest size claiming c_steps = 10^6, so its norm
    per step looks tiny and passes the quarantine. Before: merged, and its
    claimed tokens carried the round: the model moved ~1000x an honest round.
    Now: 10^6 steps cannot fit into the 6 s since its base version was
    published (at 0.5 s per step, with the margin, at most 24 + 24): refused."""
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *params(), published_s=T0)
    honest(state, 1)
    assert send(state, "x", 1, -1000 * H * direction(0), c_steps=10**6) == "too_many_steps"
    result = close(state)
    assert result.learners == ["h0", "h1", "h2"]
    assert np.linalg.norm(state.weights.double().numpy() - W0) < 1.01 * H


def test_forged_step_advances_cannot_buy_a_step_count() -> None:
    """Attack: a learner on the roster makes its pace look like nanosecond steps,
    the steps of its deltas advancing a million between two deltas 0.5 s
    apart (before, heartbeats reporting such step times did it), to be
    credited with any step count. It is credited with at most twice the
    roster's median pace, so its claim of 10^6 steps is still refused."""
    roster = Roster(4, 5.0, now=0.0)
    for name in ("h0", "h1", "h2", "x"):
        roster.join(name, 0.0)
    for i in range(1, 9):  # deltas every 0.5 s: one step each (h), a million (x)
        for name in ("h0", "h1", "h2"):
            roster.paced(name, 1, i, T0 + 0.5 * i)
        roster.paced("x", 1, 10**6 * i, T0 + 0.5 * i)
    assert roster.pace_times()["x"] == pytest.approx(5e-7)
    credited = roster.credited_step_s("x")
    assert credited == 0.25  # half the median of 0.5, 0.5, 0.5 and 5e-7
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *params(), published_s=T0)
    big = -1000 * H * direction(0)
    assert send(state, "x", 1, big, c_steps=10**6, step_s=credited) == "too_many_steps"
    # What that pace allows is accepted: 24 + 2 * 6 s / 0.25 s = 72 steps.
    assert send(state, "x", 2, H * direction(0), c_steps=73, step_s=credited) == "too_many_steps"
    assert send(state, "x", 3, H * direction(0), c_steps=72, step_s=credited) == ACCEPTED


def test_a_learner_reporting_2_62_tokens_gets_at_most_the_clip_share() -> None:
    """Attack: c_tokens = 2^62 in one step, a weight of 2^124 against honest ones
    of ~3e5: before, the round was the attacker's alone (share ~1). Now its
    weight is capped at 3x the typical weight: with three honest learners its
    share is 3 / (3 + 3) = 1/2 at most. (With the default token limit such a
    claim is refused outright, see test_trust_bounds; here the limit is lifted
    to test the clip alone.)"""
    lifted = params(
        limits=ReportLimits(step_floor=2 * H, max_tokens_per_step=2**62, max_clock_skew_s=60.0)
    )
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *lifted, published_s=T0)
    # Every delta 1 per step, so that the quarantine leaves them all alone.
    g = [H * direction(i) for i in range(3)] + [direction(3)]
    for i in range(3):
        assert send(state, f"h{i}", 1, g[i]) == ACCEPTED
    assert send(state, "x", 1, g[3], c_steps=1, c_tokens=2**62) == ACCEPTED
    result = close(state)
    assert result.weights_clipped == 1 and result.clipped == []
    # Honest weights: (12 * 2048)^2 / 12 each; x's capped at 3x that.
    expected = W0 - (g[0] + g[1] + g[2] + 3 * g[3]) / 6
    np.testing.assert_allclose(state.weights.double().numpy(), expected, atol=1e-5)


def test_honest_unequal_weights_within_the_clip_are_unchanged() -> None:
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *params(), published_s=T0)
    g = [H * direction(i) for i in range(3)]
    tokens = [H * 1000, H * 1500, H * 1700]  # weights H * 1000^2, 2.25x, 2.89x
    for i in range(3):
        assert send(state, f"h{i}", 1, g[i], c_tokens=tokens[i]) == ACCEPTED
    assert close(state).weights_clipped == 0
    w = np.array([t * t / H for t in tokens])
    expected = W0 - sum(wi * gi for wi, gi in zip(w, g, strict=True)) / w.sum()
    np.testing.assert_allclose(state.weights.double().numpy(), expected, atol=1e-5)


def test_an_incarnation_from_the_future_cannot_lock_a_learner_out() -> None:
    """Attack: one delta under learner a's id with incarnation 2^63 - 1. Before:
    merged, it made (2^63 - 1, seq) a's newest applied key, so every later delta
    of the real a looked like a replay (DUPLICATE) and was dropped for good.
    Now: an incarnation past now + the clock-skew allowance is refused."""
    state = FragmentState(
        0, torch.tensor(W0, dtype=torch.float32), *params(quorum=1), published_s=T0
    )
    assert send(state, "a", 1, H * direction(0), incarnation=2**63 - 1) == "future_incarnation"
    real = int(T0 * 1e9)
    assert send(state, "a", 1, H * direction(0), incarnation=real) == ACCEPTED
    close(state)
    assert state.applied["a"] == (real, 1)
    assert send(state, "a", 2, H * direction(0), incarnation=real) == ACCEPTED
    assert send(state, "a", 1, H * direction(0), incarnation=real) == DUPLICATE


def test_an_outlier_in_the_first_rounds_is_clipped() -> None:
    """Attack: strike before there is any history. Before: nothing was refused
    until five peer observations existed, so a delta 10^4x the honest size in
    the first round was merged as it was. Now the first round's bar is 10x the
    median of the round itself: the outlier is scaled down to it."""
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *params(), published_s=T0)
    honest(state, 1)
    assert send(state, "x", 1, -1e4 * H * direction(0)) == ACCEPTED
    result = close(state)
    assert result.clipped == [("x", 1, 1)]
    # Four contributions of equal weight, x's at most 10 per step: the model
    # moved at most (3 * 12 + 120) / 4 = 39 (before: ~3e4).
    assert np.linalg.norm(state.weights.double().numpy() - W0) <= 39.0 + 1e-3


def walk_the_bar_up(action: str, rounds: int = 8) -> list[float]:
    """Five honest learners (norm 1 per step) and an attacker. Every round the
    attacker's three probe ids send eight deltas each, 1000x the honest size,
    and then x sends 9.5x the norm of its previous delta (just under the 10x
    bar if its previous delta had become the median). Returns the norm per step
    of x's merged deltas, round by round (0 when not merged)."""
    state = FragmentState(
        0, torch.tensor(W0, dtype=torch.float32), *params(quarantine_action=action), published_s=T0
    )
    merged = []
    size = 9.5
    for seq in range(1, rounds + 1):
        honest(state, seq, learners=5)
        for p in range(3):
            for k in range(8):
                probe = 1000 * H * direction(7 + p)
                assert send(state, f"probe{p}", seq * 100 + k, probe) == ACCEPTED
        assert send(state, "x", seq, -size * H * direction(0)) == ACCEPTED
        result = close(state)
        assert result.learners[:5] == [f"h{i}" for i in range(5)]
        recent = list(state.admission.norm_sizes.values)[-result.included :]
        norms = dict(zip((k[0] for k in result.keys), recent, strict=True))
        merged.append(norms.get("x", 0.0))
        size *= 9.5
    return merged


def test_deltas_at_9_5x_the_median_round_after_round_do_not_drive_the_model() -> None:
    """Attack: walk the quarantine bar up. The bar was 10x the median of every
    recent observation, refused ones included (up to eight per id): the refused
    probes filled the window, the median rose, and the attacker's next delta,
    9.5x its last one, passed again: 9.5, 90, 857, 8145 times the honest size,
    each merged (the model moved ~19000x an honest round). Now only merged
    deltas enter the window, one per learner and round (a clipped one at its
    clipped size), so while honest learners are the majority of what is merged
    the median stays theirs: nothing of the attacker's is merged above 10x."""
    for action in ("clip", "refuse"):
        merged = walk_the_bar_up(action)
        assert max(merged) <= 10.0 + 1e-4, (action, merged)
    # Refusing: x is merged once (9.5x is within the bar), then never again.
    refused = walk_the_bar_up("refuse")
    assert refused[0] == pytest.approx(9.5) and refused[1:] == [0.0] * 7


def test_decoys_cannot_remove_or_lower_the_quarantine_bar() -> None:
    """Attack: a learner sends zero or tiny deltas round after round, from the
    run's first round, so that the median norm of the window is 0; the bar was
    then dropped ("a median of 0 gives no scale"), and one delta 1000x the
    honest size was merged whole: final loss 647,094 in a live run. Now a norm
    of 0, or below 1/Q of the typical one, never enters the window, and a
    decoy of 1/5 the honest size that does enter is a minority below the
    median: the bar stays 10x the honest norm, and the big delta is clipped."""
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *params(), published_s=T0)
    for seq in range(1, 25):
        honest(state, seq, learners=2)
        decoy = (0.0, 1e-9, 0.2 * H)[seq % 3]  # 0.2 per step: a fifth of the honest norm
        assert send(state, "x", seq, decoy * direction(1)) == ACCEPTED
        result = close(state)
        assert result.clipped == []  # the honest deltas were never clipped
        assert state.admission.norm_sizes.limit([]) == pytest.approx(10.0)
    before = state.weights.double().numpy().copy()
    honest(state, 1000, learners=2)
    assert send(state, "x", 1000, 1000 * H * H * direction(0)) == ACCEPTED
    assert close(state).clipped == [("x", 1, 1000)]
    # Equal weights, x's delta at most 10 per step over H steps: the model moved
    # at most (2 H + 10 H) / 3.
    assert np.linalg.norm(state.weights.double().numpy() - before) <= 4 * H + 1e-3


def test_low_weight_decoys_cannot_lower_the_weight_cap() -> None:
    """Attack: a learner's deltas claim 1 step and 1 token (weight 1, against the
    honest H x 2048^2), so that the cap, 3x the lower median weight of the
    round, fell to 3, the honest weights were cut to it, and x's zero deltas
    took a quarter of every round. Now the cap is 3x the typical weight of
    the last merged terms, which a weight below a third of it never enters:
    from the first round on, no honest weight is capped."""
    state = FragmentState(0, torch.tensor(W0, dtype=torch.float32), *params(), published_s=T0)
    honest_weight = H * HONEST_TOKENS_PER_STEP**2
    for seq in range(1, 25):
        honest(state, seq, learners=2)
        assert send(state, "x", seq, np.zeros(N), c_steps=1, c_tokens=1) == ACCEPTED
        assert close(state).weights_clipped == 0
        assert state.admission.weight_sizes.limit([]) == pytest.approx(3 * honest_weight)


def test_at_m_2_a_hostile_learner_is_half_of_every_sample() -> None:
    """The limit of peer comparison, stated in docs/design.md: with two learners
    one hostile from the first round, no median tells them apart. The lower
    median keeps what matters most: its huge deltas are still clipped (it can
    slow the model with decoys, not break it)."""
    state = FragmentState(
        0, torch.tensor(W0, dtype=torch.float32), *params(quorum=2), published_s=T0
    )
    for seq in range(1, 9):
        honest(state, seq, learners=1)
        assert send(state, "x", seq, 1000 * H * H * direction(seq)) == ACCEPTED
        assert close(state).clipped == [("x", 1, seq)]


def test_a_learners_deltas_on_two_bases_are_one_term() -> None:
    """A learner that sent on version v, then on v + 1, in one round, enters it
    once: its term is the token-step weighted mean of both rebased deltas, its
    weight that of their summed steps and tokens, and the quarantine window
    gains one norm for it, not two (it would otherwise have twice the say of a
    learner that sent once)."""
    state = FragmentState(
        0, torch.tensor(W0, dtype=torch.float32), *params(quorum=1), published_s=T0
    )
    v0 = state.weights.double().numpy().copy()
    honest(state, 1, learners=1)
    close(state)  # version 1: x's first delta below is one version behind
    d0 = H * direction(3)
    d1 = 0.5 * H * direction(4)
    v1 = state.weights.double().numpy()
    x0 = Delta(
        learner_id="x", incarnation=1, seq=1, base_version=0, step=H, c_steps=H,
        c_tokens=H * 2048, numel=N,
    )  # fmt: skip
    at = state.published_at[1] + 1.0
    t0 = torch.tensor(d0, dtype=torch.float32)
    assert state.offer(x0, t0, None, 0.0, wall_s=at, step_s=0.5) == ACCEPTED
    x1 = Delta(
        learner_id="x", incarnation=1, seq=2, base_version=1, step=H + 4, c_steps=4,
        c_tokens=4 * 1024, numel=N,
    )  # fmt: skip
    t1 = torch.tensor(d1, dtype=torch.float32)
    assert state.offer(x1, t1, None, 0.0, wall_s=at, step_s=0.5) == ACCEPTED
    honest(state, 2, learners=1)
    windows_before = len(state.admission.norm_sizes.values)
    result = close(state)
    assert result.included == 3 and result.learners == ["h0", "x"]
    assert len(state.admission.norm_sizes.values) == windows_before + 2  # one per learner
    # The reference, from the written rule: x's gradient is the weighted mean of
    # (v1 - v0) + d0 and d1, weights H 2048^2 and 4 1024^2; its term weighs
    # (H 2048 + 4 1024)^2 / (H + 4), h0's H 2048^2; lr 1, no momentum.
    w0, w1 = H * 2048.0**2, 4 * 1024.0**2
    g_x = (w0 * ((v1 - v0) + d0) + w1 * d1) / (w0 + w1)
    vector = H * (direction(0) + 0.1 * direction(100))
    g_h = vector * H / np.linalg.norm(vector)
    weight_x = (H * 2048 + 4 * 1024) ** 2 / (H + 4)
    weight_h = H * 2048.0**2
    expected = v1 - (weight_x * g_x + weight_h * g_h) / (weight_x + weight_h)
    np.testing.assert_allclose(state.weights.double().numpy(), expected, rtol=0, atol=1e-5)
