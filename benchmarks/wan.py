"""Training over slow links: data parallel, synchronous DiLoCo and decoupled, with
every learner's link throttled, bytes counted by the interfaces themselves.

    python -m benchmarks.wan [--smoke | --quick] [--out benchmarks/results/wan]
                             [-- extra ddiloco local arguments]

Every run is ``ddiloco local --netns``: each learner in a network namespace of
its own, its veth link limited both ways by ``tc tbf`` (``--link-rate``) from
the start. Systems, on the same model, data, seed and token budget: ``ddp``
(gloo all-reduce every step; its ranks talk through the same links),
``diloco`` (the pinned reference: synchronous, fp32 deltas and globals,
H = 12) and ``decoupled`` (the defaults).

Bytes are the interfaces' transmit counters (everything on the wire, headers
included): what every learner sent, plus, for the DiLoCo modes, what the
syncer sent, which is what the learners' interfaces received. Each byte counts
once in every mode.

Time to target: the target is the worst of the three final losses
unthrottled. Held-out losses come from copies of the model taken every
``EVAL_EVERY_S`` seconds (every tenth of the run in data parallel) and
evaluated after training (``--eval-deferred``), so that evaluating does not
take the learners' CPU in any mode; each point keeps the time of its copy.
Decoupled runs whole at every rate and its time is read off its own held-out
loss curve (from the learners' start). Data parallel and DiLoCo
compute the same thing at every step whatever the link, so a throttled run of
theirs is only long enough to time ``MEASURED_STEPS`` steps after a warm-up,
and their time to target is the steps to target of the unthrottled run times
that step time (the JSON says so per result: ``time_method``).

full: M = 4, 300 steps, links at 100, 20 and 10 Mbit/s; ``--quick``: 150
steps, 10 Mbit/s only; ``--smoke`` (CI): M = 2, a tiny model, 20 steps,
10 Mbit/s. Each finished run is kept (``run-<system>-<rate>.json``) and not
repeated on a rerun unless a setting it ran with changed. Writes
``wan-<mode>.json`` and ``wan-<mode>.png``. Needs root (namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import compute_floor
from benchmarks.local_run import local_run
from benchmarks.quality import SYSTEMS as QUALITY_SYSTEMS
from benchmarks.quality import TINY
from broker.errors import MeasurementError
from compose.reporter import read_jsonl

SYSTEMS: dict[str, list[str]] = {
    "ddp": QUALITY_SYSTEMS["ddp"],
    "diloco": QUALITY_SYSTEMS["reference"],
    "decoupled": QUALITY_SYSTEMS["decoupled"],
}
WARMUP_STEPS = 12  # not timed: imports done, first syncs of every fragment made
MEASURED_STEPS = 30  # the least a throttled step time of ddp and diloco is taken over
MODES: dict[str, dict[str, Any]] = {
    "smoke": {"learners": 2, "steps": 20, "rates_mbit": [10], "timed_steps": 20,
              "warmup": 4, "extra": TINY},
    "quick": {"learners": 4, "steps": 150, "rates_mbit": [10], "timed_steps": 50,
              "warmup": WARMUP_STEPS, "extra": []},
    "full": {"learners": 4, "steps": 300, "rates_mbit": [100, 20, 10], "timed_steps": 50,
             "warmup": WARMUP_STEPS, "extra": []},
}  # fmt: skip
# Where decoupled at the defaults should be against data parallel and the reference.
TARGETS = {"bytes_ratio_vs_ddp": 100.0, "eval_loss_gap": 0.01, "speedup_vs_ddp_at_10mbit": 10.0}
EVAL_EVERY_S = 3.0  # the evaluator's period: finer than the default, for the time curve
FLOOR_STEPS = {"smoke": 10, "quick": 60, "full": 60}  # timed steps of each bare loop


def step_time(folder: Path, warmup: int) -> tuple[float, int]:
    """Seconds per step after ``warmup`` steps, averaged over the learners, and the
    fewest steps any learner's figure was taken over."""
    times, spans = [], []
    for path in sorted((folder / "learners").glob("*.jsonl")):
        steps = [(e["step"], e["t"]) for e in read_jsonl(path) if e["event"] == "step"]
        steps = [(s, t) for s, t in steps if s >= warmup]
        if len(steps) < 2:
            continue
        (s0, t0), (s1, t1) = steps[0], steps[-1]
        times.append((t1 - t0) / (s1 - s0))
        spans.append(s1 - s0)
    if not times:
        raise MeasurementError(f"{folder}: no learner logged two steps after step {warmup}")
    return statistics.mean(times), min(spans)


