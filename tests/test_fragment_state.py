"""FragmentState, the syncer's per-fragment logic, against numpy and hand numbers.

Every expected value below is computed here from the formulas of
docs/design.md (rebasing, token-step weights, weighted or radial mean, Nesterov),
in float64 numpy, never by calling the code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from broker.errors import ConfigError, DdilocoError
from broker.run.settings import RunSettings
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import Delta, weights_checksum
from syncer.aggregation import rebased_weighted_mean
from syncer.checkpoint import load_fragment, save_fragment
from syncer.config import OuterConfig
from syncer.fragment_state import (
    ACCEPTED,
    DUPLICATE,
    HELD,
    FragmentState,
    canonical,
)
from syncer.merge import _CHUNK_VALUES
from syncer.outer import nesterov_step
from syncer.trust import ReportLimits
from tests.syncer_settings import syncer_settings

torch.set_num_threads(1)

LR, MU = 0.7, 0.9
# The syncer's wall clock (s): version 0 is published at T0, deltas arrive at
# T0 + 10, rounds close at T1. Without a step time the step bound is the floor.
T0, T1 = 1_000.0, 1_020.0
LIMITS = ReportLimits(step_floor=64, max_tokens_per_step=1_000, max_clock_skew_s=60.0)
W0 = np.array([1.0, -2.0, 0.5, 3.0, -1.5, 0.25, 0.0, 2.0])
N = W0.size
# Three learners' first deltas, with their counters and hand-computed weights
# w = c_tokens * (c_tokens / c_steps).
ROUND1: dict[str, dict[str, Any]] = {
    "a": {
        "delta": [0.1, 0.2, -0.1, 0.0, 0.3, -0.2, 0.05, 0.1],
        "c_tokens": 100,
        "c_steps": 4,
        "w": 2500.0,
    },
    "b": {
        "delta": [-0.2, 0.1, 0.0, 0.4, -0.1, 0.1, 0.2, -0.3],
        "c_tokens": 200,
        "c_steps": 8,
        "w": 5000.0,
    },
    "c": {
        "delta": [0.3, -0.3, 0.2, 0.1, 0.0, -0.4, -0.1, 0.2],
        "c_tokens": 60,
        "c_steps": 2,
        "w": 1800.0,
    },
}


def params(**over: Any) -> tuple[OuterConfig, RunSettings]:
    values: dict[str, Any] = dict(
        quorum=3,
        grace_gamma=0.5,
        overlap=2,
        staleness=2,
        outer_lr=LR,
        outer_momentum=MU,
        aggregation="mean",
        codec="fp32",
        limits=LIMITS,
        weight_clip=3.0,
        quarantine_factor=10.0,
        quarantine_window=16,
        quarantine_action="clip",
    )
    values.update(over)
    return syncer_settings(**values)


def delta(
    learner: str,
    seq: int,
    base_version: int,
    c_tokens: int = 100,
    c_steps: int = 4,
    incarnation: int = 0,
    numel: int = N,
    step: int | None = None,
) -> Delta:
    return Delta(
        run_id="r",
        learner_id=learner,
        incarnation=incarnation,
        seq=seq,
        fragment=0,
        base_version=base_version,
        c_tokens=c_tokens,
        c_steps=c_steps,
        numel=numel,
        step=10 * seq if step is None else step,
    )


def f32(x: Any) -> torch.Tensor:
    return torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float32)


def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def offer(
    state: FragmentState,
    d: Delta,
    tensor: torch.Tensor | np.ndarray | list[float],
    ref: Any = None,
    now: float = 0.0,
    wall_s: float = T0 + 10.0,
    step_s: float | None = None,
) -> str:
    t = tensor if isinstance(tensor, torch.Tensor) else f32(tensor)
    return state.offer(d, t, ref, now, wall_s=wall_s, step_s=step_s)


def offer_round1(state: FragmentState) -> None:
    for name, r in ROUND1.items():
        status = offer(
            state, delta(name, 1, 0, r["c_tokens"], r["c_steps"]), r["delta"], ref=f"ref-{name}"
        )
        assert status == ACCEPTED


def expected_round1(w0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(new weights, momentum) after round 1, all learners based on version 0."""
    # Based on the current version, the rebased gradient is the delta itself.
    grads = {name: w0 - (w0 - np.array(r["delta"])) for name, r in ROUND1.items()}
    total = sum(r["w"] for r in ROUND1.values())
    merged = sum(r["w"] * grads[name] for name, r in ROUND1.items()) / total
    # First Nesterov step: buf = g, w_new = w - lr * (g + mu * g).
    return w0 - LR * (merged + MU * merged), merged


# -- one round, exact codec ----------------------------------------------------
def test_a_round_of_fewer_than_m_deltas_takes_their_share_of_a_step() -> None:
    """Three deltas of M = 4: 3/4 of the step a round of all four would take
    (the same merged mean). M = 0 (the default) or a full round: a full step."""
    w0 = np.asarray(W0, dtype=np.float64)
    new, buf = expected_round1(w0)
    full = FragmentState(0, f32(W0), *params(), published_s=T0)
    offer_round1(full)
    full.close(T1, learners=3)
    np.testing.assert_allclose(np64(full.weights), new, rtol=0, atol=2e-6)
    share = FragmentState(0, f32(W0), *params(), published_s=T0)
    offer_round1(share)
    share.close(T1, learners=4)
    np.testing.assert_allclose(np64(share.weights), w0 - 0.75 * (w0 - new), rtol=0, atol=2e-6)
    assert share.momentum is not None
    np.testing.assert_allclose(np64(share.momentum), 0.75 * buf, rtol=0, atol=2e-6)


