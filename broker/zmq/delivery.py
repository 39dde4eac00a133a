"""At-least-once delivery of a learner's deltas.

PUSH would block at its high-water mark and PUB silently drops, so deltas go
DEALER -> ROUTER with an explicit :class:`~broker.wire.messages.Ack` from the
syncer once the update is durable, and the learner resends anything
unacknowledged after ``ack_timeout_s`` (the syncer de-duplicates).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from broker.errors import Backpressure
from broker.fragments import owner_shard
from broker.transport import TransportStats
from broker.wire import messages as wire
from broker.wire.messages import Ack, Delta
from broker.zmq.frames import Parts, send_parts
from broker.zmq.options import ZmqOptions


@dataclass
class _Pending:
    parts: Parts
    owner: int  # the syncer shard
    last_sent: float = -math.inf
    attempts: int = 0


class DeltaSender:
    """Deltas sent to their fragments' owners and not acknowledged yet, by seq:
    sent again every ``ack_timeout_s`` until acked or refused."""

    def __init__(
        self,
        dealers: list[zmq.Socket[bytes]],
        learner_id: str,
        incarnation: int,
        options: ZmqOptions,
        stats: TransportStats,
        introduce: Callable[[int], object] = lambda owner: None,
    ) -> None:
        self._dealers = dealers
        # Sends the learner's enrollment to a syncer before each delta (one that
        # restarted knows no key, and would drop the delta until the next one).
        self._introduce = introduce
        self._learner_id = learner_id
        self._incarnation = incarnation
        self._max_message_bytes = options.max_message_bytes
        self._max_unacked = options.max_unacked
        self._ack_timeout_s = options.ack_timeout_s
        self._stats = stats
        self._unacked: dict[int, _Pending] = {}

    def __len__(self) -> int:
        return len(self._unacked)

    def send(self, delta: Delta) -> None:
        if len(self._unacked) >= self._max_unacked:
            raise Backpressure(f"{len(self._unacked)} deltas await acknowledgement")
        pending = _Pending(
            wire.encode_parts(delta, self._max_message_bytes),
            owner_shard(delta.fragment, len(self._dealers)),
        )
        self._unacked[delta.seq] = pending
        self._try_send(pending, time.monotonic())

    def _try_send(self, pending: _Pending, now: float) -> None:
        self._introduce(pending.owner)
        try:
            send_parts(self._dealers[pending.owner], pending.parts)
        except zmq.Again:
            return  # no syncer connected or its queue is full: retried by poll()
        if pending.attempts:
            self._stats.resent += 1
        pending.attempts += 1
        pending.last_sent = now
        self._stats.bytes_sent += sum(len(part) for part in pending.parts)
        self._stats.messages_sent += 1

    def resend_due(self) -> None:
        now = time.monotonic()
        for pending in self._unacked.values():
            if now - pending.last_sent >= self._ack_timeout_s:
                self._try_send(pending, now)

    def acked(self, ack: Ack) -> None:
        if ack.learner_id != self._learner_id or ack.incarnation != self._incarnation:
            self._stats.rejected["foreign_ack"] += 1
            return
        for seq in ack.seqs:
            self._unacked.pop(seq, None)

    def settle(self, seq: int) -> bool:
        """Stop sending delta ``seq`` (it was refused); False if none was waiting."""
        return self._unacked.pop(seq, None) is not None
