"""What each learner costs a Redis run: server memory, and the syncer's loop.

    python -m benchmarks.roster [--smoke | --quick] [--out benchmarks/results/roster]

With the run's keys each admitted learner is an ACL user, a delta stream per
fragment (with the syncers' consumer group), a heartbeat key and a roster
entry, and the syncer reads all of them. For N learners of P fragments this
admits N learners (each sends a heartbeat, as a learner does when it starts),
then measures Redis's ``used_memory`` per learner (against the server before
any learner), and the syncer's ``receive(0)`` with nothing new to read, called
for ``SECONDS`` (its heartbeat reads every 0.25 s included): ``loop_ms_mean``
and ``loop_ms_median``. Writes ``roster-<mode>.json`` and ``roster-<mode>.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.identity.keys import Identity, RunKeys
from broker.redis.learner import RedisLearnerTransport
from broker.redis.syncer import RedisSyncerTransport
from broker.run.key_folder import make_keys
from broker.run.settings import RunSettings
from broker.wire.messages import Heartbeat

RUN = "roster-bench"
FRAGMENTS = 8
SECONDS = 3.0
MODES = {"smoke": (1, 8), "quick": (1, 16, 64), "full": (1, 16, 64, 256)}


def measure(learners: int, keys_dir: Path, workdir: Path) -> dict[str, Any]:
    from broker.redis.server import RedisServer  # a private Redis with the run's users

    server = RedisServer(workdir / f"redis-{learners}", keys=keys_dir)
    server.start()
    admin = server.client()
    syncer = RedisSyncerTransport(
        server.url, RUN, "syncer-0", list(range(FRAGMENTS)),
        keys=RunKeys.load(keys_dir, "syncer"), identity_hold_s=RunSettings().gone_after_s,
    )  # fmt: skip
    transports: list[RedisLearnerTransport] = []
    try:
        syncer.receive(0.0)  # its scripts loaded, its users there
        empty = int(admin.info("memory")["used_memory"])
        for i in range(learners):
            t = RedisLearnerTransport(
                server.url, RUN, f"learner-{i}", 1, FRAGMENTS, identity=Identity.new(),
                keys=RunKeys.load(keys_dir, "learner"),
            )  # fmt: skip
            t.send_heartbeat(Heartbeat(run_id=RUN, learner_id=f"learner-{i}", step=1))
            transports.append(t)
        deadline = time.monotonic() + 60
        while len(syncer.learners) < learners and time.monotonic() < deadline:
            syncer.receive(0.05)
            for t in transports:  # those Redis refused before they were admitted, again
                t.send_heartbeat(Heartbeat(run_id=RUN, learner_id=t.learner_id, step=2))
        admitted = len(syncer.learners)
        syncer.receive(0.0)  # every stream's group made
        used = int(admin.info("memory")["used_memory"])
        loops: list[float] = []
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            started = time.perf_counter()
            syncer.receive(0.0)
            loops.append((time.perf_counter() - started) * 1000)
        users = len(admin.acl_users())
    finally:
        for t in transports:
            t.close()
        syncer.close()
        admin.close()
        server.stop()
    return {
        "learners": learners,
        "admitted": admitted,
        "fragments": FRAGMENTS,
        "acl_users": users,
        "redis_bytes_per_learner": round((used - empty) / max(1, learners)),
        "loop_ms_mean": round(statistics.mean(loops), 3),
        "loop_ms_median": round(statistics.median(loops), 3),
        "loops": len(loops),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    n = [r["learners"] for r in rows]
    left.plot(n, [r["loop_ms_mean"] for r in rows], "o-", label="mean")
    left.plot(n, [r["loop_ms_median"] for r in rows], "s--", label="median")
    left.set(xlabel="learners", ylabel="syncer receive(0), ms", xscale="log")
    left.legend()
    right.plot(n, [r["redis_bytes_per_learner"] / 1024 for r in rows], "o-")
    right.set(xlabel="learners", ylabel="Redis memory per learner, kB", xscale="log")
    fig.suptitle(f"A Redis run's cost per learner ({FRAGMENTS} fragments, keys on)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: 1 and 8 learners")
    which.add_argument("--quick", action="store_true", help="1, 16 and 64 learners")
    ap.add_argument("--out", default="benchmarks/results/roster")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    workdir = Path(tempfile.mkdtemp(prefix="ddiloco-roster-"))
    keys_dir = make_keys(workdir / "keys")
    rows = []
    for learners in MODES[mode]:
        rows.append(measure(learners, keys_dir, workdir))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"roster-{mode}.json").write_text(json.dumps({"mode": mode, "rows": rows}, indent=1))
    plot(rows, out / f"roster-{mode}.png")
    print(f"wrote {out / f'roster-{mode}.json'} and roster-{mode}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