def test_round_of_three_matches_numpy_fp32() -> None:
    state = FragmentState(0, f32(W0), *params(), published_s=T0)
    assert state.version == 0
    offer_round1(state)
    assert state.pending_learners == ["a", "b", "c"]
    result = state.close(T1)

    new, buf = expected_round1(W0)
    np.testing.assert_allclose(np64(state.weights), new, rtol=0, atol=2e-6)
    assert state.momentum is not None
    np.testing.assert_allclose(np64(state.momentum), buf, rtol=0, atol=2e-6)
    assert state.weights.dtype == torch.float32 and state.weights.shape == (N,)

    assert result.version == 1 and state.version == 1
    assert result.included == 3
    assert result.tokens == 100 + 200 + 60
    assert result.learners == ["a", "b", "c"]
    assert result.keys == [("a", 0, 1), ("b", 0, 1), ("c", 0, 1)]
    assert result.refs == ["ref-a", "ref-b", "ref-c"]
    assert state.applied == {"a": (0, 1), "b": (0, 1), "c": (0, 1)}
    assert state.pending_learners == []
    # fp32 is lossless: the payload is exactly the stored weights' bytes.
    published = state.publication
    assert not published.is_change and published.codec == Codec("fp32")
    assert published.payload == state.weights.numpy().tobytes()
    assert state.snapshot is published


def test_round_of_three_int8_publishes_the_quantised_change() -> None:
    codec = Codec.parse("int8")
    state = FragmentState(0, f32(W0), *params(codec="int8"), published_s=T0)
    # The first version goes out as its fp32 weights: nothing to take a change from.
    assert torch.equal(state.weights, f32(W0))
    assert not state.publication.is_change
    assert state.publication.payload == f32(W0).numpy().tobytes()

    offer_round1(state)
    state.close(T1)
    new, _ = expected_round1(np64(f32(W0)))
    published = state.publication
    assert published.is_change and published.codec == codec
    # Changes go out with least-squares scales (canonical's reason).
    assert published.payload == codec.encode(state.master - f32(W0), fit_scales=True)
    # What a learner holding v0 builds is the syncer's version, bit for bit.
    rebuilt = apply_change(f32(W0), codec.decode(published.payload, N))
    assert torch.equal(rebuilt, state.weights)
    assert len(published.payload) == codec.quantised_size(N)
    # The snapshot is that version's exact fp32 bytes.
    assert not state.snapshot.is_change
    assert state.snapshot.payload == state.weights.numpy().tobytes()
    assert state.snapshot.weights_crc == weights_checksum(state.weights) == published.weights_crc
    # Lossy, but within one quantisation step of the change from the fp32 result.
    step = np.abs(new - np64(f32(W0))).max() / 127
    np.testing.assert_allclose(np64(state.weights), new, rtol=0, atol=step)


def test_quantised_changes_follow_the_master_without_drift() -> None:
    """Error feedback: each change carries the rounding error of the ones before
    (master - version), so after many rounds the published version is within one
    step of the last change's quantisation of the master, not a sum of errors."""
    codec = Codec.parse("int4")
    state = FragmentState(0, f32(W0), *params(codec="int4", quorum=1), published_s=T0)
    gen = np.random.default_rng(0)
    held = f32(W0)  # what a learner that took every change holds
    for k in range(1, 41):
        d = gen.normal(0, 0.01, N)
        assert offer(state, delta("a", k, state.version), d) == ACCEPTED
        state.close(T1)
        held = apply_change(held, codec.decode(state.publication.payload, N))
        assert torch.equal(held, state.weights)
    error = (state.master - state.weights).abs().max().item()
    last_change = codec.decode(state.publication.payload, N).abs().max().item()
    assert error <= last_change / 7 + 1e-7  # one int4 step of the last change


def test_sparse_changes_rebuild_bit_for_bit_and_leave_nothing_behind() -> None:
    """A sparse global codec sends a quarter of each change; error feedback keeps
    the rest in ``master - version`` for later changes. Every learner's rebuild is
    the syncer's version bit for bit, and the version never falls behind the
    master by more than a few rounds' moves, however many rounds go by."""
    codec = Codec("int8", "none", 8, 0.25)
    state = FragmentState(0, f32(W0), *params(codec=codec.name, quorum=1), published_s=T0)
    gen = np.random.default_rng(0)
    held = f32(W0)
    for k in range(1, 201):
        assert offer(state, delta("a", k, state.version), gen.normal(0, 0.01, N)) == ACCEPTED
        previous_master = state.master.clone()
        state.close(T1)
        held = apply_change(held, codec.decode(state.publication.payload, N))
        assert torch.equal(held, state.weights)
        one_move = (state.master - previous_master).abs().max().item()
        # Without the feedback (the sparse change of each move alone) the gap
        # reaches 13 moves here, and grows with the rounds.
        assert (state.master - state.weights).abs().max().item() < 3 * one_move


def test_a_fragment_past_a_chunk_merges_and_steps_as_whole_tensors_would() -> None:
    """The close merges and steps chunk by chunk: bit for bit what the whole-tensor
    mean and outer step give, for deltas on the current version (a zero shift)
    and two on an older one (one shift), with and without momentum."""
    n = 2 * _CHUNK_VALUES + 37
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(n, generator=gen)
    w0[::5] = -0.0
    state = FragmentState(0, w0, *params(quorum=3, staleness=3), published_s=T0)
    master, momentum, history = w0.clone(), None, [w0.clone()]
    for r in range(3):
        wall_s = T1 + 10.0 * r
        deltas, shifts, weights = [], [], []
        shift_of: dict[int, torch.Tensor] = {}  # one per base, as the syncer keeps them
        for i, name in enumerate("abc"):
            base = max(r - min(i, 1), 0)  # b and c: a version behind from the second round
            d = 1e-2 * torch.randn(n, generator=gen)
            d[::7] = -0.0
            tokens = 100 + 50 * i
            sent = delta(name, r + 1, base, c_tokens=tokens, c_steps=4)
            assert offer(state, sent, d, wall_s=wall_s) == ACCEPTED
            deltas.append(d)
            shifts.append(shift_of.setdefault(base, master - history[base]))
            weights.append(tokens * tokens / 4)
        state.close(wall_s + 1.0)
        merged = rebased_weighted_mean(deltas, shifts, weights)
        master, momentum = nesterov_step(master, merged, momentum, LR, MU)
        history.append(master.clone())
        assert torch.equal(state.master.view(torch.int32), master.view(torch.int32))
        assert state.momentum is not None
        assert torch.equal(state.momentum.view(torch.int32), momentum.view(torch.int32))


