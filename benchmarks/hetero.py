"""Learners of mixed speeds: decoupled, synchronous DiLoCo and data parallel with
learners at speeds 1, 1, 1/2 and 1/4, on paired seeds.

    python -m benchmarks.hetero [--smoke | --quick] [--out benchmarks/results/hetero]
                                [--quality-out benchmarks/results/quality]
                                [-- extra ddiloco local arguments]

Every run is ``ddiloco local --slowdown 1,1,2,4``: each learner's step lasts
at least its factor times the fastest compute it has seen (older chips beside
new ones), and every learner runs 300 steps. Systems, on the same model, data,
seed and tokens: ``decoupled`` (the defaults: fast learners do not wait, and
finish first); ``diloco`` (synchronous DiLoCo, fp32 both ways, H = 12: each
round waits for the slowest learner); ``ddp`` (data parallel: each step does).

The target of a seed is the final held-out loss of ``reference``: the same
synchronous DiLoCo with every learner at full speed (``benchmarks.wan``'s
diloco system, unthrottled), which is ``benchmarks.quality``'s reference run:
taken from its folder (``--quality-out``) when it holds it with today's
settings, else run there. Per system and seed the JSON gives the wall
seconds from the learners' start to the target, read off the held-out loss
curve (None: not reached by the end); the tokens the global model merged per
learner; goodput; and the held-out loss at equal tokens (each curve read at the
fewest tokens any system of the seed trained, so a system whose learners
trained more is not credited for it). Held-out losses come from copies of the
model taken every ``EVAL_EVERY_S`` seconds and evaluated after training
(``--eval-deferred``), so evaluating takes no learner's CPU.

Targets: decoupled reaches the target at least ``speedup_vs_diloco`` times
sooner than synchronous DiLoCo, and its loss at equal tokens is within 1% of
synchronous DiLoCo's (mean over seeds), or within two standard errors of the
paired differences.

full: M = 4, 300 steps, seeds 0-2 (9 runs and 3 references); ``--quick``:
seed 0 only; ``--smoke`` (CI): ``benchmarks.quality``'s smoke settings (M = 2,
a tiny model, 20 steps) at speeds 1 and 1/2. Each
finished run is kept (``run-seed<S>-<system>.json``) and not repeated on a
rerun unless a setting it ran with changed. Writes ``hetero-<mode>.json`` and
``hetero-<mode>.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import quality
from benchmarks.local_run import local_run
from benchmarks.quality import SYSTEMS as QUALITY_SYSTEMS
from benchmarks.quality import relative_gaps
from benchmarks.wan import first_reach
from compose.report import eval_curve_seconds
from compose.reporter import read_jsonl

SYSTEMS: dict[str, list[str]] = {
    "decoupled": QUALITY_SYSTEMS["decoupled"],
    "diloco": QUALITY_SYSTEMS["reference"],
    "ddp": QUALITY_SYSTEMS["ddp"],
}
REFERENCE = "reference"  # synchronous DiLoCo at full speed: the target's run
# quality's settings (learners, steps, model), whose reference runs are the targets.
MODES: dict[str, dict[str, Any]] = {
    "smoke": quality.MODES["smoke"] | {"slowdown": "1,2"},
    "quick": quality.MODES["quick"] | {"slowdown": "1,1,2,4"},
    "full": quality.MODES["full"] | {"slowdown": "1,1,2,4", "seeds": [0, 1, 2]},
}
TARGETS = {"speedup_vs_diloco": 2.0, "loss_gap_at_equal_tokens": 0.01}
EVAL_EVERY_S = 4.0  # the evaluator's period: fine enough to time the target


def run_once(
    out: Path, mode: dict[str, Any], system: str, seed: int, extra: list[str]
) -> dict[str, Any]:
    """One run of one system with the mode's slowdown on one seed, or its stored result."""
    args = [
        *SYSTEMS[system], "--learners", str(mode["learners"]), "--steps", str(mode["steps"]),
        "--seed", str(seed), "--eval-every-s", str(EVAL_EVERY_S), "--eval-deferred",
        "--slowdown", mode["slowdown"], *mode["extra"], *extra,
    ]  # fmt: skip

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        if system == "ddp":  # one group: every rank's tokens reach the model every step
            merged = {
                f"learner-{i}": summary["tokens_total"] / mode["learners"]
                for i in range(mode["learners"])
            }
        else:
            merged = {k: v["merged_tokens"] for k, v in summary["merged_by_learner"].items()}
        return {
            "system": system,
            "seed": seed,
            "final_eval_loss": summary["final_eval_loss"],
            "wall_s": summary["wall_s"],
            "tokens": summary["tokens_total"],
            "goodput": summary["goodput"],
            "merged_tokens_by_learner": merged,
            "curve_tokens": summary["eval_curve"],
            "curve_seconds": eval_curve_seconds(read_jsonl(folder / "metrics.jsonl")),
        }

    return local_run(out / f"run-seed{seed}-{system}.json", args, describe)


