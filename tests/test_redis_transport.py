"""Integration tests of the Redis Streams transport against a real redis-server.

Each test gets a private redis-server (AOF, appendfsync always) on a free port.
The consumer-process tests run ``tests/transport_consumer.py``, which records
every applied delta in SQLite with de-duplication and acks only after its
commit: "exactly once" means SQLite holds every sent (learner, seq) once.
"""

from __future__ import annotations

import logging
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import torch

from broker.errors import ConfigError
from broker.identity.keys import RunKeys
from broker.redis import delta_reader as redis_deltas
from broker.redis.frames import FIELD, PART_FIELDS, check_entry
from broker.redis.learner import RedisLearnerTransport
from broker.redis.names import (
    GROUP,
    changes_key,
    delta_stream_key,
    globals_stream_key,
    heartbeat_key,
    model_key,
    roster_key,
    weightless_key,
)
from broker.redis.options import RedisOptions
from broker.redis.server import RedisServer
from broker.redis.syncer import RedisSyncerTransport
from broker.transport import Backpressure, Inbound, TransportError, TransportStats
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import (
    Delta,
    GlobalFragment,
    Heartbeat,
    decode,
    decode_parts,
    encode,
    encode_parts,
    weights_checksum,
)
from tests.servers import run_keys, take_globals, wait_until

pytestmark = pytest.mark.integration

RUN = "test"
PLAN_HASH = "0123456789abcdef"
REPO_ROOT = Path(__file__).resolve().parents[1]


# -- helpers -------------------------------------------------------------------
def make_delta(learner: str, seq: int, fragment: int, numel: int = 4, run: str = RUN) -> Delta:
    payload = torch.full((numel,), float(seq)).numpy().tobytes()
    return Delta(
        run_id=run,
        learner_id=learner,
        incarnation=1,
        seq=seq,
        fragment=fragment,
        plan_hash=PLAN_HASH,
        base_version=0,
        step=seq,
        c_steps=1,
        c_tokens=64,
        codec="fp32",
        numel=numel,
        payload=payload,
        sent_at=time.time(),
    )


def make_global(fragment: int, version: int, run: str = RUN) -> GlobalFragment:
    payload = torch.full((4,), float(version)).numpy().tobytes()
    return GlobalFragment(
        run_id=run,
        fragment=fragment,
        plan_hash=PLAN_HASH,
        version=version,
        codec="fp32",
        numel=4,
        payload=payload,
        sent_at=time.time(),
    )


def versions_of(globals_: list[GlobalFragment]) -> list[tuple[int, int]]:
    return [(g.fragment, g.version) for g in globals_]


def send_all(transport: RedisLearnerTransport, deltas: list[Delta], pace_s: float = 0.0) -> None:
    """What a learner's comm thread does: hand deltas over, wait on backpressure."""
    for delta in deltas:
        while True:
            try:
                transport.send_delta(delta)
                break
            except Backpressure:
                transport.poll(0.05)
        if pace_s:
            transport.poll(pace_s)
    assert transport.flush(60.0), f"{transport.unacked} deltas never delivered"


def run_learners(
    url: str,
    counts: dict[str, int],
    num_fragments: int,
    pace_s: float = 0.0,
    keys: Path | None = None,
) -> tuple[ThreadPoolExecutor, list]:
    """One thread and one transport per learner; delta seq s goes to fragment s % P."""
    pool = ThreadPoolExecutor(len(counts))
    learner_keys = RunKeys.load(keys, "learner") if keys else None
    transports = {
        name: RedisLearnerTransport(
            url,
            RUN,
            name,
            0,
            num_fragments,
            keys=learner_keys,
            options=RedisOptions(max_unacked=16),
        )
        for name in counts
    }

    def work(name: str) -> RedisLearnerTransport:
        deltas = [make_delta(name, s, s % num_fragments) for s in range(counts[name])]
        send_all(transports[name], deltas, pace_s)
        return transports[name]

    return pool, [pool.submit(work, name) for name in counts]


def applied(db: Path) -> tuple[int, int]:
    """(rows, distinct (learner, incarnation, seq)) in the consumer's SQLite file."""
    if not db.exists():
        return 0, 0
    con = sqlite3.connect(db, timeout=5)
    try:
        rows, distinct = con.execute(
            "SELECT COUNT(*), COUNT(DISTINCT learner || ':' || incarnation || ':' || seq)"
            " FROM applied"
        ).fetchone()
        return int(rows), int(distinct)
    except sqlite3.OperationalError:  # the consumer has not created the table yet
        return 0, 0
    finally:
        con.close()


def delta_streams(client: redis.Redis, fragments: range) -> list[str]:
    """Every learner's delta stream of ``fragments``."""
    keys = [k.decode() for k in client.scan_iter(match=f"ddiloco:{RUN}:deltas:*")]
    return [k for k in keys if int(k.split(":")[3]) in fragments]


def pending_total(client: redis.Redis, fragments: range) -> int:
    return sum(int(client.xpending(s, GROUP)["pending"]) for s in delta_streams(client, fragments))


class ConsumerProcess:
    """``python -m tests.transport_consumer`` as a real process that can be SIGKILLed."""

    def __init__(
        self, url: str, db: Path, log: Path, syncer_id: str = "syncer-0", keys: Path | None = None
    ) -> None:
        self.args = [
            sys.executable,
            "-m",
            "tests.transport_consumer",
            "--backend",
            "redis",
            "--url",
            url,
            "--db",
            str(db),
            "--run",
            RUN,
            "--syncer-id",
            syncer_id,
            *(["--keys", str(keys)] if keys else []),
        ]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=REPO_ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        assert self.proc is None or self.proc.returncode in (0, -signal.SIGKILL), (
            self.log.read_text()[-2000:]
        )


@contextmanager
def consumer_process(
    url: str, tmp_path: Path, keys: Path | None = None
) -> Iterator[tuple[ConsumerProcess, Path]]:
    db = tmp_path / "applied.sqlite"
    consumer = ConsumerProcess(url, db, tmp_path / "consumer.log", keys=keys)
    consumer.start()
    try:
        yield consumer, db
    finally:
        consumer.stop()