def test_decoded_deltas_reuse_the_fragments_buffers() -> None:
    """A buffer of decode() comes back when its offer is refused and when its
    round closes, so a running syncer decodes into memory already paged in."""
    codec = Codec.parse("int8")
    payload = codec.encode(f32(ROUND1["a"]["delta"]))

    def sent(seq: int, base: int) -> Delta:
        return Delta(
            run_id="r",
            learner_id="a",
            incarnation=0,
            seq=seq,
            fragment=0,
            base_version=base,
            c_tokens=100,
            c_steps=4,
            numel=N,
            step=10 * seq,
            codec=codec,
            payload=payload,
        )

    state = FragmentState(0, f32(W0), *params(quorum=1), published_s=T0)
    first = state.decode(sent(1, 0))
    assert torch.equal(first, codec.decode(payload, N))
    assert offer(state, sent(1, 0), first) == ACCEPTED
    state.close(T1)
    again = state.decode(sent(1, 1))
    assert again is first
    assert offer(state, sent(1, 1), again) == DUPLICATE
    assert state.decode(sent(2, 1)) is first
    # A tensor of the caller's is never taken: decode() hands out its own.
    own = codec.decode(payload, N)
    assert offer(state, sent(1, 1), own) == DUPLICATE
    assert state.decode(sent(2, 1)) is not own


def test_canonical_returns_what_the_codec_decodes() -> None:
    codec = Codec.parse("int4")
    x = f32(np.linspace(-1.0, 1.0, 100))
    previous = torch.zeros(100)
    weights, published = canonical(codec, x, previous)
    assert published.payload == codec.encode(x - previous, fit_scales=True)
    assert torch.equal(weights, codec.decode(published.payload, 100))
    assert not torch.equal(weights, x)  # int4 is lossy, so the copy matters
    lossless = Codec.parse("fp32+zstd")
    weights, published = canonical(lossless, x, previous)
    assert torch.equal(weights, x) and not published.is_change


# -- a stale learner is rebased ------------------------------------------------
def test_second_round_rebases_a_learner_one_version_behind() -> None:
    # Round 2's weights (500 and 1600) are 3.2x apart: a clip above that keeps
    # them exact (test_weight_clip_* cover the clip).
    state = FragmentState(0, f32(W0), *params(weight_clip=4.0), published_s=T0)
    offer_round1(state)
    state.close(T1)
    v0 = W0
    v1 = np64(state.weights)  # what the syncer rebases against (numpy-checked above)
    _, buf1 = expected_round1(W0)

    d_a = np.array([0.05, -0.1, 0.2, 0.0, 0.1, 0.1, -0.2, 0.3])  # a trained from v0
    d_b = np.array([0.1, 0.1, -0.1, -0.2, 0.0, 0.3, 0.1, -0.1])  # b trained from v1
    assert offer(state, delta("a", 2, 0, c_tokens=50, c_steps=5), d_a, "a2") == ACCEPTED
    assert offer(state, delta("b", 2, 1, c_tokens=80, c_steps=4), d_b, "b2") == ACCEPTED
    result = state.close(T1)

    # a's weights theta_a = v0 - d_a; its outer gradient is against v1.
    g_a = v1 - (v0 - d_a)
    g_b = v1 - (v1 - d_b)
    w_a, w_b = 50 * 50 / 5, 80 * 80 / 4  # 500, 1600
    merged = (w_a * g_a + w_b * g_b) / (w_a + w_b)
    buf2 = MU * buf1 + merged
    v2 = v1 - LR * (merged + MU * buf2)
    np.testing.assert_allclose(np64(state.weights), v2, rtol=0, atol=3e-6)
    assert state.momentum is not None
    np.testing.assert_allclose(np64(state.momentum), buf2, rtol=0, atol=3e-6)
    assert result.version == 2 and result.tokens == 130
    assert result.keys == [("a", 0, 2), ("b", 0, 2)]

    # Staleness 2 keeps versions 1 and 2: 0 is now too old, 3 does not exist yet.
    assert offer(state, delta("c", 2, 0), d_a) == "stale"
    assert offer(state, delta("c", 2, 3), d_a) == "future_version"
    assert offer(state, delta("c", 2, 1), d_a) == ACCEPTED


def test_staleness_one_keeps_only_the_current_version() -> None:
    state = FragmentState(0, f32(W0), *params(staleness=1), published_s=T0)
    offer_round1(state)
    state.close(T1)
    assert offer(state, delta("a", 2, 0), ROUND1["a"]["delta"]) == "stale"
    assert offer(state, delta("a", 2, 2), ROUND1["a"]["delta"]) == "future_version"
    assert offer(state, delta("a", 2, 1), ROUND1["a"]["delta"]) == ACCEPTED


def test_first_version_may_be_nonzero() -> None:
    state = FragmentState(0, f32(W0), *params(), version=7, published_s=T0)
    assert state.version == 7
    assert offer(state, delta("a", 0, 6), ROUND1["a"]["delta"]) == "stale"
    assert offer(state, delta("a", 0, 7), ROUND1["a"]["delta"]) == ACCEPTED
    assert state.close(T1).version == 8


# -- duplicates, resends, superseding ------------------------------------------
def plain_average() -> tuple[OuterConfig, RunSettings]:
    """lr 1, momentum 0: the new global is the (weighted) mean of learners' weights."""
    return params(outer_lr=1.0, outer_momentum=0.0)


def test_replay_of_an_applied_delta_is_a_duplicate() -> None:
    state = FragmentState(0, f32(W0), *params(), published_s=T0)
    offer_round1(state)
    state.close(T1)
    before = state.weights.clone()
    d = ROUND1["a"]["delta"]
    assert offer(state, delta("a", 1, 0), d, "replay") == DUPLICATE  # same key
    assert offer(state, delta("a", 0, 0), d, "older") == DUPLICATE  # older key
    assert state.pending_learners == []
    with pytest.raises(DdilocoError):
        state.close(T1)  # nothing was taken in
    assert torch.equal(state.weights, before) and state.version == 1


