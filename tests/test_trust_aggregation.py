"""The robust aggregators (coordinate-wise median and trimmed mean) against numpy,
and wired into a fragment's round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker.wire.codecs import Codec
from broker.wire.messages import Delta
from syncer.aggregation import coordinate_median, trimmed_mean
from syncer.fragment_state import ACCEPTED, FragmentState
from syncer.trust import ReportLimits
from tests.syncer_settings import syncer_settings

torch.set_num_threads(1)


def grads_of(rows: np.ndarray) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


def np_trimmed(rows: np.ndarray, trim: int) -> np.ndarray:
    n = rows.shape[0]
    if n <= 2 * trim:
        return np.median(rows, axis=0)
    return np.sort(rows, axis=0)[trim : n - trim].mean(axis=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coordinate_median_matches_numpy(n: int, seed: int) -> None:
    rows = np.random.default_rng(seed).normal(0, 1, (n, 33)).astype(np.float32)
    got = coordinate_median(grads_of(rows)).numpy()
    np.testing.assert_allclose(got, np.median(rows.astype(np.float64), axis=0), atol=1e-6)


@pytest.mark.parametrize(("n", "trim"), [(1, 1), (2, 1), (3, 1), (5, 1), (5, 2), (8, 3), (4, 0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_trimmed_mean_matches_numpy(n: int, trim: int, seed: int) -> None:
    rows = np.random.default_rng(seed).normal(0, 1, (n, 33)).astype(np.float32)
    got = trimmed_mean(grads_of(rows), trim).numpy()
    np.testing.assert_allclose(got, np_trimmed(rows.astype(np.float64), trim), atol=1e-6)


def test_by_hand() -> None:
    rows = np.array([[1.0, -5.0], [2.0, 0.0], [3.0, 1.0], [1000.0, 2.0], [-7.0, 3.0]])
    assert coordinate_median(grads_of(rows)).tolist() == [2.0, 1.0]
    # Drop one high and one low value per coordinate: (1 + 2 + 3) / 3, (0 + 1 + 2) / 3.
    assert trimmed_mean(grads_of(rows), 1).tolist() == pytest.approx([2.0, 1.0])
    # Even count: the mean of the middle two, as numpy.
    assert coordinate_median(grads_of(rows[:4])).tolist() == [2.5, 0.5]


def test_a_minority_cannot_drag_any_coordinate_past_the_honest_ones() -> None:
    honest = np.random.default_rng(3).normal(0, 1, (5, 16))
    bad = np.full((2, 16), 1e30)
    rows = np.concatenate([honest, bad])
    lo, hi = honest.min(axis=0), honest.max(axis=0)
    for merged in (coordinate_median(grads_of(rows)), trimmed_mean(grads_of(rows), 2)):
        m = merged.numpy()
        assert np.all((m >= lo - 1e-6) & (m <= hi + 1e-6))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        coordinate_median([])
    with pytest.raises(ValueError):
        trimmed_mean([torch.zeros(2)], -1)


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "coordinate_median"])
def test_a_round_merged_robustly_ignores_weights(aggregation: str) -> None:
    """Robust aggregators take each learner's outer gradient once, whatever its
    token-step weight: lr 1 and no momentum publish W0 minus the robust merge."""
    w0 = np.linspace(-1.0, 1.0, 6)
    params = syncer_settings(
        quorum=3,
        grace_gamma=0.5,
        overlap=2,
        staleness=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        aggregation=aggregation,
        codec=Codec.parse("fp32"),
        limits=ReportLimits(step_floor=64, max_tokens_per_step=10**6, max_clock_skew_s=60.0),
        weight_clip=3.0,
        quarantine_factor=1e9,  # isolate the aggregator from the quarantine
        quarantine_window=16,
        quarantine_action="clip",
        trim_per_side=1,
    )
    state = FragmentState(0, torch.tensor(w0, dtype=torch.float32), *params, published_s=0.0)
    rows = np.array(
        [
            [0.1, 0.2, 0.3, -0.1, 0.0, 0.5],
            [0.2, -0.1, 0.3, 0.0, 0.1, 0.4],
            [0.0, 0.1, 0.2, -0.2, 0.1, 0.6],
            [9.0, -9.0, 9.0, 9.0, -9.0, 9.0],
        ]
    )
    for i, (row, tokens) in enumerate(zip(rows, (10, 20, 30, 10**6), strict=True)):
        d = Delta(learner_id=f"l{i}", seq=1, c_steps=4, c_tokens=tokens, numel=6)
        t = torch.tensor(row, dtype=torch.float32)
        assert state.offer(d, t, None, 0.0, wall_s=10.0, step_s=None) == ACCEPTED
    state.close(20.0)
    expected = np_trimmed(rows, 1) if aggregation == "trimmed_mean" else np.median(rows, axis=0)
    np.testing.assert_allclose(state.weights.double().numpy(), w0 - expected, atol=1e-6)
