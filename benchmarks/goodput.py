"""Goodput under real failures: decoupled DiLoCo against elastic data parallel.

    python -m benchmarks.goodput [--smoke | --quick] [--out benchmarks/results/goodput]

Per seed, two ``ddiloco local`` runs back to back on the same settings and the
same seeded kill schedule (``ChaosSchedule``: Poisson kills, mean
``--chaos-mtbf-s`` apart, on the launcher's clock from the run's start; each
draw picks a learner, and a draw that finds its target down is spent): real
processes, real SIGKILLs.

* ``decoupled``: the killed learner restarts after ``--restart-s`` and rejoins
  from the global model; the others train on.
* ``elastic_dp``: ``--mode ddp``, M ranks all-reducing every step; a kill stops
  every rank, and after ``--restart-s`` the group is rebuilt from rank 0's last
  checkpoint (torchrun's elastic restarts). It checkpoints at the same steps
  as a decoupled learner saves its progress.

Both run with ``--warm-spares``: a restart goes on in a spare process whose
imports are done, so it does not wait for Python and torch.

Each run's goodput, uptime and lost goodput by cause come from its events
(``compose.report.goodput_breakdown``): restart delay (what the experiment
sets), process start (process spawned to the learner built: interpreter,
imports, model), join (to its first step), progress lost (steps run again,
progress never merged). Goodput plus the causes plus ``other`` is 1.

One JSON per finished run (a rerun skips runs already done), then
``goodput-<mode>.json`` (``kills``, ``decoupled``, ``elastic_dp``, per-seed
runs) and ``goodput-<mode>.png``. Targets: decoupled goodput >= 0.85, uptime
>= 0.99, above elastic_dp; a restarted learner trains again within 1.5 s of
its process starting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.local_run import local_run
from compose.chaos import ChaosSchedule
from compose.report import LOSS_CAUSES, goodput_breakdown

SYSTEMS = {"decoupled": "decoupled", "elastic_dp": "ddp"}  # name -> ddiloco local --mode
TINY = ["--model-d-model", "64", "--model-n-layer", "2", "--model-seq-len", "64"]
# Per mode: learners, steps, seeds, restart delay, and the kills: Poisson
# (mtbf_s) or, for CI, one scheduled kill of learner-0 (kill_at_s).
MODES: dict[str, dict[str, Any]] = {
    "smoke": {
        "learners": 2, "steps": 100, "seeds": [0], "restart_s": 1.0,
        "mtbf_s": 0.0, "kill_at_s": 4.0, "extra": TINY,
    },
    "quick": {
        "learners": 4, "steps": 300, "seeds": [0], "restart_s": 3.0,
        "mtbf_s": 15.0, "kill_at_s": 0.0, "extra": [],
    },
    "full": {
        "learners": 4, "steps": 300, "seeds": [0, 1, 2], "restart_s": 3.0,
        "mtbf_s": 15.0, "kill_at_s": 0.0, "extra": [],
    },
}  # fmt: skip
TARGETS = {"goodput": 0.85, "uptime": 0.99, "restart_to_train_s": 1.5}


def _arguments(mode: dict[str, Any], system: str, seed: int) -> list[str]:
    args = [
        "--mode", SYSTEMS[system], "--learners", str(mode["learners"]),
        "--steps", str(mode["steps"]), "--seed", str(seed),
        "--restart-s", str(mode["restart_s"]), "--warm-spares", *mode["extra"],
    ]  # fmt: skip
    if mode["mtbf_s"]:
        args += ["--chaos-mtbf-s", str(mode["mtbf_s"])]
    if mode["kill_at_s"]:
        args += ["--kill-learner-at-s", str(mode["kill_at_s"])]
    return args


def run_once(out: Path, mode: dict[str, Any], system: str, seed: int) -> dict[str, Any]:
    """One run of one system, or its stored result (if run with today's settings)."""

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        accounting = goodput_breakdown(events, SYSTEMS[system], fragments=_fragments(events))
        start = next(e["t"] for e in events if e["event"] == "run_start")
        kills = [
            {"at_s": round(e["t"] - start, 2), "process": e["process"]}
            for e in events
            if e["event"] == "process_kill" and e.get("reason") in ("chaos", "scheduled")
        ]
        return {
            "system": system,
            "seed": seed,
            "goodput": accounting["goodput"],
            "uptime": summary["uptime"],
            "lost": accounting["lost"],
            "kills": kills,
            "restarts": accounting["restarts"],
            "wall_s": accounting["wall_s"],
            "final_eval_loss": summary["final_eval_loss"],
            "learners": mode["learners"],
            "steps": mode["steps"],
            "restart_s": mode["restart_s"],
            "chaos_mtbf_s": mode["mtbf_s"],
            "kill_learner_at_s": mode["kill_at_s"],
        }

    args = _arguments(mode, system, seed)
    return local_run(out / f"run-seed{seed}-{system}.json", args, describe)


def _fragments(events: list[dict[str, Any]]) -> int:
    run_start = next(e for e in events if e["event"] == "run_start")
    return int(run_start["config"]["fragments"])


def schedule(mode: dict[str, Any], seed: int, horizon_s: float) -> list[dict[str, Any]]:
    """The kills the seeded schedule draws over ``horizon_s`` with every learner up:
    both systems run against these draws (a draw that finds its target down is spent)."""
    if not mode["mtbf_s"]:
        return [{"at_s": mode["kill_at_s"], "process": "learner-0"}]
    chaos = ChaosSchedule(mode["learners"], seed=seed, start=0.0, mtbf_s=mode["mtbf_s"])
    draws = []
    while chaos.next_kill is not None and chaos.next_kill <= horizon_s:
        at = chaos.next_kill
        kills = chaos.due(at, [True] * mode["learners"])
        draws += [{"at_s": round(at, 2), "process": k.process} for k in kills]
    return draws


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.mean(r[key] for r in runs), 4)