def test_resend_of_a_pending_delta_is_held_and_acked_on_close() -> None:
    state = FragmentState(0, f32(W0), *plain_average(), published_s=T0)
    d = np.full(N, 0.25)
    assert offer(state, delta("a", 3, 0), d, "first") == ACCEPTED
    assert offer(state, delta("a", 3, 0), d, "resend") == HELD
    assert offer(state, delta("a", 2, 0), d, "late-older") == HELD
    result = state.close(T1)
    assert result.included == 1 and result.keys == [("a", 0, 3)]
    assert sorted(result.refs) == ["first", "late-older", "resend"]
    np.testing.assert_allclose(np64(state.weights), W0 - d, rtol=0, atol=1e-6)
    # The held refs were handed over once; the next round starts clean.
    assert offer(state, delta("b", 0, 1), d, "b0") == ACCEPTED
    assert state.close(T1).refs == ["b0"]


def test_newer_delta_of_the_same_learner_supersedes_the_older() -> None:
    state = FragmentState(0, f32(W0), *plain_average(), published_s=T0)
    old = np.full(N, 1.0)
    new = np.linspace(-0.5, 0.5, N)
    assert offer(state, delta("a", 3, 0, c_tokens=10, c_steps=1), old, "a3") == ACCEPTED
    assert offer(state, delta("a", 4, 0, c_tokens=20, c_steps=2), new, "a4") == ACCEPTED
    assert state.pending_learners == ["a"]
    result = state.close(T1)
    assert result.included == 1
    assert result.keys == [("a", 0, 4)]
    assert result.tokens == 20  # only the newer delta's tokens
    assert sorted(result.refs) == ["a3", "a4"]
    np.testing.assert_allclose(np64(state.weights), W0 - new, rtol=0, atol=1e-6)
    assert state.applied == {"a": (0, 4)}
    assert offer(state, delta("a", 3, 0), old) == DUPLICATE


def test_new_incarnation_is_accepted_after_the_old_one_was_applied() -> None:
    state = FragmentState(0, f32(W0), *plain_average(), published_s=T0)
    d = np.full(N, 0.5)
    assert offer(state, delta("a", 9, 0), d) == ACCEPTED
    state.close(T1)
    assert state.applied == {"a": (0, 9)}
    # A restarted learner numbers its deltas from 0 again under a higher incarnation.
    assert offer(state, delta("a", 0, 1, incarnation=1), d, "inc1") == ACCEPTED
    result = state.close(T1)
    assert result.keys == [("a", 1, 0)]
    assert state.applied == {"a": (1, 0)}
    assert offer(state, delta("a", 9, 1, incarnation=0), d) == DUPLICATE


