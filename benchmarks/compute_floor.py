"""The host's floor for a run's step time: the workload's training step with
nothing else, in one process alone and in M processes at once.

    python -m benchmarks.compute_floor [--learners 4] [--steps 60] [-- ddiloco local arguments]

Each process builds the workload as a learner does (same model, batch, AdamW
settings, gradient clipping, learning-rate schedule, one torch thread) and
trains ``--steps`` steps after a warm-up, with no broker, syncer, evaluator or
communication thread. On a host with fewer cores than learners, M processes
at once share the cores; their step time is the least a run of M learners
can take per step there, whatever its system does. ``benchmarks.wan`` records
it beside its runs' step times. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from broker.cli_config import add_dataclass_args, dataclass_from_args
from broker.errors import MeasurementError
from compose.local import LocalConfig
from learner.worker import inner_optimizer, inner_step, lr_at
from learner.workload import WorkloadContext, load_workload

WARMUP_STEPS = 5  # allocations and first-call costs, not timed


def bare_seconds_per_step(extra: list[str], steps: int, shard: int, shards: int) -> float:
    """Seconds per step of the workload's training loop alone in this process."""
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, LocalConfig)
    cfg = dataclass_from_args(LocalConfig, parser.parse_args(extra))
    torch.set_num_threads(1)  # as every learner (ProcessConfig.torch_threads)
    workload = load_workload(
        WorkloadContext(cfg.workload, shard=shard, num_shards=shards, train=cfg.train)
    )
    optimizer = inner_optimizer(workload.model, cfg.train)
    total = WARMUP_STEPS + steps
    for step in range(total):
        if step == WARMUP_STEPS:
            start = time.perf_counter()
        batch = next(workload.batches)
        inner_step(workload, optimizer, batch, cfg.train, lr_at(step, cfg.train, total))
    return (time.perf_counter() - start) / steps


def _processes(count: int, steps: int, extra: list[str]) -> list[float]:
    """Seconds per step of ``count`` bare loops started together."""
    cmds = [
        [sys.executable, "-m", "benchmarks.compute_floor", "--worker", str(i),
         "--learners", str(count), "--steps", str(steps), "--", *extra]
        for i in range(count)
    ]  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for cmd in cmds]
    outputs = [p.communicate()[0] for p in procs]
    for cmd, p in zip(cmds, procs, strict=True):
        if p.returncode:
            raise MeasurementError(f"{' '.join(cmd)} exited with {p.returncode}")
    return [float(out.split()[-1]) for out in outputs]


def measure(learners: int, steps: int, extra: list[str]) -> dict[str, Any]:
    """One bare loop alone, then ``learners`` at once, on the same settings."""
    alone = _processes(1, steps, extra)[0]
    together = _processes(learners, steps, extra)
    return {
        "learners": learners,
        "timed_steps": steps,
        "seconds_per_step_alone": alone,
        "seconds_per_step_together": statistics.mean(together),
        "seconds_per_step_together_each": together,
        "how": "the workload's training step and nothing else (no broker, syncer, "
        "evaluator or communication), one torch thread per process",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--learners", type=int, default=4, help="processes at once")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per process")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="ddiloco local arguments (model, batch, lr)")
    args = ap.parse_args(argv)
    if args.learners < 1 or args.steps < 1:
        ap.error("--learners and --steps must be at least 1")
    if args.worker is not None:  # one of the processes of measure()
        print(bare_seconds_per_step(args.extra, args.steps, args.worker, args.learners))
        return 0
    print(json.dumps(measure(args.learners, args.steps, args.extra), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
