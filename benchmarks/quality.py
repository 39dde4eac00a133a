"""Like-for-like quality: decoupled at the defaults against a pinned synchronous
DiLoCo reference and data parallel, on paired seeds.

    python -m benchmarks.quality [--smoke | --quick] [--out benchmarks/results/quality]
                                 [--variant NAME --decoupled "ARGS"]
                                 [-- extra ddiloco local arguments]

Every system runs ``ddiloco local`` on the same model, data, seed and token
budget (M learners x steps x batch); a seed pairs the three runs. The
reference is pinned: synchronous DiLoCo with fp32 deltas and globals at
H = 12, so that changing a default moves the decoupled figure, never the
reference. The cost of decoupling and compression is ``decoupled / reference
- 1`` per seed; the JSON gives its mean and standard error over the seeds, and
each system's gap to data parallel at equal tokens.

full: M = 4, 300 steps, seeds 0-4 (15 runs); ``--quick``: seed 0 only;
``--smoke`` (CI): M = 2, a tiny model, 20 steps. Each finished run is kept
(``run-seed<S>-<system>.json``) and not repeated on a rerun unless a setting
it ran with changed (a new default reruns decoupled, never the reference). Writes
``quality-<mode>.json`` and ``quality-<mode>.png`` (held-out loss against tokens
for the first seed, and the per-seed cost).

``--variant sparse --decoupled "--delta-codec int4+top0.1"`` measures an option
the same way: decoupled with those arguments (``run-seed<S>-decoupled-sparse``)
against the same reference and data parallel runs, written to
``quality-<mode>-sparse.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.local_run import local_run

# name -> the ddiloco local arguments that make it
SYSTEMS: dict[str, list[str]] = {
    "decoupled": ["--mode", "decoupled"],
    "reference": [
        "--mode", "diloco", "--sync-every", "12", "--delta-codec", "fp32", "--global-codec", "fp32",
    ],
    "ddp": ["--mode", "ddp"],
}  # fmt: skip
TINY = ["--model-d-model", "64", "--model-n-layer", "2", "--model-seq-len", "64"]
MODES: dict[str, dict[str, Any]] = {
    "smoke": {"learners": 2, "steps": 20, "seeds": [0], "extra": TINY},
    "quick": {"learners": 4, "steps": 300, "seeds": [0], "extra": []},
    "full": {"learners": 4, "steps": 300, "seeds": [0, 1, 2, 3, 4], "extra": []},
}
# The targets of the low-bandwidth issue: decoupling and compression cost at
# most 1% of loss against the reference, and the gap to data parallel is no
# worse than the +14.1% measured before compression was the default.
TARGETS = {"decoupling_cost_mean": 0.01, "gap_to_ddp": 0.141}


def add_shared_runs_argument(ap: argparse.ArgumentParser, what: str) -> None:
    """``--quality-out``: this benchmark's folder, for another that reuses its runs."""
    ap.add_argument(
        "--quality-out",
        default="benchmarks/results/quality",
        help=f"benchmarks.quality's folder: {what}",
    )


def shared_runs(quality_out: str, mode: str) -> tuple[Path, dict[str, Any]]:
    """The folder and settings of this benchmark's runs that another benchmark's
    ``mode`` reuses: the smoke runs for a smoke, else the full runs (quick is
    their first seed)."""
    name = "smoke" if mode == "smoke" else "full"
    folder = Path(quality_out) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder, MODES[name]


def run_once(
    out: Path,
    mode: dict[str, Any],
    system: str,
    seed: int,
    extra: list[str],
    variant: tuple[str, list[str]] | None = None,
) -> dict[str, Any]:
    """One run of one system, or its stored result (if run with today's settings).
    ``variant``: (name, arguments) that decoupled runs with."""
    args = [
        *SYSTEMS[system], "--learners", str(mode["learners"]), "--steps", str(mode["steps"]),
        "--seed", str(seed), *mode["extra"], *extra,
    ]  # fmt: skip
    label = system
    if variant is not None and system == "decoupled":
        label = f"{system}-{variant[0]}"
        args += variant[1]

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        return {
            "system": system,
            "seed": seed,
            "final_eval_loss": summary["final_eval_loss"],
            "tokens": summary.get("tokens_total"),
            "bytes_up": summary.get("bytes_up"),
            "bytes_down": summary.get("bytes_down"),
            "eval_curve": summary.get("eval_curve", []),
        }

    return local_run(out / f"run-seed{seed}-{label}.json", args, describe)