# -- rejections ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("tensor", "c_tokens", "c_steps", "reason"),
    [
        (torch.zeros(N + 1), 10, 1, "bad_shape"),
        (torch.zeros(N - 1), 10, 1, "bad_shape"),
        (torch.zeros(2, N // 2), 10, 1, "bad_shape"),
        (f32([0.0] * (N - 1) + [float("nan")]), 10, 1, "non_finite"),
        (f32([float("inf")] + [0.0] * (N - 1)), 10, 1, "non_finite"),
        (f32([0.0] * (N - 1) + [float("-inf")]), 10, 1, "non_finite"),
        (torch.zeros(N), 0, 1, "empty"),
        (torch.zeros(N), 10, 0, "empty"),
    ],
)
def test_bad_deltas_are_refused_with_their_reason(
    tensor: torch.Tensor, c_tokens: int, c_steps: int, reason: str
) -> None:
    state = FragmentState(0, f32(W0), *params(), published_s=T0)
    assert offer(state, delta("a", 0, 0, c_tokens=c_tokens, c_steps=c_steps), tensor) == reason
    assert state.pending_learners == []
    # A refusal is not a key the learner has used up.
    assert offer(state, delta("a", 0, 0), torch.zeros(N)) == ACCEPTED


def test_close_with_nothing_pending_raises() -> None:
    state = FragmentState(0, f32(W0), *params(), published_s=T0)
    with pytest.raises(DdilocoError, match="no deltas"):
        state.close(T1)


# -- quarantine ----------------------------------------------------------------
def unit(scale: float, n: int = N) -> np.ndarray:
    """A vector of norm ``scale``."""
    return np.full(n, scale / np.sqrt(n))


def honest_round(state: FragmentState, seq: int, learners: int = 5, scale: float = 1.0) -> None:
    """Every learner sends a delta of norm ``scale`` per step on the current version."""
    for i in range(learners):
        d = delta(f"l{i}", seq, state.version, c_steps=1)
        assert offer(state, d, unit(scale)) == ACCEPTED


def test_outlier_is_clipped_to_the_bar_by_default() -> None:
    """Five deltas of norm 1 per step set the bar at 10 (warm-up: the round's own
    median); a delta of 100 per step is scaled down to 10 per step and merged."""
    state = FragmentState(0, f32(W0), *plain_average(), published_s=T0)
    for i in range(5):
        assert offer(state, delta(f"l{i}", 0, 0, c_steps=2), unit(2.0), f"l{i}") == ACCEPTED
    bad = np.linspace(1.0, 2.0, N)
    bad *= 200.0 / np.linalg.norm(bad)  # 100 per step over 2 steps
    assert offer(state, delta("bad", 0, 0, c_steps=2), bad, "bad") == ACCEPTED
    result = state.close(T1)
    assert result.included == 6 and "bad" in result.learners
    assert result.clipped == [("bad", 0, 0)] and result.refused == []
    # Equal weights, lr 1, no momentum: the new global is W0 minus the mean delta,
    # the bad one scaled to norm 20 (10 per step) with its direction kept.
    clipped = bad * 20.0 / 200.0
    expected = W0 - (5 * unit(2.0) + clipped) / 6
    np.testing.assert_allclose(np64(state.weights), expected, rtol=0, atol=1e-6)
    # What the window remembers is what was merged: 1 per step, and 10 for bad.
    assert sorted(state.admission.norm_sizes.values) == pytest.approx([1.0] * 5 + [10.0])


def test_outlier_is_refused_with_the_refuse_option() -> None:
    state = FragmentState(0, f32(W0), *params(quarantine_action="refuse"), published_s=T0)
    for i in range(5):
        assert offer(state, delta(f"l{i}", 0, 0, c_steps=2), unit(2.0), f"l{i}") == ACCEPTED
    assert offer(state, delta("bad", 0, 0, c_steps=2), unit(200.0), "bad") == ACCEPTED
    result = state.close(T1)
    assert result.included == 5 and "bad" not in result.learners
    assert result.refused == [("bad", 0, 0)] and result.clipped == []
    assert "bad" in result.refs  # refused on close, acked with the round
    assert "bad" not in state.applied  # a refusal is not a key used up
    assert sorted(state.admission.norm_sizes.values) == pytest.approx([1.0] * 5)


def test_a_round_whose_every_delta_is_refused_publishes_nothing() -> None:
    state = FragmentState(
        0,
        f32(W0),
        *params(quorum=1, quarantine_action="refuse", quarantine_window=2),
        published_s=T0,
    )
    for seq in (0, 1):
        honest_round(state, seq, learners=1)
        state.close(T1)
    before = (state.version, state.weights.clone(), list(state.admission.norm_sizes.values))
    assert offer(state, delta("l0", 2, state.version, c_steps=1), unit(50.0), "big") == ACCEPTED
    result = state.close(T1)
    assert not result.published and result.included == 0
    assert result.refused == [("l0", 0, 2)] and result.refs == ["big"]
    assert (state.version, list(state.admission.norm_sizes.values)) == (before[0], before[2])
    assert torch.equal(state.weights, before[1])
    assert state.pending_learners == []


def test_warm_up_bar_comes_from_the_round_itself() -> None:
    """Before W deltas were merged, the round's own deltas join the sample, so the
    very first round already has a bar a minority cannot move."""
    state = FragmentState(0, f32(W0), *params(), published_s=T0)
    for i in range(3):
        assert offer(state, delta(f"l{i}", 0, 0, c_steps=1), unit(1.0)) == ACCEPTED
    assert offer(state, delta("bad", 0, 0, c_steps=1), unit(1000.0)) == ACCEPTED
    assert state.close(T1).clipped == [("bad", 0, 0)]
    # Alone, a delta is its own reference: nothing to compare with yet.
    alone = FragmentState(0, f32(W0), *params(quorum=1), published_s=T0)
    assert offer(alone, delta("a", 0, 0, c_steps=1), unit(1000.0)) == ACCEPTED
    assert alone.close(T1).clipped == []


def test_quarantine_measures_norm_per_step() -> None:
    state = FragmentState(0, f32(W0), *params(quarantine_window=5), published_s=T0)
    honest_round(state, 0)
    state.close(T1)
    # 40x the norm, but over 40 steps: 1.0 per step, an ordinary delta.
    assert offer(state, delta("slow", 0, 1, c_steps=40), unit(40.0)) == ACCEPTED
    # 40x the norm in 2 steps: 20 per step, more than 10x the median.
    assert offer(state, delta("fast", 0, 1, c_steps=2), unit(40.0)) == ACCEPTED
    assert state.close(T1).clipped == [("fast", 0, 0)]


def test_the_bar_is_the_last_w_merged_deltas_once_there_are_w() -> None:
    """With W merged deltas of 1 per step, a round of five at 30 (everyone grew at
    once, a rare jump) is clipped to 10; those clipped deltas enter the window at
    10, so the bar follows a real change within a window (no deadlock)."""
    state = FragmentState(0, f32(W0), *params(quarantine_window=5), published_s=T0)
    honest_round(state, 0)
    state.close(T1)
    honest_round(state, 1, scale=30.0)
    assert len(state.close(T1).clipped) == 5
    assert list(state.admission.norm_sizes.values) == pytest.approx([10.0] * 5)
    honest_round(state, 2, scale=30.0)
    assert state.close(T1).clipped == []  # the bar is 100 now


def test_a_median_of_zero_sets_no_bar() -> None:
    state = FragmentState(0, f32(W0), *params(quorum=1, quarantine_window=2), published_s=T0)
    for seq in (0, 1):
        assert offer(state, delta("a", seq, state.version), np.zeros(N)) == ACCEPTED
        state.close(T1)
    assert offer(state, delta("a", 2, state.version), unit(1.0)) == ACCEPTED
    assert state.close(T1).clipped == []


def test_a_single_bad_learner_stays_quarantined() -> None:
    """One bad learner among six supplies too few samples to move the median."""
    refuse = params(quorum=5, quarantine_action="refuse")
    state = FragmentState(0, f32(W0), *refuse, published_s=T0)
    for seq in range(15):  # 90 offers: the 16-delta window turns over
        version = state.version
        for i in range(5):
            status = offer(state, delta(f"l{i}", seq, version, c_steps=1), unit(1.0))
            assert status == ACCEPTED
        assert offer(state, delta("bad", seq, version, c_steps=1), unit(100.0)) == ACCEPTED
        result = state.close(T1)
        assert result.learners == [f"l{i}" for i in range(5)]
        assert result.refused == [("bad", 0, seq)]
    assert "bad" not in state.applied


# -- figures a delta reports ---------------------------------------------------
@pytest.mark.parametrize(
    ("c_steps", "c_tokens", "incarnation", "step_s", "reason"),
    [
        (65, 100, 0, None, "too_many_steps"),  # above the floor, no pace known
        (64, 100, 0, None, ACCEPTED),  # the floor
        # 10 s after publication at 1 s per step: 64 + 2 * 10 = 84 steps at most.
        (84, 100, 0, 1.0, ACCEPTED),
        (85, 100, 0, 1.0, "too_many_steps"),
        (4, 4_000, 0, None, ACCEPTED),  # 1000 tokens per step
        (4, 4_001, 0, None, "too_many_tokens"),
        (4, 100, int((T0 + 10 + 60) * 1e9), None, ACCEPTED),  # 60 s ahead: the skew
        (4, 100, int((T0 + 10 + 61) * 1e9), None, "future_incarnation"),
    ],
)
def test_reported_figures_are_bounded(
    c_steps: int, c_tokens: int, incarnation: int, step_s: float | None, reason: str
) -> None:
    state = FragmentState(0, f32(W0), *params(), published_s=T0)
    d = delta("a", 0, 0, c_tokens=c_tokens, c_steps=c_steps, incarnation=incarnation)
    assert offer(state, d, np.zeros(N), wall_s=T0 + 10, step_s=step_s) == reason


def test_the_step_bound_runs_from_each_versions_publication() -> None:
    """A delta on an older version may cover more steps than one on the newest."""
    state = FragmentState(0, f32(W0), *params(quorum=1), published_s=T0)
    assert offer(state, delta("a", 0, 0), np.zeros(N)) == ACCEPTED
    state.close(T0 + 100)  # version 1, published at T0 + 100
    arrive = T0 + 110
    # On v0: 64 + 2 * 110 = 284 steps; on v1: 64 + 2 * 10 = 84.
    assert offer(state, delta("b", 0, 1, c_steps=85), np.zeros(N), wall_s=arrive, step_s=1.0) == (
        "too_many_steps"
    )
    assert offer(state, delta("b", 1, 0, c_steps=284), np.zeros(N), wall_s=arrive, step_s=1.0) == (
        ACCEPTED
    )


# -- radial aggregation --------------------------------------------------------
def test_radial_aggregation_matches_numpy() -> None:
    state = FragmentState(0, f32(W0), *params(aggregation="radial"), published_s=T0)
    offer_round1(state)
    state.close(T1)
    total = sum(r["w"] for r in ROUND1.values())
    direction = np.zeros(N)
    radius = 0.0
    for r in ROUND1.values():
        g = np.array(r["delta"])
        p = r["w"] / total
        direction += p * g / np.linalg.norm(g)
        radius += p * np.linalg.norm(g)
    merged = direction / np.linalg.norm(direction) * radius
    expected = W0 - LR * (1 + MU) * merged
    np.testing.assert_allclose(np64(state.weights), expected, rtol=0, atol=2e-6)
    # Radial keeps the mean magnitude; the plain mean of these is shorter.
    plain, _ = expected_round1(W0)
    assert np.linalg.norm(W0 - expected) > np.linalg.norm(W0 - plain)


# -- round timing --------------------------------------------------------------
def test_should_close_follows_quorum_and_round_done_resets() -> None:
    state = FragmentState(0, f32(W0), *params(quorum=2), published_s=T0)
    live = {"a", "b", "c"}
    offer(state, delta("a", 0, 0), np.zeros(N), now=10.0)
    assert not state.round.should_close(11.0, live, step_s=1.0, known=0, quorum=2)
    assert state.round.close_at(1.0, quorum=2) is None
    offer(state, delta("b", 0, 0), np.zeros(N), now=12.0)
    # Quorum at t=12. No step time yet: no grace window. With 1 s steps and no
    # history: 0.5 * max(0, 2 * 1.0 - 0) = 1 s after quorum.
    assert state.round.close_at(None, quorum=2) == 12.0
    assert state.round.close_at(1.0, quorum=2) == 13.0
    assert not state.round.should_close(12.5, {"a", "b", "c"}, step_s=1.0, known=0, quorum=2)
    assert state.round.should_close(
        12.5, {"a", "b"}, step_s=1.0, known=0, quorum=2
    )  # every live one reported
    assert state.round.should_close(12.0, live, step_s=None, known=0, quorum=2)
    state.close(T1)
    state.round_done(sync_s=0.1, quorum=2)
    assert state.round.opened_at is None and state.round.reporters == set()
    assert not state.round.should_close(100.0, live, step_s=1.0, known=0, quorum=2)


# -- checkpoint state ----------------------------------------------------------
def two_rounds(codec: str) -> FragmentState:
    state = FragmentState(0, f32(W0), *params(codec=codec), published_s=T0)
    offer_round1(state)
    state.close(T1)
    assert offer(state, delta("a", 2, 0, incarnation=1), np.full(N, 0.1)) == ACCEPTED
    assert offer(state, delta("b", 2, 1), np.full(N, -0.2)) == ACCEPTED
    state.close(T1)
    return state


def assert_same_state(a: FragmentState, b: FragmentState) -> None:
    assert a.version == b.version
    assert a.versions.kept == b.versions.kept
    assert torch.equal(a.weights, b.weights)
    for v in a.versions.kept[:-1]:  # the older ones, by their shifts to the current one
        sa, sb = a.versions.shift(v)[0], b.versions.shift(v)[0]
        assert sa is not None and sb is not None and torch.equal(sa, sb)
    assert a.momentum is not None and b.momentum is not None
    assert torch.equal(a.momentum, b.momentum)
    assert a.snapshot.payload == b.snapshot.payload
    assert a.applied == b.applied
    assert a.published_at == b.published_at
    assert list(a.admission.norm_sizes.values) == list(b.admission.norm_sizes.values)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_state_load_round_trip(codec: str) -> None:
    state = two_rounds(codec)
    tensors, meta = state.state()
    assert meta["version"] == 2
    fresh = FragmentState(0, torch.zeros(N), *params(codec=codec), published_s=T0)
    fresh.load(tensors, meta)
    assert_same_state(state, fresh)
    assert fresh.applied == {"a": (1, 2), "b": (0, 2), "c": (0, 1)}
    # Both continue identically, and the restored one still refuses replays.
    assert offer(fresh, delta("b", 2, 1), np.full(N, -0.2)) == DUPLICATE
    for s in (state, fresh):
        assert offer(s, delta("c", 2, 1), np.linspace(-1, 1, N)) == ACCEPTED
        s.close(T1)
    assert_same_state(state, fresh)


def test_state_survives_the_checkpoint_files(tmp_path: Path) -> None:
    state = two_rounds("int8")
    save_fragment(tmp_path, 0, *state.state())
    loaded = load_fragment(tmp_path, 0)
    assert loaded is not None
    fresh = FragmentState(0, torch.zeros(N), *params(codec="int8"), published_s=T0)
    fresh.load(*loaded)
    assert_same_state(state, fresh)


def test_load_without_momentum() -> None:
    state = FragmentState(0, f32(W0), *params(), version=3, published_s=T0)
    fresh = FragmentState(0, torch.zeros(N), *params(), published_s=T0)
    fresh.load(*state.state())
    assert fresh.version == 3 and fresh.momentum is None
    assert torch.equal(fresh.weights, f32(W0))


def test_load_refuses_tensors_of_another_size() -> None:
    other = FragmentState(0, torch.zeros(N - 2), *params(), published_s=T0)
    fresh = FragmentState(0, torch.zeros(N), *params(), published_s=T0)
    with pytest.raises(ValueError, match="plan needs"):
        fresh.load(*other.state())
    assert fresh.version == 0 and torch.equal(fresh.weights, torch.zeros(N))


def test_load_refuses_versions_that_do_not_end_at_the_recorded_one() -> None:
    tensors, meta = two_rounds("fp32").state()
    fresh = FragmentState(0, torch.zeros(N), *params(), published_s=T0)
    with pytest.raises(ValueError, match="do not end at"):
        fresh.load(tensors, {**meta, "version": 5})
    with pytest.raises(ValueError, match="do not end at"):
        fresh.load({}, meta)


def test_load_refuses_momentum_of_another_size() -> None:
    tensors, meta = two_rounds("fp32").state()
    tensors["momentum"] = torch.zeros(N + 3)
    fresh = FragmentState(0, torch.zeros(N), *params(), published_s=T0)
    with pytest.raises(ValueError):
        fresh.load(tensors, meta)


def test_a_restart_under_another_codec_publishes_the_version_it_had_as_weights() -> None:
    state = two_rounds("fp32")
    fresh = FragmentState(0, torch.zeros(N), *params(codec="int8"), published_s=T0)
    fresh.load(*state.state())
    assert fresh.version == state.version and torch.equal(fresh.weights, state.weights)
    assert not fresh.publication.is_change
    assert fresh.publication.payload == state.weights.numpy().tobytes()
    # The next version is a change from it under the new codec.
    assert offer(fresh, delta("c", 2, 1), np.linspace(-1, 1, N)) == ACCEPTED
    previous = fresh.weights
    fresh.close(T1)
    assert fresh.publication.is_change
    change = Codec.parse("int8").decode(fresh.publication.payload, N)
    assert torch.equal(apply_change(previous, change), fresh.weights)


def test_tokens_already_merged_are_not_counted_again() -> None:
    """A learner merged up to step 10 flushes progress covering steps (6, 13]:
    only steps 11-13 are new, at its 10 tokens per step."""
    state = FragmentState(0, f32(W0), *params(quorum=1), published_s=T0)
    d = np.full(N, 0.01)
    assert offer(state, delta("a", 1, 0, c_tokens=40, c_steps=4, step=10), d) == ACCEPTED
    assert state.close(T1).tokens == 40
    assert offer(state, delta("a", 2, 0, c_tokens=70, c_steps=7, step=13), d) == ACCEPTED
    assert state.close(T1).tokens == 30
    # Another learner's first delta counts in full.
    assert offer(state, delta("b", 1, 1, c_tokens=50, c_steps=5, step=5), d) == ACCEPTED
    assert state.close(T1).tokens == 50


def test_deltas_on_different_bases_are_both_merged() -> None:
    """A learner's late delta on v0 and its next one on v1 carry different progress
    (it overwrote its weights in between): neither supersedes the other."""
    plain = params(quorum=1, outer_lr=1.0, outer_momentum=0.0)
    state = FragmentState(0, f32(W0), *plain, published_s=T0)
    d = np.full(N, 0.1)
    assert offer(state, delta("b", 1, 0), d) == ACCEPTED
    state.close(T1)  # v1, without a's delta
    assert offer(state, delta("a", 1, 0), d) == ACCEPTED
    assert offer(state, delta("a", 2, 1), d) == ACCEPTED
    result = state.close(T1)
    assert result.included == 2 and result.keys == [("a", 0, 1), ("a", 0, 2)]


def test_lossy_downlink_keeps_the_outer_optimizer_in_fp32() -> None:
    """With int8 globals, the master follows the fp32 Nesterov trajectory of the
    outer gradients taken against the master, from the learners' exact weights
    (base as decoded, minus the delta), and what is published is the previous
    version plus the int8 image of the change."""
    rng = np.random.default_rng(1)
    w0 = rng.normal(0, 0.02, N)
    lr, mu = 0.7, 0.9
    state = FragmentState(
        0, f32(w0), *params(quorum=1, outer_lr=lr, outer_momentum=mu, codec="int8"), published_s=T0
    )
    master = np64(f32(w0))
    buf = None
    codec = state.codec
    for k in range(1, 6):
        previous = state.weights  # the global the learner holds, as decoded
        base = np64(previous)
        d = rng.normal(0, 1e-3, N)
        assert offer(state, delta("a", k, state.version, step=k, c_steps=1), d) == ACCEPTED
        state.close(T1)
        g = master - (base - d)  # against the master, from the weights learners hold
        buf = g if buf is None else mu * buf + g
        master = master - lr * (g + mu * buf)
        np.testing.assert_allclose(np64(state.master), master, atol=1e-6)
        change = codec.decode(codec.encode(state.master - previous, fit_scales=True), N)
        assert torch.equal(state.weights, apply_change(previous, change))


@pytest.mark.parametrize("codec", ["int2+zstd", "int8"])
def test_a_full_state_and_the_logged_rounds_after_it_restore_the_fragment(codec: str) -> None:
    """syncer/checkpoint.py: a full state, then each later round's published
    change and small state. Replayed, they give the versions learners built,
    bit for bit, and the de-duplication state of the last round; the master
    is the version (its lead is not logged), the momentum the full state's."""
    state = FragmentState(0, f32(W0), *params(quorum=1, codec=codec), published_s=T0)
    gen = np.random.default_rng(0)
    full = None
    records = []
    for seq in range(1, 7):
        d = delta("a", seq, state.version, step=4 * seq)
        assert offer(state, d, gen.normal(0, 0.1, N)) == ACCEPTED
        state.close(T1 + seq)
        tensors, meta = state.state()
        if seq == 2:
            full = ({k: v.clone() for k, v in tensors.items()}, meta)
        elif seq > 2:
            records.append((state.version, bytes(state.publication.payload), meta))
    assert full is not None
    fresh = FragmentState(0, torch.zeros(N), *params(quorum=1, codec=codec), published_s=T0)
    fresh.load(*full)
    momentum = fresh.momentum
    # A record not newer than the full state (a crash between its rename and
    # the log's removal) is skipped.
    fresh.replay([(2, b"not a change", {}), *records])
    assert fresh.version == state.version == 6
    assert torch.equal(fresh.weights, state.weights)
    assert fresh.versions.kept == state.versions.kept
    for v in state.versions.kept[:-1]:
        shift, expected = fresh.versions.shift(v)[0], state.versions.shift(v)[0]
        assert shift is not None and expected is not None and torch.equal(shift, expected)
    assert fresh.applied == state.applied == {"a": (0, 6)}
    assert fresh.published_at == state.published_at
    assert torch.equal(fresh.master, fresh.weights) and fresh.momentum is momentum
    assert not fresh.publication.is_change  # after a restart it goes out whole
    # It goes on: a replayed delta is a duplicate, the next one is merged.
    assert offer(fresh, delta("a", 6, 5, step=24), np.zeros(N)) == DUPLICATE
    assert offer(fresh, delta("a", 7, 6, step=28), gen.normal(0, 0.1, N)) == ACCEPTED
    assert fresh.close(T1 + 10).version == 7


def test_a_replay_onto_a_state_without_momentum_estimates_it_from_the_last_change() -> None:
    """The first full state of a run, or of a rebuilt fragment, holds no
    momentum: replayed rounds then leave it estimated from the last logged
    change (``-change / lr``, syncer.outer.momentum_from_change), not zero."""
    codec = Codec.parse("int8")
    state = FragmentState(0, f32(W0), *params(quorum=1, codec="int8"), published_s=T0)
    full = state.state()
    gen = np.random.default_rng(1)
    records = []
    for seq in range(1, 4):
        assert (
            offer(state, delta("a", seq, state.version, step=4 * seq), gen.normal(0, 0.1, N))
            == ACCEPTED
        )
        state.close(T1 + seq)
        records.append((state.version, bytes(state.publication.payload), state.meta()))
    fresh = FragmentState(0, torch.zeros(N), *params(quorum=1, codec="int8"), published_s=T0)
    fresh.load({k: v.clone() for k, v in full[0].items()}, full[1])
    assert fresh.momentum is None
    fresh.replay(records)
    assert fresh.momentum is not None
    torch.testing.assert_close(fresh.momentum, -codec.decode(records[-1][1], N) / LR)


def test_a_logged_round_that_does_not_follow_is_refused() -> None:
    state = two_rounds("int8")
    tensors, meta = state.state()
    with pytest.raises(ConfigError, match="does not follow"):
        state.replay([(state.version + 2, b"", meta)])


def test_a_fragment_rebuilt_from_its_latest_version_takes_the_momentum_of_its_change(
    tmp_path: Path,
) -> None:
    """A syncer that lost its checkpoint rebuilds a fragment from the latest
    version found and the state published with it; the change that made that
    version (kept by learners) gives the momentum back as the last update,
    ``-change / lr`` (syncer.outer.momentum_from_change), not zero."""
    from types import SimpleNamespace

    from broker.fragments import FragmentPlan, ParamSpec
    from broker.transport import ResumePoint
    from broker.wire.messages import GlobalFragment
    from syncer.recovery import rebuild_from_broker

    outer, run = params(codec="int8")
    lost = FragmentState(0, f32(W0), outer, run, published_s=T0)
    offer_round1(lost)
    lost.close(T1)
    codec = Codec.parse("int8")
    header = dict(run_id="r", fragment=0, plan_hash="p", epoch=0, version=1, numel=N)
    change = GlobalFragment(
        **header, change_from=0, codec=codec, payload=bytes(lost.publication.payload)
    )
    latest = GlobalFragment(**header, codec=Codec(), payload=Codec().encode(lost.weights))
    resume = msgpack.packb(lost.meta(), use_bin_type=True)
    found = {0: ResumePoint(latest, resume, change)}
    broker = SimpleNamespace(resume_points=lambda owned, held, wait_s: found)
    plan = FragmentPlan.build([ParamSpec("w", (N,), "float32")], 1)
    states: dict[int, FragmentState] = {}

    def new_state(p: int, weights: torch.Tensor) -> FragmentState:
        return FragmentState(p, weights, outer, run, 1, published_s=T1)

    rebuilt = rebuild_from_broker(broker, states, [0], plan, tmp_path, 4.0, LR, new_state)  # type: ignore[arg-type]
    assert rebuilt == [0] and states[0].version == 1
    assert torch.equal(states[0].weights, lost.weights)
    step = codec.decode(lost.publication.payload, N)
    assert states[0].momentum is not None
    torch.testing.assert_close(states[0].momentum, -step / LR)
    # Without the change (a learner that joined on this version's snapshot): zero.
    found[0] = ResumePoint(latest, resume)
    states.clear()
    rebuild_from_broker(broker, states, [0], plan, tmp_path, 4.0, LR, new_state)  # type: ignore[arg-type]
    assert states[0].momentum is None
