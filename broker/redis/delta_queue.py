"""A learner's delta streams on Redis (docs/transports.md): :class:`DeltaQueue`
XADDs its deltas in order to its own stream of each fragment, bounding the
stream (:data:`~broker.redis.scripts.BOUNDED_XADD`), and keeps each until redis
replied and, with ``wait_replicas``, until that many replicas hold it (WAIT on
the same connection, in the same round trip): a delta a failover could still
lose is sent again, and the syncer's de-duplication drops the copy. The
syncer reads them (:mod:`broker.redis.delta_reader`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from functools import partial

from broker.errors import ConfigError
from broker.redis.frames import PART_FIELDS, encode_parts_bounded, entries_within
from broker.redis.link import Failed, NotReplicated, RedisLink
from broker.redis.names import GROUP, delta_stream_key, trimmed_key
from broker.redis.options import RedisOptions
from broker.redis.scripts import BOUNDED_XADD
from broker.transport import Backpressure, TransportStats
from broker.wire.messages import Delta

log = logging.getLogger(__name__)


@dataclass
class _QueuedDelta:
    stream: str
    trimmed_key: str
    parts: tuple[bytes, bytes, bytes]  # wire.encode_parts: the payload is the caller's
    failed_attempts: int = 0


class DeltaQueue:
    """A learner's deltas until redis replied to their XADD, oldest first: sent in
    order, kept across transient errors, at most ``max_unacked`` of them."""

    def __init__(
        self,
        link: RedisLink,
        run_id: str,
        learner_id: str,
        num_fragments: int,
        options: RedisOptions,
        stats: TransportStats,
    ) -> None:
        self._link = link
        self._run_id = run_id
        self._learner_id = learner_id
        self._num_fragments = num_fragments
        self._max_message_bytes = options.max_message_bytes
        self._max_unacked = options.max_unacked
        self._maxlen = options.delta_stream_maxlen
        # Each of our num_fragments streams holds its share of the bytes.
        self._stream_max_bytes = options.delta_stream_max_bytes // num_fragments
        self._wait_replicas = options.wait_replicas
        self._wait_ms = max(1, int(options.socket_timeout_s * 1000 / 2))
        self._stats = stats
        self._bounded_xadd = link.client.register_script(BOUNDED_XADD)
        self._queue: deque[_QueuedDelta] = deque()
        self.trimmed_unread = 0  # deltas of ours (or others') the stream bound dropped unread

    def __len__(self) -> int:
        return len(self._queue)

    def send(self, delta: Delta) -> None:
        """Queue ``delta`` and send what is queued; raises :class:`Backpressure`
        when ``max_unacked`` deltas still wait after a try to send them."""
        if delta.run_id != self._run_id:
            raise ConfigError(f"delta of run {delta.run_id!r} sent on run {self._run_id!r}")
        if not 0 <= delta.fragment < self._num_fragments:
            raise ConfigError(f"fragment {delta.fragment} outside [0, {self._num_fragments})")
        if len(self._queue) >= self._max_unacked:
            self.send_queued()
            if len(self._queue) >= self._max_unacked:
                raise Backpressure(f"{len(self._queue)} deltas wait for redis")
        if delta.learner_id != self._learner_id:
            raise ConfigError(f"delta of {delta.learner_id!r} sent by {self._learner_id!r}")
        self._queue.append(
            _QueuedDelta(
                delta_stream_key(self._run_id, delta.fragment, self._learner_id),
                trimmed_key(self._run_id, delta.fragment, self._learner_id),
                encode_parts_bounded(delta, self._max_message_bytes),
            )
        )
        self.send_queued()

    def send_queued(self) -> None:
        """XADD queued deltas in order until the queue is empty or redis fails."""
        while self._queue and not self._link.backing_off():
            item = self._queue[0]
            size = sum(len(part) for part in item.parts)
            maxlen = entries_within(self._stream_max_bytes, size, self._maxlen)
            lost = self._link.call(partial(self._xadd, item, maxlen))
            if isinstance(lost, Failed):
                item.failed_attempts += 1
                return
            self._queue.popleft()
            if lost:
                self.trimmed_unread += lost
                log.error(
                    "learner %s: %s is at its bound of %d entries (delta_stream_maxlen, "
                    "delta_stream_max_bytes) with the syncer behind: dropped %d unread "
                    "deltas (raise the bounds or restart the syncer)",
                    self._learner_id,
                    item.stream,
                    maxlen,
                    lost,
                )
            self._stats.bytes_sent += size
            self._stats.messages_sent += 1
            if item.failed_attempts:
                self._stats.resent += 1

    def _xadd(self, item: _QueuedDelta, maxlen: int) -> int:
        """XADD ``item`` to its stream, bounded to ``maxlen`` entries
        (``BOUNDED_XADD``); how many unread entries that dropped. With
        ``wait_replicas``, :class:`NotReplicated` unless that many replicas
        confirmed it within half the socket timeout."""
        args: list[bytes | str | int] = [maxlen, GROUP, *self._entry(item.parts)]
        if not self._wait_replicas:
            return int(self._bounded_xadd(keys=[item.stream, item.trimmed_key], args=args))
        # One pipeline, one connection: WAIT counts the replicas that hold what
        # this connection wrote.
        # EVALSHA itself: a script call in a pipeline would first ask SCRIPT
        # EXISTS, which a learner may not (the syncer loads its scripts).
        pipe = self._link.client.pipeline(transaction=False)
        pipe.evalsha(self._bounded_xadd.sha, 2, item.stream, item.trimmed_key, *args)
        pipe.wait(self._wait_replicas, self._wait_ms)
        lost, replicas = pipe.execute()
        if replicas < self._wait_replicas:
            raise NotReplicated(
                f"{item.stream}: {replicas} of {self._wait_replicas} replicas hold the delta "
                f"after {self._wait_ms} ms"
            )
        return int(lost)

    @staticmethod
    def _entry(parts: tuple[bytes, bytes, bytes]) -> list[bytes]:
        """A delta entry's fields and values, as XADD takes them."""
        return [v for pair in zip(PART_FIELDS, parts, strict=True) for v in pair]
