"""benchmarks.goodput --smoke end to end: both systems, the same kill, the JSON and
the plot; a second call reuses the finished runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import goodput


@pytest.mark.timeout(600)
def test_smoke_writes_the_json_and_the_plot_and_resumes(tmp_path: Path) -> None:
    assert goodput.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "goodput-smoke.json").read_text())
    assert (tmp_path / "goodput-smoke.png").stat().st_size > 0
    kill = {"at_s": goodput.MODES["smoke"]["kill_at_s"], "process": "learner-0"}
    assert result["kills"]["per_seed"]["0"]["schedule"] == [kill]
    for system in ("decoupled", "elastic_dp"):
        figures = result[system]
        assert result["kills"][system] == figures["kills"] == 1
        assert set(figures["lost"]) == {*goodput.LOSS_CAUSES, "other"}
        assert figures["goodput"] + sum(figures["lost"].values()) == pytest.approx(1, abs=0.01)
        assert 0 < figures["uptime"] <= 1
        assert figures["restart_to_train_s"]["count"] >= 1
    stored = tmp_path / "smoke" / "run-seed0-elastic_dp.json"
    written = stored.stat().st_mtime_ns
    assert goodput.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert stored.stat().st_mtime_ns == written
