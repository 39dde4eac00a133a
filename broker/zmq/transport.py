"""ZeroMQ backend: brokerless, learner DEALER/SUB <-> syncer ROUTER/PUB.

Each syncer binds a ROUTER (``tcp://host:port``) for deltas, heartbeats and
snapshot requests, and a PUB on ``port + 1`` for globals. A learner connects
one DEALER and one SUB to every syncer shard; fragment ``p`` belongs to shard
``owner_shard(p, syncer_shards)`` (:func:`broker.fragments.owner_shard`).
Where shard s is (:func:`shard_endpoint`): the URL lists one endpoint per
shard, in shard order, or one endpoint for all of them, and shard s listens
at ``port + 2s``. With one endpoint for several shards, a learner connects
each shard's sockets to that port on every address the host name resolves
to, and looks it up again every few seconds: the replicas of a scaled
compose service share one name, and a restarted one may come back at another
address. Only the replica that holds shard s listens on its port, so each
DEALER has one live peer.

Deltas and globals travel as three-part messages, the parts of
:func:`broker.wire.messages.encode_parts` (prefix and header, payload, checksum), so a
fragment is sent from the caller's buffer and received into one without a
copy; everything else is one frame. Under CURVE the payload goes in 1 MiB
frames, joined again on receipt (see ``_CURVE_FRAME_BYTES``). Every message is
received frame by frame within a bound of parts and bytes.

Why these sockets: PUSH would block at its high-water mark and PUB silently
drops, so deltas go DEALER -> ROUTER with an explicit :class:`~broker.wire.messages.Ack`
from the syncer once the update is durable, and the learner resends anything
unacknowledged after ``ack_timeout_s`` (the syncer de-duplicates). Globals are
full fragment weights, so PUB's drops are harmless as long as they are
noticed: versions are per-fragment sequence numbers, and a gap triggers a
snapshot request for that fragment over the DEALER.

Learner slots (``lease``) are held by the first syncer's transport, which
answers lease requests itself, like snapshot requests. It keeps them in
memory: a restarted syncer knows none, so for half a lease period it grants
only the slots holders say they hold (their renewals), then free ones again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import zmq

from broker.checks import check_positive
from broker.errors import ConfigError
from broker.fragments import owner_shard
from broker.identity.keys import (
    CURVE_PUBLIC,
    CURVE_SECRET,
    FileWatch,
    Identity,
    RunKeys,
    curve_key_hex,
    enroll_proof,
)
from broker.identity.members import Members, SlotLeases
from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.transport import (
    MAX_LEARNER_SLOTS,
    Backpressure,
    Inbound,
    LearnerTransport,
    SyncerTransport,
    TransportError,
    TransportStats,
    candidate_order,
    learner_id_of,
    lease_request_ok,
)
from broker.wire import messages as wire
from broker.wire.messages import (
    Ack,
    Delta,
    Enroll,
    GlobalFragment,
    Heartbeat,
    LeaseGrant,
    LeaseRequest,
    Refusal,
    SnapshotRequest,
    WireError,
)
from broker.zmq.auth import GLOBALS_DOMAIN, REQUESTS_DOMAIN, ZapHandler
from broker.zmq.options import ZmqOptions

log = logging.getLogger(__name__)
GLOBALS_TOPIC = b"g"
_FRAME_OVERHEAD = 64 * 1024 + 16  # header limit + prefix + checksum
# Parts at least this big are sent zero-copy (libzmq reads the bytes object
# itself); below it a copy is cheaper than the bookkeeping.
_ZERO_COPY_BYTES = 64 * 1024
# Under CURVE, libzmq encrypts each frame into fresh buffers of its size and
# copies it twice more: a 16 MiB payload misses the CPU caches at every step.
# Sent in frames of this size it stays in them (loopback, 16 MiB deltas: 0.6
# GB/s as one frame, 0.85 GB/s as 1 MiB frames; benchmarks/README.md).
_CURVE_FRAME_BYTES = 2**20
# A message as sent: one whole frame, or the three parts of wire.encode_parts.
Parts = tuple[bytes, ...]
# Globals held per fragment between two polls. Most are changes, each from the
# version before it: all of a run of them are needed to follow the chain (a
# learner busy between two polls, e.g. joining, may find a dozen).
_CANDIDATES_PER_FRAGMENT = 64
_RESYNC_FIRST_RETRY_S = 0.5  # then doubling: whole fragments must not pile up on a slow link
_RESYNC_MAX_RETRY_S = 8.0
_JOIN_MAX_RETRY_S = 2.0
# A request that could not go out (no connection yet: a transport just made,
# or a syncer restarting) is tried again this soon, without backing off: the
# backoff is for requests that went out, whose answers are whole fragments.
_UNSENT_RETRY_S = 0.02
# Refusals of who we are, not of a delta's content (broker/zmq/auth.py).
_IDENTITY_REFUSALS = {
    "identity_taken": "another key holds this learner id; give this learner another id",
    "revoked": "this learner was revoked (ddiloco keys revoke)",
    "read_only": "this process enrolled as a reader",
}
# With keys: how often a learner repeats its enrollment (tiny) when nothing
# else carried it, so a restarted syncer admits its subscription again soon.
_ENROLL_EVERY_S = 1.0
# ... and how soon after a refused subscription it enrolls and subscribes again.
_RESUBSCRIBE_AFTER_S = 0.2
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


def _disconnect(sock: zmq.Socket[bytes], endpoint: str) -> None:
    with contextlib.suppress(zmq.ZMQError):  # not connected (any more): nothing to undo
        sock.disconnect(endpoint)


def _socket(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, max_message_bytes: int
) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # ZMTP heartbeats: notice a silently dead peer (and reconnect) within seconds.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    # A peer that sends more than this is disconnected by ZeroMQ before the
    # bytes reach us, so one bad client cannot make us allocate without bound.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + _FRAME_OVERHEAD)
    return sock


@contextmanager
def _destroyed_on_error(
    ctx: zmq.Context[zmq.Socket[bytes]], first: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Destroy the context if building the sockets raises (after ``first``,
    which stops threads that hold sockets of it): nobody holds the half-built
    transport to close it, and a context left to the garbage collector can
    hang the collecting thread in zmq_ctx_term (its sockets' weak references
    are cleared first, so nothing closes them)."""
    try:
        yield
    except BaseException:
        first()
        ctx.destroy(linger=0)
        raise


