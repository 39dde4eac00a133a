"""Learner side of the Redis Streams transport (docs/transports.md).

Keys, the delivery contract and the connection handling both sides share are in
:mod:`broker.redis_common`. A learner XADDs its deltas to the delta stream of
their fragment (:class:`~broker.redis_deltas.DeltaQueue`), HSETs its heartbeat
into the learners hash, XREADs the globals stream and GETs the snapshot keys
when it has no base or sees a gap (:class:`~broker.redis_globals.GlobalsReader`).
Learner slots are leased in the leases hash by one script, on the server's clock.

Connection errors never escape, with two exceptions: ``snapshot`` and ``lease``
raise :class:`TransportError` when they get no answer within their timeout, and
``send_delta`` raises :class:`Backpressure` when ``max_unacked`` deltas wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from broker.errors import ConfigError
from broker.keys import GlobalVerifier, Identity, RunKeys
from broker.redis_common import (
    LEASE_SLOT,
    RedisLink,
    connect,
    encode_bounded,
    is_transient,
    learners_key,
    leases_key,
)
from broker.redis_deltas import DeltaQueue
from broker.redis_globals import GlobalCheck, GlobalsReader, NoticeReader, SnapshotKeys
from broker.transport import (
    MAX_LEARNER_SLOTS,
    LearnerTransport,
    TransportError,
    lease_request_ok,
)
from broker.wire import Delta, GlobalFragment, Heartbeat

log = logging.getLogger(__name__)


class RedisLearnerTransport(LearnerTransport):
    """Learner side: XADD deltas, HSET heartbeats, XREAD globals, GET snapshots."""

    def __init__(
        self,
        url: str,
        run_id: str,
        learner_id: str,
        incarnation: int,
        num_fragments: int,
        *,
        max_message_bytes: int = 256 * 2**20,
        max_unacked: int = 64,
        delta_stream_maxlen: int = 10_000,
        socket_timeout_s: float = 5.0,
        keys: RunKeys | None = None,
        identity: Identity | None = None,
        role: str = "learner",
    ) -> None:
        del identity, role  # Redis knows learners by their ACL user (docs/security.md)
        if num_fragments < 1:
            raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
        if max_unacked < 1:
            raise ConfigError(f"max_unacked must be >= 1, got {max_unacked}")
        if delta_stream_maxlen < 1:
            raise ConfigError(f"delta_stream_maxlen must be >= 1, got {delta_stream_maxlen}")
        if max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if socket_timeout_s <= 0:
            raise ConfigError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        self.run_id = run_id
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.num_fragments = num_fragments
        self.max_message_bytes = max_message_bytes
        self.max_unacked = max_unacked
        self.delta_stream_maxlen = delta_stream_maxlen
        super().__init__()
        self.heartbeats_dropped = 0
        client = connect(url, socket_timeout_s, keys)
        self._link = RedisLink(client, f"learner {learner_id}")
        self._lease_slot = client.register_script(LEASE_SLOT)
        self._deltas = DeltaQueue(
            self._link,
            run_id,
            learner_id,
            num_fragments,
            max_message_bytes,
            max_unacked,
            delta_stream_maxlen,
            self.stats,
        )
        verifier = GlobalVerifier(keys) if keys is not None else None
        check = GlobalCheck(run_id, num_fragments, max_message_bytes, self.stats, verifier)
        notices = NoticeReader(
            run_id, learner_id, incarnation, num_fragments, max_message_bytes, self.stats,
            self._refused,
        )  # fmt: skip
        self._globals = GlobalsReader(
            client,
            run_id,
            learner_id,
            num_fragments,
            socket_timeout_s / 2,  # a blocking read must end well before the socket timeout
            self.stats,
            check,
            SnapshotKeys(client, run_id, check),
            notices,
            self._versions,
            self._is_new,
        )

    @property
    def connection_errors(self) -> int:
        return self._link.errors

    @property
    def trimmed_unread(self) -> int:
        """Deltas of ours (or others') the delta streams' bound dropped unread."""
        return self._deltas.trimmed_unread

    # -- deltas and heartbeats ----------------------------------------------
    def send_delta(self, delta: Delta) -> None:
        self._deltas.send(delta)

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        if heartbeat.run_id != self.run_id or heartbeat.learner_id != self.learner_id:
            raise ValueError("heartbeat of another run or learner")
        frame = encode_bounded(heartbeat, self.max_message_bytes)
        if self._link.backing_off():
            self.heartbeats_dropped += 1
            return
        try:
            self._link.client.hset(learners_key(self.run_id), self.learner_id, frame)
        except Exception as e:
            if not is_transient(e):
                raise
            self.heartbeats_dropped += 1
            self._link.failed(e)
            return
        self._link.succeeded()
        self.stats.bytes_sent += len(frame)
        self.stats.messages_sent += 1

    @property
    def unacked(self) -> int:
        return len(self._deltas)

    # -- globals --------------------------------------------------------------
    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        # Queued deltas go out ahead of every read: poll() is what resends them.
        return self._link.retry(deadline, self._globals.read, before=self._deltas.send_queued)

    def resync(self, fragment: int) -> None:
        if 0 <= fragment < self.num_fragments:
            self._globals.want(fragment)

    def snapshot(
        self, fragments: list[int], timeout_s: float, held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        bad = [p for p in fragments if not 0 <= p < self.num_fragments]
        if bad:
            raise ValueError(f"fragments {bad} outside [0, {self.num_fragments})")
        return self._link.call_within(
            timeout_s, lambda: self._globals.load(list(fragments), held), "snapshot"
        )

    # -- learner slots ----------------------------------------------------------
    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        if not lease_request_ok(ttl_s, held_slot):
            raise ValueError(f"lease of slot {held_slot} for {ttl_s}s: out of bounds")
        slot = self._link.call_within(
            timeout_s,
            lambda: self._lease_slot(
                keys=[leases_key(self.run_id)],
                args=[holder, max(1, int(ttl_s * 1000)), held_slot, MAX_LEARNER_SLOTS],
            ),
            "learner slot",
        )
        if slot < 0:
            raise TransportError(f"all {MAX_LEARNER_SLOTS} learner slots are held")
        return int(slot)

    def close(self) -> None:
        if self._deltas:
            log.warning(
                "learner %s: closing with %d undelivered deltas", self.learner_id, len(self._deltas)
            )
        self._link.close()
