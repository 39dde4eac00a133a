"""Local child processes: a restart goes on in the warm spare, with the environment
the launcher holds at the restart (a data-parallel group's new rendezvous port)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from compose.local import LocalRun
from compose.processes import Proc, Supervisor
from learner.startup import STANDBY_ENV

# What ``ddiloco learner`` does as a spare, in a few lines: wait for the line, go on.
SCRIPT = f"""
import json, os, sys, time
if os.environ.get({STANDBY_ENV!r}):
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    os.environ.update(json.loads(line))
print(os.environ["PORT"], flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_restart_goes_on_in_the_warm_spare(tmp_path: Path) -> None:
    proc = Proc("w", [sys.executable, "-c", SCRIPT], tmp_path / "w.log", env={"PORT": "1"})
    proc.warm_spare = True
    events: list[dict[str, Any]] = []
    try:
        proc.start(events)
        assert events[-1]["warm"] is False and proc.spare is not None
        assert proc.popen is not None and proc.popen.stdout is not None
        assert proc.popen.stdout.readline().strip() == b"1"
        spare = proc.spare.pid
        proc.kill(events, "chaos")
        proc.env["PORT"] = "2"
        proc.start(events)
        assert events[-1]["warm"] is True and proc.popen.pid == spare
        assert proc.popen.stdout.readline().strip() == b"2"
        assert proc.spare is not None and proc.spare.pid != spare  # the next one
    finally:
        proc.kill(events, "shutdown")
        proc.close_spare()
        proc.close_files()


@pytest.mark.timeout(60)
def test_without_a_live_spare_a_restart_starts_fresh(tmp_path: Path) -> None:
    proc = Proc("w", [sys.executable, "-c", SCRIPT], tmp_path / "w.log", env={"PORT": "3"})
    proc.warm_spare = True
    events: list[dict[str, Any]] = []
    try:
        proc.start(events)
        proc.close_spare()  # gone, as if it had died
        proc.kill(events, "chaos")
        proc.start(events)
        assert events[-1]["warm"] is False
        assert proc.popen is not None and proc.popen.stdout is not None
        assert proc.popen.stdout.readline().strip() == b"3"
    finally:
        proc.kill(events, "shutdown")
        proc.close_spare()
        proc.close_files()


@pytest.mark.timeout(60)
def test_a_rank_that_dies_while_its_group_is_stopped_is_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elastic data parallel: a rank is killed, and the launcher stops the others.
    One of them saw its killed peer's socket close and exited with an error while
    the launcher was still stopping another rank; it was taken for a crash, which
    ends a data-parallel run (a goodput run failed so)."""
    peer_gone = tmp_path / "peer-gone"
    # A rank that exits with an error once its peer is gone, as gloo makes it.
    failing = (
        f"import os, sys, time\nwhile not os.path.exists({str(peer_gone)!r}): time.sleep(0.01)"
        "\nsys.exit(2)"
    )
    sleeping = "import time; time.sleep(120)"
    ranks = [
        Proc(f"learner-{i}", [sys.executable, "-c", code], tmp_path / f"{i}.log")
        for i, code in enumerate((sleeping, sleeping, failing))
    ]
    events: list[dict[str, Any]] = []
    try:
        for rank in ranks:
            rank.start(events)
        ranks[0].kill(events, "chaos")
        stop_rank_1 = ranks[1].kill

        def stopping_slowly(events: list[dict[str, Any]], reason: str) -> None:
            peer_gone.touch()
            popen = ranks[2].popen
            assert popen is not None
            popen.wait(timeout=30)  # rank 2 fails while rank 1 is being stopped
            stop_rank_1(events, reason)

        monkeypatch.setattr(ranks[1], "kill", stopping_slowly)
        LocalRun._elastic_restart(SimpleNamespace(learners=ranks, events=events), set())  # type: ignore[arg-type]
        assert ranks[2].popen is not None and ranks[2].popen.returncode == 2
        stopped = [e["process"] for e in events if e.get("reason") == "group_stop"]
        assert sorted(stopped) == ["learner-1", "learner-2"]
        # Not a crash: the supervisor restarts the group instead of ending the run.
        supervisor = Supervisor(ranks, [], events, 0.0, crash_is_fatal=True, console=Console())
        supervisor.check(time.monotonic())
        assert all(rank.crashes == 0 and rank.restart_at is not None for rank in ranks)
    finally:
        for rank in ranks:
            rank.kill(events, "shutdown")
            rank.close_files()
