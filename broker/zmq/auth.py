"""Who may talk to a ZeroMQ syncer, with the run's keys (docs/security.md).

Both syncer sockets are CURVE servers under the syncers' key, so every byte
is encrypted and every peer has a CURVE key of its own. A ZAP handler (a
thread of the syncer, asked by ZeroMQ at each handshake) admits:

* on the request socket (ROUTER), any key that is not revoked: a learner must
  be able to reach the syncer to enroll, and nothing but an
  :class:`~broker.wire.messages.Enroll` is taken from a key that has not;
* on the globals socket (PUB), enrolled keys only: the weights go to members.

ZAP is asked at handshake only, so :class:`~broker.identity.members.Members` is checked
again for each message (``check``): a key revoked since, or one claiming
another learner's id, is refused there.
"""

from __future__ import annotations

import threading
import time

import zmq
from zmq.utils import z85

from broker.identity.keys import curve_key_hex
from broker.identity.members import Members

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REQUESTS_DOMAIN = b"ddiloco-requests"
GLOBALS_DOMAIN = b"ddiloco-globals"
_ZAP_POLL_MS = 20
# Subscriptions held for their key's enrollment at once, at most: beyond it
# every held one is refused (its learner subscribes again).
_MAX_HELD = 1024


def admits(members: Members, domain: bytes, key_z85: str) -> bool:
    """The ZAP decision for a handshake on ``domain`` by ``key_z85``: any key
    not revoked on the request socket, members only on the globals socket."""
    key = curve_key_hex(key_z85)
    if not members.may_enroll(key):
        return False
    return domain == REQUESTS_DOMAIN or (domain == GLOBALS_DOMAIN and members.is_member(key))


class ZapHandler:
    """Answers ZeroMQ's ZAP requests from a thread, by :func:`admits`.

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
        if admits(self._members, domain, key):
            self._reply(peer, envelope, b"200", key.encode())
        elif domain == GLOBALS_DOMAIN and self._members.may_enroll(curve_key_hex(key)):
            self._held.append((peer, envelope, domain, key, time.monotonic() + self._hold_s))
        else:
            self._reply(peer, envelope, b"400")

    def _answer_held(self) -> None:
        now = time.monotonic()
        waiting = []
        for peer, envelope, domain, key, until in self._held:
            if admits(self._members, domain, key):
                self._reply(peer, envelope, b"200", key.encode())
            elif now >= until or len(self._held) > _MAX_HELD:
                self._reply(peer, envelope, b"400")
            else:
                waiting.append((peer, envelope, domain, key, until))
        self._held = waiting

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
