"""CURVE with the run's keys, on both sides (docs/security.md): the learner's
keys and its enrollment, the syncer's CURVE servers and its per-message
membership checks, and a rotated key taken up by each. Who may connect at
all is the ZAP handler's (:mod:`broker.zmq.auth`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import zmq

from broker.identity.keys import (
    CURVE_PUBLIC,
    CURVE_SECRET,
    FileWatch,
    Identity,
    RunKeys,
    curve_key_hex,
    enroll_proof,
)
from broker.identity.members import Members
from broker.transport import TransportStats
from broker.wire import messages as wire
from broker.wire.messages import Delta, Enroll, Heartbeat, LeaseRequest, Refusal
from broker.zmq.addressing import ShardSockets, disconnect, pub_endpoint
from broker.zmq.auth import GLOBALS_DOMAIN, REQUESTS_DOMAIN, ZapHandler
from broker.zmq.frames import Parts

log = logging.getLogger(__name__)
# Refusals of who we are, not of a delta's content (broker/zmq/auth.py).
IDENTITY_REFUSALS = {
    "identity_taken": "another key holds this learner id; give this learner another id",
    "revoked": "this learner was revoked (ddiloco keys revoke)",
    "read_only": "this process enrolled as a reader",
}
# With keys: how often a learner repeats its enrollment (tiny) when nothing
# else carried it, so a restarted syncer admits its subscription again soon.
_ENROLL_EVERY_S = 1.0
# ... and how soon after a refused subscription it enrolls and subscribes again.
_RESUBSCRIBE_AFTER_S = 0.2


def peer_key(frame: zmq.Frame) -> str:
    """The CURVE key a frame came on (our ZAP handler named the peer by it, z85),
    in hex: the member's key."""
    return curve_key_hex(str(frame.get("User-Id")))