def _send(sock: zmq.Socket[bytes], parts: Parts, flags: int = 0) -> None:
    """Send ``parts`` as one message without blocking (under CURVE, large parts
    in frames of ``_CURVE_FRAME_BYTES``). Raises ``zmq.Again`` only before
    anything is queued: once its first part is, a message is whole."""
    frames: list[bytes | memoryview] = list(parts)
    if sock.get(zmq.MECHANISM) == zmq.CURVE:
        frames = []
        for part in parts:
            view = memoryview(part)
            frames.extend(
                view[i : i + _CURVE_FRAME_BYTES] for i in range(0, len(view), _CURVE_FRAME_BYTES)
            )
            if not view:
                frames.append(part)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        more = zmq.SNDMORE if i < last else 0
        sock.send(frame, flags | zmq.NOBLOCK | more, copy=len(frame) < _ZERO_COPY_BYTES)


def _max_parts(max_message_bytes: int) -> int:
    """Frames of one message at most: an envelope (identity or topic), prefix
    and header, the payload in CURVE frames, checksum."""
    return 3 + max(1, math.ceil(max_message_bytes / _CURVE_FRAME_BYTES))


def _receive(
    sock: zmq.Socket[bytes], max_message_bytes: int, stats: TransportStats
) -> list[zmq.Frame] | None:
    """The next message's frames (``zmq.Again`` when none is there), read one
    by one: one with more frames or bytes than any message of ours is read to
    its end and dropped, counted ``too_large``, so a peer that sends endless
    parts (each within MAXMSGSIZE) never makes us hold them all."""
    first = sock.recv(zmq.NOBLOCK, copy=False)
    frames: list[zmq.Frame] | None = [first]
    total = len(first)
    max_parts, max_bytes = _max_parts(max_message_bytes), max_message_bytes + _FRAME_OVERHEAD
    more = first.more
    while more:
        frame = sock.recv(copy=False)  # the rest of a message is there with its first part
        more = frame.more
        total += len(frame)
        if frames is None:
            continue
        if len(frames) >= max_parts or total > max_bytes:
            frames = None
            stats.rejected["too_large"] += 1
            log.warning("rejected a message of over %d parts or %d bytes", max_parts, max_bytes)
        else:
            frames.append(frame)
    return frames


def _decode(
    frames: list[zmq.Frame], max_message_bytes: int, stats: TransportStats
) -> wire.Message | None:
    """The message of one frame or of the parts of ``wire.encode_parts``, its
    payload in one frame or in several (CURVE), joined."""
    stats.bytes_received += sum(len(f) for f in frames)
    stats.messages_received += 1
    try:
        if len(frames) == 1:
            return wire.decode(frames[0].buffer, max_payload_bytes=max_message_bytes)
        if len(frames) >= 3:
            payload = (
                frames[1].buffer if len(frames) == 3 else b"".join(f.buffer for f in frames[1:-1])
            )
            return wire.decode_parts(
                frames[0].buffer, payload, frames[-1].buffer, max_payload_bytes=max_message_bytes
            )
        raise WireError("bad_envelope", f"{len(frames)} parts")
    except WireError as e:
        stats.rejected[e.reason] += 1
        log.warning("rejected frame: %s", e)
        return None


@dataclass
class _Pending:
    parts: Parts
    owner: int  # the syncer shard
    last_sent: float = -math.inf
    attempts: int = 0


class DeltaSender:
    """Deltas sent to their fragments' owners and not acknowledged yet, by seq:
    sent again every ``ack_timeout_s`` until acked or refused."""

    def __init__(
        self,
        dealers: list[zmq.Socket[bytes]],
        learner_id: str,
        incarnation: int,
        options: ZmqOptions,
        stats: TransportStats,
        introduce: Callable[[int], object] = lambda owner: None,
    ) -> None:
        self._dealers = dealers
        # Sends the learner's enrollment to a syncer before each delta (one that
        # restarted knows no key, and would drop the delta until the next one),
        # and its newest heartbeat where that could not be sent: the heartbeat's
        # step time is what bounds the delta's step count there.
        self._introduce = introduce
        self._learner_id = learner_id
        self._incarnation = incarnation
        self._max_message_bytes = options.max_message_bytes
        self._max_unacked = options.max_unacked
        self._ack_timeout_s = options.ack_timeout_s
        self._stats = stats
        self._unacked: dict[int, _Pending] = {}

    def __len__(self) -> int:
        return len(self._unacked)

    def send(self, delta: Delta) -> None:
        if len(self._unacked) >= self._max_unacked:
            raise Backpressure(f"{len(self._unacked)} deltas await acknowledgement")
        pending = _Pending(
            wire.encode_parts(delta, self._max_message_bytes),
            owner_shard(delta.fragment, len(self._dealers)),
        )
        self._unacked[delta.seq] = pending
        self._try_send(pending, time.monotonic())

    def _try_send(self, pending: _Pending, now: float) -> None:
        self._introduce(pending.owner)
        try:
            _send(self._dealers[pending.owner], pending.parts)
        except zmq.Again:
            return  # no syncer connected or its queue is full: retried by poll()
        if pending.attempts:
            self._stats.resent += 1
        pending.attempts += 1
        pending.last_sent = now
        self._stats.bytes_sent += sum(len(part) for part in pending.parts)
        self._stats.messages_sent += 1

    def resend_due(self) -> None:
        now = time.monotonic()
        for pending in self._unacked.values():
            if now - pending.last_sent >= self._ack_timeout_s:
                self._try_send(pending, now)

    def acked(self, ack: Ack) -> None:
        if ack.learner_id != self._learner_id or ack.incarnation != self._incarnation:
            self._stats.rejected["foreign_ack"] += 1
            return
        for seq in ack.seqs:
            self._unacked.pop(seq, None)

    def settle(self, seq: int) -> bool:
        """Stop sending delta ``seq`` (it was refused); False if none was waiting."""
        return self._unacked.pop(seq, None) is not None


