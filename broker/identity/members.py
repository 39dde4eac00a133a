"""Who is in a run, by key (docs/security.md): the rules both transports apply.

:class:`Members` holds the enrolled keys (hex: a CURVE public key over ZeroMQ,
the digest of an ACL password over Redis), their roles, and the learner id
bound to each key: each learner id is bound to the first key that claims it,
until that key has been silent for ``hold_s`` (a learner that lost its key
file comes back under its id once the old binding lapses; one that kept it,
at once). :class:`SlotLeases` hands out learner slots, each held by the key
that took it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from broker.errors import ConfigError
from broker.identity.keys import RunKeys, proof_ok
from broker.transport import MAX_LEARNER_SLOTS, TransportStats, lease_request_ok, slot_of

if TYPE_CHECKING:  # the messages hold tensors: torch is not loaded for types alone
    from broker.wire.messages import Enroll, LeaseRequest

log = logging.getLogger(__name__)

# Keys enrolled at once, at most: each costs a few hundred bytes, and a holder
# of the join secret could otherwise enroll keys without end.
MAX_MEMBERS = 4 * MAX_LEARNER_SLOTS
# Learner ids one key may hold: a learner needs one (a slot learner, also its
# slot's); more would let one key grow the roster and its ACL rules alone.
MAX_IDS_PER_KEY = 4
_REVOKED_REREAD_S = 1.0


class Members:
    """Enrolled keys, their roles and the learner ids bound to them. Read by
    the ZAP thread, written by the syncer's loop: every access holds the lock."""

    def __init__(self, keys: RunKeys, run_id: str, hold_s: float) -> None:
        self._keys = keys
        self._run_id = run_id
        self._hold_s = hold_s
        self._lock = threading.Lock()
        self._roles: dict[str, str] = {}  # key (hex) -> role
        self._last_heard: dict[str, float] = {}  # key -> monotonic time
        self._bound: dict[str, str] = {}  # learner id -> key
        self._revoked_ids: frozenset[str] = frozenset()
        self._revoked_keys: set[str] = set()
        self._revoked_read = -float("inf")

    def enroll(self, key: str, msg: Enroll) -> str | None:
        """Admit ``key`` (hex; the caller checked it is the one ``msg`` came
        with); None, or the reason it was refused."""
        if not proof_ok(self._keys.join_secret, self._run_id, msg.key, msg.role, msg.proof):
            return "bad_enroll_proof"
        with self._lock:
            if key in self._revoked_keys:
                return "revoked"
            if key not in self._roles and len(self._roles) >= MAX_MEMBERS:
                self._forget_silent()
                if len(self._roles) >= MAX_MEMBERS:
                    return "too_many_members"
            self._roles[key] = msg.role
            self._last_heard[key] = time.monotonic()
        return None

    def check(self, key: str, learner_id: str | None, writes: bool) -> str | None:
        """None if ``key`` may send this (``learner_id``: the id the message
        claims; ``writes``: a delta, heartbeat or lease), else the reason."""
        self._reread_revoked()
        now = time.monotonic()
        with self._lock:
            if key in self._revoked_keys:
                return "revoked"
            role = self._roles.get(key)
            if role is None:
                return "not_enrolled"
            if writes and role != "learner":
                return "read_only"
            self._last_heard[key] = now
            if learner_id is None:
                return None
            if learner_id in self._revoked_ids:
                self._revoke_key_locked(key)
                return "revoked"
            holder = self._bound.get(learner_id)
            holder_heard = self._last_heard.get(holder, -float("inf")) if holder else -float("inf")
            if holder not in (None, key) and now - holder_heard < self._hold_s:
                return "identity_taken"
            if holder != key and self._count_ids_locked(key) >= MAX_IDS_PER_KEY:
                return "too_many_ids"
            self._bound[learner_id] = key
        return None

    def _count_ids_locked(self, key: str) -> int:
        return sum(1 for k in self._bound.values() if k == key)

    def slots_held_by_others(self, key: str) -> frozenset[int]:
        """Learner slots whose id (``learner-<slot>``) a live key other than
        ``key`` holds: a lease of them would hand that id over."""
        now = time.monotonic()
        held = set()
        with self._lock:
            for learner_id, holder in self._bound.items():
                slot = slot_of(learner_id)
                live = now - self._last_heard.get(holder, -float("inf")) < self._hold_s
                if slot is not None and holder != key and live:
                    held.add(slot)
        return frozenset(held)

    def bind(self, key: str, learner_id: str) -> None:
        """``learner_id`` is the key's now: it holds that id's learner slot
        (granted only when no other live key holds the id), and no other: a
        key holds one slot at a time."""
        with self._lock:
            for other in [i for i, k in self._bound.items() if k == key and slot_of(i) is not None]:
                del self._bound[other]
            self._bound[learner_id] = key

    def may_enroll(self, key: str) -> bool:
        """Whether ``key`` is not revoked (an enrollment may still admit it)."""
        with self._lock:
            return key not in self._revoked_keys

    def restore(self, key: str, learner_id: str) -> None:
        """``key``, a learner's, holds ``learner_id`` (as a roster written before
        this process started says), heard from now."""
        with self._lock:
            if key in self._revoked_keys:
                return
            self._roles.setdefault(key, "learner")
            self._bound[learner_id] = key
            self._last_heard[key] = time.monotonic()

    def heard(self, learner_id: str) -> None:
        """The key bound to ``learner_id`` was heard from (a heartbeat only it
        can write): it keeps the id."""
        with self._lock:
            key = self._bound.get(learner_id)
            if key is not None:
                self._last_heard[key] = time.monotonic()

    def holder_of(self, learner_id: str) -> str | None:
        with self._lock:
            return self._bound.get(learner_id)

    def ids_of(self, key: str) -> frozenset[str]:
        """The learner ids bound to ``key``."""
        with self._lock:
            return frozenset(i for i, k in self._bound.items() if k == key)

    def role_of(self, key: str) -> str | None:
        with self._lock:
            return self._roles.get(key)

    def revoked_keys(self) -> frozenset[str]:
        """Keys revoked so far (the revoked list is read again at most every second)."""
        self._reread_revoked()
        with self._lock:
            return frozenset(self._revoked_keys)

    def is_member(self, key: str) -> bool:
        """Whether ``key`` is enrolled and not revoked."""
        with self._lock:
            return key in self._roles and key not in self._revoked_keys

    def _reread_revoked(self) -> None:
        now = time.monotonic()
        if now - self._revoked_read < _REVOKED_REREAD_S:
            return
        self._revoked_read = now
        revoked = self._keys.revoked()
        if revoked == self._revoked_ids:
            return
        with self._lock:
            self._revoked_ids = revoked
            for learner_id in revoked:
                key = self._bound.get(learner_id)
                if key is not None:
                    self._revoke_key_locked(key)
        log.warning("revoked learners: %s", ", ".join(sorted(revoked)))

    def _revoke_key_locked(self, key: str) -> None:
        self._revoked_keys.add(key)
        self._roles.pop(key, None)

    def _forget_silent(self) -> None:
        now = time.monotonic()
        for key, heard in list(self._last_heard.items()):
            if now - heard >= self._hold_s:
                self._roles.pop(key, None)
                self._last_heard.pop(key, None)