def _bind_when_free(sock: zmq.Socket[bytes], endpoint: str, timeout_s: float = 5.0) -> None:
    """Bind ``endpoint`` again: ZeroMQ frees an unbound port in its I/O thread."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class CurveClient:
    """A learner process's CURVE keys: the syncers' public key, from the run's
    keys (None: no CURVE), and this process's own pair. The syncers' key list
    is watched for a rotation (`ddiloco keys rotate-curve`)."""

    def __init__(self, keys: RunKeys | None, identity: Identity | None, learner_id: str) -> None:
        self.keys = keys
        self.identity = identity or (Identity.new() if keys else None)
        self.watch = FileWatch(keys.folder / CURVE_PUBLIC) if keys else None
        self._learner_id = learner_id

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """CURVE client of the syncers' key, under this process's own key."""
        if self.keys is None or self.identity is None:
            return
        sock.curve_serverkey = self.keys.curve_public
        sock.curve_publickey = self.identity.public
        sock.curve_secretkey = self.identity.secret

    def take_up_rotation(self, sockets: ShardSockets) -> None:
        """Dial the syncers with the newest key of their list once it changed:
        the sockets connect again (a connection keeps the key it was made with)."""
        if self.watch is None or self.keys is None:
            return
        keys = self.keys.rotated(self.watch, "the syncers' CURVE key list")
        if keys is None or keys.curve_public == self.keys.curve_public:
            return
        self.keys = keys
        for dealer, sub, endpoints in zip(
            sockets.dealers, sockets.subs, sockets.dialled, strict=True
        ):
            for sock in (dealer, sub):
                sock.curve_serverkey = keys.curve_public
            for endpoint in endpoints:
                for sock, where in ((dealer, endpoint), (sub, pub_endpoint(endpoint))):
                    disconnect(sock, where)
                    sock.connect(where)
        log.warning("learner %s: dialling the syncers with their rotated key", self._learner_id)


class Enrollment:
    """A learner's enrollment with every syncer, with the run's keys (nothing
    without them): an :class:`~broker.wire.messages.Enroll` proved with the
    join secret, and subscriptions a syncer refused made again."""

    def __init__(
        self,
        sockets: ShardSockets,
        keys: RunKeys | None,
        identity: Identity | None,
        run_id: str,
        role: str,
    ) -> None:
        self._sockets = sockets
        self._keys = keys
        self.frame = b""
        self._last_enrolled = -math.inf
        if keys is not None and identity is not None:
            key = identity.key_hex
            proof = enroll_proof(keys.join_secret, run_id, key, role)
            self.frame = wire.encode(Enroll(run_id=run_id, key=key, role=role, proof=proof))
        self._monitors = [self._monitor(sub) for sub in sockets.subs]
        self._resubscribe_at: dict[int, float] = {}

    def enroll(self) -> None:
        """Enroll with every syncer (again: one that restarted knows no key).
        Sent with heartbeats, before requests and before each delta, at most
        every second otherwise; best effort, as they are."""
        sent = [self.enroll_with(owner) for owner in range(len(self._sockets.dealers))]
        if all(sent):  # else: again at the next poll (a syncer not connected yet)
            self._last_enrolled = time.monotonic()

    def enroll_with(self, owner: int) -> bool:
        return not self.frame or self._sockets.send_small(owner, self.frame)

    def enroll_due(self) -> None:
        """Enroll if nothing carried the enrollment for ``_ENROLL_EVERY_S``."""
        if self.frame and time.monotonic() - self._last_enrolled >= _ENROLL_EVERY_S:
            self.enroll()

    def _monitor(self, sub: zmq.Socket[bytes]) -> zmq.Socket[bytes] | None:
        """With keys: a syncer admits a subscription only from an enrolled key,
        and ZeroMQ does not retry a handshake the syncer refused. A refusal
        (the subscription raced the enrollment, or the syncer restarted) is
        watched for, and the subscription made again (``renew_refused``)."""
        if self._keys is None:
            return None
        return sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def renew_refused(self) -> None:
        now = time.monotonic()
        for i, monitor in enumerate(self._monitors):
            if monitor is not None and monitor.poll(0):
                while monitor.poll(0):
                    monitor.recv_multipart()
                self._resubscribe_at[i] = now + _RESUBSCRIBE_AFTER_S
            if self._resubscribe_at.get(i, math.inf) <= now:
                del self._resubscribe_at[i]
                self.enroll_with(i)
                old = self._sockets.replace_sub(i)
                old.disable_monitor()
                old.close(linger=0)
                if monitor is not None:
                    monitor.close(linger=0)
                self._monitors[i] = self._monitor(self._sockets.subs[i])


class CurveServer:
    """A syncer's side, with the run's keys (nothing without them): its sockets
    CURVE servers under the syncers' key, admitted by a ZAP handler, each
    message checked against :class:`~broker.identity.members.Members`, and a
    rotated key (`ddiloco keys rotate-curve`) taken up by binding again: a
    bound socket keeps the key it was bound with. ``answer``: sends a reply
    to the connection named by an identity."""

    def __init__(
        self,
        keys: RunKeys | None,
        run_id: str,
        identity_hold_s: float,
        stats: TransportStats,
        answer: Callable[[bytes, Parts], None],
    ) -> None:
        self.keys = keys
        self.members = Members(keys, run_id, identity_hold_s) if keys else None
        self.watch = FileWatch(keys.folder / CURVE_SECRET) if keys else None
        self._stats = stats
        self._answer = answer
        self._zap: ZapHandler | None = None

    def serve_zap(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Start the ZAP handler, with keys: before any socket is a CURVE server."""
        if self.members is not None:
            self._zap = ZapHandler(ctx, self.members)

    def secure(self, sock: zmq.Socket[bytes], domain: bytes) -> None:
        self._serve(sock, self.keys, domain)

    @staticmethod
    def _serve(sock: zmq.Socket[bytes], keys: RunKeys | None, domain: bytes) -> None:
        if keys is None:
            return
        assert keys.curve_secret is not None
        sock.curve_server = True
        # No handshake succeeds unless our ZAP handler admits it (without
        # this, libzmq admits everyone when no handler answers).
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.curve_secretkey = keys.curve_secret
        sock.curve_publickey = keys.curve_public
        sock.zap_domain = domain

    def refused(self, identity: bytes, frame: zmq.Frame, msg: wire.Message) -> bool:
        """With keys: whether the key ``frame`` came on may not send ``msg``
        (counted by reason); an enrollment is handled here. A refused delta is
        answered (to the connection it came on, so nobody else can make a
        learner drop its deltas): a learner whose id another key holds learns
        it, rather than resending into silence. A key not enrolled yet gets no
        answer: its learner enrolls before each delta, and resends it."""
        if self.members is None:
            return False
        key = peer_key(frame)
        if isinstance(msg, Enroll):
            # A proof made for another key than the one it came on is refused.
            reason = "enroll_key_mismatch" if msg.key != key else self.members.enroll(key, msg)
        elif isinstance(msg, Delta | Heartbeat):
            reason = self.members.check(key, msg.learner_id, writes=True)
        elif isinstance(msg, LeaseRequest):
            reason = self.members.check(key, None, writes=True)
        else:
            reason = self.members.check(key, None, writes=False)
        if reason is not None:
            self._stats.rejected[reason] += 1
            if isinstance(msg, Delta) and reason in IDENTITY_REFUSALS:
                self._answer(identity, (wire.encode(Refusal.of(msg, reason)),))
        return reason is not None or isinstance(msg, Enroll)

    def take_up_rotation(self, router: zmq.Socket[bytes], pub: zmq.Socket[bytes]) -> None:
        if self.watch is None or self.keys is None:
            return
        keys = self.keys.rotated(self.watch, "CURVE key")
        if keys is None:
            return
        for sock, domain in ((router, REQUESTS_DOMAIN), (pub, GLOBALS_DOMAIN)):
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            # The connections this endpoint accepted close; their learners dial
            # again with the new key (deltas unacked are sent again).
            sock.unbind(endpoint)
            self._serve(sock, keys, domain)
            _bind_when_free(sock, endpoint)
        self.keys = keys
        log.warning("serving with the rotated CURVE key in %s", keys.folder)

    def close(self) -> None:
        if self._zap is not None:
            self._zap.close()  # its socket is closed by its own thread