def relative_gaps(losses: dict[int, float], against: dict[int, float]) -> dict[str, Any]:
    """``loss / against - 1`` per paired seed, with the mean and its standard error
    (None with one seed)."""
    gaps = [losses[s] / against[s] - 1 for s in sorted(losses) if s in against]
    stderr = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
    return {"per_seed": gaps, "mean": statistics.mean(gaps) if gaps else None, "stderr": stderr}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: M=2, tiny model, 20 steps")
    which.add_argument("--quick", action="store_true", help="the full settings, seed 0 only")
    ap.add_argument(
        "--out",
        default="benchmarks/results/quality",
        help="a folder: the summary JSON and PNG go in it, and each finished run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    ap.add_argument("--variant", help="a name for --decoupled's arguments, e.g. sparse")
    ap.add_argument("--decoupled", default="", help="ddiloco local arguments of decoupled only")
    ap.add_argument("extra", nargs="*", help="arguments passed to every ddiloco local run")
    args = ap.parse_args(argv)
    if bool(args.variant) != bool(args.decoupled):
        ap.error("--variant NAME and --decoupled ARGS go together")
    variant = (args.variant, shlex.split(args.decoupled)) if args.variant else None
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    runs = [
        run_once(out, mode, system, seed, args.extra, variant)
        for seed in mode["seeds"]
        for system in SYSTEMS
    ]
    losses = {
        system: {r["seed"]: r["final_eval_loss"] for r in runs if r["system"] == system}
        for system in SYSTEMS
    }
    result: dict[str, Any] = {
        "benchmark": "quality",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"]), "extra": args.extra},
        "systems": {system: " ".join(flags) for system, flags in SYSTEMS.items()}
        | ({"decoupled": f"--mode decoupled {args.decoupled}"} if variant else {}),
        "final_eval_loss": {
            system: {str(seed): loss for seed, loss in by_seed.items()}
            for system, by_seed in losses.items()
        },
        "decoupling_cost": relative_gaps(losses["decoupled"], losses["reference"]),
        "gap_to_ddp": {
            s: relative_gaps(losses[s], losses["ddp"])["mean"] for s in ("decoupled", "reference")
        },
        "bytes_on_the_wire": {
            s: statistics.mean(r["bytes_up"] + r["bytes_down"] for r in runs if r["system"] == s)
            for s in ("decoupled", "reference")
        },
        "targets": TARGETS,
        "runs": runs,
    }
    stem = f"quality-{name}" + (f"-{args.variant}" if variant else "")
    (out.parent / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(runs, result, out.parent / f"{stem}.png")
    shown = ("mode", "final_eval_loss", "decoupling_cost", "gap_to_ddp", "bytes_on_the_wire")
    print(json.dumps({k: result[k] for k in shown}, indent=2))
    return 0


def _plot(runs: list[dict[str, Any]], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, costs) = plt.subplots(1, 2, figsize=(10, 4))
    first = min(r["seed"] for r in runs)
    for r in runs:
        if r["seed"] != first:
            continue
        curve = [(t, loss) for t, loss in r["eval_curve"] if t is not None]
        tokens, loss = [t for t, _ in curve], [x for _, x in curve]
        curves.plot(tokens, loss, marker="o", ms=3, label=r["system"])
    curves.set_xlabel(f"tokens trained (all learners), seed {first}")
    curves.set_ylabel("held-out loss")
    curves.legend()
    curves.grid(alpha=0.3)
    cost = result["decoupling_cost"]
    seeds = sorted({r["seed"] for r in runs})
    costs.bar([str(s) for s in seeds], [100 * g for g in cost["per_seed"]])
    costs.axhline(100 * TARGETS["decoupling_cost_mean"], color="red", ls="--", label="target")
    costs.set_xlabel("seed")
    costs.set_ylabel("decoupled / reference - 1 (%)")
    costs.legend()
    costs.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