def receive_until(
    syncer: RedisSyncerTransport,
    count: int,
    timeout_s: float = 20.0,
) -> list[Inbound]:
    """Receive deltas (not acking them) until ``count`` arrived."""
    got: list[Inbound] = []

    def enough() -> bool:
        got.extend(i for i in syncer.receive(0.1) if isinstance(i.message, Delta))
        return len(got) >= count

    wait_until(enough, timeout_s, interval_s=0, what=f"{count} deltas")
    return got


def poll_until(
    learner: RedisLearnerTransport,
    count: int,
    timeout_s: float = 10.0,
) -> list[GlobalFragment]:
    """Poll until ``count`` globals arrived."""
    got: list[GlobalFragment] = []

    def enough() -> bool:
        got.extend(take_globals(learner, 0.1))
        return len(got) >= count

    wait_until(enough, timeout_s, interval_s=0, what=f"{count} globals")
    return got


def stream_ids(client: redis.Redis, key: str) -> list[bytes]:
    return [cast(bytes, entry_id) for entry_id, _ in cast(list, client.xrange(key))]


def seq_of(item: Inbound) -> int:
    assert isinstance(item.message, Delta)
    return item.message.seq


def delta_keys(items: list[Inbound]) -> set[tuple[str, int]]:
    keys = set()
    for item in items:
        assert isinstance(item.message, Delta)
        keys.add((item.message.learner_id, item.message.seq))
    return keys


