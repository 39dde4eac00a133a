"""Where each syncer shard is, and a learner's sockets dialled there.

Each syncer binds a ROUTER (``tcp://host:port``) for deltas, heartbeats and
snapshot requests, and a PUB on ``port + 1`` for globals. Where shard s is
(:func:`shard_endpoint`): the URL lists one endpoint per shard, in shard
order, or one endpoint for all of them, and shard s listens at
``port + 2s``. With one endpoint for several shards, a learner connects each
shard's sockets to that port on every address the host name resolves to,
and looks it up again every few seconds: the replicas of a scaled compose
service share one name, and a restarted one may come back at another
address. Only the replica that holds shard s listens on its port, so each
DEALER has one live peer.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable, Sequence

import zmq

from broker.errors import ConfigError
from broker.transport import TransportStats
from broker.zmq.frames import GLOBALS_TOPIC, make_socket

log = logging.getLogger(__name__)
# One endpoint for several shards: shard s's ROUTER is at port + 2s, its PUB
# at the port after it.
SHARD_PORT_STRIDE = 2
# ... and how often a learner looks the host's addresses up again.
_REDIAL_EVERY_S = 2.0


def pub_endpoint(endpoint: str) -> str:
    """The PUB endpoint that goes with a syncer's ROUTER endpoint (port + 1)."""
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1}"


def shard_endpoint(endpoints: Sequence[str], shard: int, shards: int) -> str:
    """Syncer shard ``shard``'s ROUTER endpoint, out of a URL's ``endpoints``:
    the shard-th when they are one per shard; with one endpoint for all,
    its host at ``port + SHARD_PORT_STRIDE * shard``."""
    if len(endpoints) == shards:
        return endpoints[shard]
    if len(endpoints) != 1:
        raise ConfigError(
            f"the url lists {len(endpoints)} syncer endpoints for syncer_shards={shards}: "
            f"list one per shard, in shard order, or one for all (shard s at port + "
            f"{SHARD_PORT_STRIDE}s)"
        )
    host, _, port = endpoints[0].rpartition(":")
    last = int(port) + SHARD_PORT_STRIDE * (shards - 1) + 1  # the last shard's PUB
    if last > 65535:
        raise ConfigError(
            f"{endpoints[0]}: {shards} shards need ports up to {last}; use a lower one"
        )
    return f"{host}:{int(port) + SHARD_PORT_STRIDE * shard}"


def resolve_addresses(host: str) -> set[str]:
    """Every address ``host`` resolves to (a scaled compose service: one per replica)."""
    return {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}


def _at_address(endpoint: str, address: str) -> str:
    """``endpoint`` with its host replaced by ``address``."""
    port = endpoint.rpartition(":")[2]
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def disconnect(sock: zmq.Socket[bytes], endpoint: str) -> None:
    try:
        sock.disconnect(endpoint)
    except zmq.ZMQError as e:  # not connected (any more): nothing to undo
        log.debug("%s was not connected: %s", endpoint, e)


