"""Local child processes: a restart goes on in the warm spare, with the environment
the launcher holds at the restart (a data-parallel group's new rendezvous port)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from compose.local import LocalRun, uninterrupted
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


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except OSError:
        return False


def _start_local(out: Path) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """``ddiloco local`` of a tiny model that trains on until stopped, once every
    process of it is up: the launcher and its children's pids."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "compose.cli", "local", "--no-progress", "--learners", "2",
         "--steps", "100000", "--model-d-model", "16", "--model-n-layer", "1",
         "--model-seq-len", "16", "--insecure", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            pids = json.loads((out / "processes.json").read_text())
        except (OSError, ValueError):
            pids = {}
        if len(pids) >= 4:  # syncer, evaluator, 2 learners
            return launcher, pids
        time.sleep(0.5)
    launcher.kill()
    raise AssertionError("the run's processes did not all start")


@pytest.mark.timeout(180)
def test_a_launcher_killed_outright_leaves_no_process_running(tmp_path: Path) -> None:
    """The launcher SIGKILLed (no handler runs): the kernel sends its children
    SIGTERM (broker.runtime.stop_with_launcher), and nothing of the run is left."""
    launcher, pids = _start_local(tmp_path / "run")
    try:
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.2)
        left = {name: pid for name, pid in pids.items() if _alive(pid)}
        assert not left, f"still running after the launcher: {left}"
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_sigterm_or_ctrl_c_does_not_cut_the_launchers_stop_short() -> None:
    """While the launcher stops its services (``uninterrupted``), SIGTERM and
    SIGINT change nothing; its handlers are back after."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with uninterrupted():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # delivered here, if not ignored: the test would end
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_local_syncer_asks_learners_for_the_run_only_when_restarted(tmp_path: Path) -> None:
    """Its first start comes before any learner's, so nobody holds a global to take
    back and waiting for claims would only delay the run; a restarted syncer (a chaos
    kill that lost its folder) asks them, as a user's syncer does."""
    from compose.local import LocalConfig
    from syncer.config import SyncerConfig

    run = LocalRun(LocalConfig(out=str(tmp_path / "run")))

    def recall_s(args: list[str]) -> float:
        if "--recall-s" not in args:
            return SyncerConfig.recall_s
        return float(args[args.index("--recall-s") + 1])

    assert recall_s(run.syncer_proc(first_start=True).args) == 0.0
    assert recall_s(run.syncer_proc().args) == SyncerConfig.recall_s > 0
