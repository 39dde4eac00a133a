"""Transport throughput on loopback: deltas/s and MB/s through each backend,
against the raw library moving the same bytes the same way, in the same run.

    python -m benchmarks.transport [--smoke | --quick] [--out benchmarks/results/transport.json]
    python -m benchmarks.transport --keys [--smoke | --quick]   # the cost of the run's keys

One learner process sends fp32 deltas of each size; one syncer process
receives and acknowledges each (as a syncer does after its update is durable,
minus the update). Measured from the first send to the last acknowledgement,
so it is end-to-end delivered throughput, not socket write speed. Redis is a
private server started for the run (AOF with appendfsync always, so every
acknowledged delta is on disk) unless --redis-url is given.

The baselines do what each backend does with nothing of ours on the path:
``raw_zmq`` sends the bytes from a DEALER to a ROUTER in another process that
answers each with an 8-byte acknowledgement, at most 16 unacknowledged (the
backend's window here); ``raw_redis`` XADDs them one at a time (a delta is
delivered when its XADD returns, as in the backend) while a consumer process
reads them with XREADGROUP and XACKs them. ``ratio_vs_raw`` is the backend's
MB/s over its baseline's at the same size. The two are measured in pairs,
alternately first (ours then raw, raw then ours, ...), ``pairs`` times per size:
a pair runs within seconds, so a slow minute of the disk (fsync, for Redis)
or of the machine falls on both of its halves, and ``ratio_vs_raw`` in
``summary`` is the median of the pairs' ratios.

With ``--keys`` the baseline is the same backend without keys (``--insecure``)
instead of the raw library, measured in the same alternating pairs:
``ratio_vs_raw`` is then keys on over keys off (ZeroMQ: CURVE encryption and
the per-message key check; both backends: nothing else on the delta path).
The JSON also gets ``signatures``: seconds per MB to sign a global and to
check its signature (median of 5), at each size. Every process, ours and the
baselines', freezes its startup heap before it is timed, as the services do
(:func:`broker.runtime.freeze_startup_heap`): a full garbage collection over
torch's objects costs a tenth of a second whichever code triggers it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import numpy as np

from broker.connect import connect_learner, connect_syncer
from broker.errors import MeasurementError
from broker.identity.keys import RunKeys
from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.run.key_folder import make_keys
from broker.run.settings import RunSettings
from broker.runtime import freeze_startup_heap
from broker.transport import Backpressure
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, GlobalFragment

RUN = "bench"
PLAN = "0123456789abcdef"
INCARNATION = 1
# A spawned side imports torch (through broker.wire.codecs) before it is ready: on a
# loaded machine that alone can take a minute. Not timed.
_START_TIMEOUT_S = 300
WINDOW = 16  # deltas in flight: the backends' max_unacked here, and the raw window
# (fragment sizes in MiB, about how many bytes each backend sends at each size, pairs).
# ZeroMQ moves 2-4 GB/s here: 256 MB took 0.1 s, where one scheduling hiccup
# moved the ratio by a fifth, so it sends more. Redis writes every byte to disk.
MODES: dict[str, tuple[tuple[float, ...], dict[str, float], int]] = {
    "smoke": ((1,), {"zmq": 32e6, "redis": 32e6}, 1),
    "quick": ((1, 16), {"zmq": 2e9, "redis": 256e6}, 3),
    "full": ((1, 16, 64), {"zmq": 8e9, "redis": 1e9}, 5),
}


def _syncer(url: str, ready: Any, stop: Any, keys_dir: str | None) -> None:
    keys = RunKeys.load(keys_dir, "syncer") if keys_dir else None
    transport = connect_syncer(
        url, run_id=RUN, syncer_id="bench", fragments=[0], keys=keys,
        identity_hold_s=RunSettings().gone_after_s,
    )  # fmt: skip
    freeze_startup_heap()
    ready.set()
    while not stop.is_set():
        items = transport.receive(0.05)
        if items:
            transport.ack(items)
    transport.close()


def measure(
    backend: str, url: str, size_bytes: int, count: int, keys_dir: str | None = None
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_syncer, args=(url, ready, stop, keys_dir), daemon=True)
    proc.start()
    if not ready.wait(_START_TIMEOUT_S):
        raise MeasurementError("syncer side did not start")
    # A deep window and a long ack timeout: measure throughput, not resends.
    sep = "&" if "?" in url else "?"
    learner = connect_learner(
        f"{url}{sep}max_unacked={WINDOW}" + ("&ack_timeout_s=30" if backend == "zmq" else ""),
        run_id=RUN,
        learner_id="bench-learner",
        incarnation=INCARNATION,
        num_fragments=1,
        keys=RunKeys.load(keys_dir, "learner") if keys_dir else None,
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
                        # As the learner's comm thread waits: poll returns as
                        # soon as an acknowledgement arrives.
                        learner.poll(0.01)
            if not learner.flush(300):
                raise MeasurementError(f"{learner.unacked} deltas never acknowledged")
            elapsed = time.perf_counter() - start
        wire_bytes = learner.stats.bytes_sent
    finally:
        learner.close()
        stop.set()
        proc.join(30)
    name = f"{backend}+keys" if keys_dir else backend
    return _result(name, size_bytes, count, elapsed) | {"wire_bytes_total": wire_bytes}


def _raw_zmq_receiver(endpoint: str, ready: Any, stop: Any) -> None:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    freeze_startup_heap()
    ready.set()
    while not stop.is_set():
        if not router.poll(50):
            continue
        while True:
            try:
                identity, seq, _ = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            router.send_multipart([identity, seq])  # the 8-byte acknowledgement
    ctx.destroy(linger=0)


def measure_raw_zmq(endpoint: str, size_bytes: int, count: int) -> dict[str, Any]:
    import zmq

    ctx_mp = mp.get_context("spawn")
    ready, stop = ctx_mp.Event(), ctx_mp.Event()
    proc = ctx_mp.Process(target=_raw_zmq_receiver, args=(endpoint, ready, stop), daemon=True)
    proc.start()
    if not ready.wait(_START_TIMEOUT_S):
        raise MeasurementError("raw ZeroMQ receiver did not start")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    payload = np.random.default_rng(0).standard_normal(size_bytes // 4, dtype=np.float32)
    body = payload.tobytes()
    try:
        for warm in (True, False):
            n = 2 if warm else count
            start = time.perf_counter()
            sent = acked = 0
            while acked < n:
                while sent < n and sent - acked < WINDOW:
                    dealer.send_multipart([sent.to_bytes(8, "little"), body], copy=False)
                    sent += 1
                dealer.recv()
                acked += 1
            elapsed = time.perf_counter() - start
    finally:
        ctx.destroy(linger=0)
        stop.set()
        proc.join(30)
    return _result("raw_zmq", size_bytes, count, elapsed)


def _raw_redis_consumer(url: str, stream: str, ready: Any, stop: Any) -> None:
    import redis

    client = redis.Redis.from_url(url)
    with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: made by an earlier size
        client.xgroup_create(stream, "raw", id="0", mkstream=True)
    freeze_startup_heap()
    ready.set()
    while not stop.is_set():
        reply = cast(list[Any], client.xreadgroup("raw", "c", {stream: ">"}, count=64, block=50))
        for _, entries in reply or []:
            client.xack(stream, "raw", *[entry_id for entry_id, _ in entries])
    client.close()


def measure_raw_redis(url: str, size_bytes: int, count: int) -> dict[str, Any]:
    import redis

    stream = f"bench-raw-{size_bytes}"
    ctx_mp = mp.get_context("spawn")
    ready, stop = ctx_mp.Event(), ctx_mp.Event()
    proc = ctx_mp.Process(target=_raw_redis_consumer, args=(url, stream, ready, stop), daemon=True)
    proc.start()
    if not ready.wait(_START_TIMEOUT_S):
        raise MeasurementError("raw Redis consumer did not start")
    client = redis.Redis.from_url(url)
    body = np.random.default_rng(0).standard_normal(size_bytes // 4, dtype=np.float32).tobytes()
    try:
        for warm in (True, False):
            n = 2 if warm else count
            start = time.perf_counter()
            for _ in range(n):
                client.xadd(stream, {"m": body}, maxlen=10_000, approximate=True)
            elapsed = time.perf_counter() - start
    finally:
        stop.set()
        proc.join(30)
        client.delete(stream)
        client.close()
    return _result("raw_redis", size_bytes, count, elapsed)


def measure_pair(
    backend: str,
    urls: tuple[str, str],
    size_bytes: int,
    count: int,
    raw_first: bool,
    keys_dir: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ours and its baseline, one right after the other, in the order given: the
    raw library's, or (``keys_dir``) ours with keys against ours without.
    ``urls``: ours, and the baseline's (Redis: with keys, a server with the
    run's users and TLS; without, a plain one)."""
    from compose.processes import free_port_pair

    url, base_url = urls

    def raw() -> dict[str, Any]:
        if keys_dir:
            return measure(backend, base_url, size_bytes, count)
        if backend == "zmq":
            endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
            return measure_raw_zmq(endpoint, size_bytes, count)
        return measure_raw_redis(url, size_bytes, count)

    if raw_first:
        base = raw()
        return measure(backend, url, size_bytes, count, keys_dir), base
    return measure(backend, url, size_bytes, count, keys_dir), raw()