# -- 1. throughput, exactly once ----------------------------------------------------
@pytest.mark.timeout(120)
def test_ten_thousand_deltas_from_four_learners_applied_exactly_once(
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    counts = {f"learner-{i}": 2500 for i in range(4)}
    with consumer_process(redis_server.url, tmp_path) as (_, db):
        pool, futures = run_learners(redis_server.url, counts, num_fragments=4)
        with pool:
            learners = [f.result(timeout=90) for f in futures]
        assert sum(t.stats.messages_sent for t in learners) == 10_000
        wait_until(lambda: applied(db)[0] >= 10_000, 90, interval_s=0.1, what="10,000 applied")
        client = redis.Redis.from_url(redis_server.url)
        wait_until(lambda: pending_total(client, range(4)) == 0, 10, what="all acked")
    assert applied(db) == (10_000, 10_000)
    for t in learners:
        t.close()


# -- 2. consumer killed mid-stream ----------------------------------------------------
@pytest.mark.timeout(300)
def test_consumer_sigkilled_twice_mid_stream_applies_every_delta_once(
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    total = 3000
    counts = {"learner-0": total // 2, "learner-1": total // 2}
    kill_points = [rng.randint(total // 10, total // 3), rng.randint(total // 2, 3 * total // 4)]
    with consumer_process(redis_server.url, tmp_path) as (consumer, db):
        pool, futures = run_learners(redis_server.url, counts, num_fragments=4, pace_s=0.0005)
        with pool:
            for point in kill_points:
                wait_until(
                    lambda p=point: applied(db)[0] >= p,
                    60,
                    interval_s=0.005,
                    what=f"{point} applied (seed {seed})",
                )
                consumer.kill()
                consumer.start()  # same consumer name: re-reads its own pending entries
            learners = [f.result(timeout=60) for f in futures]
        wait_until(
            lambda: applied(db)[0] >= total, 60, interval_s=0.1, what=f"all applied (seed {seed})"
        )
        client = redis.Redis.from_url(redis_server.url)
        wait_until(lambda: pending_total(client, range(4)) == 0, 10, what="all acked")
    assert applied(db) == (total, total), f"seed {seed}, kills at {kill_points}"
    for t in learners:
        t.close()


# -- 3. redis-server killed mid-stream ------------------------------------------------
@pytest.mark.timeout(120)
def test_redis_sigkilled_mid_stream_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """Redis as compose and the docs start it (the run's redis.acl, TLS, AOF with
    appendfsync always): its append-only file replays the learners' deltas,
    each written by a script, after a SIGKILL."""
    keys = Path(run_keys())
    server = RedisServer(tmp_path / "redis", keys=keys, tls=True)
    server.start()
    total = 2000
    counts = {"learner-0": total // 2, "learner-1": total // 2}
    try:
        with consumer_process(server.url, tmp_path, keys) as (_, db):
            client = server.client()
            pool, futures = run_learners(
                server.url, counts, num_fragments=4, pace_s=0.002, keys=keys
            )
            with pool:
                wait_until(
                    lambda: applied(db)[0] >= total // 4, 60, interval_s=0.01,
                    what="a quarter applied",
                )  # fmt: skip
                assert not all(f.done() for f in futures), "learners finished before the kill"
                server.kill()  # SIGKILL: only what the AOF holds survives
                server.start()  # same port, folder and flags
                learners = [f.result(timeout=90) for f in futures]
            # Every XADD the learners saw acknowledged left their queues; flush()
            # above returned True, so all `total` were acknowledged at some point.
            assert sum(t.stats.messages_sent for t in learners) == total
            assert sum(t.connection_errors for t in learners) > 0, "learners never saw the outage"
            wait_until(lambda: applied(db)[0] >= total, 60, interval_s=0.1, what="all applied")
            wait_until(lambda: pending_total(client, range(4)) == 0, 15, what="all acked")
        assert applied(db) == (total, total)
        assert "NOPERM" not in (server.workdir / "redis.log").read_text()
        for t in learners:
            t.close()
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_outage_queues_deltas_and_globals_then_backpressure_then_delivers(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 0, num_fragments=2, options=RedisOptions(max_unacked=8)
    )
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0, 1], identity_hold_s=15.0)
    assert learner.snapshot([0, 1], timeout_s=5) == {}
    redis_server.kill()

    for seq in range(8):  # queued, not raised
        learner.send_delta(make_delta("learner-0", seq, seq % 2))
    with pytest.raises(Backpressure):
        learner.send_delta(make_delta("learner-0", 8, 0))
    for step in (1, 2):  # liveness only: dropped while Redis is away, and counted
        learner.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", step=step))
    assert take_globals(learner, 0.3) == [] and learner.unacked == 8
    assert syncer.receive(0.3) == []
    syncer.publish(make_global(0, 1))  # kept until redis is back
    assert learner.connection_errors > 0 and syncer.connection_errors > 0
    assert learner.heartbeats_dropped == 2
    with pytest.raises(TransportError):
        learner.snapshot([0], timeout_s=0.3)

    redis_server.start()
    assert learner.flush(15.0)
    assert learner.stats.resent >= 1 and learner.stats.messages_sent == 8
    learner.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", step=3))
    heartbeat = decode(redis_server.client().get(heartbeat_key(RUN, "learner-0")))
    assert isinstance(heartbeat, Heartbeat) and heartbeat.step == 3
    got = receive_until(syncer, 8)  # receive() also writes the queued global
    assert sorted(seq_of(i) for i in got) == list(range(8))
    assert versions_of(poll_until(learner, 1)) == [(0, 1)]
    learner.close()
    syncer.close()


@pytest.mark.timeout(60)
def test_a_learner_that_redis_refuses_for_memory_backs_off_counts_it_and_delivers_later(
    redis_server: RedisServer,
) -> None:
    """Redis at its maxmemory with noeviction (as the compose cluster runs it)
    answers writes with OOM: the learner queues, backs off, counts each such
    reply, loses nothing, and delivers once there is room again."""
    admin = redis_server.client()
    learner = RedisLearnerTransport(redis_server.url, RUN, "learner-0", 0, num_fragments=1)
    syncer = RedisSyncerTransport(redis_server.url, RUN, "syncer-0", [0], identity_hold_s=15.0)
    assert syncer.receive(0.1) == []  # its group exists
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]))
    try:
        for seq in range(4):
            learner.send_delta(make_delta("learner-0", seq, 0))  # queued, not raised
        assert not learner.flush(1.0) and learner.unacked == 4
        assert learner.stats.out_of_memory > 0
    finally:
        admin.config_set("maxmemory", 0)
    assert learner.flush(15.0)
    assert sorted(seq_of(i) for i in receive_until(syncer, 4)) == list(range(4))
    learner.close()
    syncer.close()


# -- 4. a dead consumer's pending entries are claimed --------------------------------
@pytest.mark.timeout(60)
def test_second_consumer_claims_pending_entries_of_a_dead_one(redis_server: RedisServer) -> None:
    url = redis_server.url
    learner = RedisLearnerTransport(url, RUN, "learner-0", 0, num_fragments=2)
    sent = [make_delta("learner-0", s, s % 2) for s in range(300)]
    send_all(learner, sent)

    dead = RedisSyncerTransport(
        url, RUN, "syncer-dead", [0, 1], options=RedisOptions(claim_idle_s=60), identity_hold_s=15.0
    )
    held = receive_until(dead, 120)
    dead.ack(held[:40])  # it applied some, then died holding the rest
    dead.close()
    client = redis.Redis.from_url(url)
    pending: Counter[bytes] = Counter()
    for stream in delta_streams(client, range(2)):
        for c in client.xpending(stream, GROUP)["consumers"]:
            pending[c["name"]] += c["pending"]
    assert pending == {b"syncer-dead": len(held) - 40}

    heir = RedisSyncerTransport(
        url,
        RUN,
        "syncer-heir",
        [0, 1],
        options=RedisOptions(claim_idle_s=0.5),
        identity_hold_s=15.0,
    )
    got: list[Inbound] = []

    def all_in() -> bool:
        items = [i for i in heir.receive(0.1) if isinstance(i.message, Delta)]
        got.extend(items)
        heir.ack(items)
        return len(delta_keys(got) | delta_keys(held[:40])) >= len(sent)

    wait_until(all_in, 20, interval_s=0, what="every delta applied by one of the two")
    assert delta_keys(got) | delta_keys(held[:40]) == {("learner-0", s) for s in range(300)}
    assert len(got) == len(sent) - 40, "the heir got an entry twice or one the dead one acked"
    claimed = {i.token for i in got} & {i.token for i in held[40:]}
    assert len(claimed) == len(held) - 40
    assert pending_total(client, range(2)) == 0
    heir.close()
    learner.close()


@pytest.mark.timeout(30)
def test_restarted_consumer_reads_its_own_pending_entries_first(redis_server: RedisServer) -> None:
    url = redis_server.url
    learner = RedisLearnerTransport(url, RUN, "learner-0", 0, num_fragments=1)
    send_all(learner, [make_delta("learner-0", s, 0) for s in range(10)])
    before = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], options=RedisOptions(claim_idle_s=60), identity_hold_s=15.0
    )
    got = receive_until(before, 10)
    before.ack(got[:3])
    before.close()  # "crashes" holding seqs 3..9
    send_all(learner, [make_delta("learner-0", s, 0) for s in range(10, 15)])

    after = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], options=RedisOptions(claim_idle_s=60), identity_hold_s=15.0
    )
    seqs: list[int] = []
    for _ in range(2):
        items = after.receive(1.0)
        seqs += [seq_of(i) for i in items]
        after.ack(items)
    assert seqs == list(range(3, 15))  # pending first, in order; then the new ones
    assert pending_total(redis.Redis.from_url(url), range(1)) == 0
    after.close()
    learner.close()


@pytest.mark.timeout(30)
def test_syncer_recreates_its_group_when_the_streams_vanish(redis_server: RedisServer) -> None:
    url = redis_server.url
    learner = RedisLearnerTransport(url, RUN, "learner-0", 0, num_fragments=1)
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0], identity_hold_s=15.0)
    send_all(learner, [make_delta("learner-0", 0, 0)])
    syncer.ack(receive_until(syncer, 1))
    # As if redis lost its data:
    redis.Redis.from_url(url).delete(delta_stream_key(RUN, 0, "learner-0"))
    assert syncer.receive(0.3) == []
    send_all(learner, [make_delta("learner-0", 1, 0)])
    assert [seq_of(i) for i in receive_until(syncer, 1)] == [1]
    syncer.close()
    learner.close()


