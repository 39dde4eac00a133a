"""Transport throughput on loopback: deltas/s and MB/s through each backend.

    python -m benchmarks.transport [--out benchmarks/results/transport.json]

One learner process sends fp32 deltas of each size; one syncer process
receives and acknowledges each (as a syncer does after its update is durable,
minus the update). Measured from the first send to the last acknowledgement,
so it is end-to-end delivered throughput, not socket write speed. Redis is a
private server started for the run (AOF with appendfsync always, so every
acknowledged delta is on disk) unless --redis-url is given.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from broker.codecs import Codec
from broker.connect import connect_learner, connect_syncer
from broker.transport import Backpressure
from broker.wire import Delta

RUN = "bench"
PLAN = "0123456789abcdef"
INCARNATION = 1


def _syncer(url: str, ready: Any, stop: Any) -> None:
    transport = connect_syncer(url, run_id=RUN, syncer_id="bench", fragments=[0])
    ready.set()
    while not stop.is_set():
        items = transport.receive(0.05)
        if items:
            transport.ack(items)
    transport.close()


def measure(backend: str, url: str, size_bytes: int, count: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_syncer, args=(url, ready, stop), daemon=True)
    proc.start()
    if not ready.wait(60):
        raise RuntimeError("syncer side did not start")
    # A deep window and a long ack timeout: measure throughput, not resends.
    sep = "&" if "?" in url else "?"
    learner = connect_learner(
        f"{url}{sep}max_unacked=16&ack_timeout_s=30",
        run_id=RUN,
        learner_id="bench-learner",
        incarnation=INCARNATION,
        num_fragments=1,
    )
    numel = size_bytes // 4
    payload = np.random.default_rng(0).standard_normal(numel, dtype=np.float32).tobytes()
    try:
        # Warm up (connections, first allocations), then time.
        seq = 0
        for warm in (True, False):
            n = 2 if warm else count
            start = time.perf_counter()
            for _ in range(n):
                seq += 1
                delta = Delta(
                    run_id=RUN,
                    learner_id="bench-learner",
                    incarnation=INCARNATION,
                    seq=seq,
                    fragment=0,
                    plan_hash=PLAN,
                    base_version=0,
                    step=seq,
                    c_steps=1,
                    c_tokens=1,
                    sent_at=time.time(),
                    codec=Codec("fp32"),
                    numel=numel,
                    payload=payload,
                )
                while True:
                    try:
                        learner.send_delta(delta)
                        break
                    except Backpressure:
                        learner.poll(0.001)
            if not learner.flush(300):
                raise RuntimeError(f"{learner.unacked} deltas never acknowledged")
            elapsed = time.perf_counter() - start
        wire_bytes = learner.stats.bytes_sent
    finally:
        learner.close()
        stop.set()
        proc.join(30)
    return {
        "backend": backend,
        "fragment_bytes": size_bytes,
        "deltas": count,
        "seconds": round(elapsed, 4),
        "deltas_per_s": round(count / elapsed, 2),
        "mb_per_s": round(count * size_bytes / elapsed / 1e6, 2),
        "wire_bytes_total": wire_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/transport.json")
    ap.add_argument("--backends", default="zmq,redis")
    ap.add_argument("--sizes-mb", default="1,16")
    ap.add_argument(
        "--bytes-per-size",
        type=float,
        default=512e6,
        help="send about this many bytes per (backend, size)",
    )
    ap.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    args = ap.parse_args(argv)

    server = None
    results = []
    try:
        for backend in args.backends.split(","):
            if backend == "redis" and args.redis_url:
                url = args.redis_url
            elif backend == "redis":
                from tests.servers import RedisServer

                server = RedisServer(Path(tempfile.mkdtemp(prefix="ddiloco-bench-")))
                server.start()
                url = server.url
            else:
                from compose.processes import free_port_pair

                url = f"zmq://127.0.0.1:{free_port_pair()}"
            for mb in (float(x) for x in args.sizes_mb.split(",")):
                size = int(mb * 1024 * 1024)
                count = max(8, int(args.bytes_per_size // size))
                r = measure(backend, url, size, count)
                print(json.dumps(r), flush=True)
                results.append(r)
    finally:
        if server:
            server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "transport",
                "machine": {
                    "cpus": mp.cpu_count(),
                    "python": sys.version.split()[0],
                    "platform": platform.platform(),
                },
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    _plot(results, out.with_suffix(".png"))
    return 0


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r['backend']}\n{r['fragment_bytes'] / 2**20:.0f} MB" for r in results]
    ax.bar(labels, [r["mb_per_s"] for r in results])
    ax.set_ylabel("delivered MB/s (loopback, acked)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
