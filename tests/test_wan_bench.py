"""The WAN benchmark's arithmetic: step times, where a curve reaches the target,
and the figures per rate (its runs, with real throttled links, are checked by
.ci/run's --smoke)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.compute_floor import measure
from benchmarks.quality import TINY
from benchmarks.wan import first_reach, step_time, summarise
from broker.errors import MeasurementError


def test_first_reach_interpolates_between_points() -> None:
    curve = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0), (30.0, 1.5)]
    assert first_reach(curve, 2.5) == pytest.approx(15.0)
    assert first_reach(curve, 3.0) == pytest.approx(10.0)
    assert first_reach(curve, 6.0) == 0.0  # already there at the start
    assert first_reach(curve, 1.0) is None  # never
    # The first time it gets there, not a later dip.
    assert first_reach([(0, 5.0), (10, 2.0), (20, 3.0), (30, 1.0)], 2.0) == pytest.approx(10)


def test_step_time_skips_the_warm_up_and_averages_the_learners(tmp_path: Path) -> None:
    learners = tmp_path / "learners"
    learners.mkdir()
    for name, seconds in (("learner-0", 1.0), ("learner-1", 3.0)):
        events = [{"event": "start", "t": 0.0, "step": 0}]
        # Slow first steps (imports, first syncs) must not count.
        events += [{"event": "step", "step": s, "t": 100.0 + s * seconds} for s in (5, 10)]
        events += [{"event": "step", "step": s, "t": 200.0 + s * seconds} for s in (15, 20, 50)]
        (learners / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    seconds, span = step_time(tmp_path, warmup=12)
    assert seconds == pytest.approx(2.0) and span == 35


def run(system: str, rate: int | None, loss: float, nbytes: int, **over: Any) -> dict[str, Any]:
    return {
        "system": system, "rate_mbit": rate, "final_eval_loss": loss, "bytes": nbytes,
        "wall_s": 100.0, "seconds_per_step": 0.5, "timed_steps": 35,
        "curve_steps": [(0, 5.0), (100, 3.0), (300, loss)],
        "curve_seconds": [(0, 5.0), (50, 3.0), (150, loss)],
    } | over  # fmt: skip


def test_figures_per_rate() -> None:
    free = {
        "ddp": run("ddp", None, 1.8, 6_000_000_000),
        "diloco": run("diloco", None, 2.0, 700_000_000),
        "decoupled": run("decoupled", None, 1.9, 60_000_000),
    }
    slow = {
        "ddp": run("ddp", 10, 9.9, 999, seconds_per_step=5.0),
        "diloco": run("diloco", 10, 9.9, 999, seconds_per_step=1.0),
        "decoupled": run("decoupled", 10, 2.0, 50_000_000,
                         curve_seconds=[(0, 5.0), (100, 2.5), (200, 2.0)]),
    }  # fmt: skip
    floor = {"seconds_per_step_together": 0.4}
    result = summarise(free, {10: slow}, floor)
    assert result["target_loss"] == 2.0  # the worst final loss unthrottled
    unthrottled, at10 = result["rates"]
    assert unthrottled["rate_mbit"] is None and at10["rate_mbit"] == 10
    # ddp: steps to 2.0 unthrottled (curve 3.0 at 100, 1.8 at 300: 2.0 at 266.7)
    # times the throttled step time; its loss is the unthrottled run's.
    ddp = at10["modes"]["ddp"]
    assert ddp["time_to_target_s"] == pytest.approx(5.0 * (100 + 200 * 1.0 / 1.2))
    assert ddp["final_eval_loss"] == 1.8 and ddp["bytes"] is None
    assert "unthrottled x seconds per step over 35 steps at this rate" in ddp["time_method"]
    # decoupled: off its own throttled curve.
    decoupled = at10["modes"]["decoupled"]
    assert decoupled["time_to_target_s"] == pytest.approx(200.0)
    assert at10["speedup_vs_ddp"] == pytest.approx(ddp["time_to_target_s"] / 200.0)
    assert at10["bytes_ratio_vs_ddp"] == pytest.approx(6e9 / 5e7)
    assert at10["eval_loss_gap"] == pytest.approx(2.0 / 2.0 - 1)
    assert at10["eval_loss_gap_vs_ddp"] == pytest.approx(2.0 / 1.8 - 1)
    assert unthrottled["bytes_ratio_vs_ddp"] == pytest.approx(100.0)
    assert unthrottled["eval_loss_gap"] == pytest.approx(1.9 / 2.0 - 1)
    # decoupled's 0.5 s a step against bare loops' 0.4 on the same host.
    assert at10["decoupled_step_over_floor"] == pytest.approx(0.5 / 0.4)
    assert result["compute_floor"] is floor


def test_a_run_that_never_reaches_the_target_has_no_speedup() -> None:
    free = {
        "ddp": run("ddp", None, 1.8, 6_000),
        "diloco": run("diloco", None, 2.0, 700),
        "decoupled": run("decoupled", None, 1.9, 60),
    }
    slow = dict(free) | {"decoupled": run("decoupled", 10, 2.4, 50, curve_seconds=[(0, 5.0)])}
    at10 = summarise(free, {10: slow}, {"seconds_per_step_together": 0.4})["rates"][1]
    assert at10["modes"]["decoupled"]["time_to_target_s"] is None
    assert at10["speedup_vs_ddp"] is None


def test_compute_floor_times_real_bare_loops_alone_and_together() -> None:
    """Real processes, each building the workload as a learner does."""
    tiny = [*TINY, "--batch-size", "4"]
    floor = measure(learners=2, steps=3, extra=tiny)
    assert floor["learners"] == 2 and floor["timed_steps"] == 3
    assert len(floor["seconds_per_step_together_each"]) == 2
    assert floor["seconds_per_step_alone"] > 0
    assert floor["seconds_per_step_together"] == pytest.approx(
        sum(floor["seconds_per_step_together_each"]) / 2
    )


def test_compute_floor_names_a_bad_setting() -> None:
    with pytest.raises(MeasurementError, match="exited with"):
        measure(learners=1, steps=1, extra=["--model-d-model", "0"])
