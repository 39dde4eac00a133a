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
the mixture's mean gap at most the dense one plus 2 points. Expert shares:
each layer's share of the held-out tokens per expert at the final evaluation;
target: none below 10%.

full: seeds 0-2 (6 mixture runs, plus the dense ones); ``--quick``: seed 0;
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
from compose.reporter import read_jsonl

WORKLOAD = "learner.moe:moe_gpt"
SYSTEMS = ("decoupled", "ddp")
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
        *quality.SYSTEMS[system], "--learners", str(mode["learners"]),
        "--steps", str(mode["steps"]), "--seed", str(seed), "--workload", WORKLOAD,
        *mode["extra"], *extra,
    ]  # fmt: skip

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        evals = [e for e in read_jsonl(folder / "metrics.jsonl") if e["event"] == "eval"]
        shares = evals[-1].get("expert_shares") if evals else None
        if shares is None:
            raise RuntimeError(f"{folder}: the final evaluation logged no expert_shares")
        return {
            "system": system,
            "seed": seed,
            "final_eval_loss": summary["final_eval_loss"],
            "tokens": summary["tokens_total"],
            "expert_shares": shares,
            "eval_curve": summary["eval_curve"],
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
    moe = [run_moe(out, mode, s, seed, args.extra) for seed in mode["seeds"] for s in SYSTEMS]
    dense = [
        quality.run_once(dense_out, dense_mode, s, seed, args.extra)
        for seed in mode["seeds"]
        for s in SYSTEMS
    ]

    def gap(runs: list[dict[str, Any]]) -> dict[str, Any]:
        losses = {
            s: {r["seed"]: r["final_eval_loss"] for r in runs if r["system"] == s} for s in SYSTEMS
        }
        return quality.relative_gaps(losses["decoupled"], losses["ddp"])

    shares = {f"seed{r['seed']}-{r['system']}": r["expert_shares"] for r in moe}
    min_share = min(x for layers in shares.values() for layer in layers for x in layer)
    moe_gap, dense_gap = gap(moe), gap(dense)
    result: dict[str, Any] = {
        "benchmark": "moe",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"]), "extra": args.extra, "workload": WORKLOAD},
        "gap_to_ddp": {"moe": moe_gap, "dense": dense_gap},
        "gap_over_dense_gap": (
            moe_gap["mean"] - dense_gap["mean"]
            if moe_gap["mean"] is not None and dense_gap["mean"] is not None
            else None
        ),
        "final_eval_loss": {
            f"{model}-{system}": {
                str(r["seed"]): r["final_eval_loss"] for r in runs if r["system"] == system
            }
            for model, runs in (("moe", moe), ("dense", dense))
            for system in SYSTEMS
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
