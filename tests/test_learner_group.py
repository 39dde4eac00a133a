"""A learner that is itself a torch.distributed group: torchrun, 2 ranks, gloo on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from broker.redis.server import free_port
from compose.processes import free_port_pair
from tests.servers import run_keys

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
MODEL = [
    "--model-d-model",
    "64",
    "--model-n-layer",
    "2",
    "--model-n-head",
    "2",
    "--model-seq-len",
    "64",
]
RUN = [
    "--keys",
    run_keys(),
    "--fragments",
    "2",
    "--sync-every",
    "4",
    "--run-id",
    "grp",
    "--learners",
    "1",
]


@pytest.mark.timeout(300)
def test_two_rank_learner_group_trains_through_rank_zero(tmp_path: Path) -> None:
    url = f"zmq://127.0.0.1:{free_port_pair()}"
    # The syncer knows no model: it takes the run settings and the initial model file.
    shared = [*RUN, "--url", url, "--initial-model", str(tmp_path / "initial.safetensors")]
    init = [sys.executable, "-m", "compose.cli", "init", *MODEL, *shared]
    subprocess.run(init, cwd=ROOT, check=True, capture_output=True, timeout=120)
    syncer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "compose.cli",
            "syncer",
            *shared,
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--metrics-file",
            str(tmp_path / "syncer.jsonl"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert syncer.stdout is not None
        assert syncer.stdout.readline().strip() == b"ready"
        group = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                "-m",
                "compose.cli",
                "learner",
                *MODEL,
                *shared,
                "--learner-id",
                "group-0",
                "--steps",
                "24",
                "--metrics-file",
                str(tmp_path / "group.jsonl"),
                "--log-every",
                "4",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        assert group.returncode == 0, group.stderr[-3000:]
        results = [json.loads(line) for line in group.stdout.splitlines() if line.startswith("{")]
        assert len(results) == 2  # one per rank
        assert all(r["ranks"] == 2 and r["ranks_consistent"] for r in results)
        # Rank 0 spoke for the group: tokens count both ranks' batches.
        assert all(r["tokens"] == 24 * 16 * 64 * 2 for r in results)
    finally:
        syncer.terminate()
        syncer.wait(timeout=60)
    rounds = [json.loads(line) for line in (tmp_path / "syncer.jsonl").read_text().splitlines()]
    merged = [e for e in rounds if e["event"] == "round"]
    assert merged and all(e["learners"] == ["group-0"] for e in merged)