@pytest.mark.timeout(30)
def test_a_syncer_refuses_at_start_a_plan_whose_snapshot_redis_cannot_hold(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("proto-max-bulk-len", "1mb")  # its least
    with pytest.raises(ConfigError, match=r"2\.0 MiB.*at most 1\.0 MiB \(proto-max-bulk-len\)"):
        RedisSyncerTransport(
            redis_server.url,
            RUN,
            "syncer-0",
            [0],
            options=RedisOptions(max_message_bytes=2 * 2**20),
            identity_hold_s=15.0,
        )
    syncer = RedisSyncerTransport(
        redis_server.url,
        RUN,
        "syncer-0",
        [0],
        options=RedisOptions(max_message_bytes=2**20),
        identity_hold_s=15.0,
    )
    syncer.close()
    client.close()


# -- 5. late joiners, gaps and trimmed globals ------------------------------------
@pytest.mark.timeout(60)
def test_late_joiner_snapshot_then_poll_gets_exactly_the_later_versions(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0, 1, 2, 3], identity_hold_s=15.0)
    for version in (1, 2, 3):
        for p in (0, 1, 2):
            syncer.publish(make_global(p, version))

    joiner = RedisLearnerTransport(url, RUN, "late", 0, num_fragments=4)
    snap = joiner.snapshot([0, 1, 2, 3], timeout_s=5)
    assert sorted((p, g.version) for p, g in snap.items()) == [(0, 3), (1, 3), (2, 3)]
    assert torch.equal(snap[1].tensor(), torch.full((4,), 3.0))

    later = [(0, 4), (1, 4), (3, 0), (1, 5), (2, 4), (3, 1)]
    for p, version in later:
        syncer.publish(make_global(p, version))
    # Fragment 3 did not exist at the snapshot, so its version 0 is the next one.
    # (A poll hands each fragment's candidates over oldest first.)
    assert sorted(versions_of(poll_until(joiner, len(later)))) == sorted(later)
    assert take_globals(joiner, 0.2) == []
    assert joiner.stats.rejected == Counter()

    # A learner that never took a snapshot starts from the latest of each fragment.
    fresh = RedisLearnerTransport(url, RUN, "fresh", 0, num_fragments=4)
    assert versions_of(take_globals(fresh, 1.0)) == [(0, 4), (1, 5), (2, 4), (3, 1)]
    syncer.publish(make_global(2, 5))
    assert versions_of(poll_until(fresh, 1)) == [(2, 5)]
    for t in (joiner, fresh, syncer):
        t.close()


@pytest.mark.timeout(60)
def test_a_joiner_holding_the_current_weights_does_not_read_them(
    redis_server: RedisServer,
) -> None:
    """A learner that starts from the run's initial model downloaded it whole at
    every join (the ZeroMQ twin is in test_zmq_transport.py)."""
    url = redis_server.url
    n = 100_000
    weights = {p: torch.randn(n, generator=torch.Generator().manual_seed(p)) for p in (0, 1)}

    def version(p: int, v: int, payload: torch.Tensor, change_from: int = -1) -> GlobalFragment:
        return GlobalFragment(
            run_id=RUN, fragment=p, plan_hash=PLAN_HASH, version=v, sent_at=time.time(),
            weights_crc=weights_checksum(weights[p]), codec="fp32", numel=n,
            payload=Codec().encode(payload), change_from=change_from,
        )  # fmt: skip

    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0, 1], identity_hold_s=15.0)
    syncer.publish(version(0, 5, torch.zeros(n), 4), snapshot=version(0, 5, weights[0]))
    syncer.publish(version(1, 3, weights[1]))
    joiner = RedisLearnerTransport(url, RUN, "joiner", 0, num_fragments=2)
    server = redis.Redis.from_url(url)
    before = server.info("stats")["total_net_output_bytes"]
    # It holds fragment 0's current weights, and other weights of fragment 1.
    snap = joiner.snapshot([0, 1], timeout_s=5, held={0: weights[0].clone(), 1: weights[1] + 1})
    sent = server.info("stats")["total_net_output_bytes"] - before
    assert {p: (g.version, g.is_change) for p, g in snap.items()} == {0: (5, False), 1: (3, False)}
    for p in (0, 1):
        assert torch.equal(snap[p].tensor(), weights[p])
        assert weights_checksum(snap[p].tensor()) == snap[p].weights_crc
    assert 4 * n < sent < 4 * n + 10_000  # fragment 1's weights, not fragment 0's
    # Without held weights, both come whole.
    assert torch.equal(joiner.snapshot([0], timeout_s=5)[0].tensor(), weights[0])
    assert joiner.stats.rejected == Counter()
    for t in (joiner, syncer):
        t.close()
    server.close()


@pytest.mark.timeout(60)
def test_an_announced_version_is_fetched_only_by_learners_that_lack_it(
    redis_server: RedisServer,
) -> None:
    """An idle fragment was appended again whole every heartbeat timeout (the
    ZeroMQ twin is in test_zmq_transport.py)."""
    url = redis_server.url
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0, 1], identity_hold_s=15.0)
    syncer.publish(make_global(0, 3))
    learner = RedisLearnerTransport(url, RUN, "l", 0, num_fragments=2)
    held = learner.snapshot([0], timeout_s=5)[0]  # it holds fragment 0's version only
    learner.accepted(held)
    syncer.publish(make_global(1, 1))
    learner.accepted(poll_until(learner, 1)[0])
    # Fragment 1's next version: the learner reads it only as an announcement,
    # as if the stream had dropped the version itself.
    syncer.publish(make_global(1, 2))
    server = redis.Redis.from_url(url)
    entries = server.xrange(globals_stream_key(RUN))
    server.xdel(globals_stream_key(RUN), entries[-1][0])
    syncer.announce(make_global(0, 3))
    syncer.announce(make_global(1, 2))
    assert versions_of(poll_until(learner, 1)) == [(1, 2)]  # fetched: the snapshot
    assert take_globals(learner, 0.3) == []  # fragment 0: held, nothing new
    assert learner.stats.rejected == Counter()
    for t in (learner, syncer):
        t.close()
    server.close()


