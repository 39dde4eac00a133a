"""Learner slots (:meth:`broker.transport.LearnerTransport.lease`) over ZeroMQ.

The first syncer's transport holds them, and answers lease requests itself,
like snapshot requests. It keeps them in memory: a restarted syncer knows
none, so for half a lease period it grants only the slots holders say they
hold (their renewals), then free ones again
(:class:`~broker.identity.members.SlotLeases`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from broker.errors import ConfigError, TransportError
from broker.identity.members import Members, SlotLeases
from broker.transport import TransportStats, learner_id_of, lease_request_ok
from broker.wire import messages as wire
from broker.wire.messages import LeaseGrant, LeaseRequest
from broker.zmq.frames import UNSENT_RETRY_S, Parts


class LeaseClient:
    """A learner's lease requests to the first syncer, asked again with backoff
    until its grant comes. ``enroll``: enrolls with the syncers (before each
    request); ``pump``: receives for up to the seconds given (grants come in
    through :meth:`granted`) and resends what is due."""

    def __init__(
        self,
        run_id: str,
        dealer: zmq.Socket[bytes],
        stats: TransportStats,
        enroll: Callable[[], None],
        pump: Callable[[float], None],
    ) -> None:
        self._run_id = run_id
        self._dealer = dealer  # the first syncer's: it holds the leases
        self._stats = stats
        self._enroll = enroll
        self._pump = pump
        self._grants: dict[str, int] = {}  # holder -> slot, from the syncer's last answer

    def granted(self, grant: LeaseGrant) -> None:
        self._grants[grant.holder] = grant.slot

    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        if not lease_request_ok(ttl_s, held_slot):
            raise ConfigError(f"lease of slot {held_slot} for {ttl_s}s: out of bounds")
        req = LeaseRequest(run_id=self._run_id, holder=holder, held_slot=held_slot, ttl_s=ttl_s)
        frame = wire.encode(req)
        self._grants.pop(holder, None)
        deadline = time.monotonic() + timeout_s
        next_request = 0.0
        retry_s = 0.5  # doubles, as for snapshots
        while holder not in self._grants:
            now = time.monotonic()
            if now >= deadline:
                raise TransportError(f"no learner slot from the first syncer within {timeout_s}s")
            if now >= next_request:
                self._enroll()
                try:
                    self._dealer.send(frame, zmq.NOBLOCK)  # the first syncer holds leases
                except zmq.Again:
                    next_request = now + UNSENT_RETRY_S  # not connected yet
                else:
                    self._stats.bytes_sent += len(frame)
                    next_request = now + retry_s
                    retry_s = min(retry_s * 2, 4.0)
            self._pump(min(0.05, max(0.0, next_request - time.monotonic()), deadline - now))
        return self._grants.pop(holder)


class LeaseDesk:
    """The first syncer's side: lease requests answered from
    :class:`~broker.identity.members.SlotLeases`; with keys, a granted slot's
    learner id is bound to the key that asked. ``answer``: sends a reply to the
    connection named by an identity."""

    def __init__(
        self,
        run_id: str,
        stats: TransportStats,
        roster_cap: int,
        members: Members | None,
        answer: Callable[[bytes, Parts], None],
    ) -> None:
        self._run_id = run_id
        self._members = members
        self._answer = answer
        self._leases = SlotLeases(stats, roster_cap)

    def answer(self, identity: bytes, req: LeaseRequest, owner: str) -> None:
        # Slots whose id a learner that named itself sends as; a slot leased
        # before follows its lease (expired: free, and its id goes with it).
        in_use: frozenset[int] = frozenset()
        if self._members is not None:
            in_use = self._members.slots_held_by_others(owner) - self._leases.leased_slots()
        slot = self._leases.grant(req, owner, in_use)
        if slot is not None and self._members is not None:
            # The slot's learner id goes with it: nobody else may send as it.
            self._members.bind(owner, learner_id_of(slot))
        if slot is not None:
            grant = LeaseGrant(run_id=self._run_id, holder=req.holder, slot=slot)
            self._answer(identity, (wire.encode(grant),))