def first_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Where a loss curve ``[(x, loss)]`` first reaches ``target``, linear between
    its points; None if it never does."""
    for i, (x, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return x
            x0, l0 = curve[i - 1]
            return x0 + (x - x0) * (l0 - target) / (l0 - loss)
    return None


def run_once(
    out: Path, mode: dict[str, Any], system: str, rate: int | None, extra: list[str]
) -> dict[str, Any]:
    """One run of one system at one link rate (None: unthrottled), or its stored result."""
    # Throttled data parallel and DiLoCo run only long enough to time their steps.
    timed_only = rate is not None and system != "decoupled"
    steps = mode["timed_steps"] if timed_only else mode["steps"]
    args = [
        "--netns", *SYSTEMS[system], "--learners", str(mode["learners"]), "--steps", str(steps),
        "--seed", "0", "--eval-every-s", str(EVAL_EVERY_S), "--eval-deferred",
        *mode["extra"], *extra,
    ]  # fmt: skip
    if rate:
        args += ["--link-rate", f"{rate}mbit"]

    def describe(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        links = summary["link_bytes"]
        sent = sum(v["tx_bytes"] for v in links.values())
        received = sum(v["rx_bytes"] for v in links.values())
        seconds_per_step, timed = step_time(folder, mode["warmup"])
        tokens_per_step = summary["tokens_total"] / summary["steps_per_learner"]
        starts = [e["t"] for e in read_jsonl(folder / "metrics.jsonl") if e["event"] == "start"]
        evals = [e for e in read_jsonl(folder / "evaluator.jsonl") if e["event"] == "eval"]
        return {
            "system": system,
            "rate_mbit": rate,
            "steps": steps,
            "final_eval_loss": summary["final_eval_loss"],
            "wall_s": summary["wall_s"],
            # What crossed the links: learners' transmissions, and for the DiLoCo modes
            # the syncer's (what the learners received; in ddp, other learners' sends).
            "bytes": sent + (received if system != "ddp" else 0),
            "bytes_sent_by_learners": sent,
            "bytes_received_by_learners": received,
            "seconds_per_step": seconds_per_step,
            "timed_steps": timed,
            "curve_steps": [(t / tokens_per_step, loss) for t, loss in summary["eval_curve"]
                            if t is not None],
            "curve_seconds": [(e["t"] - min(starts), e["loss"]) for e in evals] if starts else [],
        }  # fmt: skip

    label = f"{system}-{rate}mbit" if rate else f"{system}-free"
    return local_run(out / f"run-{label}.json", args, describe)


def time_to_target(
    run: dict[str, Any], free: dict[str, Any], target: float
) -> tuple[float | None, str]:
    """Seconds to ``target`` for one run, and how it was found."""
    if run["system"] == "decoupled":
        return first_reach(run["curve_seconds"], target), "read off its held-out loss curve"
    steps = first_reach(free["curve_steps"], target)
    how = f"steps to target unthrottled x seconds per step over {run['timed_steps']} steps" + (
        " at this rate" if run["rate_mbit"] else ""
    )
    return (None if steps is None else steps * run["seconds_per_step"]), how


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarise(
    free: dict[str, dict[str, Any]],
    throttled: dict[int, dict[str, dict[str, Any]]],
    floor: dict[str, Any],
) -> dict[str, Any]:
    """The JSON's figures from the runs (unthrottled per system, then per rate)
    and the host's compute floor (``benchmarks.compute_floor``)."""
    target = max(r["final_eval_loss"] for r in free.values())
    reference, ddp = free["diloco"]["final_eval_loss"], free["ddp"]["final_eval_loss"]
    # ddp's bytes per step do not depend on the link: its whole unthrottled run is
    # the one to compare with a whole decoupled run.
    ddp_bytes = free["ddp"]["bytes"]
    rates = []
    for rate, runs in [(None, free), *throttled.items()]:
        modes = {}
        for system, run in runs.items():
            seconds, how = time_to_target(run, free[system], target)
            modes[system] = {
                "bytes": run["bytes"] if system == "decoupled" or rate is None else None,
                "wall_s": run["wall_s"],
                "seconds_per_step": run["seconds_per_step"],
                "final_eval_loss": run["final_eval_loss"] if system == "decoupled" or rate is None
                else free[system]["final_eval_loss"],
                "time_to_target_s": seconds,
                "time_method": how,
            }  # fmt: skip
        loss = modes["decoupled"]["final_eval_loss"]
        rates.append(
            {
                "rate_mbit": rate,
                "modes": modes,
                "bytes_ratio_vs_ddp": _ratio(ddp_bytes, modes["decoupled"]["bytes"]),
                "bytes_ratio_diloco_vs_ddp": _ratio(ddp_bytes, free["diloco"]["bytes"]),
                "eval_loss_gap": loss / reference - 1,
                "eval_loss_gap_vs_ddp": loss / ddp - 1,
                "speedup_vs_ddp": _ratio(
                    modes["ddp"]["time_to_target_s"], modes["decoupled"]["time_to_target_s"]
                ),
                # 1.0: decoupled's learners step as fast as bare training loops can
                # on this host, so only fewer steps to the target would make it faster.
                "decoupled_step_over_floor": _ratio(
                    modes["decoupled"]["seconds_per_step"], floor["seconds_per_step_together"]
                ),
            }
        )
    return {"target_loss": target, "rates": rates, "compute_floor": floor}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: M=2, tiny model, 20 steps")
    which.add_argument("--quick", action="store_true", help="150 steps, 10 Mbit/s only")
    ap.add_argument(
        "--out",
        default="benchmarks/results/wan",
        help="a folder: the summary JSON and PNG go in it, and each finished run in "
        "its mode's subfolder, from which a rerun resumes",
    )
    ap.add_argument("extra", nargs="*", help="arguments passed to every ddiloco local run")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("needs root: learners run in network namespaces with tc limits")
    name = "smoke" if args.smoke else "quick" if args.quick else "full"
    mode = MODES[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    free = {s: run_once(out, mode, s, None, args.extra) for s in SYSTEMS}
    throttled = {
        rate: {s: run_once(out, mode, s, rate, args.extra) for s in SYSTEMS}
        for rate in mode["rates_mbit"]
    }
    print(f"compute floor: {mode['learners']} bare training loops at once", flush=True)
    floor_args = [*mode["extra"], *args.extra]
    floor = compute_floor.measure(mode["learners"], FLOOR_STEPS[name], floor_args)
    result: dict[str, Any] = {
        "benchmark": "wan",
        "mode": name,
        "settings": {k: v for k, v in mode.items() if k != "extra"}
        | {"tiny_model": bool(mode["extra"]), "extra": args.extra, "seed": 0},
        "systems": {s: " ".join(flags) for s, flags in SYSTEMS.items()},
        "bytes_counted": "interface transmit counters: learners, plus the syncer's "
        "(the learners' received bytes) for diloco and decoupled",
        **summarise(free, throttled, floor),
        "targets": TARGETS,
        "runs": [*free.values(), *(r for runs in throttled.values() for r in runs.values())],
    }
    (out.parent / f"wan-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out.parent / f"wan-{name}.png")
    shown = {k: result[k] for k in ("mode", "target_loss")}
    shown["rates"] = [
        {k: r[k] for k in ("rate_mbit", "bytes_ratio_vs_ddp", "eval_loss_gap",
                           "eval_loss_gap_vs_ddp", "speedup_vs_ddp",
                           "decoupled_step_over_floor")}
        | {s: m["time_to_target_s"] for s, m in r["modes"].items()}
        for r in result["rates"]
    ]  # fmt: skip
    shown["compute_floor_s_per_step"] = floor["seconds_per_step_together"]
    print(json.dumps(shown, indent=2))
    return 0


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, volume) = plt.subplots(1, 2, figsize=(11, 4))
    rates = result["rates"]
    labels = [f"{r['rate_mbit']} Mbit/s" if r["rate_mbit"] else "unthrottled" for r in rates]
    width = 0.8 / len(SYSTEMS)
    for j, system in enumerate(SYSTEMS):
        values = [r["modes"][system]["time_to_target_s"] or 0 for r in rates]
        times.bar([i + j * width for i in range(len(rates))], values, width, label=system)
    times.set_xticks([i + width for i in range(len(rates))], labels)
    times.set_yscale("log")
    times.set_ylabel(f"seconds to held-out loss {result['target_loss']:.3f}")
    times.legend()
    times.grid(alpha=0.3, axis="y")
    free = {r["system"]: r for r in result["runs"] if r["rate_mbit"] is None}
    volume.bar(list(free), [free[s]["bytes"] / 1e6 for s in free])
    volume.set_yscale("log")
    volume.set_ylabel("MB on the links, whole run (interface counters)")
    volume.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
