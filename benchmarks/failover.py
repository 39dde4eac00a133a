"""A lost Redis primary, as a user sees it: ``ddiloco local`` on a Redis that
fails over (a primary, its replica and three Sentinels as
compose/compose.sentinel.yaml runs them, here on loopback with the run's
keys and TLS), the primary SIGKILLed and its data folder deleted (a lost host)
some seconds after the first round, and started again empty 3 s later (it
joins as the new primary's replica).

    python -m benchmarks.failover [--smoke] [--out FILE]

Full: M = 4, 300 steps, seed 0, the loss 30 s after the first round, and a
clean run on the same servers for the final loss. Smoke (CI): M = 2, 96
steps, the loss 5 s after the first round, no clean run. Writes JSON: seconds
from the loss to the Sentinels' promotion, to each fragment's next round and
to the moment every fragment has had one (``rounds_resumed_after_s``),
versions before and after (same epoch), deltas merged twice, refusals,
whether every learner delivered everything, and the final loss; and a plot
of each fragment's versions around the loss beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from broker.errors import MeasurementError
from broker.run.key_folder import make_keys
from compose.failover import FailoverRedis

RESULTS = Path(__file__).resolve().parent / "results" / "durability"
RESTART_AFTER_S = 3.0  # the lost server comes back (empty) this long after the loss


def _rounds(run: Path) -> list[dict[str, Any]]:
    path = run / "syncer.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [e for e in lines if e.get("event") == "round"]


def _run_local(
    cluster: FailoverRedis, keys: Path, out: Path, flags: list[str], fault_after_s: float | None
) -> dict[str, Any]:
    """One ``ddiloco local`` run on ``cluster``; with ``fault_after_s``, the
    primary lost that long after the first round, back empty 3 s later."""
    args = [sys.executable, "-m", "compose.cli", "local", "--no-progress", "--url", cluster.url,
            "--keys", str(keys), "--out", str(out), *flags]  # fmt: skip
    log = open(out.parent / f"{out.name}.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    fault: dict[str, Any] = {}
    try:
        if fault_after_s is not None:
            while not _rounds(out):
                if proc.poll() is not None:
                    raise MeasurementError(f"the run ended before its first round: {log.name}")
                time.sleep(0.2)
            time.sleep(fault_after_s)
            primary = cluster.primary()
            if primary is None:
                raise MeasurementError("the Sentinels name no primary before the fault")
            fault = _lose(cluster, primary)
        if proc.wait(timeout=1800) != 0:
            raise MeasurementError(f"ddiloco local exited {proc.returncode}: see {log.name}")
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    summary = json.loads((out / "summary.json").read_text())
    done = [
        json.loads(line)
        for f in sorted((out / "learners").glob("*.jsonl"))
        for line in f.read_text().splitlines()
        if '"event": "done"' in line
    ]
    result = {
        "delivered": [d["delivered"] for d in done],
        "final_eval_loss": summary.get("final_eval_loss"),
        "wall_s": summary.get("wall_s"),
        "deltas_applied": summary.get("deltas_applied"),
        "deltas_rejected": summary.get("deltas_rejected"),
        "rejected_by_reason": summary.get("rejected_by_reason"),
        "applied_twice": sum(
            n > 1 for n in Counter(tuple(k) for e in _rounds(out) for k in e["keys"]).values()
        ),
    }
    if fault:
        result |= fault | _after(_rounds(out), fault["lost_at"])
    return result


def _lose(cluster: FailoverRedis, primary: str) -> dict[str, Any]:
    """SIGKILL the primary and delete its data; start it again 3 s later; how
    long the Sentinels took to promote the other (watched in a thread)."""
    lost_at = time.time()
    cluster.kill(primary, lose_data=True)
    other = next(name for name in cluster.ports if name != primary)
    promoted: dict[str, float] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and cluster.primary() != other:
            time.sleep(0.05)
        if cluster.primary() == other:
            promoted["at"] = time.time()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(RESTART_AFTER_S)
    cluster.start_node(primary)
    watcher.join(timeout=60)
    return {
        "lost": primary,
        "lost_at": lost_at,
        "promoted_after_s": round(promoted["at"] - lost_at, 2) if promoted else None,
        "back_after_s": RESTART_AFTER_S,
    }


def _after(rounds: list[dict[str, Any]], lost_at: float) -> dict[str, Any]:
    """Per fragment: the version before the loss, the first after, and when."""
    fragments = sorted({e["fragment"] for e in rounds})
    before = {p: [e for e in rounds if e["fragment"] == p and e["t"] < lost_at] for p in fragments}
    after = {p: [e for e in rounds if e["fragment"] == p and e["t"] >= lost_at] for p in fragments}
    first = {p: round(a[0]["t"] - lost_at, 2) for p, a in after.items() if a}
    return {
        # Every fragment has merged a round again (its first after the loss).
        "rounds_resumed_after_s": max(first.values()) if len(first) == len(fragments) else None,
        "per_fragment_first_round_after_s": first,
        "versions_before": {p: b[-1]["version"] for p, b in before.items() if b},
        "versions_after": {p: a[0]["version"] for p, a in after.items() if a},
        "same_epoch": all(
            b[-1]["epoch"] == a[0]["epoch"]
            for p, b in before.items()
            for a in [after[p]]
            if b and a
        ),
        "rounds_after_by_fragment": {p: len(a) for p, a in after.items()},
        # Each fragment's versions against seconds from the loss, for the plot.
        "timeline": {
            p: [[round(e["t"] - lost_at, 2), e["version"]] for e in rounds if e["fragment"] == p]
            for p in fragments
        },
    }


def plot(lost: dict[str, Any], path: Path) -> None:
    """Each fragment's versions around the loss, with the promotion and the
    lost server's return marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p, points in lost["timeline"].items():
        ax.step([t for t, _ in points], [v for _, v in points], where="post", label=f"fragment {p}")
    ax.axvline(0, color="red", label="primary lost")
    if lost["promoted_after_s"] is not None:
        ax.axvline(lost["promoted_after_s"], color="orange", ls="--", label="replica promoted")
    ax.axvline(lost["back_after_s"], color="grey", ls=":", label="lost server back, empty")
    ax.set_xlabel("seconds from the loss of the primary")
    ax.set_ylabel("version (rounds merged)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="M = 2, 96 steps, no clean run")
    parser.add_argument(
        "--out", default=str(RESULTS / "failover.json"), help="the results JSON (its plot beside)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        flags, fault_after_s = ["--learners", "2", "--steps", "96", "--seed", "0"], 5.0
    else:
        flags, fault_after_s = ["--seed", "0"], 30.0
    with tempfile.TemporaryDirectory(prefix="ddiloco-failover-") as tmp:
        work = Path(tmp)
        keys = make_keys(work / "keys")
        result: dict[str, Any] = {
            "benchmark": "failover",
            "mode": "smoke" if args.smoke else "full",
            "setup": "ddiloco local --no-progress --url rediss+sentinel://S1,S2,S3/ddiloco/0 "
            f"--keys K {' '.join(flags)}; servers by compose/redis-node.sh, Sentinels by "
            "ddiloco keys sentinel; the primary SIGKILLed and its data deleted "
            f"{fault_after_s:g} s after the first round, started again empty "
            f"{RESTART_AFTER_S:g} s later",
        }
        for name, fault in [("primary_lost", fault_after_s)] + (
            [] if args.smoke else [("clean", None)]
        ):
            cluster = FailoverRedis(work / f"redis-{name}", keys)
            cluster.start()
            try:
                print(f"{name}: running", flush=True)
                result[name] = _run_local(cluster, keys, work / name, flags, fault)
            finally:
                cluster.stop()
            print(f"{name}: {json.dumps(result[name])}", flush=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result["primary_lost"], out.with_suffix(".png"))
    print(f"wrote {out} and its plot")
    lost = result["primary_lost"]
    ok = lost["applied_twice"] == 0 and lost["rounds_resumed_after_s"] is not None
    return 0 if ok and all(lost["delivered"]) else 1


if __name__ == "__main__":
    sys.exit(main())