class SlotLeases:
    """Learner slots, held by the first syncer: the rule of
    ``LearnerTransport.lease`` by this process's clock. In memory only: for half
    a lease period after a start it grants only the slots holders say they hold.

    ``max_slots``: slots below it are granted, no more (nor past
    MAX_LEARNER_SLOTS): the syncer passes its roster cap, so that a holder of
    the join secret, one key per slot, adds learners up to the cap and cannot
    pin the slots beyond it."""

    def __init__(self, stats: TransportStats, max_slots: int = MAX_LEARNER_SLOTS) -> None:
        if max_slots < 1:
            raise ConfigError(f"max_slots={max_slots}: at least 1")
        self._stats = stats
        self._max_slots = min(max_slots, MAX_LEARNER_SLOTS)
        self._leases: dict[int, tuple[str, str, float]] = {}  # slot -> (holder, key, expiry)
        self._started = time.monotonic()

    def leased_slots(self) -> frozenset[int]:
        """Every slot a lease was granted for (running or run out)."""
        return frozenset(self._leases)

    def grant(
        self, req: LeaseRequest, owner: str = "", in_use: frozenset[int] = frozenset()
    ) -> int | None:
        """The slot ``req`` gets, or None when it gets none now (it asks again).
        ``owner``: the key the request came on (with the run's keys): a lease is
        renewed only by the key that took it, whatever holder name another uses.
        ``in_use``: slots whose learner id another live key sends as (a learner
        that named itself ``learner-<slot>``): never granted, or its id would be
        handed over."""
        if not lease_request_ok(req.ttl_s, req.held_slot):
            self._stats.rejected["bad_lease"] += 1
            return None
        now = time.monotonic()
        mine = [
            s
            for s, (holder, key, _) in self._leases.items()
            if (holder, key) == (req.holder, owner)
        ]
        taken = {s for s, (_, _, expiry) in self._leases.items() if expiry > now} - set(mine)
        taken |= in_use
        mine = [s for s in mine if s not in in_use]
        if mine:
            slot = min(mine)
        elif 0 <= req.held_slot < self._max_slots and req.held_slot not in taken:
            slot = req.held_slot
        elif now - self._started < req.ttl_s / 2:
            # Just started: leases granted before may still run. Their holders
            # renew within a third of the lease, so they reclaim their slots
            # first, and a newcomer asks again.
            return None
        else:
            slot = next(s for s in range(len(taken) + 1) if s not in taken)
            if slot >= self._max_slots:
                self._stats.rejected["no_free_slot"] += 1
                return None
        self._leases[slot] = (req.holder, owner, now + req.ttl_s)
        return slot
