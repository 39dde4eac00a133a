"""A stand-in syncer for transport tests, run as a real process.

It receives deltas through a :class:`broker.transport.SyncerTransport`,
"applies" each one by recording (learner, incarnation, seq, fragment) in a
SQLite file in the same transaction as the de-duplication check, commits
(the update is durable), and only then acks. Killing it at any point must
leave every delta recorded exactly once after a restart.

    python -m tests.transport_consumer --backend redis --url URL --db applied.sqlite ...
"""

from __future__ import annotations

import argparse
import signal
import sqlite3
import sys
import time

import torch

from broker.redis.options import RedisOptions
from broker.transport import SyncerTransport
from broker.wire.messages import Delta, GlobalFragment

PLAN_HASH = "0123456789abcdef"


def open_db(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(
        "CREATE TABLE IF NOT EXISTS applied ("
        "learner TEXT, incarnation INTEGER, seq INTEGER, fragment INTEGER)"
    )
    # Not UNIQUE: a double application must show up as a second row.
    db.execute("CREATE INDEX IF NOT EXISTS by_id ON applied (learner, incarnation, seq)")
    return db


def make_transport(args: argparse.Namespace) -> SyncerTransport:
    fragments = [int(p) for p in args.fragments.split(",")]
    if args.backend == "redis":
        from broker.identity.keys import RunKeys
        from broker.redis.syncer import RedisSyncerTransport

        return RedisSyncerTransport(
            args.url,
            args.run,
            consumer=args.syncer_id,
            fragments=fragments,
            keys=RunKeys.load(args.keys, "syncer") if args.keys else None,
            options=RedisOptions(claim_idle_s=args.claim_idle_s),
            identity_hold_s=15.0,
        )
    from broker.zmq.syncer import ZmqSyncerTransport

    return ZmqSyncerTransport(args.url, args.run, fragments=fragments, identity_hold_s=15.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["redis", "zmq"], required=True)
    ap.add_argument("--url", required=True, help="redis URL or zmq bind endpoint")
    ap.add_argument("--run", default="test")
    ap.add_argument("--fragments", default="0,1,2,3")
    ap.add_argument("--syncer-id", default="syncer-0")
    ap.add_argument("--db", required=True)
    ap.add_argument("--claim-idle-s", type=float, default=2.0)
    ap.add_argument("--keys", help="redis: the run's key folder (none: a Redis without users)")
    ap.add_argument("--publish", action="store_true", help="publish a global per applied batch")
    args = ap.parse_args(argv)

    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    db = open_db(args.db)
    transport = make_transport(args)
    versions: dict[int, int] = {}
    print("ready", flush=True)
    while not stop:
        items = transport.receive(0.2)
        deltas = [i for i in items if isinstance(i.message, Delta)]
        if not deltas:
            continue
        db.execute("BEGIN IMMEDIATE")
        touched: set[int] = set()
        for item in deltas:
            d = item.message
            assert isinstance(d, Delta)
            seen = db.execute(
                "SELECT 1 FROM applied WHERE learner=? AND incarnation=? AND seq=?",
                (d.learner_id, d.incarnation, d.seq),
            ).fetchone()
            if not seen:
                db.execute(
                    "INSERT INTO applied VALUES (?, ?, ?, ?)",
                    (d.learner_id, d.incarnation, d.seq, d.fragment),
                )
                touched.add(d.fragment)
        db.execute("COMMIT")  # durable before the ack
        if args.publish:
            for p in sorted(touched):
                versions[p] = versions.get(p, 0) + 1
                payload = torch.full((4,), float(versions[p])).numpy().tobytes()
                transport.publish(
                    GlobalFragment(
                        run_id=args.run,
                        fragment=p,
                        plan_hash=PLAN_HASH,
                        version=versions[p],
                        codec="fp32",
                        numel=4,
                        payload=payload,
                        sent_at=time.time(),
                    )
                )
        transport.ack(deltas)
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
