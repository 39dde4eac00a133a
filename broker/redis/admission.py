"""Who is in a run on Redis: the admitting syncer's part (docs/security.md).

Learners write requests to the run's requests stream (with the run's keys, as
the ``ddiloco-join`` user, who may do nothing else): an
:class:`~broker.wire.messages.Enroll` names the learner's key (its Redis password's
digest), its role and the learner id it will send as; a
:class:`~broker.wire.messages.LeaseRequest` asks for a learner slot. The syncer that
owns fragment 0 takes them (:data:`~broker.redis.scripts.TAKE_BOUNDED`: no
request larger than :data:`MAX_REQUEST_BYTES` leaves the server), applies the
rules of :class:`~broker.identity.members.Members` and
:class:`~broker.identity.members.SlotLeases` (the same as over ZeroMQ), and then:

* makes or updates the key's ACL user (:func:`~broker.redis.access.member_rules`):
  a learner may write only the keys of the learner ids bound to its key;
* answers a lease request, or a refused enrollment, in the key's grant;
* lists each admitted learner id in the roster, which every syncer reads to
  know whose delta streams to read.

A revoked key's user is deleted (Redis drops its connections at once). The
scripts members may run (EVALSHA only) are loaded here, again after a Redis
restart. Without keys the same requests are taken without proofs or users:
the roster and the slots work alike.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import redis

from broker.identity.keys import RunKeys
from broker.identity.members import MAX_MEMBERS, Members, SlotLeases
from broker.redis.access import member_rules
from broker.redis.frames import check_frame
from broker.redis.names import grant_key, requests_key, roster_key
from broker.redis.scripts import (
    BOUNDED_XADD,
    SNAPSHOTS_UNLESS_HELD,
    STREAM_TRIMMED_PAST,
    TAKE_BOUNDED,
)
from broker.redis.users import member_user
from broker.transport import TransportStats, learner_id_of
from broker.wire.messages import Enroll, LeaseRequest

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4096  # an Enroll or a LeaseRequest frame is a few hundred bytes
REQUESTS_MAXLEN = 10_000  # learners XADD requests with this (approximate) bound
GRANT_TTL_S = 3600
# The scripts members run: a member may not load one, so the syncer does.
MEMBER_SCRIPTS = (BOUNDED_XADD, SNAPSHOTS_UNLESS_HELD, STREAM_TRIMMED_PAST)
_REQUESTS_PER_STEP = 256
_SCRIPTS_CHECK_S = 1.0


class Admission:
    """Takes the requests stream's enrollments and lease requests (see the module)."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        num_fragments: int,
        keys: RunKeys | None,
        hold_s: float,
        roster_cap: int,
        stats: TransportStats,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._num_fragments = num_fragments
        self._stats = stats
        self._members = Members(keys, run_id, hold_s) if keys is not None else None
        self._leases = SlotLeases(stats, roster_cap)
        self._take = client.register_script(TAKE_BOUNDED)
        self.roster: dict[str, str] = {}  # admitted learner id -> its key
        self._users: dict[str, frozenset[str]] = {}  # key -> the ids its ACL user holds
        self._deleted: set[str] = set()  # revoked keys whose users are gone
        self._scripts_checked_at = -float("inf")
        self._restored = False

    def _restore(self) -> None:
        """A restarted syncer takes up the roster it (or another) wrote: each listed
        id stays bound to its key, as if just heard from."""
        listed = cast(dict[bytes, bytes], self._client.hgetall(roster_key(self._run_id)))
        for raw_id, raw_key in list(listed.items())[:MAX_MEMBERS]:
            learner_id, key = raw_id.decode(errors="replace"), raw_key.decode(errors="replace")
            self.roster[learner_id] = key
            if self._members is not None:
                self._members.restore(key, learner_id)
        self._restored = True

    def heard(self, learner_ids: list[str]) -> None:
        """Heartbeats of ``learner_ids`` were read: their keys are live."""
        if self._members is not None:
            for learner_id in learner_ids:
                self._members.heard(learner_id)

    def step(self) -> None:
        """Load the members' scripts if Redis lost them, take the waiting
        requests, and delete the users of keys revoked since the last step."""
        if not self._restored:
            self._restore()
        self._load_member_scripts()
        reply = cast(
            list[Any],
            self._take(
                keys=[requests_key(self._run_id)],
                args=[_REQUESTS_PER_STEP, MAX_REQUEST_BYTES],
            ),
        )
        dropped, entries = int(reply[0]), reply[1]
        if dropped:
            self._stats.rejected["too_large"] += dropped
        pipe = self._client.pipeline(transaction=False)
        for entry_id, frame in zip(entries[::2], entries[1::2], strict=True):
            msg = check_frame(frame, MAX_REQUEST_BYTES, self._stats)
            if msg is None:
                continue
            if getattr(msg, "run_id", None) != self._run_id:
                self._stats.rejected["wrong_run"] += 1
            elif isinstance(msg, Enroll):
                self._enroll(pipe, entry_id.decode(), msg)
            elif isinstance(msg, LeaseRequest):
                self._lease(pipe, entry_id.decode(), msg)
            else:
                self._stats.rejected["unexpected_kind"] += 1
        self._revoke(pipe)
        pipe.execute()

    # -- requests -------------------------------------------------------------
    def _enroll(self, pipe: Any, entry_id: str, msg: Enroll) -> None:
        if self._members is None:  # without keys: the id is listed, nothing checked
            if msg.claims:
                self._list(pipe, msg.claims, msg.key)
            return
        reason = self._members.enroll(msg.key, msg)
        if reason is None and msg.claims:
            reason = self._members.check(msg.key, msg.claims, writes=True)
        if reason is not None:
            self._stats.rejected[reason] += 1
            if reason in ("bad_enroll_proof", "too_many_members"):
                return  # no user: nothing of it is kept, not even an answer
            # Said where the learner reads it (its user is made below).
            self._grant(pipe, msg.key, entry_id, reason)
        if reason is None and msg.claims:
            self._list(pipe, msg.claims, msg.key)
        if reason != "revoked":
            self._set_user(pipe, msg.key)

    def _lease(self, pipe: Any, entry_id: str, req: LeaseRequest) -> None:
        in_use: frozenset[int] = frozenset()
        if self._members is not None:
            reason = self._members.check(req.owner_key, None, writes=True)
            if reason is not None:
                self._stats.rejected[reason] += 1
                if reason != "not_enrolled":  # a key without a user cannot read an answer
                    self._grant(pipe, req.owner_key, entry_id, reason)
                return
            in_use = self._members.slots_held_by_others(req.owner_key)
            in_use -= self._leases.leased_slots()
        slot = self._leases.grant(req, req.owner_key, in_use)
        if slot is None:
            self._grant(pipe, req.owner_key, entry_id, "no_slot")
            return
        learner_id = learner_id_of(slot)
        if self._members is not None:
            self._members.bind(req.owner_key, learner_id)
            self._set_user(pipe, req.owner_key)
        self._list(pipe, learner_id, req.owner_key)
        self._grant(pipe, req.owner_key, entry_id, str(slot))

    def _grant(self, pipe: Any, key: str, entry_id: str, answer: str) -> None:
        """The answer to ``key``'s request ``entry_id``, where its user reads it."""
        pipe.set(grant_key(self._run_id, key), f"{entry_id} {answer}", ex=GRANT_TTL_S)

    def _list(self, pipe: Any, learner_id: str, key: str) -> None:
        if self.roster.get(learner_id) != key:
            previous = self.roster.get(learner_id)
            self.roster[learner_id] = key
            pipe.hset(roster_key(self._run_id), learner_id, key)
            if previous is not None and self._members is not None:
                self._set_user(pipe, previous)  # it holds that id no more

    def _set_user(self, pipe: Any, key: str) -> None:
        """Make ``key``'s ACL user hold what its role and bound ids allow. Sent on
        every enrollment: a restarted Redis without its ACL file knows no members."""
        assert self._members is not None
        role = self._members.role_of(key) or "reader"
        ids = self._members.ids_of(key) if role == "learner" else frozenset()
        rules = member_rules(self._run_id, key, role, set(ids), self._num_fragments)
        pipe.execute_command("ACL", "SETUSER", member_user(self._run_id, key), *rules)
        self._users[key] = ids

    def _revoke(self, pipe: Any) -> None:
        if self._members is None:
            return
        for key in self._members.revoked_keys() - self._deleted:
            self._deleted.add(key)
            pipe.execute_command("ACL", "DELUSER", member_user(self._run_id, key))
            for learner_id in [i for i, k in self.roster.items() if k == key]:
                del self.roster[learner_id]
                pipe.hdel(roster_key(self._run_id), learner_id)
            log.warning("revoked key %s...: its Redis user is deleted", key[:12])

    def _load_member_scripts(self) -> None:
        now = time.monotonic()
        if now - self._scripts_checked_at < _SCRIPTS_CHECK_S:
            return
        self._scripts_checked_at = now
        for script in MEMBER_SCRIPTS:  # a no-op for a loaded one: a round trip each
            self._client.script_load(script)
