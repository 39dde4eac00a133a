"""The options of a Redis run, from the broker URL: ``redis://host:6379/0?claim_idle_s=10``.

A query parameter that is not one of these passes through to redis-py (for
example ``ssl_cert_reqs``), but for its own timeouts, which the blocking reads
are sized against: those are ``socket_timeout_s`` here.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.checks import check_int, check_positive, require
from broker.redis.names import GROUP
from broker.transport import DEFAULT_MAX_MESSAGE_BYTES

# Versions between two whole snapshots of a fragment's weights, at most: a
# learner that fell behind reads the last snapshot and every change since.
MAX_SNAPSHOT_EVERY = 64
# redis-py's own timeouts, which would override ours.
REDIS_PY_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


@dataclass(frozen=True)
class RedisOptions:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # largest frame; unset: what the plan needs
    socket_timeout_s: float = 5.0  # a request Redis does not answer within this failed
    # Replicas that must hold a learner's delta before it counts as delivered
    # (WAIT, up to socket_timeout_s); a redis+sentinel:// URL sets 1 unless given.
    wait_replicas: int = 0
    max_unacked: int = 64  # learner: deltas written and not yet acknowledged, at most
    delta_stream_maxlen: int = 10_000  # learner: entries of one delta stream, at most
    delta_stream_max_bytes: int = 2**30  # learner: bytes of one delta stream, at most
    group: str = GROUP  # syncer: the consumer group that reads the delta streams
    claim_idle_s: float = 30.0  # syncer: a delta pending this long at a dead syncer is taken
    globals_maxlen: int = 1000  # syncer: entries of the globals stream, at most
    globals_max_bytes: int = 2**30  # syncer: bytes of the globals stream, at most
    snapshot_every: int = 8  # syncer: versions between whole snapshots of a fragment
    block_ms: int = 200  # syncer: the longest blocking read, milliseconds

    def __post_init__(self) -> None:
        check_int("max_message_bytes", self.max_message_bytes, minimum=1024)
        check_int("wait_replicas", self.wait_replicas, minimum=0)
        for name in ("max_unacked", "delta_stream_maxlen", "delta_stream_max_bytes"):
            check_int(name, getattr(self, name))
        for name in ("globals_maxlen", "globals_max_bytes", "block_ms"):
            check_int(name, getattr(self, name))
        check_positive("socket_timeout_s", self.socket_timeout_s)
        check_positive("claim_idle_s", self.claim_idle_s)
        require(
            type(self.snapshot_every) is int and 1 <= self.snapshot_every <= MAX_SNAPSHOT_EVERY,
            f"snapshot_every={self.snapshot_every!r}: must be in [1, {MAX_SNAPSHOT_EVERY}]",
        )
        require(bool(self.group), "group: give the consumer group's name")
