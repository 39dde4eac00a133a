"""ddiloco chaos (its schedule and refusals) and the reporter's reading of chaos
kills; the kills themselves are exercised on real containers (test_cluster.py)
and real processes (test_throttle.py)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from compose import reporter
from compose.chaos_run import ChaosConfig, CrashSchedule
from compose.reporter import ReportConfig, chaos_as_process_events, finished

REPO = Path(__file__).resolve().parents[1]


def test_crashes_are_poisson_seeded_and_hit_running_targets() -> None:
    def decisions(seed: int) -> list[tuple[float, str]]:
        schedule = CrashSchedule(mtbf_s=10.0, seed=seed, start=0.0)
        out = []
        for tick in range(200_000):
            now = tick * 0.1
            victim = schedule.due(now, ["b", "a", "c"])
            if victim:
                out.append((now, victim))
        return out

    first = decisions(1)
    assert first == decisions(1) and first != decisions(2)
    gaps = [b - a for (a, _), (b, _) in zip(first, first[1:], strict=False)]
    assert 9.0 < statistics.mean(gaps) < 11.0  # mean gap = mtbf_s (2,000 crashes)
    counts = {v: sum(1 for _, x in first if x == v) for v in "abc"}
    assert min(counts.values()) > 0.28 * len(first)  # uniform over the targets
    schedule = CrashSchedule(mtbf_s=1.0, seed=0, start=0.0)
    assert schedule.due(1e6, []) is None  # due with nothing up: spent, not queued
    assert schedule.due(1e6, ["a"]) is None


def test_bad_options_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="target"):
        ChaosConfig(target="database")
    with pytest.raises(ValueError, match="mtbf_s"):
        ChaosConfig(mtbf_s=0)


def _chaos(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[dict[str, object]]]:
    proc = subprocess.run(
        [sys.executable, "-m", "compose.cli", "chaos", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def test_refused_clearly_without_an_engine_or_a_target(tmp_path: Path) -> None:
    code, events = _chaos(
        "--duration-s", "1", env={"PATH": "/usr/bin:/bin", "DOCKER_HOST": f"unix://{tmp_path}/no"}
    )
    assert code == 2 and events[0]["event"] == "refused"
    assert "no Docker engine answers" in str(events[0]["reason"])
    code, events = _chaos("--local", str(tmp_path), "--duration-s", "1")
    assert code == 2 and "processes.json" in str(events[0]["reason"])
    (tmp_path / "processes.json").write_text(json.dumps({"learner-0": 2**22 + 7}))
    code, events = _chaos("--local", str(tmp_path), "--duration-s", "1")
    assert code == 2 and "no running learner" in str(events[0]["reason"])


def test_reporter_counts_a_container_kill_as_its_learner_kill() -> None:
    leases = [
        {"t": 1.0, "event": "lease", "learner": "learner-0", "holder": "c0"},
        {"t": 1.0, "event": "lease", "learner": "learner-1", "holder": "c1"},
        {"t": 5.0, "event": "lease", "learner": "learner-2", "holder": "c0"},  # c0 later
    ]
    chaos = [
        {"t": 2.0, "event": "kill", "role": "learner", "hostname": "c1"},
        {"t": 3.0, "event": "restart", "role": "learner", "hostname": "c1", "by": "chaos"},
        {"t": 6.0, "event": "kill", "role": "learner", "hostname": "c0"},
        {"t": 7.0, "event": "kill", "role": "syncer", "hostname": "s"},
        {"t": 8.0, "event": "kill", "role": "learner", "hostname": "unknown"},
    ]
    events = chaos_as_process_events(chaos, leases)
    assert [(e["event"], e["process"]) for e in events] == [
        ("process_kill", "learner-1"),
        ("process_restart", "learner-1"),
        ("process_kill", "learner-2"),
        ("process_kill", "syncer"),
    ]


def test_a_run_is_finished_when_every_learner_is_done() -> None:
    start = {"event": "start", "learner": "learner-0"}
    done = {"event": "done", "learner": "learner-0"}
    assert not finished([]) and not finished([start])
    assert finished([start, done]) and not finished([start, done, dict(start)])


def test_a_stop_during_a_report_gets_one_more_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The syncer's last round lands while a periodic report draws its plots, and
    SIGTERM comes before that report ends: the reporter must report once more,
    or summary.json misses the end of the run."""
    stop = threading.Event()
    calls: list[bool] = []

    def slow_report(cfg: ReportConfig) -> dict[str, object] | None:
        calls.append(stop.is_set())
        stop.set()  # the stop arrives while this report runs
        return None

    monkeypatch.setattr(reporter, "report", slow_report)
    cfg = ReportConfig(out=str(tmp_path), follow=True, every_s=60.0)
    assert reporter.run_report(cfg, stop) == 0
    assert calls == [False, True]  # the one interrupted, then the final one
