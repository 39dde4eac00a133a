"""Pure aggregation math of the syncer: rebasing, weighting, merging.

A learner reports ``delta = Theta(base) - theta_m`` against the global version
it started from. The syncer rebuilds ``theta_m = Theta(base) - delta`` and takes
the outer gradient against the *current* global, so a learner that is a
version or two behind contributes exactly what it would have contributed by
sending its weights: here ``shift_m + delta_m``, the shift of its base to the
current version; the merge adds the master's lead over that version
(docs/design.md, rule 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from broker.errors import ConfigError, TrustError

# Below this magnitude the sum of two fp32 values cannot overflow.
SAFE_MAGNITUDE = torch.finfo(torch.float32).max / 2


class StaleDelta(TrustError):
    """A delta whose base version is no longer (or not yet) kept."""


def max_abs(x: torch.Tensor) -> float:
    """The largest magnitude in ``x``; inf when any value is not finite. One pass, no copy."""
    if x.numel() == 0:
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return math.inf
    return max(-lo, hi)


def magnitude_below(norm: float, x: torch.Tensor) -> float:
    """What :func:`max_abs` says of ``x`` wherever it is compared (inf or not, at
    least ``SAFE_MAGNITUDE`` or not), from ``norm`` = ``l2_norm(x)`` when that
    can tell: the norm itself, or else ``max_abs(x)``.

    No value's magnitude is above the norm (up to rounding), and one that is
    not finite makes the norm not finite; so a norm below ``SAFE_MAGNITUDE / 2``
    settles both questions, and saves a pass over ``x``."""
    return norm if norm < SAFE_MAGNITUDE / 2 else max_abs(x)


def l2_norm(x: torch.Tensor) -> float:
    """The L2 norm, in fp32 unless that overflows (then in float64)."""
    norm = float(torch.linalg.vector_norm(x))
    if math.isinf(norm):
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    return norm


def token_step_weight(c_tokens: int, c_steps: int) -> float:
    """w = c_tokens * (c_tokens / c_steps): more tokens, and bigger batches, count more."""
    if c_tokens <= 0 or c_steps <= 0:
        return 0.0
    return c_tokens * (c_tokens / c_steps)


def _normalised(weights: Sequence[float], n: int) -> torch.Tensor:
    if len(weights) != n or n == 0:
        raise ConfigError(f"need one weight per gradient, got {len(weights)} for {n}")
    w = torch.tensor(weights, dtype=torch.float64)
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ConfigError(f"weights must be finite, non-negative, not all zero: {weights}")
    return w / w.sum()


def weighted_mean(grads: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum(w_m g_m) / sum(w_m), accumulated in fp32."""
    w = _normalised(weights, len(grads))
    out = torch.zeros_like(grads[0], dtype=torch.float32)
    for g, wi in zip(grads, w.tolist(), strict=True):
        out.add_(g.to(torch.float32), alpha=wi)
    return out


def rebased_weighted_mean(
    deltas: Sequence[torch.Tensor],
    shifts: Sequence[torch.Tensor | None],
    weights: Sequence[float],
) -> torch.Tensor:
    """``weighted_mean`` of ``shift_m + delta_m`` without forming any of them:
    sum(w_m delta_m) plus, once per distinct shift tensor (deltas on one base
    share it), the sum of its deltas' weights times it. A shift of None is
    zero: the delta's base is the version the gradient is taken against."""
    return accumulate_rebased(deltas, shifts, normalised_weights(weights, len(deltas)))


def normalised_weights(weights: Sequence[float], n: int) -> list[float]:
    """The weights divided by their sum (ValueError for unusable weights)."""
    return _normalised(weights, n).tolist()


def accumulate_rebased(
    deltas: Sequence[torch.Tensor],
    shifts: Sequence[torch.Tensor | None],
    fractions: Sequence[float],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum of ``fraction_m (shift_m + delta_m)`` (:func:`rebased_weighted_mean`
    with its weights already normalised), into ``out`` if given.

    Elementwise, so a slice of every input gives that slice of the result, bit
    for bit: the syncer merges a fragment chunk by chunk."""
    first = deltas[0].to(torch.float32)
    out = torch.mul(first, fractions[0]) if out is None else torch.mul(first, fractions[0], out=out)
    on_shift: dict[int, tuple[torch.Tensor | None, float]] = {}
    for i, (delta, shift, wi) in enumerate(zip(deltas, shifts, fractions, strict=True)):
        if i:
            out.add_(delta, alpha=wi)
        _, total = on_shift.get(id(shift), (shift, 0.0))
        on_shift[id(shift)] = (shift, total + wi)
    for shift, total in on_shift.values():
        if shift is None:
            # Adding total x (+0.0), which is what a zero shift tensor adds: it
            # only turns -0.0 into +0.0 (total >= 0).
            out.add_(0.0)
        else:
            out.add_(shift, alpha=total)
    return out


def radial_directional_mean(
    grads: Sequence[torch.Tensor], weights: Sequence[float], eps: float = 1e-12
) -> torch.Tensor:
    """Mean of the norms times the direction of the mean of unit vectors.

    Unlike the plain mean, disagreeing directions do not shrink the step: the
    magnitude is the (weighted) average magnitude of the learners' updates.
    """
    w = _normalised(weights, len(grads))
    norms = [float(g.to(torch.float32).norm()) for g in grads]
    direction = torch.zeros_like(grads[0], dtype=torch.float32)
    radius = 0.0
    for g, n, wi in zip(grads, norms, w.tolist(), strict=True):
        if n > eps:
            direction.add_(g.to(torch.float32), alpha=wi / n)
        radius += wi * n
    dnorm = float(direction.norm())
    # direction is a convex mix of unit vectors (norm <= 1) summed in fp32, so
    # when they cancel the rounding leaves ~1e-8, which must not be blown up
    # to a full-size step in a noise direction.
    if dnorm <= max(eps, 1e-6):
        return torch.zeros_like(direction)
    return direction * (radius / dnorm)


# -- robust aggregators, for learners that are not all trusted ------------------
# Both ignore the token-step weights: in an untrusted setup the counters they
# come from are the attacker's to choose. Each coordinate is taken on its own,
# so up to ``trim`` (trimmed mean) or fewer than half (median) of the learners
# can send anything at all without dragging any coordinate past the honest ones.
def _sorted_stack(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    if not grads:
        raise ConfigError("need at least one gradient")
    return torch.stack([g.to(torch.float32) for g in grads]).sort(dim=0).values


def coordinate_median(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per coordinate, the median of the learners' values (the mean of the middle
    two for an even count, as numpy's median)."""
    ordered = _sorted_stack(grads)
    n = ordered.shape[0]
    if n % 2:
        return ordered[n // 2].clone()
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(grads: Sequence[torch.Tensor], trim: int) -> torch.Tensor:
    """Per coordinate, the mean after dropping the ``trim`` highest and lowest values.

    With too few learners to drop that many from both ends (n <= 2 trim) it is
    the coordinate-wise median, the limit of trimming.
    """
    if trim < 0:
        raise ConfigError(f"trim must be >= 0, got {trim}")
    n = len(grads)
    if n <= 2 * trim:
        return coordinate_median(grads)
    return _sorted_stack(grads)[trim : n - trim].mean(dim=0)