def _spread(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"count": 0}
    return {
        "count": len(seconds),
        "median": round(statistics.median(seconds), 2),
        "mean": round(statistics.mean(seconds), 2),
        "max": round(max(seconds), 2),
        "within_target": sum(s <= TARGETS["restart_to_train_s"] for s in seconds),
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over its seeds. Restarts in a spare whose imports were
    done apart from those where it was still importing (a kill soon after the last)."""
    restarts = [r for run in runs for r in run["restarts"]]
    return {
        "goodput": _mean(runs, "goodput"),
        "uptime": _mean(runs, "uptime"),
        "lost": {
            cause: round(statistics.mean(r["lost"][cause] for r in runs), 4)
            for cause in (*LOSS_CAUSES, "other")
        },
        "kills": round(statistics.mean(len(r["kills"]) for r in runs), 2),
        "restart_to_train_s": _spread([r["restart_to_train_s"] for r in restarts])
        | {
            "spare_ready": _spread(
                [r["restart_to_train_s"] for r in restarts if not r["imports_s"]]
            ),
            "spare_importing": _spread(
                [r["restart_to_train_s"] for r in restarts if r["imports_s"]]
            ),
        },
        "wall_s": _mean(runs, "wall_s"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: M=2, tiny model, one kill")
    which.add_argument("--quick", action="store_true", help="the full settings, seed 0 only")
    ap.add_argument(
        "--out",
        default="benchmarks/results/goodput",
        help="a folder: the summary JSON and PNG go in it, and each finished run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    runs = [run_once(out, mode, system, seed) for seed in mode["seeds"] for system in SYSTEMS]
    by_system = {system: [r for r in runs if r["system"] == system] for system in SYSTEMS}
    result: dict[str, Any] = {
        "benchmark": "goodput",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"])},
        "kills": {
            "per_seed": {
                str(seed): {
                    "schedule": schedule(
                        mode, seed, max(r["wall_s"] for r in runs if r["seed"] == seed)
                    ),
                    **{s: r["kills"] for s in SYSTEMS for r in by_system[s] if r["seed"] == seed},
                }
                for seed in mode["seeds"]
            },
        }
        | {s: round(statistics.mean(len(r["kills"]) for r in by_system[s]), 2) for s in SYSTEMS},
        **{system: aggregate(by_system[system]) for system in SYSTEMS},
        "targets": TARGETS,
        "runs": runs,
        "bench_wall_s": round(time.monotonic() - began, 1),
    }
    # Beside the run folders, which stay out of version control.
    (out.parent / f"goodput-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.parent / f"goodput-{name}.png")
    print(json.dumps({k: result[k] for k in ("mode", *SYSTEMS)}, indent=2))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    """Stacked bars per system: goodput, then each cause of the rest (they sum to 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    parts = ["goodput", *LOSS_CAUSES, "other"]
    colors = ["tab:green", "tab:gray", "tab:orange", "tab:blue", "tab:red", "white"]
    x = list(range(len(SYSTEMS)))
    bottom = [0.0] * len(SYSTEMS)
    for part, color in zip(parts, colors, strict=True):
        heights = [
            result[s]["goodput"] if part == "goodput" else max(0.0, result[s]["lost"][part])
            for s in SYSTEMS
        ]
        ax.bar(x, heights, 0.5, bottom=bottom, label=part.replace("_", " "), color=color,
               edgecolor="black", linewidth=0.5)  # fmt: skip
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, s in enumerate(SYSTEMS):
        ax.text(i, result[s]["goodput"] / 2, f"{result[s]['goodput']:.2f}", ha="center")
    ax.axhline(TARGETS["goodput"], color="green", ls="--", lw=1)
    ax.set_xticks(x, list(SYSTEMS))
    ax.set_ylabel("share of undisturbed tokens")
    ax.set_title(f"goodput and what was lost ({result['mode']}, mean over seeds)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
