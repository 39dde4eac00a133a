"""Local child processes: a restart goes on in the warm spare, with the environment
the launcher holds at the restart (a data-parallel group's new rendezvous port)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from compose.processes import STANDBY_ENV, Proc

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
