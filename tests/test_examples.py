"""The examples and a user workload, run as a user would, each with a small budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.redis.server import RedisServer
from compose.processes import free_port_pair

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, *args: str) -> dict[str, object]:
    # PYTHONPATH: the examples import the checkout under test, whatever is installed.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(300)
def test_plain_loop_example_learns_over_zeromq() -> None:
    url = f"zmq://127.0.0.1:{free_port_pair()}"
    result = run_example("plain_loop.py", "--steps", "200", "--url", url)
    # "after" is the global model's loss: only merged deltas can have lowered it.
    assert result["after"] < 0.25 * result["before"], result  # type: ignore[operator]
    # More than one round per fragment. How many more is a race: the example's
    # learners run 200 steps of a toy in well under a second, so on a busy machine
    # later deltas of a learner supersede its earlier ones before the syncer merges
    # them (a CI run merged 6 rounds, an idle one 17-29).
    assert min(result["versions"]) >= 2  # type: ignore[type-var, arg-type]


@pytest.mark.timeout(300)
def test_transformers_example_learns_over_redis(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        result = run_example("hf_causal_lm.py", "--steps", "80", "--url", server.url)
    finally:
        server.stop()
    assert result["tied"] is True
    assert result["after"] < result["before"] - 1.5, result  # type: ignore[operator]
    assert min(result["versions"]) >= 5  # type: ignore[type-var, arg-type]


@pytest.mark.timeout(300)
def test_ddiloco_local_trains_a_user_workload(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, "-m", "compose.cli", "local",
            "--workload", "tests.workloads:regression",
            "--learners", "2", "--steps", "120", "--fragments", "2", "--sync-every", "8",
            # The toy's steps outrun a round trip to the syncer (as in
            # examples/plain_loop.py): rounds of one delta, not the default 2 of 2.
            "--quorum", "1",
            "--eval-every-s", "2", "--no-progress", "--out", str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_eval_loss"] < 0.25 * summary["initial_eval_loss"], summary
    assert summary["deltas_applied"] >= 10
    # Only staleness may refuse a delta in a healthy run (a learner slowed by a
    # loaded machine), and rarely.
    assert set(summary["rejected_by_reason"]) <= {"stale"}
    assert summary["deltas_rejected"] <= 0.1 * summary["deltas_applied"]


@pytest.mark.timeout(300)
def test_ddiloco_local_starts_from_the_initial_model_it_is_given(tmp_path: Path) -> None:
    """`ddiloco local --initial-model FILE` trains from FILE (a `ddiloco init` output
    or a pretrained model) instead of writing a fresh one over it."""
    initial = tmp_path / "given.safetensors"
    common = ["--workload", "tests.workloads:regression", "--fragments", "2",
              "--sync-every", "8", "--initial-model", str(initial)]  # fmt: skip
    cli = [sys.executable, "-m", "compose.cli"]
    init = subprocess.run([*cli, "init", *common], cwd=ROOT, capture_output=True, text=True)
    assert init.returncode == 0, init.stderr[-3000:]
    written = initial.stat().st_mtime_ns
    out = tmp_path / "run"
    local = [*cli, "local", *common, "--learners", "2", "--steps", "16", "--no-progress"]
    proc = subprocess.run([*local, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert initial.stat().st_mtime_ns == written  # used, not overwritten
    assert not (out / "initial-model.safetensors").exists()
    started = json.loads((out / "launcher.jsonl").read_text().splitlines()[0])
    assert started["config"]["initial_model"] == str(initial)
    # A file that is not there: one clear line, before anything starts.
    elsewhere = [str(tmp_path / "nope.safetensors") if a == str(initial) else a for a in local]
    missing = subprocess.run(
        [*elsewhere, "--out", str(tmp_path / "run2")], cwd=ROOT, capture_output=True, text=True
    )
    assert missing.returncode != 0
    assert "no such file; write it with `ddiloco init`" in missing.stderr
