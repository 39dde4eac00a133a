"""The one transport interface that learner and syncer code talk to.

Two backends implement it: :mod:`broker.zmq_transport`, and Redis Streams
(:mod:`broker.redis_learner`, :mod:`broker.redis_syncer`, :mod:`broker.redis_common`).
:func:`broker.connect.connect_learner` and :func:`broker.connect.connect_syncer`
build one from a URL, and nothing else in the code base asks which one it got.

Delivery contract
-----------------
* Deltas are delivered at least once: a learner keeps a delta until the
  transport has handed it durably to the syncer side (ZeroMQ: the syncer's
  ack; Redis: the XADD reply), retrying across restarts of either peer. The
  syncer acknowledges an inbound delta only after the update it fed is
  durable, and de-duplicates by (learner, incarnation, seq); together this is
  exactly-once application.
* Globals reach learners in version order per fragment; a learner that missed
  one (dropped, trimmed, joined late) sees a gap and fetches the latest
  snapshot of that fragment instead.
* Heartbeats are best effort and tiny.
* Learner slots (:meth:`LearnerTransport.lease`) give learners that do not
  name themselves a distinct id and data shard that survive their restarts;
  Redis holds the leases (by its own clock), or the first ZeroMQ syncer does.
* Every inbound frame is size-bounded and validated; a bad one is dropped and
  counted in ``rejected`` by reason, never raised into the service.
* Every call that waits takes a timeout; none blocks forever.
"""

from __future__ import annotations

import abc
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from broker.wire import Delta, GlobalFragment, Heartbeat


class TransportError(RuntimeError):
    """The transport could not do what was asked within its timeout."""


class Backpressure(TransportError):
    """Too many deltas are waiting for acknowledgement; try again later."""


@dataclass
class TransportStats:
    """Bytes on the wire and rejected frames, by reason (for metrics and summaries)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    resent: int = 0
    rejected: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Inbound:
    """A message received by the syncer, with what the backend needs to ack it."""

    message: Delta | Heartbeat
    token: Any = None  # backend-specific; None for messages that need no ack


class LearnerTransport(abc.ABC):
    """Learner side. Used from one thread (the learner's comm thread)."""

    stats: TransportStats

    @abc.abstractmethod
    def send_delta(self, delta: Delta) -> None:
        """Hand a delta over for at-least-once delivery; raises :class:`Backpressure`
        when ``unacked`` is at its bound."""

    @abc.abstractmethod
    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Best effort; never blocks."""

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        """Wait up to ``timeout_s`` for globals; also services acks, resends and
        reconnects. Returns new globals in version order per fragment."""

    @abc.abstractmethod
    def snapshot(self, fragments: list[int], timeout_s: float) -> dict[int, GlobalFragment]:
        """The latest global of each fragment that exists, for joining or rejoining.
        Fragments nobody has published yet are missing from the result."""

    @property
    @abc.abstractmethod
    def unacked(self) -> int:
        """Deltas handed over but not yet durably delivered."""

    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        """Take or renew a learner slot (0, 1, ...) for ``holder`` for ``ttl_s``.

        The slot ``holder`` holds already; else ``held_slot`` when it is free
        (a holder renewing after the lease authority lost its leases); else
        the lowest free slot. A slot is free when nobody holds it or its
        holder's lease ran out. Call again well within ``ttl_s`` to keep the
        slot. Raises :class:`TransportError` when the authority does not
        answer within ``timeout_s``.
        """
        raise NotImplementedError(f"{type(self).__name__} hands out no learner slots")

    def flush(self, timeout_s: float) -> bool:
        """Wait until every delta is delivered; True if none is left."""
        deadline = time.monotonic() + timeout_s
        while self.unacked and time.monotonic() < deadline:
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.unacked == 0

    @abc.abstractmethod
    def close(self) -> None: ...


class SyncerTransport(abc.ABC):
    """Syncer side. Used from one thread (the syncer's event loop)."""

    stats: TransportStats

    @abc.abstractmethod
    def receive(self, timeout_s: float) -> list[Inbound]:
        """Deltas of the owned fragments and heartbeats, waiting up to ``timeout_s``.
        Also answers snapshot requests from the latest published globals."""

    @abc.abstractmethod
    def ack(self, items: list[Inbound]) -> None:
        """Acknowledge deltas whose update is durable (or that were rejected or
        de-duplicated): they will not be delivered again."""

    @abc.abstractmethod
    def publish(self, fragment: GlobalFragment) -> None:
        """Publish a new global and make it the snapshot joiners get."""

    @abc.abstractmethod
    def close(self) -> None: ...
