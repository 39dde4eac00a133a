"""Syncer shards: the rule that gives each shard its fragments, shard leases
(``--syncer-shard auto``) against a real redis-server, with the run's users
(the syncers' ACL user holds the leases), and over ZeroMQ the shard folders
that replicas lock instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import redis
from redis.client import Pipeline

from broker.connect import lease_shard
from broker.errors import TransportError
from broker.fragments import owned_fragments, owner_shard
from broker.identity.keys import RunKeys
from broker.redis.link import is_transient
from broker.redis.names import shard_key, term_key
from broker.redis.server import RedisServer
from broker.redis.shards import ShardLease
from broker.run.key_folder import make_keys
from syncer.service import _take_shard_folder
from tests.servers import wait_until

RUN = "shards-test"
TTL_S = 2.0


def test_fragments_go_to_shards_round_robin_and_each_to_one() -> None:
    assert [owner_shard(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    shards = [owned_fragments(s, 3, 7) for s in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(p for owned in shards for p in owned) == list(range(7))


@pytest.fixture
def keys(tmp_path: Path) -> RunKeys:
    return RunKeys.load(make_keys(tmp_path / "keys"), "syncer")


@pytest.fixture
def server(tmp_path: Path, keys: RunKeys) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", keys=tmp_path / "keys", tls=True)
    server.start()
    yield server
    server.stop()


@pytest.mark.integration
class TestShardLease:
    @pytest.fixture(autouse=True)
    def _leases(self, server: RedisServer, keys: RunKeys) -> Iterator[None]:
        self.server, self.keys = server, keys
        self.made: list[ShardLease] = []
        yield
        for lease in self.made:
            lease.close()

    def lease(self, holder: str, shards: int = 2) -> ShardLease:
        lease = lease_shard(
            self.server.url, run_id=RUN, syncer_shards=shards, holder=holder, ttl_s=TTL_S,
            keys=self.keys,
        )  # fmt: skip
        self.made.append(lease)
        return lease

    def test_holders_take_the_lowest_free_shards(self) -> None:
        assert self.lease("a").take(5) == 0
        assert self.lease("b").take(5) == 1
        with pytest.raises(TransportError, match="no free shard of 2"):
            self.lease("c").take(1)

    def test_a_restarted_holder_gets_its_own_shard_back_at_once(self) -> None:
        self.lease("a").take(5)
        self.lease("b").take(5)
        # "b" dies without closing (its lease still runs) and starts again.
        self.made[1]._stop.set()
        assert self.lease("b").take(1) == 1

    def test_a_standby_takes_a_shard_when_its_holder_leaves_or_dies(self) -> None:
        first, second = self.lease("a"), self.lease("b")
        first.take(5)
        second.take(5)
        standby = self.lease("c")
        taken: list[int] = []
        waiting = threading.Thread(target=lambda: taken.append(standby.take(30)))
        waiting.start()
        time.sleep(0.5)
        assert not taken  # every shard held: it waits
        first.close()  # a clean stop frees shard 0 at once
        waiting.join(10)
        assert taken == [0]
        # A holder that dies (no more renewals) frees its shard once its lease ran out.
        second._stop.set()
        died = time.monotonic()
        assert self.lease("d").take(10) == 1
        assert time.monotonic() - died >= TTL_S * 0.5

    def test_leases_are_renewed_past_their_time_to_live(self) -> None:
        lease = self.lease("a")
        lease.take(5)
        time.sleep(TTL_S * 2)
        assert not lease.lost.is_set()
        with pytest.raises(TransportError):
            self.lease("b", shards=1).take(0.5)

    def test_a_lease_taken_by_another_is_reported_lost(self) -> None:
        lease = self.lease("a")
        lease.take(5)
        self.server.client().set(shard_key(RUN, 0), "intruder")
        wait_until(lease.lost.is_set, TTL_S * 2, what="the lost lease noticed")
        lease.close()  # a lost lease is not released: it is not ours
        assert self.server.client().get(shard_key(RUN, 0)) == b"intruder"

    def test_a_lease_that_ran_out_with_nobody_taking_it_keeps_its_term(self) -> None:
        """A holder frozen, or cut off from Redis, past its lease takes it back
        under the same term if nobody took the shard meanwhile (no other syncer
        wrote under a later term); if one held it meanwhile, the lease is lost."""
        lease = self.lease("a", shards=1)
        lease.take(5)
        admin = self.server.client()
        admin.delete(shard_key(RUN, 0))  # ran out, and nobody took it
        time.sleep(TTL_S)
        assert not lease.lost.is_set() and lease.fence().term == lease.term == 1
        assert int(admin.get(term_key(RUN, 0))) == 1
        admin.delete(shard_key(RUN, 0))
        admin.incr(term_key(RUN, 0))  # another held it meanwhile, and let go
        wait_until(lease.lost.is_set, TTL_S * 2, what="the lost lease noticed")


def test_zmq_has_no_shard_leases() -> None:
    assert (
        lease_shard(
            "zmq://127.0.0.1:5555", run_id=RUN, syncer_shards=2, holder="a", ttl_s=1, keys=None
        )
        is None
    )


def test_over_zmq_each_replica_takes_a_free_shard_folder_and_a_standby_the_next_freed(
    tmp_path: Path,
) -> None:
    """``--syncer-shard auto`` over ZeroMQ: the lowest shard whose folder of the
    shared checkpoint folder no live syncer locks; a third replica waits and
    takes the folder of one that died (a real process, SIGKILLed: the kernel
    frees its lock)."""
    code = (
        "import sys, time; from pathlib import Path; from syncer.service import _take_shard_folder;"
        f"shard, _ = _take_shard_folder(Path({str(tmp_path)!r}), 2); print(shard, flush=True);"
        "time.sleep(600)"
    )
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "0"
        second, second_lock = _take_shard_folder(tmp_path, 2)
        assert second == 1 and (tmp_path / "shard-1" / ".lock").exists()
        taken: list[int] = []
        standby = threading.Thread(target=lambda: taken.append(_take_shard_folder(tmp_path, 2)[0]))
        standby.start()
        time.sleep(1.5)
        assert taken == []  # both held: it waits
        first.kill()
        standby.join(timeout=10)
        assert taken == [0]
        second_lock.close()
    finally:
        first.kill()
        first.wait()


def test_a_fenced_write_that_redis_does_not_answer_is_retried_not_a_crash(
    server: RedisServer, keys: RunKeys
) -> None:
    """Redis frozen (SIGSTOP) right after a fenced write began to watch the
    term: redis-py says WatchError, which crashed the syncer (a 30 s freeze in
    CI); it is a connection error, which the syncer's link retries."""
    lease = lease_shard(server.url, run_id=RUN, syncer_shards=1, holder="a", ttl_s=TTL_S, keys=keys)
    assert lease is not None and server.proc is not None
    pid = server.proc.pid
    watch = Pipeline.watch

    def watch_then_freeze(pipe: Pipeline, *names: str) -> object:
        answer = watch(pipe, *names)
        os.kill(pid, signal.SIGSTOP)  # the term's GET, next, gets no answer
        return answer

    try:
        lease.take(5)
        fence = lease.fence()
        client = server.client(socket_timeout=0.5)
        client.ping()
        try:
            with (
                mock.patch.object(Pipeline, "watch", watch_then_freeze),
                pytest.raises(redis.RedisError) as caught,
            ):
                fence.transaction(client)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert is_transient(caught.value), repr(caught.value)
        fence.execute(fence.transaction(client))  # answered again: it goes through
    finally:
        lease.close()