def signature_costs(sizes_mb: tuple[float, ...], repeats: int = 5) -> list[dict[str, Any]]:
    """Seconds per MB to sign a global of each size and to check it (median)."""
    keys_dir = make_keys(Path(tempfile.mkdtemp(prefix="ddiloco-bench-keys-")) / "keys")
    signer = GlobalSigner(RunKeys.load(keys_dir, "syncer"))
    verifier = GlobalVerifier(RunKeys.load(keys_dir, "learner"))
    out = []
    for mb in sizes_mb:
        size = int(mb * 1024 * 1024)
        payload = np.random.default_rng(0).standard_normal(size // 4, dtype=np.float32).tobytes()
        g = GlobalFragment(
            run_id=RUN, fragment=0, plan_hash=PLAN, version=1, codec=Codec("fp32"),
            numel=size // 4, payload=payload,
        )  # fmt: skip
        sign_s, verify_s = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            signed = signer.sign(g)
            sign_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            if not verifier.verify(signed):
                raise MeasurementError("a signature did not verify")
            verify_s.append(time.perf_counter() - start)
        out.append(
            {
                "fragment_bytes": size,
                "sign_s_per_mb": round(statistics.median(sign_s) / (size / 1e6), 6),
                "verify_s_per_mb": round(statistics.median(verify_s) / (size / 1e6), 6),
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def _result(backend: str, size_bytes: int, count: int, elapsed: float) -> dict[str, Any]:
    return {
        "backend": backend,
        "fragment_bytes": size_bytes,
        "deltas": count,
        "seconds": round(elapsed, 4),
        "deltas_per_s": round(count / elapsed, 2),
        "mb_per_s": round(count * size_bytes / elapsed / 1e6, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        default="benchmarks/results/transport.json",
        help="the results JSON; its PNG is written beside it",
    )
    ap.add_argument("--backends", default="zmq,redis")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--smoke", action="store_true", help="CI: 1 MB, 32 MB, one pair")
    which.add_argument("--quick", action="store_true", help="1 and 16 MB, 3 pairs")
    ap.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    ap.add_argument(
        "--keys", action="store_true", help="baseline: the same backend without the run's keys"
    )
    args = ap.parse_args(argv)
    keys_dir = None
    if args.keys:
        keys_dir = str(make_keys(Path(tempfile.mkdtemp(prefix="ddiloco-bench-keys-")) / "keys"))
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes_mb, bytes_per_backend, pairs = MODES[mode]
    freeze_startup_heap()

    servers = []
    results: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    try:
        for backend in args.backends.split(","):
            if backend == "redis" and args.redis_url:
                url = base_url = args.redis_url
            elif backend == "redis":
                from broker.redis.server import RedisServer

                folder = Path(tempfile.mkdtemp(prefix="ddiloco-bench-"))
                plain = RedisServer(folder / "plain")
                servers.append(plain)
                plain.start()
                url = base_url = plain.url
                if keys_dir:  # the run's users, and TLS with the run's CA
                    keyed = RedisServer(folder / "keyed", keys=Path(keys_dir), tls=True)
                    servers.append(keyed)
                    keyed.start()
                    url = keyed.url
            else:
                from compose.processes import free_port_pair

                url = base_url = f"zmq://127.0.0.1:{free_port_pair()}"
            for mb in sizes_mb:
                size = int(mb * 1024 * 1024)
                count = max(8, int(bytes_per_backend[backend] // size))
                ratios, ours_mb_s, raw_mb_s = [], [], []
                for pair in range(pairs):
                    mine, base = measure_pair(
                        backend, (url, base_url), size, count, pair % 2 == 1, keys_dir
                    )
                    mine["ratio_vs_raw"] = round(mine["mb_per_s"] / base["mb_per_s"], 3)
                    for r in (mine, base):
                        r["pair"] = pair
                        print(json.dumps(r), flush=True)
                    results += [mine, base]
                    ratios.append(mine["ratio_vs_raw"])
                    ours_mb_s.append(mine["mb_per_s"])
                    raw_mb_s.append(base["mb_per_s"])
                summary.append(
                    {
                        "backend": backend,
                        "fragment_bytes": size,
                        "pairs": pairs,
                        "pair_ratios": ratios,
                        "ratio_vs_raw": round(statistics.median(ratios), 3),
                        "mb_per_s": round(statistics.median(ours_mb_s), 2),
                        "raw_mb_per_s": round(statistics.median(raw_mb_s), 2),
                    }
                )
                print(json.dumps(summary[-1]), flush=True)
    finally:
        for server in servers:
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
                "mode": mode,
                "window": WINDOW,
                "baseline": "keys off" if args.keys else "raw library",
                "summary": summary,
                "signatures": signature_costs(sizes_mb) if args.keys else [],
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    _plot(summary, out.with_suffix(".png"), "keys off" if args.keys else "raw library")
    return 0


def _plot(summary: list[dict[str, Any]], path: Path, baseline: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    at = np.arange(len(summary))
    ax.bar(at - 0.2, [s["mb_per_s"] for s in summary], 0.4, label="ddiloco")
    ax.bar(at + 0.2, [s["raw_mb_per_s"] for s in summary], 0.4, label=baseline)
    ax.set_xticks(at)
    ax.set_xticklabels(
        [
            f"{s['backend']} {s['fragment_bytes'] / 2**20:.0f} MB\nratio {s['ratio_vs_raw']}"
            for s in summary
        ]
    )
    ax.set_ylabel("delivered MB/s, median of pairs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
