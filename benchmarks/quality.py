"""Like-for-like quality: decoupled vs synchronous DiLoCo vs data parallel.

    python -m benchmarks.quality [--steps 300] [--out benchmarks/results/quality]

Runs ``ddiloco local`` once per mode on the same model, data, seed and token
budget (M learners x steps x batch), then writes ``quality.json`` (each run's
summary plus the gaps) and ``quality.png`` (held-out loss against tokens).
Extra arguments after ``--`` go to every run, e.g. ``-- --outer-lr 1.0``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_mode(mode: str, out: Path, steps: int, extra: list[str]) -> dict[str, Any]:
    folder = out / mode
    cmd = [
        sys.executable,
        "-m",
        "compose.cli",
        "local",
        "--mode",
        mode,
        "--steps",
        str(steps),
        "--out",
        str(folder),
        "--no-progress",
        *extra,
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    summary: dict[str, Any] = json.loads((folder / "summary.json").read_text())
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--modes", default="decoupled,diloco,ddp")
    ap.add_argument("--out", default="benchmarks/results/quality")
    ap.add_argument("extra", nargs="*", help="arguments passed to every ddiloco local run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {mode: run_mode(mode, out, args.steps, args.extra) for mode in args.modes.split(",")}
    result: dict[str, Any] = {
        "benchmark": "quality",
        "steps": args.steps,
        "extra": args.extra,
        "final_eval_loss": {m: r["final_eval_loss"] for m, r in runs.items()},
        "runs": runs,
    }
    losses = result["final_eval_loss"]
    if "decoupled" in losses and "diloco" in losses:
        result["decoupling_cost"] = losses["decoupled"] / losses["diloco"] - 1
    if "decoupled" in losses and "ddp" in losses:
        result["gap_to_ddp"] = losses["decoupled"] / losses["ddp"] - 1
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(runs, out / "quality.png")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
    return 0


def _plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, r in runs.items():
        curve = [(t, loss) for t, loss in r["eval_curve"] if t is not None]
        ax.plot([t for t, _ in curve], [loss for _, loss in curve], marker="o", ms=3, label=mode)
    ax.set_xlabel("tokens trained (all learners)")
    ax.set_ylabel("held-out loss")
    ax.set_ylim(top=4.0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
