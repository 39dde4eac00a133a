"""The goodput simulator: closed forms, orderings, determinism, and the --smoke output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks import simulate as sim

YEAR_S = sim.SECONDS_PER_YEAR


def _group(chips: float, policy: sim.GroupPolicy, horizon_s: float, seed: int = 0) -> np.ndarray:
    return sim.simulate_group(chips, policy, YEAR_S, horizon_s, 20, np.random.default_rng(seed))


def _mean_and_stderr(per_window: np.ndarray) -> tuple[float, float]:
    return float(per_window.mean()), float(per_window.std(ddof=1) / math.sqrt(len(per_window)))


def test_no_failures_means_goodput_one() -> None:
    params = sim.Parameters(mtbi_s=math.inf)
    for system in ("dp", "dp_elastic", "M=4"):
        cell = sim.simulate_cell(1_200_000, system, params, 100, 10, seed=0)
        assert cell.goodput == 1.0
        assert cell.stderr == 0.0


def test_renewal_with_fixed_downtime_matches_availability_formula() -> None:
    # Exponential failures (MTBF = MTBI / chips) and a fixed downtime d:
    # availability 1 / (1 + d / MTBF).
    chips, downtime_s = 600_000, 40.0
    policy = sim.GroupPolicy(downtime_s, 0.0, 1.0, 0.0, 0.0)
    mean, stderr = _mean_and_stderr(_group(chips, policy, horizon_s=2e6))
    closed_form = 1 / (1 + downtime_s * chips / YEAR_S)
    assert 0 < stderr < 0.003
    assert abs(mean - closed_form) < 4 * stderr


def test_recovery_window_matches_closed_form() -> None:
    # After each stall, recover_s at half speed unless the next failure comes first:
    # goodput (1 - 0.5 (1 - exp(-rate recover_s))) / (1 + rate stall_s).
    policy = sim.GroupPolicy(25.0, 100.0, 0.5, 0.0, 0.0)
    chips = 1_200_000
    mean, stderr = _mean_and_stderr(_group(chips, policy, horizon_s=2e6))
    assert abs(mean - sim.expected_goodput(chips, policy, YEAR_S)) < 4 * stderr


def test_lost_replicas_cost_their_share_until_replaced() -> None:
    # Little's law: on average rate * replace_s failures are out, each taking
    # lost_chips, so the share lost is lost_chips * replace_s / MTBI at any size.
    policy = sim.GroupPolicy(20.0, 0.0, 1.0, 256.0, 3600.0)
    for chips in (37_500, 600_000):
        mean, stderr = _mean_and_stderr(_group(chips, policy, horizon_s=3e7))
        expected = sim.expected_goodput(chips, policy, YEAR_S)
        assert abs(mean - expected) < 4 * stderr + 0.002, chips


def test_more_learners_never_lower_goodput() -> None:
    params = sim.Parameters()
    for chips in (150_000, 2_400_000):
        previous = None
        for system in ("dp_elastic", "M=2", "M=4", "M=8", "M=16", "M=32", "M=64"):
            cell = sim.simulate_cell(chips, system, params, 2000, 20, seed=0)
            if previous is not None:
                assert cell.goodput >= previous.goodput - 3 * math.hypot(
                    cell.stderr, previous.stderr
                ), (chips, system)
            previous = cell


def test_elastic_data_parallel_beats_restarting() -> None:
    params = sim.Parameters()
    for chips in sim.CHIPS:
        dp = sim.simulate_cell(chips, "dp", params, 2000, 20, seed=1)
        elastic = sim.simulate_cell(chips, "dp_elastic", params, 2000, 20, seed=1)
        assert elastic.goodput > dp.goodput, chips


def test_seeded_runs_are_deterministic() -> None:
    params = sim.Parameters()
    first = sim.simulate_cell(600_000, "M=4", params, 500, 10, seed=7)
    assert sim.simulate_cell(600_000, "M=4", params, 500, 10, seed=7) == first
    assert sim.simulate_cell(600_000, "M=4", params, 500, 10, seed=8) != first


def test_slowest_chip_sets_the_pace() -> None:
    rng = np.random.default_rng(0)
    assert np.all(sim.slowest_chip_speed(1000, 0.0, 10, rng) == 1.0)
    # One chip: the mean chip, on average.
    assert abs(sim.slowest_chip_speed(1, 0.05, 20000, rng).mean() - 1) < 0.002
    # More chips in lockstep, a slower slowest chip; learners keep more of the speed.
    speeds = [sim.speed_factor(2_400_000, s, 0.05, seed=0)[0] for s in ("dp", "M=16", "M=64")]
    assert speeds[0] < speeds[1] < speeds[2] < 1


def test_stored_defaults_are_the_fit() -> None:
    fit = sim.fit_parameters(sim.Parameters())
    assert fit.params == sim.Parameters()
    assert fit.max_abs_error_points < 3


def test_bad_parameters_and_systems_are_rejected() -> None:
    with pytest.raises(ValueError, match="detect_s"):
        sim.Parameters(detect_s=-1)
    with pytest.raises(ValueError, match="recover_throughput"):
        sim.Parameters(recover_throughput=1.5)
    with pytest.raises(ValueError, match="unknown system"):
        sim.system_layout("M=0")


def test_smoke_writes_the_json(tmp_path: Path) -> None:
    assert sim.main(["--smoke", "--out", str(tmp_path), "--seed", "3"]) == 0
    result = json.loads((tmp_path / "simulate.json").read_text())
    assert result["mode"] == "smoke" and result["seed"] == 3
    assert {p["name"] for p in result["parameters"]} == set(sim.SOURCES)
    for p in result["parameters"]:
        assert set(p) == {"name", "value", "unit", "source"} and p["source"]
    assert len(result["cells"]) == 30
    for cell in result["cells"]:
        assert {"chips", "system", "paper", "simulated", "stderr"} <= set(cell)
    assert {(c["chips"], c["system"]) for c in result["cells"]} == {
        (chips, system) for chips in sim.CHIPS for system in sim.PAPER_SYSTEMS
    }
    assert result["max_abs_error_points"] == pytest.approx(
        max(abs(c["simulated"] - c["paper"]) for c in result["cells"]), abs=0.01
    )
    assert isinstance(result["notes"], list)
    assert {c["system"] for c in result["extended"]["cells"]} == {"M=32", "M=64"}
    assert result["extended"]["chip_speed"]
    for name in ("simulate.png", "simulate_extended.png"):
        assert (tmp_path / name).stat().st_size > 0
