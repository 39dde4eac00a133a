"""Who may talk to a ZeroMQ syncer, with the run's keys (docs/security.md).

Both syncer sockets are CURVE servers under the syncers' key, so every byte
is encrypted and every peer has a CURVE key of its own. A ZAP handler (a
thread of the syncer, asked by ZeroMQ at each handshake) admits:

* on the request socket (ROUTER), any key that is not revoked: a learner must
  be able to reach the syncer to enroll, and nothing but an
  :class:`~broker.wire.Enroll` is taken from a key that has not;
* on the globals socket (PUB), enrolled keys only: the weights go to members.

ZAP is asked at handshake only, so :class:`Members` is checked again for each
message (``check``): a key revoked since, or one claiming another learner's
id, is refused there. Each learner id is bound to the first key that claims
it, until that key has been silent for ``hold_s`` (a learner that lost its
key file comes back under its id once the old binding lapses; one that kept
it, in its ``state_dir``, at once).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils import z85

from broker.keys import RunKeys, curve_key_hex, proof_ok
from broker.transport import MAX_LEARNER_SLOTS, slot_of
from broker.wire import Enroll

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REQUESTS_DOMAIN = b"ddiloco-requests"
GLOBALS_DOMAIN = b"ddiloco-globals"
# Keys enrolled at once, at most: each costs a few hundred bytes, and a holder
# of the join secret could otherwise enroll keys without end.
MAX_MEMBERS = 4 * MAX_LEARNER_SLOTS
_REVOKED_REREAD_S = 1.0
_ZAP_POLL_MS = 20
# Subscriptions held for their key's enrollment at once, at most: beyond it
# every held one is refused (its learner subscribes again).
_MAX_HELD = 1024


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

    def enroll(self, key_z85: str, msg: Enroll) -> str | None:
        """Admit the connection's key; None, or the reason it was refused."""
        key = curve_key_hex(key_z85)
        if msg.key != key:
            return "enroll_key_mismatch"  # a proof made for another key
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

    def check(self, key_z85: str, learner_id: str | None, writes: bool) -> str | None:
        """None if the key may send this (``learner_id``: the id the message
        claims; ``writes``: a delta, heartbeat or lease), else the reason."""
        key = curve_key_hex(key_z85)
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
            self._bound[learner_id] = key
        return None

    def slots_held_by_others(self, key_z85: str) -> frozenset[int]:
        """Learner slots whose id (``learner-<slot>``) a live key other than
        ``key_z85`` holds: a lease of them would hand that id over."""
        key = curve_key_hex(key_z85)
        now = time.monotonic()
        held = set()
        with self._lock:
            for learner_id, holder in self._bound.items():
                slot = slot_of(learner_id)
                live = now - self._last_heard.get(holder, -float("inf")) < self._hold_s
                if slot is not None and holder != key and live:
                    held.add(slot)
        return frozenset(held)

    def bind(self, key_z85: str, learner_id: str) -> None:
        """``learner_id`` is the key's now: it holds that id's learner slot
        (granted only when no other live key holds the id)."""
        with self._lock:
            self._bound[learner_id] = curve_key_hex(key_z85)

    def may_enroll(self, key_z85: str) -> bool:
        """Whether ``key_z85`` is not revoked (an enrollment may still admit it)."""
        with self._lock:
            return curve_key_hex(key_z85) not in self._revoked_keys

    def admits(self, domain: bytes, key_z85: str) -> bool:
        """The ZAP decision for a handshake on ``domain`` by ``key_z85``."""
        key = curve_key_hex(key_z85)
        with self._lock:
            if key in self._revoked_keys:
                return False
            if domain == REQUESTS_DOMAIN:
                return True
            return domain == GLOBALS_DOMAIN and key in self._roles

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


class ZapHandler:
    """Answers ZeroMQ's ZAP requests from a thread, by :meth:`Members.admits`.

    A subscription from a key not enrolled yet is held (up to ``hold_s``)
    rather than refused: a learner's subscription races its enrollment, which
    the syncer's loop takes from the request socket, and ZeroMQ does not retry
    a refused handshake. Each handshake is its own ZAP peer, so a ROUTER can
    answer them in any order."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], members: Members, hold_s: float = 5.0
    ) -> None:
        self._members = members
        self._hold_s = hold_s
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        # Held requests: (peer, envelope, domain, key, when to give up).
        self._held: list[tuple[bytes, list[bytes], bytes, str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(_ZAP_POLL_MS, zmq.POLLIN):
                    self._take(self._socket.recv_multipart())
                self._answer_held()
        finally:
            self._socket.close(linger=0)

    def _reply(self, peer: bytes, envelope: list[bytes], status: bytes, user: bytes = b"") -> None:
        version, request_id = envelope
        text = b"OK" if status == b"200" else b"not admitted"
        self._socket.send_multipart([peer, b"", version, request_id, status, text, user, b""])

    def _take(self, frames: list[bytes]) -> None:
        # [peer, empty] then RFC 27: version, request id, domain, address,
        # identity, mechanism, credentials.
        if len(frames) < 8 or frames[1] != b"":
            return
        peer, request = frames[0], frames[2:]
        envelope = request[:2]
        domain, mechanism = request[2], request[5]
        if mechanism != b"CURVE" or len(request) != 7 or len(request[6]) != 32:
            self._reply(peer, envelope, b"400")
            return
        key = z85.encode(request[6]).decode()
        if self._members.admits(domain, key):
            self._reply(peer, envelope, b"200", key.encode())
        elif domain == GLOBALS_DOMAIN and self._members.may_enroll(key):
            self._held.append((peer, envelope, domain, key, time.monotonic() + self._hold_s))
        else:
            self._reply(peer, envelope, b"400")

    def _answer_held(self) -> None:
        now = time.monotonic()
        waiting = []
        for peer, envelope, domain, key, until in self._held:
            if self._members.admits(domain, key):
                self._reply(peer, envelope, b"200", key.encode())
            elif now >= until or len(self._held) > _MAX_HELD:
                self._reply(peer, envelope, b"400")
            else:
                waiting.append((peer, envelope, domain, key, until))
        self._held = waiting

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