class ShardSockets:
    """A learner's DEALER and SUB per syncer shard, dialled where the shard is
    (:meth:`dial`), and dialled again as the host's addresses change
    (:meth:`redial_due`). ``secure``: makes a socket a CURVE client (or
    nothing, without keys); ``dealer_identity``: the DEALERs' chosen identity
    (None: the syncer names the connection); ``resolve_host``: how a host name
    becomes its addresses (one endpoint for several shards)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoints: Sequence[str],
        syncer_shards: int,
        *,
        max_message_bytes: int,
        send_hwm: int,
        stats: TransportStats,
        secure: Callable[[zmq.Socket[bytes]], None],
        dealer_identity: bytes | None,
        resolve_host: Callable[[str], set[str]],
    ) -> None:
        # Each shard's endpoint; with one endpoint for several shards, its host is
        # looked up and each of its addresses dialled (dial).
        self.shard_endpoints = [
            shard_endpoint(endpoints, s, syncer_shards) for s in range(syncer_shards)
        ]
        # That host, or None when each shard has its own endpoint.
        self._lookup_host = (
            endpoints[0].removeprefix("tcp://").rpartition(":")[0].strip("[]")
            if len(endpoints) < syncer_shards
            else None
        )
        self._resolve_host = resolve_host
        self._ctx = ctx
        self._max_message_bytes = max_message_bytes
        self._stats = stats
        self._secure = secure
        self.dealers: list[zmq.Socket[bytes]] = []
        self.subs: list[zmq.Socket[bytes]] = []
        self.dialled: list[set[str]] = []  # per shard: the ROUTER endpoints its sockets dial
        self._dialled_at = -math.inf
        self.poller = zmq.Poller()
        for _ in self.shard_endpoints:
            dealer = make_socket(ctx, zmq.DEALER, max_message_bytes)
            if dealer_identity is not None:
                dealer.setsockopt(zmq.IDENTITY, dealer_identity)
            # else: the syncer names the connection (no handover of a chosen id)
            secure(dealer)
            # Queue nothing for a syncer that is not connected: a restarted
            # syncer gets resends from us instead of a stale backlog; and with
            # one endpoint for several shards, nothing for the other shards'
            # addresses, where nobody listens on this shard's port.
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            dealer.setsockopt(zmq.SNDHWM, send_hwm)
            self._for_lookup(dealer)
            self.poller.register(dealer, zmq.POLLIN)
            self.dealers.append(dealer)
            self.dialled.append(set())
            self.subs.append(self.subscribe(set()))

    def _for_lookup(self, sock: zmq.Socket[bytes]) -> None:
        """With one endpoint for several shards, a socket dials every address, and
        nobody listens on its port at all but one: those refusals are retried
        with backoff up to ``_REDIAL_EVERY_S`` (libzmq's default retries every
        100 ms for ever), and the addresses may be IPv6."""
        if self._lookup_host is not None:
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(_REDIAL_EVERY_S * 1000))

    def redial_due(self) -> None:
        """Look the host up again (:meth:`dial`) if it is time to."""
        if self._lookup_host is not None and time.monotonic() - self._dialled_at >= _REDIAL_EVERY_S:
            self.dial()

    def dial(self) -> None:
        """Connect each shard's sockets to where the shard is, and leave the
        endpoints it is no longer at. With one endpoint for several shards that
        is its port on every address the host has now (a name that does not
        resolve for the moment keeps the last ones)."""
        self._dialled_at = time.monotonic()
        host = self._lookup_host
        if host is None:
            wanted = [{e} for e in self.shard_endpoints]
        else:
            try:
                addresses = self._resolve_host(host)
            except OSError as e:
                log.debug("the syncers' host %s does not resolve now: %s", host, e)
                return
            wanted = [{_at_address(e, a) for a in addresses} for e in self.shard_endpoints]
        for shard, endpoints in enumerate(wanted):
            dealer, sub = self.dealers[shard], self.subs[shard]
            for endpoint in endpoints - self.dialled[shard]:
                dealer.connect(endpoint)
                sub.connect(pub_endpoint(endpoint))
            for endpoint in self.dialled[shard] - endpoints:
                disconnect(dealer, endpoint)
                disconnect(sub, pub_endpoint(endpoint))
            self.dialled[shard] = endpoints

    def subscribe(self, endpoints: set[str]) -> zmq.Socket[bytes]:
        """A SUB to the PUBs beside ``endpoints`` (ROUTERs)."""
        sub = make_socket(self._ctx, zmq.SUB, self._max_message_bytes)
        self._secure(sub)
        sub.setsockopt(zmq.SUBSCRIBE, GLOBALS_TOPIC)
        self._for_lookup(sub)
        for endpoint in endpoints:
            sub.connect(pub_endpoint(endpoint))
        self.poller.register(sub, zmq.POLLIN)
        return sub

    def replace_sub(self, shard: int) -> zmq.Socket[bytes]:
        """Subscribe shard ``shard`` again on a new SUB; the old one, no longer
        polled, is returned for the caller to close."""
        old, self.subs[shard] = self.subs[shard], self.subscribe(self.dialled[shard])
        self.poller.unregister(old)
        return old

    def send_small(self, owner: int, frame: bytes) -> bool:
        """Send a one-part frame to shard ``owner`` without waiting; False when
        no syncer is connected there (or its queue is full)."""
        try:
            self.dealers[owner].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._stats.bytes_sent += len(frame)
        return True
