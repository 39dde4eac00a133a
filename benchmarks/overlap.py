"""Does syncing slow a learner down? Step rate with sync on and off, in one run.

    python -m benchmarks.overlap [--smoke | --quick] [--out benchmarks/results/overlap]

``ddiloco local --sync-pause-every N`` makes every learner alternate: N steps
with syncing (apply globals, send deltas, all on the comm thread), N steps
without. Both phases run in the same processes, on the same data and the same
contended CPU, so the ratio isolates what syncing costs the training loop.
One JSON per finished run (a rerun skips runs already done), then
``overlap-<mode>.json`` (``steps_per_s_sync``, ``steps_per_s_nosync``,
``ratio``, per run and their mean) and ``overlap-<mode>.png``. Target: ratio >= 0.95.
Runs have the run's keys, as ``ddiloco local`` does by default; ``--insecure``
runs them without (``overlap-<mode>-insecure.json``), for what keys cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.local_run import local_run

# (learners, steps, pause period, seeds, extra flags) per mode.
MODES: dict[str, dict[str, Any]] = {
    "smoke": {
        "learners": 2,
        "steps": 48,
        "pause": 12,
        "seeds": [0],
        "extra": ["--model-d-model", "64", "--model-n-layer", "2", "--model-seq-len", "64"],
    },
    "quick": {"learners": 4, "steps": 144, "pause": 12, "seeds": [0], "extra": []},
    "full": {"learners": 4, "steps": 300, "pause": 12, "seeds": [0, 1, 2], "extra": []},
}


def run_once(out: Path, mode: dict[str, Any], seed: int) -> dict[str, Any]:
    """One run, or its stored result (if run with today's settings)."""
    args = [
        "--learners", str(mode["learners"]), "--steps", str(mode["steps"]),
        "--sync-pause-every", str(mode["pause"]), "--seed", str(seed), *mode["extra"],
    ]  # fmt: skip

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        sync, nosync = summary["steps_per_s_sync_on"], summary["steps_per_s_sync_off"]
        return {
            "seed": seed,
            "steps_per_s_sync": sync,
            "steps_per_s_nosync": nosync,
            "ratio": sync / nosync,
            "learners": mode["learners"],
            "steps": mode["steps"],
            "pause_every": mode["pause"],
        }

    return local_run(out / f"run-seed{seed}.json", args, describe)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: 2 small learners, a minute")
    which.add_argument("--quick", action="store_true", help="4 learners, 144 steps")
    ap.add_argument("--insecure", action="store_true", help="runs without the run's keys")
    ap.add_argument(
        "--out",
        default="benchmarks/results/overlap",
        help="a folder: the summary JSON and PNG go in it, and each finished run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    if args.insecure:
        mode = {**mode, "extra": [*mode["extra"], "--insecure"]}
        name += "-insecure"
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_once(out, mode, seed) for seed in mode["seeds"]]
    result = {
        "benchmark": "overlap",
        "mode": name,
        "steps_per_s_sync": statistics.mean(r["steps_per_s_sync"] for r in runs),
        "steps_per_s_nosync": statistics.mean(r["steps_per_s_nosync"] for r in runs),
        "ratio": statistics.mean(r["ratio"] for r in runs),
        "target_ratio": 0.95,
        "runs": runs,
    }
    # Beside the run folders, which stay out of version control.
    (out.parent / f"overlap-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(runs, out.parent / f"overlap-{name}.png")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = [f"seed {r['seed']}" for r in runs]
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [r["steps_per_s_sync"] for r in runs], 0.4, label="sync on")
    ax.bar([i + 0.2 for i in x], [r["steps_per_s_nosync"] for r in runs], 0.4, label="sync off")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("learner steps/s (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