@pytest.mark.timeout(60)
def test_learner_resyncs_after_globals_trimmed_past_it_or_a_missing_version(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0, 1], options=RedisOptions(globals_maxlen=3), identity_hold_s=15.0
    )
    syncer.publish(make_global(0, 1))
    syncer.publish(make_global(1, 1))
    learner = RedisLearnerTransport(url, RUN, "slow", 0, num_fragments=2)
    assert {p: g.version for p, g in learner.snapshot([0, 1], 5).items()} == {0: 1, 1: 1}

    # Fragment 1's only new version is trimmed away before the learner reads:
    # only the trim detection can find it (no later entry of fragment 1 shows a gap).
    syncer.publish(make_global(1, 2))
    for version in range(2, 9):
        syncer.publish(make_global(0, version))
    client = redis.Redis.from_url(url)
    assert client.xlen(globals_stream_key(RUN)) == 3
    assert versions_of(poll_until(learner, 2)) == [(0, 8), (1, 2)]
    assert take_globals(learner, 0.2) == []

    # A version missing from the stream (deleted here) is a gap: the learner
    # takes the snapshot key, which already holds the newest version.
    roomy = RedisSyncerTransport(
        url, RUN, "syncer-1", [0, 1], identity_hold_s=15.0
    )  # globals_maxlen 1000
    for version in (9, 10, 11):
        roomy.publish(make_global(0, version))
    v9_id = stream_ids(client, globals_stream_key(RUN))[-3]
    client.xdel(globals_stream_key(RUN), v9_id)
    assert versions_of(poll_until(learner, 1)) == [(0, 11)]
    assert take_globals(learner, 0.2) == []
    for t in (learner, syncer, roomy):
        t.close()


# -- 6. bad input ----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_syncer_rejects_counts_and_acks_bad_entries_and_keeps_going(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    client = redis.Redis.from_url(url)
    stream = delta_stream_key(RUN, 0, "learner-0")
    limit = 16 * 1024
    # The group exists before anything is written, as it does in a running system.
    dead = RedisSyncerTransport(
        url,
        RUN,
        "syncer-dead",
        [0],
        options=RedisOptions(claim_idle_s=60, max_message_bytes=limit),
        identity_hold_s=15.0,
    )
    good = encode(make_delta("learner-0", 0, 0))
    bad_checksum = bytearray(good)
    bad_checksum[-1] ^= 0xFF
    entries = [
        ("bad_magic", b"this is not a frame, just some bytes"),
        ("truncated", good[:-7]),
        ("too_large", encode(make_delta("learner-0", 99, 0, numel=8192))),  # 32 KiB payload
        ("wrong_kind", encode(Heartbeat(run_id=RUN, learner_id="learner-0"))),
        ("wrong_fragment", encode(make_delta("learner-0", 98, 1))),
        ("wrong_learner", encode(make_delta("learner-9", 96, 0))),  # not the stream's
        ("wrong_run", encode(make_delta("learner-0", 97, 0, run="other"))),
        ("bad_checksum", bytes(bad_checksum)),
    ]
    client.xadd(stream, {FIELD: good})
    for _, frame in entries:
        client.xadd(stream, {FIELD: frame})
    client.xadd(stream, {b"not-m": b"x"})
    client.xadd(stream, {FIELD: encode(make_delta("learner-0", 1, 0))})
    # Two good deltas delivered to a consumer that dies; one of them is then
    # deleted (as a MAXLEN trim would) while pending: it must come back "trimmed".
    client.xadd(stream, {FIELD: encode(make_delta("learner-0", 2, 0))})
    doomed_frame = encode(make_delta("learner-0", 3, 0))
    doomed_id = cast(bytes, client.xadd(stream, {FIELD: doomed_frame})).decode()
    # ... and two heartbeats: a good one, and garbage from another listed learner.
    beating = RedisLearnerTransport(url, RUN, "learner-0", 0, num_fragments=2)
    beating.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", step=1))
    client.hset(roster_key(RUN), "intruder", "0" * 64)
    client.set(heartbeat_key(RUN, "intruder"), b"garbage garbage garbage garbage")

    taken = receive_until(dead, 4)
    assert sorted(seq_of(i) for i in taken) == [0, 1, 2, 3]
    assert (stream, doomed_id) in {i.token for i in taken}
    dead.ack([i for i in taken if seq_of(i) in (0, 1)])
    dead.close()
    client.xdel(stream, doomed_id)

    syncer = RedisSyncerTransport(
        url,
        RUN,
        "syncer-live",
        [0],
        options=RedisOptions(claim_idle_s=0.3, max_message_bytes=limit),
        identity_hold_s=15.0,
    )
    heartbeats: list[Heartbeat] = []
    seqs: set[int] = set()

    def settled() -> bool:
        items = syncer.receive(0.1)
        heartbeats.extend(i.message for i in items if isinstance(i.message, Heartbeat))
        seqs.update(i.message.seq for i in items if isinstance(i.message, Delta))
        syncer.ack(items)
        return 2 in seqs and syncer.stats.rejected["trimmed"] >= 1

    wait_until(settled, 10, interval_s=0, what="the dead consumer's entries to be claimed")
    assert seqs == {2}  # 0 and 1 were acked by the dead consumer; 3 was deleted
    assert [(h.learner_id, h.step) for h in heartbeats] == [("learner-0", 1)]
    beating.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0", step=2))

    def beat_seen() -> bool:
        items = syncer.receive(0.1)
        heartbeats.extend(i.message for i in items if isinstance(i.message, Heartbeat))
        return len(heartbeats) == 2

    wait_until(beat_seen, 5, interval_s=0, what="the changed heartbeat")
    assert heartbeats[-1].step == 2 and syncer.receive(0.5) == []  # unchanged: not repeated
    beating.close()
    # The dead consumer rejected the bad delta entries (and acked them) already.
    expected = Counter({reason: 1 for reason, _ in entries})
    expected["bad_entry"] = 1
    assert dead.stats.rejected == expected + Counter({"bad_magic": 1})  # the heartbeat garbage
    assert syncer.stats.rejected == Counter({"trimmed": 1, "bad_magic": 1})

    # A trimmed pending entry in a restarted consumer's own pending list.
    client.xadd(stream, {FIELD: encode(make_delta("learner-0", 4, 0))})
    own_doomed = receive_until(syncer, 1)
    assert [seq_of(i) for i in own_doomed] == [4]
    syncer.close()
    client.xdel(stream, own_doomed[0].token[1])
    restarted = RedisSyncerTransport(
        url,
        RUN,
        "syncer-live",
        [0],
        options=RedisOptions(max_message_bytes=limit),
        identity_hold_s=15.0,
    )
    client.xadd(stream, {FIELD: encode(make_delta("learner-0", 5, 0))})
    got = receive_until(restarted, 1)
    assert [seq_of(i) for i in got] == [5]
    assert restarted.stats.rejected["trimmed"] == 1
    restarted.ack(got)
    assert pending_total(client, range(1)) == 0
    restarted.close()


