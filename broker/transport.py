"""The one transport interface that learner and syncer code talk to.

Two backends implement it: :mod:`broker.zmq`, and Redis Streams
(:mod:`broker.redis`: :mod:`broker.redis.learner`, :mod:`broker.redis.syncer`).
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
* Globals reach learners in version order per fragment, as weights or as the
  change from the version before; a learner that missed one (dropped,
  trimmed, joined late) sees a gap and fetches the latest snapshot of that
  fragment (always weights) instead. Versions compare within a syncer epoch
  only. A transport hands globals over as candidates and records a version
  only once the learner has validated the global (:meth:`LearnerTransport.accepted`):
  a malformed global with a huge version cannot make it drop the real ones.
* A delta the syncer refuses is answered with a :class:`~broker.wire.messages.Refusal`,
  never a silent acknowledgement: the learner stops resending it, counts it by
  reason, and fetches the fragment's latest global.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

# Defined in broker.errors; re-exported here, where the transports import them.
from broker.errors import Backpressure as Backpressure
from broker.errors import TransportError as TransportError

if TYPE_CHECKING:  # the messages hold tensors: torch is not loaded for types alone
    from broker.wire.messages import Delta, GlobalFragment, Heartbeat

# Bounds of learner slots, so that no peer can hold slots without end or many
# of them: a lease outlives its holder by at most an hour, and the slots of
# one run are few enough to scan.
MAX_LEARNER_SLOTS = 4096
# The largest frame a transport takes where neither the URL nor the fragment
# plan (plan.max_message_bytes) sets one.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
MAX_LEASE_TTL_S = 3600.0


_SLOT_ID_PREFIX = "learner-"


def learner_id_of(slot: int) -> str:
    """The learner id that goes with a learner slot."""
    return f"{_SLOT_ID_PREFIX}{slot}"


def slot_of(learner_id: str) -> int | None:
    """The learner slot whose id ``learner_id`` is, if it is one."""
    number = learner_id.removeprefix(_SLOT_ID_PREFIX)
    if number == learner_id or not number.isdigit() or int(number) >= MAX_LEARNER_SLOTS:
        return None
    return int(number)


def lease_request_ok(ttl_s: float, held_slot: int) -> bool:
    """Whether a lease request is within the bounds above (checked on both ends)."""
    return 0 < ttl_s <= MAX_LEASE_TTL_S and -1 <= held_slot < MAX_LEARNER_SLOTS


@dataclass
class TransportStats:
    """Bytes on the wire and rejected frames, by reason (for metrics and summaries)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    resent: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # our deltas the syncer refused
    # Snapshot requests left unanswered because the same peer was answered within
    # the rate limit: flow control (a learner asks again), not a refused message.
    rate_limited: int = 0
    # Requests a broker refused for want of memory (Redis at maxmemory, nothing
    # evicted): backed off and tried again, nothing dropped.
    out_of_memory: int = 0
    # Snapshots a broker that stores them (Redis) no longer held as written (a
    # restart or failover lost them): written again, whole.
    snapshots_lost: int = 0


class Terms:
    """The highest syncer term a learner took, per shard. A syncer's term grows
    with each tenure of its shard's lease: a global or an ack of a lower term
    than one taken comes from a syncer that another took over from (woken from
    a freeze, say), and is refused, counted as ``lower_term``."""

    def __init__(self, stats: TransportStats) -> None:
        self._stats = stats
        self._taken: dict[int, int] = {}

    def admits(self, shard: int, term: int) -> bool:
        """Whether a message of ``term`` from ``shard`` may be taken (then ``term``
        is the lowest taken from it from now on)."""
        if term < self._taken.get(shard, 0):
            self._stats.rejected["lower_term"] += 1
            return False
        self._taken[shard] = term
        return True


# What a learner holds of a fragment, for a recall (LearnerTransport.answer_recalls).
HeldGlobals = Callable[[int, bool], "list[GlobalFragment]"]


class ResumePoint(NamedTuple):
    """What a syncer that lost its checkpoint resumes a fragment from
    (:meth:`SyncerTransport.resume_points`): the latest version with its
    weights, the syncer state published with it, and, where known, the signed
    change that made that version (the last outer step's update, from which
    the momentum is estimated: ``syncer.outer.momentum_from_change``)."""

    latest: GlobalFragment
    state: bytes
    last_change: GlobalFragment | None = None


@dataclass(frozen=True)
class Inbound:
    """A message received by the syncer, with what the backend needs to ack it."""

    message: Delta | Heartbeat
    token: Any = None  # backend-specific; None for messages that need no ack


def candidate_order(g: GlobalFragment) -> tuple[int, int, int]:
    """The order a learner takes candidate globals in: per fragment, oldest first
    (an epoch is its syncer's start time, so a later epoch is a newer lineage)."""
    return (g.fragment, g.epoch, g.version)