def loss_at(curve: list[list[float]], x: float) -> float | None:
    """A loss curve ``[(x, loss)]`` read at ``x``, linear between its points; None
    before its first point, its last loss past its end."""
    points = [(a, loss) for a, loss in curve if a is not None]
    if not points or x < points[0][0]:
        return None
    for (x0, l0), (x1, l1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return l0 if x1 == x0 else l0 + (l1 - l0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def summarise(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per system: its figures per seed and their means; decoupled against
    synchronous DiLoCo (time to target, loss at equal tokens)."""
    by = {(r["system"], r["seed"]): r for r in runs}
    per_system: dict[str, Any] = {}
    at_equal: dict[str, dict[int, float]] = {s: {} for s in SYSTEMS}
    for seed in seeds:
        target = by[(REFERENCE, seed)]["final_eval_loss"]  # quality's reference run
        equal_tokens = min(by[(s, seed)]["tokens"] for s in SYSTEMS)
        for system in SYSTEMS:
            run = by[(system, seed)]
            loss = loss_at(run["curve_tokens"], equal_tokens)
            if loss is not None:
                at_equal[system][seed] = loss
            per_system.setdefault(system, {"per_seed": {}})["per_seed"][str(seed)] = {
                "target_loss": target,
                "time_to_target_s": first_reach(run["curve_seconds"], target),
                "wall_s": run["wall_s"],
                "goodput": run["goodput"],
                "merged_tokens_by_learner": run["merged_tokens_by_learner"],
                "equal_tokens": equal_tokens,
                "loss_at_equal_tokens": loss,
                "final_eval_loss": run["final_eval_loss"],
            }
    for figures in per_system.values():
        seeds_done = list(figures["per_seed"].values())
        for key in ("time_to_target_s", "goodput", "loss_at_equal_tokens", "wall_s"):
            values = [s[key] for s in seeds_done if s[key] is not None]
            figures[f"mean_{key}"] = statistics.mean(values) if values else None
        figures["reached_target"] = sum(s["time_to_target_s"] is not None for s in seeds_done)
    speedups = []
    for seed in seeds:
        ours = per_system["decoupled"]["per_seed"][str(seed)]["time_to_target_s"]
        theirs = per_system["diloco"]["per_seed"][str(seed)]["time_to_target_s"]
        if ours and theirs:
            speedups.append(theirs / ours)
    return {
        "systems": per_system,
        "speedup_vs_diloco": {
            "per_seed": speedups,
            "mean": statistics.mean(speedups) if speedups else None,
            "seeds_where_both_reached": len(speedups),
        },
        "loss_gap_at_equal_tokens": relative_gaps(at_equal["decoupled"], at_equal["diloco"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: quality's smoke, speeds 1, 1/2")
    which.add_argument("--quick", action="store_true", help="the full settings, seed 0 only")
    ap.add_argument(
        "--out",
        default="benchmarks/results/hetero",
        help="a folder: the summary JSON and PNG go in it, and each finished run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    quality.add_shared_runs_argument(ap, "the reference runs")
    ap.add_argument("extra", nargs="*", help="arguments passed to every ddiloco local run")
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    reference_out, reference_mode = quality.shared_runs(args.quality_out, name)
    runs = []
    for seed in mode["seeds"]:
        reference = quality.run_once(reference_out, reference_mode, REFERENCE, seed, args.extra)
        runs.append(reference | {"system": REFERENCE})
        runs += [run_once(out, mode, system, seed, args.extra) for system in SYSTEMS]
    result: dict[str, Any] = {
        "benchmark": "hetero",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"]), "extra": args.extra},
        "systems": {s: " ".join(flags) for s, flags in SYSTEMS.items()}
        | {REFERENCE: " ".join(QUALITY_SYSTEMS["reference"]) + " (no slowdown)"},
        **summarise(runs, mode["seeds"]),
        "targets": TARGETS,
        "runs": runs,
    }
    (out.parent / f"hetero-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.parent / f"hetero-{name}.png")
    shown = {
        "mode": name,
        "speedup_vs_diloco": result["speedup_vs_diloco"],
        "loss_gap_at_equal_tokens": result["loss_gap_at_equal_tokens"],
        "systems": {
            s: {k: v for k, v in f.items() if k != "per_seed"} for s, f in result["systems"].items()
        },
    }
    print(json.dumps(shown, indent=2))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, times) = plt.subplots(1, 2, figsize=(11, 4))
    first = result["settings"]["seeds"][0]
    for run in result["runs"]:
        if run["seed"] != first:
            continue
        if run["system"] == REFERENCE:
            curves.axhline(run["final_eval_loss"], color="gray", ls="--", label="target")
            continue
        xs, ys = zip(*run["curve_seconds"], strict=True) if run["curve_seconds"] else ((), ())
        curves.plot(xs, ys, label=run["system"])
    curves.set_xlabel(f"seconds from the learners' start (seed {first})")
    curves.set_ylabel("held-out loss")
    curves.set_yscale("log")
    curves.legend()
    curves.grid(alpha=0.3)
    systems = list(result["systems"])
    means = [result["systems"][s]["mean_time_to_target_s"] or 0 for s in systems]
    times.bar(systems, means)
    times.set_ylabel("s to the target, mean (0: not reached)")
    times.grid(alpha=0.3, axis="y")
    fig.suptitle(f"learners slowed {result['settings']['slowdown']}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
