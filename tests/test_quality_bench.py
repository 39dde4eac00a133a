"""The quality benchmark's statistics (its runs are checked by .ci/run's --smoke)."""

from __future__ import annotations

import math

import pytest

from benchmarks.quality import relative_gaps


def test_relative_gaps_pair_seeds_and_give_the_standard_error() -> None:
    decoupled = {0: 2.02, 1: 1.98, 2: 2.10}
    reference = {0: 2.00, 1: 2.00, 2: 2.00, 3: 1.90}  # seed 3 has no pair: left out
    gaps = relative_gaps(decoupled, reference)
    assert gaps["per_seed"] == pytest.approx([0.01, -0.01, 0.05])
    assert gaps["mean"] == pytest.approx(0.05 / 3)
    mean = 0.05 / 3
    spread = math.sqrt(sum((g - mean) ** 2 for g in (0.01, -0.01, 0.05)) / 2)
    assert gaps["stderr"] == pytest.approx(spread / math.sqrt(3))


def test_one_seed_has_no_standard_error() -> None:
    gaps = relative_gaps({0: 2.2}, {0: 2.0})
    assert gaps["mean"] == pytest.approx(0.1) and gaps["stderr"] is None