class SnapshotRequests:
    """Snapshot requests to the fragments' owners, asked again with backoff until
    an answer comes: the syncer may drop a request (rate limit, full queue) and
    PUB may drop the newest version, after which no later message would reveal
    the gap."""

    def __init__(
        self,
        dealers: list[zmq.Socket[bytes]],
        run_id: str,
        learner_id: str,
        stats: TransportStats,
    ) -> None:
        self._dealers = dealers
        self._run_id = run_id
        self._learner_id = learner_id
        self._stats = stats
        # Fragments to resync: (when to ask again, the retry interval after that).
        self.awaiting: dict[int, tuple[float, float]] = {}
        # While snapshot() runs: the checksums of the weights the caller holds.
        self.held_crcs: dict[int, int] = {}

    def request(self, fragments: list[int]) -> bool:
        """Ask the owners of ``fragments`` for them; False if a request could not
        go out (its syncer is not connected, or its queue is full)."""
        sent = True
        by_owner: dict[int, list[int]] = defaultdict(list)
        for p in fragments:
            by_owner[owner_shard(p, len(self._dealers))].append(p)
        for owner, owned in by_owner.items():
            held = [self.held_crcs[p] for p in owned if p in self.held_crcs]
            req = SnapshotRequest(
                run_id=self._run_id,
                learner_id=self._learner_id,
                fragments=owned,
                held_crcs=held if len(held) == len(owned) else [],
            )
            frame = wire.encode(req)
            try:
                self._dealers[owner].send(frame, zmq.NOBLOCK)
            except zmq.Again:
                sent = False
                continue
            self._stats.bytes_sent += len(frame)
        return sent

    def resync(self, fragment: int) -> None:
        """Ask for the fragment's latest global until :meth:`answered`."""
        if fragment not in self.awaiting:
            self.awaiting[fragment] = (0.0, _RESYNC_FIRST_RETRY_S)

    def answered(self, fragment: int) -> None:
        self.awaiting.pop(fragment, None)

    def retry_due(self) -> None:
        now = time.monotonic()
        for p, (due, retry_s) in list(self.awaiting.items()):
            if now < due:
                continue
            if self.request([p]):
                self.awaiting[p] = (now + retry_s, min(2 * retry_s, _RESYNC_MAX_RETRY_S))
            else:
                self.awaiting[p] = (now + _UNSENT_RETRY_S, retry_s)


class Candidates:
    """Globals received and not yet handed to the learner, oldest first per
    fragment; a skipped version (a gap) asks ``resync`` for the latest."""

    def __init__(
        self,
        run_id: str,
        num_fragments: int,
        stats: TransportStats,
        versions: dict[int, tuple[int, int]],
        is_new: Callable[[GlobalFragment], bool],
        resync: Callable[[int], None],
    ) -> None:
        self._run_id = run_id
        self._num_fragments = num_fragments
        self._stats = stats
        self._versions = versions  # the accepted ones: the transport's, shared
        self._is_new = is_new
        self._resync = resync
        self.gaps = 0
        self._ready: dict[int, list[GlobalFragment]] = {}

    def _ours(self, g: GlobalFragment) -> bool:
        if g.run_id != self._run_id or g.fragment >= self._num_fragments:
            self._stats.rejected["wrong_run" if g.run_id != self._run_id else "bad_fragment"] += 1
            return False
        return True

    def offer(self, g: GlobalFragment) -> None:
        """A global with weights or a change, broadcast or answering a request."""
        if not self._ours(g) or not self._is_new(g):
            return
        known = self._versions.get(g.fragment)
        ready = self._ready.setdefault(g.fragment, [])
        if (
            known is not None
            and g.epoch == known[0]
            and g.version > 1 + max([known[1]] + [r.version for r in ready if r.epoch == g.epoch])
        ):
            # Missed at least one version (PUB dropped it, or we were away):
            # ask for the latest. Weights are offered too (a change the learner
            # cannot apply, it drops).
            self.gaps += 1
            self._resync(g.fragment)
        # A global of another epoch is a restarted syncer's new lineage: offered
        # as is, whatever its version (its versions start again at 0). Nothing is
        # recorded until the learner has validated it (accepted()); every
        # candidate is offered, so a bad one cannot hide a good one.
        ready.append(g)
        if len(ready) > _CANDIDATES_PER_FRAGMENT:
            # The changes kept no longer reach back to what the learner holds.
            del ready[:-_CANDIDATES_PER_FRAGMENT]
            self._resync(g.fragment)

    def announced(self, g: GlobalFragment) -> None:
        """A version announced without weights: fetch it unless it is held."""
        if self._ours(g) and self._is_new(g):
            self._resync(g.fragment)

    def take_all(self) -> list[GlobalFragment]:
        ready = sorted((g for queued in self._ready.values() for g in queued), key=candidate_order)
        self._ready.clear()
        return ready

    def take_weights(self, fragments: set[int]) -> dict[int, GlobalFragment]:
        """The newest candidate with weights of each of ``fragments`` that has one,
        for a joiner: a change (broadcast meanwhile) needs a base the joiner does
        not have yet. Later changes stay for :meth:`take_all`."""
        got: dict[int, GlobalFragment] = {}
        for p in fragments & self._ready.keys():
            whole = [g for g in self._ready[p] if not g.is_change]
            if whole:
                got[p] = max(whole, key=candidate_order)
                self._ready[p] = [
                    g for g in self._ready[p]
                    if g.is_change and candidate_order(g) > candidate_order(got[p])
                ]  # fmt: skip
        return got


