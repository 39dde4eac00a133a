"""Compute added to a running job: two learners that start a third of the way in,
against four from the start and two throughout.

    python -m benchmarks.newcomers [--smoke] [--out benchmarks/results/newcomers]
                                   [-- extra ddiloco local arguments]

Three ``ddiloco local`` runs of decoupled at the defaults, seed 0, 300 steps
per learner: ``all`` (M = 4 from the start), ``first`` (M = 2 throughout: the
learners that start at once) and ``joining`` (M = 4, learners 2 and 3 started by ``--join-at-step
0,0,100,100`` once a running learner has logged step 100; they enroll as any
learner does, and the syncer's quorum follows the learners it hears). Per
newcomer: seconds from its process start to the first round that merged one of
its deltas; the newcomers' share of the merged tokens; each run's final
held-out loss and its loss curve against seconds and against tokens, in one
plot. Held-out losses come from copies of the model taken every
``EVAL_EVERY_S`` seconds and evaluated after training (``--eval-deferred``).

``--smoke`` (CI): M = 2 (one newcomer at step 4 of 12) against 2 from the
start and 1 throughout, a tiny model. Each finished run is kept
(``run-<name>.json``) and not repeated unless a setting changed. Writes
``newcomers-<mode>.json`` and ``newcomers-<mode>.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.local_run import local_run
from benchmarks.quality import TINY
from broker.errors import MeasurementError
from compose.report import eval_curve_seconds
from compose.reporter import read_jsonl

MODES: dict[str, dict[str, Any]] = {
    "smoke": {"learners": 2, "steps": 12, "join_at": [0, 4], "extra": TINY},
    "full": {"learners": 4, "steps": 300, "join_at": [0, 0, 100, 100], "extra": []},
}
EVAL_EVERY_S = 4.0


def run_once(out: Path, mode: dict[str, Any], name: str, extra: list[str]) -> dict[str, Any]:
    """``all`` (every learner from the start), ``first`` (only those that start at
    once) or ``joining`` (the newcomers late), or its stored result."""
    join_at = mode["join_at"]
    learners = sum(1 for s in join_at if s == 0) if name == "first" else len(join_at)
    args = [
        "--learners", str(learners), "--steps", str(mode["steps"]), "--seed", "0",
        "--eval-every-s", str(EVAL_EVERY_S), "--eval-deferred", *mode["extra"], *extra,
    ]  # fmt: skip
    if name == "joining":
        args += ["--join-at-step", ",".join(map(str, join_at))]

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        events = read_jsonl(folder / "metrics.jsonl")
        merged = summary["merged_by_learner"]
        late = [f"learner-{i}" for i, step in enumerate(join_at) if step]
        newcomers = late if name == "joining" else []
        if newcomers:  # the launcher kept them back until the step was reached
            due = min(e["t"] for e in events if e["event"] == "step" and e["step"] >= max(join_at))
        for n in newcomers:
            began = next(e["t"] for e in events if e.get("process") == n)
            if began < due:
                raise MeasurementError(f"{folder}: {n} started before step {max(join_at)}")
        total = sum(v["merged_tokens"] for v in merged.values())
        return {
            "name": name,
            "learners": learners,
            "final_eval_loss": summary["final_eval_loss"],
            "wall_s": summary["wall_s"],
            "tokens": summary["tokens_total"],
            "merged_tokens": total,
            "merged_by_learner": merged,
            "newcomers": {
                n: {
                    "first_merge_s": merged.get(n, {}).get("first_merge_s"),
                    "merged_tokens": merged.get(n, {}).get("merged_tokens", 0.0),
                }
                for n in newcomers
            },
            "newcomers_share_of_merged_tokens": (
                sum(merged.get(n, {}).get("merged_tokens", 0.0) for n in newcomers) / total
                if newcomers and total
                else None
            ),
            "curve_tokens": summary["eval_curve"],
            "curve_seconds": eval_curve_seconds(events),
        }

    return local_run(out / f"run-{name}.json", args, describe)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CI: M=2, tiny model, 12 steps")
    ap.add_argument(
        "--out",
        default="benchmarks/results/newcomers",
        help="a folder: the summary JSON and PNG go in it, and each finished run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    ap.add_argument("extra", nargs="*", help="arguments passed to every ddiloco local run")
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else "full"
    mode = MODES[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    runs = {r: run_once(out, mode, r, args.extra) for r in ("all", "first", "joining")}
    joining = runs["joining"]
    result: dict[str, Any] = {
        "benchmark": "newcomers",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"]), "extra": args.extra, "seed": 0},
        "newcomers": joining["newcomers"],
        "newcomers_share_of_merged_tokens": joining["newcomers_share_of_merged_tokens"],
        "final_eval_loss": {r: run["final_eval_loss"] for r, run in runs.items()},
        "wall_s": {r: run["wall_s"] for r, run in runs.items()},
        "runs": list(runs.values()),
    }
    (out.parent / f"newcomers-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.parent / f"newcomers-{name}.png")
    shown = ("newcomers", "newcomers_share_of_merged_tokens", "final_eval_loss", "wall_s")
    print(json.dumps({k: result[k] for k in shown}, indent=2))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    join_at = result["settings"]["join_at"]
    first = sum(1 for step in join_at if step == 0)
    labels = {
        "all": f"{len(join_at)} from the start",
        "first": f"{first} throughout",
        "joining": f"{first} + {len(join_at) - first} joining at step {max(join_at)}",
    }
    for run in result["runs"]:
        for ax, key in ((by_time, "curve_seconds"), (by_tokens, "curve_tokens")):
            points = [(x, y) for x, y in run[key] if x is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=labels[run["name"]])
    joined = [c["first_merge_s"] for c in result["newcomers"].values() if c["first_merge_s"]]
    by_time.set_xlabel("seconds from the learners' start")
    by_tokens.set_xlabel("tokens trained (all learners)")
    for ax in (by_time, by_tokens):
        ax.set_ylabel("held-out loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    if joined:
        by_time.set_title(f"newcomers' first merged delta {min(joined):.1f} s after their start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