@pytest.mark.timeout(60)
def test_delta_entries_larger_than_the_bound_never_leave_redis(
    redis_server: RedisServer,
) -> None:
    """Attack: a learner XADDs 32 MB entries into its own delta stream (Redis
    bounds no key). The syncer, whose bound is 64 kB, acks, deletes and counts
    them inside Redis: Redis sends it next to nothing of them."""
    url = redis_server.url
    client = redis.Redis.from_url(url)
    syncer = RedisSyncerTransport(
        url,
        RUN,
        "syncer-0",
        [0],
        options=RedisOptions(max_message_bytes=64 * 1024),
        identity_hold_s=15.0,
    )
    learner = RedisLearnerTransport(url, RUN, "learner-0", 0, num_fragments=1)
    try:
        learner.send_heartbeat(Heartbeat(run_id=RUN, learner_id="learner-0"))
        send_all(learner, [make_delta("learner-0", 1, 0)])
        assert [seq_of(i) for i in receive_until(syncer, 1)] == [1]
        stream = delta_stream_key(RUN, 0, "learner-0")
        sent_before = int(client.info("stats")["total_net_output_bytes"])
        for _ in range(2):
            client.xadd(stream, {FIELD: b"x" * (32 * 2**20)})
        send_all(learner, [make_delta("learner-0", 2, 0)])
        assert [seq_of(i) for i in receive_until(syncer, 1)] == [2]
        sent = int(client.info("stats")["total_net_output_bytes"]) - sent_before
        assert syncer.stats.rejected["too_large"] == 2
        assert sent < 2**20, sent
        assert client.xlen(stream) <= 2  # the two deleted; the good ones wait for trimming
    finally:
        learner.close()
        syncer.close()
        client.close()


@pytest.mark.timeout(30)
def test_learner_rejects_bad_globals_and_keeps_reading(redis_server: RedisServer) -> None:
    url = redis_server.url
    client = redis.Redis.from_url(url)
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0], identity_hold_s=15.0)
    syncer.publish(make_global(0, 1))
    learner = RedisLearnerTransport(
        url, RUN, "learner-0", 0, num_fragments=2, options=RedisOptions(max_message_bytes=4096)
    )
    assert versions_of(take_globals(learner, 1.0)) == [(0, 1)]
    client.xadd(globals_stream_key(RUN), {FIELD: b"\x00" * 64})
    client.xadd(globals_stream_key(RUN), {FIELD: encode(make_delta("learner-0", 0, 0))})
    client.xadd(globals_stream_key(RUN), {FIELD: encode(make_global(5, 1))})  # no fragment 5
    syncer.publish(make_global(0, 2))
    assert versions_of(poll_until(learner, 1)) == [(0, 2)]
    assert learner.stats.rejected == Counter({"bad_magic": 1, "wrong_kind": 1, "wrong_fragment": 1})
    learner.close()
    syncer.close()


# -- 7. bounded streams -----------------------------------------------------------
@pytest.mark.timeout(60)
def test_delta_streams_stay_bounded_and_trimming_keeps_unacked_entries(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    client = redis.Redis.from_url(url)
    learner = RedisLearnerTransport(url, RUN, "learner-0", 0, num_fragments=2)
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0, 1], identity_hold_s=15.0)
    send_all(learner, [make_delta("learner-0", s, s % 2) for s in range(400)])
    got = receive_until(syncer, 400)
    send_all(learner, [make_delta("learner-0", s, s % 2) for s in range(400, 500)])  # unread
    held = [i for i in got if 100 <= seq_of(i) < 106 or (seq_of(i) > 100 and seq_of(i) % 37 == 0)]
    held_tokens = {i.token for i in held}
    syncer.ack([i for i in got if i.token not in held_tokens])

    def ids(p: int) -> list[bytes]:
        return stream_ids(client, delta_stream_key(RUN, p, "learner-0"))

    def expected_len(p: int) -> int:
        oldest_held = min(
            t[1] for t in held_tokens if t[0] == delta_stream_key(RUN, p, "learner-0")
        )
        return sum(1 for i in ids(p) if _id(i) >= _id(oldest_held))

    def trimmed_to_oldest_held() -> bool:
        syncer.ack([])  # trimming runs at most every second per stream
        return all(
            client.xlen(delta_stream_key(RUN, p, "learner-0")) == expected_len(p) for p in (0, 1)
        )

    wait_until(trimmed_to_oldest_held, 10, what="trim to the oldest unacked entry")
    assert all(client.xlen(delta_stream_key(RUN, p, "learner-0")) == 200 for p in (0, 1))  # of 250
    present = {(delta_stream_key(RUN, p, "learner-0"), i.decode()) for p in (0, 1) for i in ids(p)}
    assert held_tokens <= present, "trimming removed an unacked entry"
    present_seqs = set()
    for p in (0, 1):
        for _, fields in cast(list, client.xrange(delta_stream_key(RUN, p, "learner-0"))):
            present_seqs.add(cast(Delta, decode_parts(*(fields[f] for f in PART_FIELDS))).seq)
    assert set(range(400, 500)) <= present_seqs, "trimming removed an unread entry"

    syncer.ack(held)
    rest = receive_until(syncer, 100)
    assert {seq_of(i) for i in rest} == set(range(400, 500))
    syncer.ack(rest)

    def empty() -> bool:
        syncer.ack([])
        return all(client.xlen(delta_stream_key(RUN, p, "learner-0")) == 0 for p in (0, 1))

    wait_until(empty, 10, what="every acked entry trimmed")
    learner.close()
    syncer.close()