class LearnerTransport(abc.ABC):
    """Learner side. Used from one thread (the learner's comm thread).

    Keeps, for both backends, the (epoch, version) the learner accepted per
    fragment and the fragments to resync after a refusal."""

    def __init__(self) -> None:
        self.stats = TransportStats()
        # Accepted (epoch, version) per fragment; missing: no base yet.
        self._versions: dict[int, tuple[int, int]] = {}
        self._refused_fragments: set[int] = set()

    def _is_new(self, g: GlobalFragment) -> bool:
        """Whether ``g`` is newer than what was accepted: a later version of the
        same epoch, or any version of another epoch (a restarted syncer's lineage)."""
        known = self._versions.get(g.fragment)
        return known is None or g.epoch != known[0] or g.version > known[1]

    def _refused(self, fragment: int) -> None:
        """A delta of ``fragment`` was refused: forget its version, so that the
        syncer's latest global is taken whatever it is."""
        self._refused_fragments.add(fragment)
        self._versions.pop(fragment, None)

    @abc.abstractmethod
    def send_delta(self, delta: Delta) -> None:
        """Hand a delta over for at-least-once delivery; raises :class:`Backpressure`
        when ``unacked`` is at its bound."""

    @abc.abstractmethod
    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Best effort; never blocks."""

    @abc.abstractmethod
    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        """Wait up to ``timeout_s`` for globals; also services acks, refusals,
        resends and reconnects. Returns candidate globals newer than the accepted
        ones, in version order per fragment."""

    @abc.abstractmethod
    def snapshot(
        self, fragments: list[int], timeout_s: float, held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        """The latest global of each fragment that exists, for joining or rejoining,
        whatever version was accepted before. Fragments nobody has published yet
        are missing from the result.

        ``held``: flat fp32 weights the caller holds, by fragment. A fragment
        whose latest version is exactly those weights may be answered without
        them and completed from ``held`` (:meth:`GlobalFragment.with_weights`),
        so a learner that starts from the run's initial model joins without
        downloading it."""

    @abc.abstractmethod
    def resync(self, fragment: int) -> None:
        """Fetch the latest snapshot of ``fragment``: a change arrived for a version
        the learner does not hold (it rejected the one before, say)."""

    def answer_recalls(self, held: HeldGlobals) -> None:
        """Answer a syncer that lost its checkpoint from ``held`` (over ZeroMQ,
        where no broker keeps globals: :class:`~broker.wire.messages.Recall`).
        ``held(fragment, weights)``: the version of ``fragment`` this learner
        holds, in its held form (:meth:`GlobalFragment.held_form`), without its
        weights (a claim), or with them, then preceded by the change that made
        it where the learner took one; empty if it holds none. A broker that
        keeps globals (Redis) asks nothing."""
        return None

    def refused_fragments(self) -> set[int]:
        """Fragments whose deltas the syncer refused since the last call. The
        transport has forgotten their versions and asked for their latest global:
        the learner takes it whatever its version (its own base may be one the
        syncer never published)."""
        refused, self._refused_fragments = self._refused_fragments, set()
        return refused

    def accepted(self, fragment: GlobalFragment) -> None:
        """The learner validated ``fragment``: later globals of its fragment are
        compared with it (older ones of its epoch are dropped, a skipped version
        is a gap)."""
        if self._is_new(fragment):
            self._versions[fragment.fragment] = (fragment.epoch, fragment.version)

    @property
    @abc.abstractmethod
    def unacked(self) -> int:
        """Deltas handed over but not yet durably delivered."""

    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        """Take or renew a learner slot (0 .. MAX_LEARNER_SLOTS - 1) for ``holder``
        for ``ttl_s`` (at most MAX_LEASE_TTL_S).

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
    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        """(epoch, version) of the latest global of each of ``fragments`` that a
        syncer of this run published before, where the broker keeps globals
        (Redis does; ZeroMQ keeps none and answers {})."""

    def lost_snapshots(self) -> list[int]:
        """Owned fragments whose snapshot the broker no longer holds as published
        (a Redis restart or failover lost it): the caller announces each again
        (:meth:`announce`), which writes it whole. A broker that stores no
        snapshots (ZeroMQ) loses none."""
        return []

    @abc.abstractmethod
    def refuse(self, item: Inbound, reason: str) -> None:
        """Tell the sender its delta was refused, and never deliver it again."""

    @abc.abstractmethod
    def publish(
        self, fragment: GlobalFragment, snapshot: GlobalFragment | None = None, resume: bytes = b""
    ) -> None:
        """Publish a new global to every learner, and make ``snapshot`` (the same
        version as weights; ``fragment`` itself when None) what joiners and
        learners that missed a version get. ``resume``: the publisher's own
        state that goes with this version (opaque to the transport), kept with
        the snapshot where the broker stores snapshots, for a successor that
        lost its checkpoint (:meth:`resume_points`)."""

    def resume_points(
        self, fragments: list[int], held: Mapping[int, Any] | None = None, wait_s: float = 0.0
    ) -> dict[int, ResumePoint]:
        """The latest snapshot of each of ``fragments`` (with its weights) and the
        ``resume`` state published with it, where the broker keeps both (Redis:
        written in one transaction), or else the learners hold them (ZeroMQ:
        asked for up to ``wait_s``, for those not in ``held``, with the change
        that made it). ``held``: fp32 weights the caller holds, by fragment,
        not read again where they are the latest (as
        :meth:`LearnerTransport.snapshot`)."""
        return {}

    def serves(self, fragment: int, epoch: int, version: int) -> bool:
        """Whether the broker gives joiners this version of ``fragment`` already,
        as :meth:`resume_points` read it (Redis keeps snapshots): a syncer that
        starts need not publish it again, and its next change follows it. A
        broker that keeps no snapshots (ZeroMQ) serves none."""
        return False

    @abc.abstractmethod
    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        """Tell every learner the published version of a fragment (``fragment``:
        its weights) without the weights (:meth:`GlobalFragment.without_weights`):
        a learner that holds it does nothing, one that does not (it missed it,
        or a restarted syncer began a new epoch) fetches the snapshot, which a
        broker that stores snapshots (Redis) writes again. For fragments that
        have not moved for a while; sending their weights again cost every
        learner the whole model every heartbeat timeout while a run started."""

    @abc.abstractmethod
    def close(self) -> None: ...
