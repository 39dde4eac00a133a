"""Aggregation math against hand numbers and numpy re-implementations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from syncer.aggregation import (
    radial_directional_mean,
    rebased_weighted_mean,
    token_step_weight,
    weighted_mean,
)

torch.set_num_threads(1)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# -- rebasing ------------------------------------------------------------------
# -- weights -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("c_tokens", "c_steps", "w"),
    [
        (1000, 4, 250_000.0),  # 1000 * (1000 / 4)
        (512, 1, 262_144.0),
        (300, 3, 30_000.0),
        (10, 4, 25.0),
        (0, 4, 0.0),
        (100, 0, 0.0),
        (-5, 2, 0.0),
    ],
)
def test_token_step_weight_by_hand(c_tokens: int, c_steps: int, w: float) -> None:
    assert token_step_weight(c_tokens, c_steps) == w


def test_weight_favours_bigger_batches_at_equal_tokens() -> None:
    # Same tokens in fewer steps means bigger batches: weight grows with 1/c_steps.
    assert token_step_weight(4096, 2) == 2 * token_step_weight(4096, 4)


# -- weighted mean -------------------------------------------------------------
def test_weighted_mean_by_hand() -> None:
    out = weighted_mean([t(1, 0), t(0, 1), t(4, 4)], [1.0, 1.0, 2.0])
    # (1*(1,0) + 1*(0,1) + 2*(4,4)) / 4 = (9/4, 9/4)
    assert out.tolist() == [2.25, 2.25]
    assert out.dtype == torch.float32


@pytest.mark.parametrize("m", [1, 2, 5])
def test_weighted_mean_matches_numpy(m: int) -> None:
    rng = np.random.default_rng(m)
    grads = [rng.standard_normal(513).astype(np.float32) for _ in range(m)]
    weights = list(rng.uniform(0.1, 1e6, m))
    out = weighted_mean([torch.from_numpy(g) for g in grads], weights)
    ref = np.average(np.stack(grads).astype(np.float64), axis=0, weights=weights)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3, 6])
def test_rebased_weighted_mean_is_the_weighted_mean_of_the_outer_gradients(m: int) -> None:
    """Deltas on two bases: one shift tensor per base, shared, as the syncer passes them."""
    rng = np.random.default_rng(m)
    current = rng.standard_normal(257).astype(np.float32)
    bases = [rng.standard_normal(257).astype(np.float32) for _ in range(2)]
    shifts = [torch.from_numpy(current) - torch.from_numpy(b) for b in bases]
    deltas = [rng.standard_normal(257).astype(np.float32) for _ in range(m)]
    on = [i % 2 for i in range(m)]
    weights = list(rng.uniform(0.1, 1e3, m))
    out = rebased_weighted_mean(
        [torch.from_numpy(d) for d in deltas], [shifts[b] for b in on], weights
    )
    grads = [current.astype(np.float64) - (bases[b] - d) for d, b in zip(deltas, on, strict=True)]
    ref = np.average(np.stack(grads), axis=0, weights=weights)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_weighted_mean_zero_weight_ignored_and_bf16_input() -> None:
    out = weighted_mean([t(1, 2), t(100, 100)], [3.0, 0.0])
    assert out.tolist() == [1.0, 2.0]
    out = weighted_mean([t(1, 2).to(torch.bfloat16), t(3, 4)], [1.0, 1.0])
    assert out.dtype == torch.float32 and out.tolist() == [2.0, 3.0]


BAD_WEIGHTS = [
    [],
    [1.0],  # one weight for two grads
    [1.0, 2.0, 3.0],
    [0.0, 0.0],
    [1.0, -0.5],
    [1.0, float("nan")],
    [1.0, float("inf")],
]


@pytest.mark.parametrize("weights", BAD_WEIGHTS)
def test_bad_weights_raise(weights: list[float]) -> None:
    grads = [t(1, 2), t(3, 4)]
    with pytest.raises(ValueError):
        weighted_mean(grads, weights)
    with pytest.raises(ValueError):
        radial_directional_mean(grads, weights)


def test_no_grads_raise() -> None:
    with pytest.raises(ValueError):
        weighted_mean([], [])
    with pytest.raises(ValueError):
        radial_directional_mean([], [])


# -- radial-directional mean ---------------------------------------------------
def numpy_radial(grads: list[np.ndarray], weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    g64 = [g.astype(np.float64) for g in grads]
    norms = np.array([np.linalg.norm(g) for g in g64])
    radius = float(np.dot(w, norms))
    direction = sum(wi * g / n for wi, g, n in zip(w, g64, norms, strict=True))
    return radius * direction / np.linalg.norm(direction)


def test_radial_by_hand() -> None:
    # Unit directions (1,0) and (0,1), norms 2 and 4, equal weights:
    # radius 3, direction (1,1)/sqrt(2) -> (3/sqrt 2, 3/sqrt 2).
    out = radial_directional_mean([t(2, 0), t(0, 4)], [1.0, 1.0])
    expected = 3 / math.sqrt(2)
    torch.testing.assert_close(out, t(expected, expected))
    # The plain mean of the same is (1, 2), norm sqrt 5 < 3: radial keeps the size.
    assert float(out.norm()) == pytest.approx(3.0)


@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_radial_norm_and_direction_match_numpy(m: int) -> None:
    rng = np.random.default_rng(100 + m)
    grads = [(rng.standard_normal(300) * rng.uniform(0.1, 10)).astype(np.float32) for _ in range(m)]
    weights = list(rng.uniform(0.5, 5.0, m))
    out = radial_directional_mean([torch.from_numpy(g) for g in grads], weights).numpy()
    w = np.asarray(weights) / np.sum(weights)
    norms = np.array([np.linalg.norm(g.astype(np.float64)) for g in grads])
    # Norm = weighted mean of the norms.
    assert np.linalg.norm(out) == pytest.approx(float(np.dot(w, norms)), rel=1e-5)
    # Direction = normalised weighted mean of the unit vectors.
    units = sum(wi * g.astype(np.float64) / n for wi, g, n in zip(w, grads, norms, strict=True))
    np.testing.assert_allclose(
        out / np.linalg.norm(out), units / np.linalg.norm(units), rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(out, numpy_radial(grads, weights), rtol=1e-4, atol=1e-6)


def test_radial_of_identical_inputs_is_that_input() -> None:
    g = torch.from_numpy(np.random.default_rng(3).standard_normal(257).astype(np.float32))
    out = radial_directional_mean([g, g.clone(), g.clone()], [1.0, 5.0, 0.25])
    torch.testing.assert_close(out, g, rtol=1e-5, atol=1e-6)
    out = radial_directional_mean([g], [2.0])
    torch.testing.assert_close(out, g, rtol=1e-5, atol=1e-6)


def test_radial_scale_invariance_of_direction() -> None:
    # Scaling one learner's update changes the radius, not the direction.
    a, b = t(1, 0, 0), t(0, 1, 0)
    out1 = radial_directional_mean([a, b], [1.0, 1.0])
    out2 = radial_directional_mean([a, 10 * b], [1.0, 1.0])
    torch.testing.assert_close(out1 / out1.norm(), out2 / out2.norm())
    assert float(out2.norm()) == pytest.approx(5.5)


def test_radial_degenerate_cases() -> None:
    # Opposite directions cancel: no direction, a zero step.
    assert radial_directional_mean([t(1, 0), t(-3, 0)], [1.0, 1.0]).tolist() == [0.0, 0.0]
    # All-zero updates give zero.
    assert radial_directional_mean([t(0, 0), t(0, 0)], [1.0, 1.0]).tolist() == [0.0, 0.0]
    # A zero update has no direction but its norm (0) still counts in the radius.
    out = radial_directional_mean([t(0, 0), t(0, 4)], [1.0, 1.0])
    torch.testing.assert_close(out, t(0, 2))