class ZmqLearnerTransport(LearnerTransport):
    """Learner side: a DEALER and a SUB per syncer shard. Deltas go through a
    :class:`DeltaSender`, globals are collected as :class:`Candidates`, snapshots
    are asked for by :class:`SnapshotRequests`; this class owns the sockets and
    hands each inbound message to its part. ``resolve_host``: how a host name
    becomes its addresses (one endpoint for several shards)."""

    def __init__(
        self,
        endpoints: list[str] | tuple[str, ...],
        run_id: str,
        learner_id: str,
        incarnation: int,
        num_fragments: int,
        *,
        options: ZmqOptions = ZmqOptions(),
        keys: RunKeys | None = None,
        identity: Identity | None = None,
        role: str = "learner",
        syncer_shards: int = 1,
        resolve_host: Callable[[str], set[str]] = resolve_addresses,
    ) -> None:
        if not endpoints:
            raise ValueError("give at least one syncer endpoint")
        # Each shard's endpoint; with one endpoint for several shards, its host is
        # looked up and each of its addresses dialled (_dial).
        self._shard_endpoints = [
            shard_endpoint(endpoints, s, syncer_shards) for s in range(syncer_shards)
        ]
        # That host, or None when each shard has its own endpoint.
        self._lookup_host = (
            endpoints[0].removeprefix("tcp://").rpartition(":")[0].strip("[]")
            if len(endpoints) < syncer_shards
            else None
        )
        self._resolve_host = resolve_host
        self.run_id = run_id
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.num_fragments = num_fragments
        self.options = options
        self.max_message_bytes = options.max_message_bytes
        super().__init__()
        # With the run's keys: CURVE to every syncer under this process's own
        # key, enrolled with the join secret, and every global's signature checked.
        self._keys = keys
        self._identity = identity or (Identity.new() if keys else None)
        self._verifier = GlobalVerifier(keys) if keys else None
        # The syncers' CURVE key list, for a rotation (`ddiloco keys rotate-curve`).
        self._curve_watch = FileWatch(keys.folder / CURVE_PUBLIC) if keys else None
        self._enroll_frame = b""
        self._heartbeat_frame = b""  # the newest
        self._heartbeat_owed: set[int] = set()  # shards it could not be sent to yet
        self._last_enrolled = -math.inf
        if keys is not None and self._identity is not None:
            key = self._identity.key_hex
            proof = enroll_proof(keys.join_secret, run_id, key, role)
            self._enroll_frame = wire.encode(Enroll(run_id=run_id, key=key, role=role, proof=proof))
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._dealers: list[zmq.Socket[bytes]] = []
        self._subs: list[zmq.Socket[bytes]] = []
        self._dialled: list[set[str]] = []  # per shard: the ROUTER endpoints its sockets dial
        self._dialled_at = -math.inf
        self._monitors: list[zmq.Socket[bytes] | None] = []
        self._resubscribe_at: dict[int, float] = {}
        self._poller = zmq.Poller()
        with _destroyed_on_error(self._ctx):
            self._connect(f"{learner_id}/{incarnation}".encode(), options)
        self._enroll()
        self._deltas = DeltaSender(
            self._dealers,
            learner_id,
            incarnation,
            options,
            self.stats,
            self._introduce,
        )
        self._requests = SnapshotRequests(self._dealers, run_id, learner_id, self.stats)
        self._candidates = Candidates(
            run_id, num_fragments, self.stats, self._versions, self._is_new,
            self._requests.resync,
        )  # fmt: skip
        self._grants: dict[str, int] = {}  # holder -> slot, from the syncer's last answer
        # While snapshot() runs: the weights the caller holds.
        self._held: Mapping[int, Any] = {}

    def _connect(self, identity: bytes, options: ZmqOptions) -> None:
        for _ in self._shard_endpoints:
            dealer = _socket(self._ctx, zmq.DEALER, options.max_message_bytes)
            if self._identity is None:
                dealer.setsockopt(zmq.IDENTITY, identity)
            # else: the syncer names the connection (no handover of a chosen id)
            self._secure(dealer)
            # Queue nothing for a syncer that is not connected: a restarted
            # syncer gets resends from us instead of a stale backlog; and with
            # one endpoint for several shards, nothing for the other shards'
            # addresses, where nobody listens on this shard's port.
            dealer.setsockopt(zmq.IMMEDIATE, 1)
            dealer.setsockopt(zmq.SNDHWM, options.send_hwm)
            self._for_lookup(dealer)
            self._poller.register(dealer, zmq.POLLIN)
            self._dealers.append(dealer)
            self._dialled.append(set())
            self._subs.append(self._subscribe(set()))
            self._monitors.append(self._monitor(self._subs[-1]))
        self._dial()

    def _for_lookup(self, sock: zmq.Socket[bytes]) -> None:
        """With one endpoint for several shards, a socket dials every address, and
        nobody listens on its port at all but one: those refusals are retried
        with backoff up to ``_REDIAL_EVERY_S`` (libzmq's default retries every
        100 ms for ever), and the addresses may be IPv6."""
        if self._lookup_host is not None:
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(_REDIAL_EVERY_S * 1000))

    def _dial(self) -> None:
        """Connect each shard's sockets to where the shard is, and leave the
        endpoints it is no longer at. With one endpoint for several shards that
        is its port on every address the host has now (a name that does not
        resolve for the moment keeps the last ones)."""
        self._dialled_at = time.monotonic()
        host = self._lookup_host
        if host is None:
            wanted = [{e} for e in self._shard_endpoints]
        else:
            try:
                addresses = self._resolve_host(host)
            except OSError as e:
                log.debug("the syncers' host %s does not resolve now: %s", host, e)
                return
            wanted = [{_at_address(e, a) for a in addresses} for e in self._shard_endpoints]
        for shard, endpoints in enumerate(wanted):
            dealer, sub = self._dealers[shard], self._subs[shard]
            for endpoint in endpoints - self._dialled[shard]:
                dealer.connect(endpoint)
                sub.connect(pub_endpoint(endpoint))
            for endpoint in self._dialled[shard] - endpoints:
                _disconnect(dealer, endpoint)
                _disconnect(sub, pub_endpoint(endpoint))
            self._dialled[shard] = endpoints

    def _subscribe(self, endpoints: set[str]) -> zmq.Socket[bytes]:
        """A SUB to the PUBs beside ``endpoints`` (ROUTERs)."""
        sub = _socket(self._ctx, zmq.SUB, self.max_message_bytes)
        self._secure(sub)
        sub.setsockopt(zmq.SUBSCRIBE, GLOBALS_TOPIC)
        self._for_lookup(sub)
        for endpoint in endpoints:
            sub.connect(pub_endpoint(endpoint))
        self._poller.register(sub, zmq.POLLIN)
        return sub

    def _monitor(self, sub: zmq.Socket[bytes]) -> zmq.Socket[bytes] | None:
        """With keys: a syncer admits a subscription only from an enrolled key,
        and ZeroMQ does not retry a handshake the syncer refused. A refusal
        (the subscription raced the enrollment, or the syncer restarted) is
        watched for, and the subscription made again (``_renew_refused``)."""
        if self._keys is None:
            return None
        return sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def _renew_refused(self) -> None:
        now = time.monotonic()
        for i, monitor in enumerate(self._monitors):
            if monitor is not None and monitor.poll(0):
                while monitor.poll(0):
                    monitor.recv_multipart()
                self._resubscribe_at[i] = now + _RESUBSCRIBE_AFTER_S
            if self._resubscribe_at.get(i, math.inf) <= now:
                del self._resubscribe_at[i]
                self._enroll_with(i)
                old, self._subs[i] = self._subs[i], self._subscribe(self._dialled[i])
                self._poller.unregister(old)
                old.disable_monitor()
                old.close(linger=0)
                if monitor is not None:
                    monitor.close(linger=0)
                self._monitors[i] = self._monitor(self._subs[i])

    def _secure(self, sock: zmq.Socket[bytes]) -> None:
        """CURVE client of the syncers' key, under this process's own key."""
        if self._keys is None or self._identity is None:
            return
        sock.curve_serverkey = self._keys.curve_public
        sock.curve_publickey = self._identity.public
        sock.curve_secretkey = self._identity.secret

    def _enroll(self) -> None:
        """Enroll with every syncer (again: one that restarted knows no key).
        Sent with heartbeats, before requests and before each delta, at most
        every second otherwise; best effort, as they are."""
        sent = [self._enroll_with(owner) for owner in range(len(self._dealers))]
        if all(sent):  # else: again at the next poll (a syncer not connected yet)
            self._last_enrolled = time.monotonic()

    def _enroll_with(self, owner: int) -> bool:
        return not self._enroll_frame or self._send_small(owner, self._enroll_frame)

    def _send_small(self, owner: int, frame: bytes) -> bool:
        """Send a one-part frame to shard ``owner`` without waiting; False when
        no syncer is connected there (or its queue is full)."""
        try:
            self._dealers[owner].send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.stats.bytes_sent += len(frame)
        return True

    @property
    def unacked(self) -> int:
        return len(self._deltas)

    @property
    def gaps(self) -> int:
        """Versions found skipped (PUB dropped them, or we were away)."""
        return self._candidates.gaps

    @property
    def _awaiting(self) -> dict[int, tuple[float, float]]:
        """Fragments being resynced: (when to ask again, the retry interval after that)."""
        return self._requests.awaiting

    def send_delta(self, delta: Delta) -> None:
        self._deltas.send(delta)

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        self._enroll()
        self._heartbeat_frame = wire.encode(heartbeat)
        for owner in range(len(self._dealers)):
            self._send_heartbeat_to(owner)

    def _send_heartbeat_to(self, owner: int) -> None:
        if not self._send_small(owner, self._heartbeat_frame):
            self._heartbeat_owed.add(owner)  # sent ahead of the next delta there
            return
        self._heartbeat_owed.discard(owner)
        self.stats.messages_sent += 1

    def _introduce(self, owner: int) -> None:
        """Before a delta to ``owner``: our enrollment, and our newest heartbeat
        if it could not be sent there."""
        self._enroll_with(owner)
        if owner in self._heartbeat_owed:
            self._send_heartbeat_to(owner)

    def resync(self, fragment: int) -> None:
        if 0 <= fragment < self.num_fragments:
            self._requests.resync(fragment)

    def _handle_refusal(self, refusal: Refusal) -> None:
        if refusal.learner_id != self.learner_id or refusal.incarnation != self.incarnation:
            self.stats.rejected["foreign_refusal"] += 1
            return
        if not self._deltas.settle(refusal.seq):
            return  # already handled (a refusal of a resent delta)
        self.stats.refused[refusal.reason] += 1
        if refusal.reason in _IDENTITY_REFUSALS and self.stats.refused[refusal.reason] == 1:
            log.error(
                "learner %s: the syncer refuses our deltas (%s): %s",
                self.learner_id, refusal.reason, _IDENTITY_REFUSALS[refusal.reason],
            )  # fmt: skip
        if refusal.fragment < self.num_fragments:
            self._refused(refusal.fragment)
            self._requests.resync(refusal.fragment)

    def _take_up_curve_rotation(self) -> None:
        """Dial the syncers with the newest key of their list once it changed:
        the sockets connect again (a connection keeps the key it was made with)."""
        if self._curve_watch is None or self._keys is None:
            return
        keys = self._keys.rotated(self._curve_watch, "the syncers' CURVE key list")
        if keys is None or keys.curve_public == self._keys.curve_public:
            return
        self._keys = keys
        for dealer, sub, endpoints in zip(self._dealers, self._subs, self._dialled, strict=True):
            for sock in (dealer, sub):
                sock.curve_serverkey = keys.curve_public
            for endpoint in endpoints:
                for sock, where in ((dealer, endpoint), (sub, pub_endpoint(endpoint))):
                    _disconnect(sock, where)
                    sock.connect(where)
        log.warning("learner %s: dialling the syncers with their rotated key", self.learner_id)

    def _drain(self, timeout_s: float) -> None:
        if self._lookup_host is not None and time.monotonic() - self._dialled_at >= _REDIAL_EVERY_S:
            self._dial()
        self._take_up_curve_rotation()
        self._renew_refused()
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        for sock in self._dealers + self._subs:
            if sock not in events:
                continue
            while True:
                try:
                    parts = _receive(sock, self.max_message_bytes, self.stats)
                except zmq.Again:
                    break
                if parts is None:
                    continue
                frames = parts if sock in self._dealers else parts[1:]  # past the topic
                msg = _decode(frames, self.max_message_bytes, self.stats)
                if isinstance(msg, GlobalFragment):
                    if self._verifier is not None and not self._verifier.verify(msg):
                        self.stats.rejected["bad_signature"] += 1
                        continue
                    if msg.is_weightless and sock in self._subs:
                        self._candidates.announced(msg)
                        continue
                    if msg.is_weightless:
                        # An answer to our snapshot() naming these weights; one
                        # that comes after snapshot() returned is a duplicate.
                        if msg.fragment not in self._held:
                            continue
                        msg = msg.with_weights(self._held[msg.fragment])
                    if sock in self._dealers:  # a snapshot answer: the resync is done
                        self._requests.answered(msg.fragment)
                    self._candidates.offer(msg)
                elif isinstance(msg, Ack):
                    self._deltas.acked(msg)
                elif isinstance(msg, LeaseGrant) and msg.run_id == self.run_id:
                    self._grants[msg.holder] = msg.slot
                elif isinstance(msg, Refusal):
                    self._handle_refusal(msg)
                elif msg is not None:
                    self.stats.rejected["unexpected_kind"] += 1

    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        if self._enroll_frame and time.monotonic() - self._last_enrolled >= _ENROLL_EVERY_S:
            self._enroll()
        self._drain(timeout_s)
        self._deltas.resend_due()
        self._requests.retry_due()
        return self._candidates.take_all()

    def snapshot(
        self, fragments: list[int], timeout_s: float, held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        self._held = {p: w for p, w in (held or {}).items() if p in fragments}
        self._requests.held_crcs = {p: wire.weights_checksum(w) for p, w in self._held.items()}
        try:
            return self._snapshot(fragments, timeout_s)
        finally:
            self._held, self._requests.held_crcs = {}, {}

    def _snapshot(self, fragments: list[int], timeout_s: float) -> dict[int, GlobalFragment]:
        wanted = set(fragments)
        got: dict[int, GlobalFragment] = {}
        deadline = time.monotonic() + timeout_s
        next_request = 0.0
        retry_s = _RESYNC_FIRST_RETRY_S
        # Forget what we knew so the syncer's current version is taken even if
        # it is not newer (a learner may rejoin a syncer that restarted).
        for p in wanted:
            self._versions.pop(p, None)
        while wanted - got.keys():
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_request:
                self._enroll()
                if self._requests.request(sorted(wanted - got.keys())):
                    next_request = now + retry_s
                    # At most 2 s apart: a syncer that starts after its learners is found soon.
                    retry_s = min(retry_s * 2, _JOIN_MAX_RETRY_S)
                else:
                    next_request = now + _UNSENT_RETRY_S
            self._drain(min(0.05, max(0.0, next_request - time.monotonic()), deadline - now))
            self._deltas.resend_due()
            before = len(got)
            got.update(self._candidates.take_weights(wanted))
            if len(got) > before:
                # Answers are arriving: on a slow link the rest are on their way
                # behind them, and asking again would send them twice.
                next_request = max(next_request, time.monotonic() + retry_s)
        return got

    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        if not lease_request_ok(ttl_s, held_slot):
            raise ValueError(f"lease of slot {held_slot} for {ttl_s}s: out of bounds")
        req = LeaseRequest(run_id=self.run_id, holder=holder, held_slot=held_slot, ttl_s=ttl_s)
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
                    self._dealers[0].send(frame, zmq.NOBLOCK)  # the first syncer holds leases
                except zmq.Again:
                    next_request = now + _UNSENT_RETRY_S  # not connected yet
                else:
                    self.stats.bytes_sent += len(frame)
                    next_request = now + retry_s
                    retry_s = min(retry_s * 2, 4.0)
            self._drain(min(0.05, max(0.0, next_request - time.monotonic()), deadline - now))
            self._deltas.resend_due()
        return self._grants.pop(holder)

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class LatestGlobals:
    """The newest global of each fragment, encoded, for snapshot requests."""

    def __init__(self, snapshot_interval_s: float, stats: TransportStats) -> None:
        self._interval_s = snapshot_interval_s
        self._stats = stats
        self._latest: dict[int, Parts] = {}  # with weights
        # Per fragment: the newest version's weights checksum, and its answer to
        # a learner that holds those weights.
        self._weightless: dict[int, tuple[int, Parts]] = {}
        self._stamp: dict[int, tuple[int, int]] = {}  # (epoch, version) per fragment
        # When each (peer, fragment) was last answered, and with which version: a
        # snapshot is a whole fragment, so a peer gets each version at most once
        # per snapshot_interval_s.
        self._answered: dict[tuple[bytes, int], tuple[float, tuple[int, int]]] = {}

    def store(self, fragment: GlobalFragment, whole: Parts, weightless: Parts) -> None:
        """``fragment`` is the newest: ``whole`` its snapshot, ``weightless`` the
        same without the weights."""
        self._latest[fragment.fragment] = whole
        self._weightless[fragment.fragment] = (fragment.weights_crc, weightless)
        self._stamp[fragment.fragment] = (fragment.epoch, fragment.version)

    def answers(self, identity: bytes, req: SnapshotRequest) -> list[Parts]:
        """Each owned fragment asked for, once, and its version not again to the same
        peer within ``snapshot_interval_s`` (learners retry with backoff from 0.5 s):
        a request listing one fragment thousands of times, or a flood of requests,
        costs one fragment per peer, version and interval, not memory without bound.
        A newer version is answered at once: a learner that missed a change right
        after it joined (its subscription was not live yet) must not train on a
        base that goes stale while it waits out the interval."""
        asked = set(req.fragments) if req.fragments else set(self._latest)
        if len(asked) < len(req.fragments):
            self._stats.rejected["snapshot_duplicate"] += len(req.fragments) - len(asked)
        now = time.monotonic()
        if len(self._answered) > 16 * 1024:  # forget answers older than the interval
            self._answered = {
                k: last for k, last in self._answered.items() if now - last[0] < self._interval_s
            }
        held = dict(zip(req.fragments, req.held_crcs, strict=False))
        out: list[Parts] = []
        for p in sorted(asked & self._latest.keys()):
            stamp = self._stamp[p]
            last = self._answered.get((identity, p))
            if last is not None and now - last[0] < self._interval_s and last[1] == stamp:
                self._stats.rate_limited += 1
                continue
            self._answered[(identity, p)] = (now, stamp)
            crc, weightless = self._weightless[p]
            out.append(weightless if held.get(p) == crc else self._latest[p])
        return out


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


def _peer_key(frame: zmq.Frame) -> str:
    """The CURVE key a frame came on (our ZAP handler named the peer by it, z85),
    in hex: the member's key."""
    return curve_key_hex(str(frame.get("User-Id")))


class ZmqSyncerTransport(SyncerTransport):
    """Syncer side: a ROUTER for deltas, heartbeats and requests, a PUB for
    globals. Snapshot requests are answered from :class:`LatestGlobals`, lease
    requests from :class:`SlotLeases`."""

    def __init__(
        self,
        bind: str,
        run_id: str,
        fragments: list[int],
        *,
        options: ZmqOptions = ZmqOptions(),
        # With keys: a learner id stays bound to its key until the key is silent this long.
        identity_hold_s: float,
        keys: RunKeys | None = None,
        roster_cap: int = MAX_LEARNER_SLOTS,
    ) -> None:
        check_positive("identity_hold_s", identity_hold_s)
        max_message_bytes, send_hwm = options.max_message_bytes, options.send_hwm
        self.run_id = run_id
        self.fragments = set(fragments)
        self.max_message_bytes = max_message_bytes
        self.options = options
        self.max_batch = options.max_batch
        self.stats = TransportStats()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._signer = GlobalSigner(keys) if keys else None
        self._members = Members(keys, run_id, identity_hold_s) if keys else None
        self._zap: ZapHandler | None = None
        with _destroyed_on_error(self._ctx, self._close_zap):
            if self._members is not None:
                self._zap = ZapHandler(self._ctx, self._members)
            self._router = _socket(self._ctx, zmq.ROUTER, max_message_bytes)
            if keys is None:
                # A restarted learner reuses its identity only with a new incarnation,
                # but let a reconnecting peer take its identity over rather than be
                # refused. With keys, connections are named by the syncer: a chosen
                # identity taken over would divert another learner's acks.
                self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._router.setsockopt(zmq.SNDHWM, send_hwm)
            self._curve_server(self._router, keys, REQUESTS_DOMAIN)
            self._router.bind(bind)
            self._pub = _socket(self._ctx, zmq.PUB, max_message_bytes)
            self._pub.setsockopt(zmq.SNDHWM, send_hwm)
            self._curve_server(self._pub, keys, GLOBALS_DOMAIN)
            self._pub.bind(pub_endpoint(bind))
        self._keys = keys
        # A rotated CURVE key (`ddiloco keys rotate-curve`) is taken up by binding
        # again: a bound socket keeps the key it was bound with.
        self._curve_watch = FileWatch(keys.folder / CURVE_SECRET) if keys else None
        self._latest = LatestGlobals(options.snapshot_interval_s, self.stats)
        self._leases = SlotLeases(self.stats, roster_cap)

    @staticmethod
    def _curve_server(sock: zmq.Socket[bytes], keys: RunKeys | None, domain: bytes) -> None:
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

    def _refused_by_members(self, identity: bytes, frame: zmq.Frame, msg: wire.Message) -> bool:
        """With keys: whether the key ``frame`` came on may not send ``msg``
        (counted by reason); an enrollment is handled here. A refused delta is
        answered (to the connection it came on, so nobody else can make a
        learner drop its deltas): a learner whose id another key holds learns
        it, rather than resending into silence. A key not enrolled yet gets no
        answer: its learner enrolls before each delta, and resends it."""
        if self._members is None:
            return False
        key = _peer_key(frame)
        if isinstance(msg, Enroll):
            # A proof made for another key than the one it came on is refused.
            reason = "enroll_key_mismatch" if msg.key != key else self._members.enroll(key, msg)
        elif isinstance(msg, Delta | Heartbeat):
            reason = self._members.check(key, msg.learner_id, writes=True)
        elif isinstance(msg, LeaseRequest):
            reason = self._members.check(key, None, writes=True)
        else:
            reason = self._members.check(key, None, writes=False)
        if reason is not None:
            self.stats.rejected[reason] += 1
            if isinstance(msg, Delta) and reason in _IDENTITY_REFUSALS:
                self._send_to(identity, (wire.encode(Refusal.of(msg, reason)),))
        return reason is not None or isinstance(msg, Enroll)

    def _take_up_curve_rotation(self) -> None:
        if self._curve_watch is None or self._keys is None:
            return
        keys = self._keys.rotated(self._curve_watch, "CURVE key")
        if keys is None:
            return
        for sock, domain in ((self._router, REQUESTS_DOMAIN), (self._pub, GLOBALS_DOMAIN)):
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            # The connections this endpoint accepted close; their learners dial
            # again with the new key (deltas unacked are sent again).
            sock.unbind(endpoint)
            self._curve_server(sock, keys, domain)
            _bind_when_free(sock, endpoint)
        self._keys = keys
        log.warning("serving with the rotated CURVE key in %s", keys.folder)

    def receive(self, timeout_s: float) -> list[Inbound]:
        self._take_up_curve_rotation()
        out: list[Inbound] = []
        if not self._router.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return out
        while len(out) < self.max_batch:
            try:
                parts = _receive(self._router, self.max_message_bytes, self.stats)
            except zmq.Again:
                break
            if parts is None:
                continue
            if len(parts) < 2 or len(parts) == 3:  # identity, one frame or three parts
                self.stats.rejected["bad_envelope"] += 1
                continue
            identity = parts[0].bytes
            msg = _decode(parts[1:], self.max_message_bytes, self.stats)
            if msg is None:
                continue
            if getattr(msg, "run_id", self.run_id) != self.run_id:
                self.stats.rejected["wrong_run"] += 1
            elif self._refused_by_members(identity, parts[1], msg):
                continue
            elif isinstance(msg, Delta):
                if msg.fragment in self.fragments:
                    out.append(Inbound(msg, identity))
                else:
                    self.stats.rejected["not_owned"] += 1
            elif isinstance(msg, Heartbeat):
                out.append(Inbound(msg))
            elif isinstance(msg, SnapshotRequest):
                # With keys a peer is its key, which it cannot change at will.
                peer = _peer_key(parts[1]).encode() if self._members else identity
                for answer in self._latest.answers(peer, msg):
                    self._send_to(identity, answer)
            elif isinstance(msg, LeaseRequest):
                owner = _peer_key(parts[1]) if self._members else ""
                self._answer_lease(identity, msg, owner)
            else:
                self.stats.rejected["unexpected_kind"] += 1
        return out

    def _send_to(self, identity: bytes, parts: Parts) -> None:
        try:
            _send(self._router, (identity, *parts))
        except zmq.Again:
            return  # the learner's queue is full; it will ask again
        self.stats.bytes_sent += sum(len(part) for part in parts)
        self.stats.messages_sent += 1

    def _answer_lease(self, identity: bytes, req: LeaseRequest, owner: str) -> None:
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
            grant = LeaseGrant(run_id=self.run_id, holder=req.holder, slot=slot)
            self._send_to(identity, (wire.encode(grant),))

    def ack(self, items: list[Inbound]) -> None:
        seqs: dict[tuple[bytes, str, int], list[int]] = defaultdict(list)
        for item in items:
            if isinstance(item.message, Delta) and item.token is not None:
                d = item.message
                seqs[(item.token, d.learner_id, d.incarnation)].append(d.seq)
        for (identity, learner_id, incarnation), batch in seqs.items():
            for start in range(0, len(batch), wire.MAX_LIST_LEN):
                ack = Ack(
                    run_id=self.run_id,
                    learner_id=learner_id,
                    incarnation=incarnation,
                    seqs=batch[start : start + wire.MAX_LIST_LEN],
                )
                self._send_to(identity, (wire.encode(ack),))

    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        return {}  # globals live in this process only; learners follow a new epoch

    def refuse(self, item: Inbound, reason: str) -> None:
        d = item.message
        if not isinstance(d, Delta) or item.token is None:
            return
        refusal = Refusal.of(d, reason)
        self._send_to(item.token, (wire.encode(refusal),))

    def _signed(self, fragment: GlobalFragment) -> GlobalFragment:
        return fragment if self._signer is None else self._signer.sign(fragment)

    def publish(
        self, fragment: GlobalFragment, snapshot: GlobalFragment | None = None, resume: bytes = b""
    ) -> None:
        parts = wire.encode_parts(self._signed(fragment), self.max_message_bytes)
        whole = parts if snapshot is None else self._encoded(snapshot)
        self._latest.store(fragment, whole, self._encoded(fragment.without_weights()))
        self._broadcast(parts)

    def _encoded(self, fragment: GlobalFragment) -> Parts:
        return wire.encode_parts(self._signed(fragment), self.max_message_bytes)

    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        self._broadcast(self._encoded(fragment.without_weights()))

    def _broadcast(self, parts: Parts) -> None:
        """Send ``parts`` to every subscriber, or drop them: PUB does not block, and
        subscribers notice the gap (a missed announcement, at the next one)."""
        try:
            _send(self._pub, (GLOBALS_TOPIC, *parts))
        except zmq.Again:
            return
        self.stats.bytes_sent += sum(len(part) for part in parts)
        self.stats.messages_sent += 1

    def _close_zap(self) -> None:
        if self._zap is not None:
            self._zap.close()  # its socket is closed by its own thread

    def close(self) -> None:
        self._close_zap()
        self._ctx.destroy(linger=0)
