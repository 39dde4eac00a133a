"""Learner side of the Redis Streams transport (docs/transports.md).

The delivery contract is in :mod:`broker.redis`, the keys in
:mod:`broker.redis.names` and the connection handling both sides share in
:mod:`broker.redis.link`. A learner XADDs its deltas to its own delta stream
of their fragment (:class:`~broker.redis.delta_queue.DeltaQueue`), SETs its
heartbeat key, XREADs the globals stream and GETs the snapshot keys when it
has no base or sees a gap (:class:`~broker.redis.globals_reader.GlobalsReader`).

It enrolls on the run's requests stream (:mod:`broker.redis.admission`): at
start, naming its key and role, and again, naming its learner id, once it
first acts as that learner (a delta, a heartbeat or a poll). With the run's
keys it is then its own ACL user (:mod:`broker.redis.access`): until the
syncer made that user, or whenever Redis refuses it (a restarted Redis knows
no members), it enrolls again, at most every second, and retries as after a
connection error. A learner slot is asked for on the requests stream too,
and the syncer's answer read from the key's grant.

Connection errors never escape, with two exceptions: ``snapshot`` and ``lease``
raise :class:`TransportError` when they get no answer within their timeout, and
``send_delta`` raises :class:`Backpressure` when ``max_unacked`` deltas wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import redis

from broker.errors import ConfigError
from broker.identity.keys import Identity, RunKeys, enroll_proof
from broker.identity.signing import GlobalVerifier
from broker.redis.admission import MAX_REQUEST_BYTES, REQUESTS_MAXLEN
from broker.redis.delta_queue import DeltaQueue
from broker.redis.frames import FIELD, encode_bounded
from broker.redis.globals_reader import GlobalsReader, NoticeReader
from broker.redis.link import REFUSED, Failed, Outage, RedisLink, connect, transient_call
from broker.redis.names import grant_key, heartbeat_key, requests_key
from broker.redis.options import RedisOptions
from broker.redis.snapshot_keys import GlobalCheck, SnapshotKeys
from broker.redis.users import (
    JOIN_USER,
    join_password,
    member_password,
    member_user,
    password_digest,
)
from broker.transport import LearnerTransport, TransportError, lease_request_ok
from broker.wire.messages import Delta, Enroll, GlobalFragment, Heartbeat, LeaseRequest

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 3600  # a heartbeat key nobody writes to for an hour goes away
_ENROLL_EVERY_S = 1.0  # at most, while Redis refuses us or is away
_REENROLL_S = 10.0
_GRANT_POLL_S = 0.02
_NO_SLOT_RETRY_S = 0.25
# The syncer's answers to an enrollment that keep us from acting as our learner.
_ENROLL_REFUSALS = {
    "identity_taken": "another key holds our learner id (a second process with this id?)",
    "revoked": "this learner was revoked (ddiloco keys revoke)",
    "read_only": "we enrolled as a reader",
}


def _text(raw: object) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")


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
        options: RedisOptions = RedisOptions(),
        keys: RunKeys | None = None,
        identity: Identity | None = None,
        role: str = "learner",
    ) -> None:
        if num_fragments < 1:
            raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
        max_message_bytes, socket_timeout_s = options.max_message_bytes, options.socket_timeout_s
        self.run_id = run_id
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.num_fragments = num_fragments
        self.options = options
        self.max_message_bytes = max_message_bytes
        super().__init__()
        self.heartbeats_dropped = 0  # not written: Redis was away (the next one will be)
        # Our key is our Redis password's digest (docs/security.md), with keys or not.
        password = member_password((identity or Identity.new()).secret)
        self.key = password_digest(password)
        self.role = role
        self._proof = enroll_proof(keys.join_secret, run_id, self.key, role) if keys else ""
        if keys is not None:
            user = (member_user(run_id, self.key), password)
            client = connect(url, socket_timeout_s, keys, user)
            join = (JOIN_USER, join_password(keys.join_secret))
            self._requests = connect(url, socket_timeout_s, keys, join)
        else:
            client = self._requests = connect(url, socket_timeout_s)
        self._claims = ""  # the learner id enrolled as, once we act as it
        self._enrolled_at = -float("inf")  # the last try
        self._enroll_due = 0.0
        self._told = ""  # the last refusal logged
        self._requests_outage = Outage(
            f"learner {learner_id}: a request to redis", "asked again while due"
        )
        self._link = RedisLink(
            client, f"learner {learner_id}", self._refused_by_redis, stats=self.stats
        )
        self._deltas = DeltaQueue(
            self._link,
            run_id,
            learner_id,
            num_fragments,
            options,
            self.stats,
        )
        verifier = GlobalVerifier(keys) if keys is not None else None
        check = GlobalCheck(run_id, num_fragments, max_message_bytes, self.stats, verifier)
        notices = (
            NoticeReader(
                run_id,
                learner_id,
                incarnation,
                num_fragments,
                max_message_bytes,
                self.stats,
                self._refused,
            )  # fmt: skip
            if role == "learner"
            else None
        )
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
        self._enroll()

    # -- enrollment ---------------------------------------------------------------
    def _enroll(self) -> None:
        """Write our enrollment to the requests stream when due: every
        ``_REENROLL_S`` (a syncer or Redis that lost its state learns of us
        again), a second after a try that failed or that Redis refused us."""
        now = time.monotonic()
        if now < self._enroll_due:
            return
        self._enrolled_at = now
        msg = Enroll(
            run_id=self.run_id, key=self.key, role=self.role, proof=self._proof,
            claims=self._claims,
        )  # fmt: skip
        written = self._request(encode_bounded(msg, MAX_REQUEST_BYTES)) is not None
        self._enroll_due = now + (_REENROLL_S if written else _ENROLL_EVERY_S)

    def _request(self, frame: bytes) -> str | None:
        """XADD ``frame`` to the requests stream; its entry id, or None when Redis
        is away (the caller asks again)."""
        entry = transient_call(
            lambda: self._requests.xadd(
                requests_key(self.run_id), {FIELD: frame}, maxlen=REQUESTS_MAXLEN, approximate=True
            )
        )
        if isinstance(entry, Failed):
            self._requests_outage.failed(entry.error)  # the caller asks again
            return None
        self._requests_outage.ended()
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    def _act_as_learner(self) -> None:
        """Enroll under our learner id the first time we act as that learner."""
        if self.role == "learner" and not self._claims:
            self._claims = self.learner_id
            self._enroll_due = 0.0
            self._enroll()

    def _refused_by_redis(self, error: Exception) -> None:
        """Redis refused our user or a command (our user is not made, or not
        widened to our learner id, yet): enroll again."""
        if isinstance(error, REFUSED):
            self._enroll_due = min(self._enroll_due, self._enrolled_at + _ENROLL_EVERY_S)
            self._enroll()
        if isinstance(error, redis.exceptions.NoPermissionError):
            # Our user exists, so the syncer's answer can be read: say a refusal once.
            try:
                answer = _text(self._link.client.get(grant_key(self.run_id, self.key)))
            except redis.RedisError as e:
                log.warning(
                    "learner %s: the syncer's answer to our enrollment not read (%s); read "
                    "again at the next refusal", self.learner_id, e,
                )  # fmt: skip
                return
            reason = answer.partition(" ")[2]
            if reason in _ENROLL_REFUSALS and reason != self._told:
                self._told = reason
                log.error(
                    "learner %s: the syncer refuses us (%s): %s",
                    self.learner_id, reason, _ENROLL_REFUSALS[reason],
                )  # fmt: skip

    @property
    def connection_errors(self) -> int:
        return self._link.errors

    @property
    def trimmed_unread(self) -> int:
        """Deltas of ours (or others') the delta streams' bound dropped unread."""
        return self._deltas.trimmed_unread

    # -- deltas and heartbeats ----------------------------------------------
    def send_delta(self, delta: Delta) -> None:
        self._act_as_learner()
        self._deltas.send(delta)

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Write ``heartbeat`` (liveness only); while Redis is away it is dropped,
        counted, and the next one says the same."""
        if heartbeat.run_id != self.run_id or heartbeat.learner_id != self.learner_id:
            raise ConfigError("heartbeat of another run or learner")
        frame = encode_bounded(heartbeat, self.max_message_bytes)
        self._act_as_learner()
        written = self._link.attempt(
            lambda: self._link.client.set(
                heartbeat_key(self.run_id, self.learner_id), frame, ex=HEARTBEAT_TTL_S
            )
        )
        if not written:
            self.heartbeats_dropped += 1
            return
        self.stats.bytes_sent += len(frame)
        self.stats.messages_sent += 1

    @property
    def unacked(self) -> int:
        return len(self._deltas)

    # -- globals --------------------------------------------------------------
    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        self._act_as_learner()
        self._enroll()
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
            raise ConfigError(f"fragments {bad} outside [0, {self.num_fragments})")
        return self._link.call_within(
            timeout_s, lambda: self._globals.load(list(fragments), held), "snapshot"
        )

    # -- learner slots ----------------------------------------------------------
    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        """Ask the admitting syncer on the requests stream; its answer is read from
        our key's grant (only our ACL user may read it)."""
        if not lease_request_ok(ttl_s, held_slot):
            raise ConfigError(f"lease of slot {held_slot} for {ttl_s}s: out of bounds")
        req = LeaseRequest(
            run_id=self.run_id, holder=holder, held_slot=held_slot, ttl_s=ttl_s,
            owner_key=self.key,
        )  # fmt: skip
        frame = encode_bounded(req, MAX_REQUEST_BYTES)
        deadline = time.monotonic() + timeout_s
        grant = grant_key(self.run_id, self.key)
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            entry_id = self._link.call_within(
                remaining, lambda: self._request(frame) or self._no_answer("redis"), "learner slot"
            )
            answer = self._answer_to(grant, entry_id, deadline)
            if answer.isdigit():
                return int(answer)
            if answer != "no_slot":  # refused: the key is not a learner's, or revoked
                raise TransportError(f"no learner slot: the syncer answered {answer!r}")
            if time.monotonic() + _NO_SLOT_RETRY_S >= deadline:
                raise TransportError(
                    f"no learner slot within {timeout_s}s: all held, or the syncer just "
                    "started and waits for the holders of before"
                )
            time.sleep(_NO_SLOT_RETRY_S)

    def _answer_to(self, grant: str, entry_id: str, deadline: float) -> str:
        """The syncer's answer to our request ``entry_id``, read from our grant."""
        while True:
            raw = self._link.call_within(
                max(0.0, deadline - time.monotonic()), lambda: self._link.client.get(grant),
                "learner slot",
            )  # fmt: skip
            answered, _, answer = _text(raw).partition(" ")
            if answered == entry_id:
                return answer
            if time.monotonic() >= deadline:
                raise TransportError("no learner slot: no syncer answered (is one up?)")
            time.sleep(_GRANT_POLL_S)

    @staticmethod
    def _no_answer(what: str) -> str:
        """Raised inside a retried call: Redis took no request (it is away)."""
        raise redis.ConnectionError(f"{what} did not take the request")

    def close(self) -> None:
        if self._deltas:
            log.warning(
                "learner %s: closing with %d undelivered deltas", self.learner_id, len(self._deltas)
            )
        self._link.close()
        if self._requests is not self._link.client:
            self._requests.close()
