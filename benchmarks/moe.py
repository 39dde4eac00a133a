"""A mixture of experts against the dense model: decoupled and data parallel at
equal tokens, on paired seeds, and the experts' shares of the tokens.

    python -m benchmarks.moe [--smoke | --quick] [--out benchmarks/results/moe]
                             [--quality-out benchmarks/results/quality]
                             [-- extra ddiloco local arguments]

The mixture (``--workload learner.moe:moe_gpt``: a router, 4 experts, top-2, a
load-balancing loss weighted 0.01) has the dense byte GPT's active parameters
per token. Decoupled at the defaults and data parallel train each on the same
data, seeds and token budget as ``benchmarks.quality`` (M = 4, 300 steps);
the dense runs are ``benchmarks.quality``'s own, taken from its folder
(``--quality-out``) when it holds them with today's settings, else run there.
The gap of a model is ``decoupled / data parallel - 1`` per seed; target:
the mixture's mean gap at most the dense one plus 2 points. The mixture also
trains as ``decoupled-int4``: decoupled with int4+zstd deltas and globals
instead of the default int2+zstd, which costs the mixture more than the dense
model; its gap is given beside the default's, with each run's bytes. Expert
shares: each layer's share of the held-out tokens per expert at the final
evaluation; target: none below 10%.

full: seeds 0-2 (9 mixture runs, plus the dense ones); ``--quick``: seed 0;
``--smoke`` (CI): ``benchmarks.quality``'s smoke settings (M = 2, a tiny
model, 20 steps, seed 0). Writes ``moe-<mode>.json`` and ``moe-<mode>.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import quality
from benchmarks.local_run import local_run
from broker.errors import MeasurementError
from compose.reporter import read_jsonl

WORKLOAD = "learner.moe:moe_gpt"
SYSTEMS = ("decoupled", "ddp")  # the dense model's, from benchmarks.quality
INT4 = ["--delta-codec", "int4+zstd", "--global-codec", "int4+zstd"]
MOE_SYSTEMS: dict[str, list[str]] = {
    "decoupled": quality.SYSTEMS["decoupled"],
    "decoupled-int4": quality.SYSTEMS["decoupled"] + INT4,
    "ddp": quality.SYSTEMS["ddp"],
}
MODES: dict[str, dict[str, Any]] = {
    "smoke": quality.MODES["smoke"],
    "quick": quality.MODES["quick"],
    "full": quality.MODES["full"] | {"seeds": [0, 1, 2]},
}
TARGETS = {"gap_over_dense_gap": 0.02, "min_expert_share": 0.10}


def run_moe(
    out: Path, mode: dict[str, Any], system: str, seed: int, extra: list[str]
) -> dict[str, Any]:
    """One mixture run (quality's arguments, with the mixture's workload), or its stored result."""
    args = [
        *MOE_SYSTEMS[system], "--learners", str(mode["learners"]),
        "--steps", str(mode["steps"]), "--seed", str(seed), "--workload", WORKLOAD,
        *mode["extra"], *extra,
    ]  # fmt: skip

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        evals = [e for e in read_jsonl(folder / "metrics.jsonl") if e["event"] == "eval"]
        shares = evals[-1].get("expert_shares") if evals else None
        if shares is None:
            raise MeasurementError(f"{folder}: the final evaluation logged no expert_shares")
        return {
            "system": system,
            "seed": seed,
            "final_eval_loss": summary["final_eval_loss"],
            "tokens": summary["tokens_total"],
            "expert_shares": shares,
            "eval_curve": summary["eval_curve"],
            "bytes_up": summary["bytes_up"],
            "bytes_down": summary["bytes_down"],
        }

    return local_run(out / f"run-seed{seed}-{system}.json", args, describe)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: quality's smoke settings")
    which.add_argument("--quick", action="store_true", help="the full settings, seed 0 only")
    ap.add_argument(
        "--out",
        default="benchmarks/results/moe",
        help="a folder: the summary JSON and PNG go in it, and each mixture run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    quality.add_shared_runs_argument(ap, "the dense runs")
    ap.add_argument("extra", nargs="*", help="arguments passed to every ddiloco local run")
    args = ap.parse_args(argv)
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    dense_out, dense_mode = quality.shared_runs(args.quality_out, name)
    moe = [run_moe(out, mode, s, seed, args.extra) for seed in mode["seeds"] for s in MOE_SYSTEMS]
    dense = [
        quality.run_once(dense_out, dense_mode, s, seed, args.extra)
        for seed in mode["seeds"]
        for s in SYSTEMS
    ]

    def losses(runs: list[dict[str, Any]], system: str) -> dict[int, float]:
        return {r["seed"]: r["final_eval_loss"] for r in runs if r["system"] == system}

    def gap(runs: list[dict[str, Any]], system: str = "decoupled") -> dict[str, Any]:
        return quality.relative_gaps(losses(runs, system), losses(runs, "ddp"))

    shares = {f"seed{r['seed']}-{r['system']}": r["expert_shares"] for r in moe}
    min_share = min(x for layers in shares.values() for layer in layers for x in layer)
    dense_gap = gap(dense)
    moe_gaps = {s: gap(moe, s) for s in MOE_SYSTEMS if s != "ddp"}
    result: dict[str, Any] = {
        "benchmark": "moe",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"]), "extra": args.extra, "workload": WORKLOAD},
        "systems": {s: " ".join(flags) for s, flags in MOE_SYSTEMS.items()},
        "gap_to_ddp": {f"moe-{s}": g for s, g in moe_gaps.items()} | {"dense": dense_gap},
        "gap_over_dense_gap": {
            f"moe-{s}": g["mean"] - dense_gap["mean"]
            if g["mean"] is not None and dense_gap["mean"] is not None
            else None
            for s, g in moe_gaps.items()
        },
        "final_eval_loss": {
            f"{model}-{system}": {str(seed): loss for seed, loss in losses(runs, system).items()}
            for model, runs, systems in (("moe", moe, MOE_SYSTEMS), ("dense", dense, SYSTEMS))
            for system in systems
        },
        "bytes_up_down": {
            f"moe-{s}": {
                str(r["seed"]): [r["bytes_up"], r["bytes_down"]] for r in moe if r["system"] == s
            }
            for s in moe_gaps
        },
        "expert_shares": shares,
        "min_expert_share": min_share,
        "targets": TARGETS,
        "runs": {"moe": moe, "dense": dense},
    }
    (out.parent / f"moe-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.parent / f"moe-{name}.png")
    shown = ("mode", "gap_to_ddp", "gap_over_dense_gap", "min_expert_share", "final_eval_loss")
    print(json.dumps({k: result[k] for k in shown}, indent=2))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, shares) = plt.subplots(1, 2, figsize=(11, 4))
    first = result["settings"]["seeds"][0]
    for model, runs in result["runs"].items():
        for r in runs:
            if r["seed"] == first:
                points = [(t, loss) for t, loss in r["eval_curve"] if t is not None]
                if points:
                    xs, ys = zip(*points, strict=True)
                    curves.plot(xs, ys, label=f"{model} {r['system']}")
    curves.set_xlabel(f"tokens trained (all learners), seed {first}")
    curves.set_ylabel("held-out loss")
    curves.legend()
    curves.grid(alpha=0.3)
    run = next(iter(result["expert_shares"]))
    layers = result["expert_shares"][run]
    width = 0.8 / len(layers)
    for i, layer in enumerate(layers):
        shares.bar([e + i * width for e in range(len(layer))], layer, width, label=f"layer {i}")
    middle = width * (len(layers) - 1) / 2
    shares.set_xticks([e + middle for e in range(len(layers[0]))], range(len(layers[0])))
    shares.axhline(TARGETS["min_expert_share"], color="red", ls="--", label="10%")
    shares.set_xlabel(f"expert ({run}, final evaluation)")
    shares.set_ylabel("share of the held-out tokens")
    shares.legend(loc="lower right")
    shares.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