def _id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq)


def test_a_syncer_warns_when_redis_runs_without_aof(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("appendonly", "no")
    with caplog.at_level(logging.WARNING, logger="broker.redis.syncer"):
        RedisSyncerTransport(
            redis_server.url, "aof", consumer="s0", fragments=[0], identity_hold_s=15.0
        ).close()
    assert any("without AOF" in r.getMessage() for r in caplog.records)
    caplog.clear()
    client.config_set("appendonly", "yes")
    with caplog.at_level(logging.WARNING, logger="broker.redis.syncer"):
        RedisSyncerTransport(
            redis_server.url, "aof", consumer="s0", fragments=[0], identity_hold_s=15.0
        ).close()
    assert not any("without AOF" in r.getMessage() for r in caplog.records)


def test_a_delta_entry_is_a_whole_frame_or_exactly_its_three_parts() -> None:
    delta = make_delta("learner-0", 1, 0)
    start, payload, crc = encode_parts(delta)
    stats = TransportStats()

    def check(fields: dict[bytes, Any], max_bytes: int = 2**20) -> Any:
        return check_entry(fields, max_bytes, stats)

    assert check(dict(zip(PART_FIELDS, (start, payload, crc), strict=True))) == delta
    assert check({FIELD: encode(delta)}) == delta
    assert check({FIELD: encode(delta), b"x": b""}) is None  # neither form
    assert check({**dict(zip(PART_FIELDS, (start, payload, crc), strict=True)), FIELD: b""}) is None
    assert check(dict(zip(PART_FIELDS, (start, payload[1:], crc), strict=True))) is None
    assert check(dict(zip(PART_FIELDS, (start, payload, crc), strict=True)), max_bytes=64) is None
    assert stats.rejected == {"bad_entry": 2, "bad_split": 1, "too_large": 1}


@pytest.mark.timeout(60)
def test_streams_hold_at_most_their_bytes(redis_server: RedisServer) -> None:
    """A learner's delta streams together hold at most ``delta_stream_max_bytes``
    (each stream its share), the globals stream ``globals_max_bytes``: with no
    syncer reading, the oldest unread deltas go, each one counted."""
    client = redis.Redis.from_url(redis_server.url)
    entry = sum(len(part) for part in encode_parts(make_delta("learner-0", 1, 0)))
    learner = RedisLearnerTransport(
        redis_server.url, RUN, "learner-0", 0, num_fragments=2,
        # 5 entries in each of 2 streams
        options=RedisOptions(delta_stream_max_bytes=2 * 5 * entry + 1),
    )  # fmt: skip
    syncer = RedisSyncerTransport(
        redis_server.url,
        RUN,
        "syncer-0",
        [0, 1],
        options=RedisOptions(globals_max_bytes=3 * len(encode(make_global(0, 1)))),
        identity_hold_s=15.0,
    )
    try:
        assert syncer.receive(0.1) == []  # its group exists; it reads nothing more
        send_all(learner, [make_delta("learner-0", seq, 0) for seq in range(1, 21)])
        assert client.xlen(delta_stream_key(RUN, 0, "learner-0")) == 5  # 5 entries' bytes
        assert learner.trimmed_unread == 15
        for version in range(1, 11):
            syncer.publish(make_global(version % 2, version))
        syncer.receive(0.1)  # writes what is queued
        assert client.xlen(globals_stream_key(RUN)) == 3
    finally:
        learner.close()
        syncer.close()
        client.close()


class ChangeChain:
    """Versions of one fragment as a syncer publishes them: each the change from
    the one before (int2+zstd) and, beside it, the version's fp32 weights."""

    def __init__(self, p: int, n: int = 10_000) -> None:
        self.p, self.n, self.version = p, n, 0
        self.codec = Codec.parse("int2+zstd")
        self.weights = torch.randn(n, generator=torch.Generator().manual_seed(p))
        self.rng = torch.Generator().manual_seed(100 + p)

    def message(self, payload: bytes, codec: Codec, change: bool) -> GlobalFragment:
        return GlobalFragment(
            run_id=RUN, fragment=self.p, plan_hash=PLAN_HASH, version=self.version,
            change_from=self.version - 1 if change else -1, codec=codec, numel=self.n,
            weights_crc=weights_checksum(self.weights), payload=payload, sent_at=time.time(),
        )  # fmt: skip

    def whole(self) -> GlobalFragment:
        return self.message(Codec().encode(self.weights), Codec(), change=False)

    def next(self) -> tuple[GlobalFragment, GlobalFragment]:
        """The next version: (its change, its weights)."""
        payload = self.codec.encode(torch.randn(self.n, generator=self.rng) * 1e-3)
        self.weights = apply_change(self.weights, self.codec.decode(payload, self.n))
        self.version += 1
        return self.message(payload, self.codec, change=True), self.whole()


@pytest.mark.timeout(60)
def test_weights_are_written_every_snapshot_every_versions_and_joiners_get_the_latest(
    redis_server: RedisServer,
) -> None:
    """The model key got a fragment's fp32 weights every round: 4 bytes per
    parameter per round of Redis's append-only file. Between its writes the
    changes go to a list, and a joiner applies them to the weights it reads."""
    url, every = redis_server.url, 4
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], options=RedisOptions(snapshot_every=every), identity_hold_s=15.0
    )
    chain = ChangeChain(0)
    syncer.publish(chain.whole())
    follower = RedisLearnerTransport(url, RUN, "follower", 0, num_fragments=1)
    follower.accepted(follower.snapshot([0], timeout_s=5)[0])
    server = redis_server.client()
    weights_written = []
    for _ in range(10):
        change, weights = chain.next()
        sent_before = syncer.stats.bytes_sent
        syncer.publish(change, snapshot=weights)
        weights_written.append(syncer.stats.bytes_sent - sent_before > 4 * chain.n)
        model = decode(server.get(model_key(RUN, 0)))
        listed = server.llen(changes_key(RUN, 0))
        assert model.version + listed == chain.version and listed < every
        # A joiner gets the latest version, bit for bit, whatever the key holds.
        joiner = RedisLearnerTransport(url, RUN, f"joiner-{chain.version}", 0, num_fragments=1)
        got = joiner.snapshot([0], timeout_s=5)[0]
        assert (got.version, got.is_change) == (chain.version, False)
        assert torch.equal(got.tensor(), chain.weights)
        assert joiner.stats.rejected == Counter()
        joiner.close()
        # A learner following the stream gets each change as it is.
        (polled,) = poll_until(follower, 1)
        assert (polled.version, polled.is_change) == (chain.version, True)
        follower.accepted(polled)
    # Versions 1..10 after the whole version 0: the weights went with 4 and 8.
    assert weights_written == [v % every == 0 for v in range(1, 11)]
    # A restarted syncer writes the weights first: the list may hold its version.
    syncer.close()
    again = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], options=RedisOptions(snapshot_every=every), identity_hold_s=15.0
    )
    again.publish(chain.next()[0], snapshot=chain.whole())
    assert server.llen(changes_key(RUN, 0)) == 0
    assert decode(server.get(model_key(RUN, 0))).version == chain.version
    for t in (again, follower):
        t.close()


@pytest.mark.timeout(60)
def test_a_changes_list_that_does_not_follow_its_weights_is_refused(
    redis_server: RedisServer,
) -> None:
    url = redis_server.url
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], options=RedisOptions(snapshot_every=8), identity_hold_s=15.0
    )
    chain = ChangeChain(0)
    syncer.publish(chain.whole())
    for _ in range(3):
        syncer.publish(*chain.next())
    server = redis_server.client()
    server.lpop(changes_key(RUN, 0))  # version 1's change lost
    joiner = RedisLearnerTransport(url, RUN, "joiner", 0, num_fragments=1)
    assert joiner.snapshot([0], timeout_s=1) == {}
    assert joiner.stats.rejected == Counter({"broken_changes": 1})
    # The next weights written repair it.
    syncer.announce(chain.whole())
    assert torch.equal(joiner.snapshot([0], timeout_s=5)[0].tensor(), chain.weights)
    for t in (joiner, syncer):
        t.close()


@pytest.mark.timeout(60)
def test_snapshot_keys_that_redis_lost_are_written_again_whole(
    redis_server: RedisServer,
) -> None:
    """A Redis restart that loses the tail of its file, or a failover to a
    replica that never got it, leaves a fragment's keys older than the syncer
    wrote them, or gone. A change listed after them would not follow (no joiner
    could read the fragment, the round would wait for ever on learners stuck on
    it): the syncer writes the version whole at once, whether the fragment
    moves or not."""
    url = redis_server.url
    syncer = RedisSyncerTransport(
        url, RUN, "syncer-0", [0], options=RedisOptions(snapshot_every=8), identity_hold_s=15.0
    )
    server = redis_server.client()
    keys = [model_key(RUN, 0), changes_key(RUN, 0), weightless_key(RUN, 0)]
    chain = ChangeChain(0)
    syncer.publish(chain.whole())
    syncer.publish(*chain.next())
    older = {key: server.dump(key) for key in keys}  # as of version 1
    for _ in range(2):
        syncer.publish(*chain.next())
    joiner = RedisLearnerTransport(url, RUN, "joiner", 0, num_fragments=1)

    def joiner_gets_the_latest() -> bool:
        got = joiner.snapshot([0], timeout_s=5).get(0)
        return got is not None and torch.equal(got.tensor(), chain.weights)

    # The keys go back to version 1 (the syncer wrote 3), then a round moves it.
    for key, dumped in older.items():
        server.restore(key, 0, dumped, replace=True)
    syncer.publish(*chain.next())
    assert joiner_gets_the_latest()
    assert server.llen(changes_key(RUN, 0)) == 0  # written whole
    assert syncer.stats.snapshots_lost == 1
    # Gone, with the fragment idle: found within a second, and announced whole.
    server.delete(*keys)
    assert wait_until(syncer.lost_snapshots, 5, interval_s=0.1, what="the loss seen") == [0]
    syncer.announce(chain.whole())
    assert joiner_gets_the_latest()
    assert syncer.lost_snapshots() == [] and syncer.stats.snapshots_lost == 2
    for t in (joiner, syncer):
        t.close()


def test_a_change_is_never_published_as_the_weights(redis_server: RedisServer) -> None:
    syncer = RedisSyncerTransport(redis_server.url, RUN, "syncer-0", [0], identity_hold_s=15.0)
    chain = ChangeChain(0)
    syncer.publish(chain.whole())
    with pytest.raises(ValueError, match="without weights"):
        syncer.publish(chain.next()[0])
    syncer.close()


@pytest.mark.timeout(60)
def test_a_read_returns_at_most_its_budget_and_the_rest_comes_after(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """384 streams of 1.8 MB deltas (250M parameters) made one read larger than
    the socket moved within its timeout: it failed and was tried again, and the
    syncer applied 3 deltas in 167 s. A read now returns a bounded number of
    bytes, and what it held back comes with the next ones, each delta once."""
    monkeypatch.setattr(redis_deltas, "READ_BUDGET_BYTES", 3 * 4096)
    url = redis_server.url
    syncer = RedisSyncerTransport(url, RUN, "syncer-0", [0, 1], identity_hold_s=15.0)
    learners = [RedisLearnerTransport(url, RUN, name, 0, 2) for name in ("a", "b")]
    for t in learners:
        deltas = [make_delta(t.learner_id, s, s % 2, numel=1024) for s in range(12)]
        send_all(t, deltas)  # 4 kB each: 24 deltas wait in 4 streams
    got: list[Inbound] = []

    def all_in() -> bool:
        read = [i for i in syncer.receive(0.1) if isinstance(i.message, Delta)]
        assert len(read) <= 3 + 1  # the budget, or one delta alone
        syncer.ack(read)
        got.extend(read)
        return len(got) >= 24

    wait_until(all_in, 20, interval_s=0, what="24 deltas")
    received = sorted((cast(Delta, i.message).learner_id, cast(Delta, i.message).seq) for i in got)
    assert received == [(name, s) for name in ("a", "b") for s in range(12)]  # each once
    assert syncer.receive(0.2) == []
    for t in [*learners, syncer]:
        t.close()
