"""The syncer side of the ZeroMQ backend: :class:`ZmqSyncerTransport`, and the
newest globals it answers snapshot requests from (:class:`LatestGlobals`)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import zmq

from broker.checks import check_positive
from broker.identity.keys import FileWatch, RunKeys
from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.transport import (
    MAX_LEARNER_SLOTS,
    Inbound,
    ResumePoint,
    SyncerTransport,
    TransportStats,
)
from broker.wire import messages as wire
from broker.wire.codecs import Codec
from broker.wire.fields import MAX_LIST_LEN, MAX_RESUME_BYTES
from broker.wire.messages import (
    Ack,
    Delta,
    GlobalFragment,
    Heartbeat,
    LeaseRequest,
    Refusal,
    SnapshotRequest,
)
from broker.zmq.addressing import pub_endpoint
from broker.zmq.auth import GLOBALS_DOMAIN, REQUESTS_DOMAIN
from broker.zmq.curve import CurveServer, peer_key
from broker.zmq.frames import (
    GLOBALS_TOPIC,
    Parts,
    decode_frames,
    destroyed_on_error,
    make_socket,
    receive_frames,
    send_parts,
)
from broker.zmq.leases import LeaseDesk
from broker.zmq.options import ZmqOptions
from broker.zmq.recall import Recollection

log = logging.getLogger(__name__)


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

    def weightless(self, fragment: GlobalFragment) -> Parts | None:
        """The stored answer without weights of ``fragment``'s version, if it is
        the newest stored."""
        if self._stamp.get(fragment.fragment) != (fragment.epoch, fragment.version):
            return None
        return self._weightless[fragment.fragment][1]

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


class ZmqSyncerTransport(SyncerTransport):
    """Syncer side: a ROUTER for deltas, heartbeats and requests, a PUB for
    globals. Snapshot requests are answered from :class:`LatestGlobals`, lease
    requests by a :class:`~broker.zmq.leases.LeaseDesk`; with the run's keys, a
    :class:`~broker.zmq.curve.CurveServer` admits peers and checks each message."""

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
        term: int = 0,  # the shard's term (its lease's), on every ack
    ) -> None:
        check_positive("identity_hold_s", identity_hold_s)
        self.term = term
        max_message_bytes, send_hwm = options.max_message_bytes, options.send_hwm
        self.run_id = run_id
        self.fragments = set(fragments)
        self.max_message_bytes = max_message_bytes
        self.options = options
        self.max_batch = options.max_batch
        self.stats = TransportStats()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._signer = GlobalSigner(keys) if keys else None
        self._verifier = GlobalVerifier(keys) if keys else None
        # While resume_points runs: the recall under way, and what came meanwhile.
        self._recall: Recollection | None = None
        self._early: list[Inbound] = []
        self._resume_too_large = False
        self._curve = CurveServer(keys, run_id, identity_hold_s, self.stats, self._send_to)
        with destroyed_on_error(self._ctx, self._curve.close):
            self._curve.serve_zap(self._ctx)
            self._router = make_socket(self._ctx, zmq.ROUTER, max_message_bytes)
            if keys is None:
                # A restarted learner reuses its identity only with a new incarnation,
                # but let a reconnecting peer take its identity over rather than be
                # refused. With keys, connections are named by the syncer: a chosen
                # identity taken over would divert another learner's acks.
                self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._router.setsockopt(zmq.SNDHWM, send_hwm)
            self._curve.secure(self._router, REQUESTS_DOMAIN)
            self._router.bind(bind)
            self._pub = make_socket(self._ctx, zmq.PUB, max_message_bytes)
            self._pub.setsockopt(zmq.SNDHWM, send_hwm)
            self._curve.secure(self._pub, GLOBALS_DOMAIN)
            self._pub.bind(pub_endpoint(bind))
        self._latest = LatestGlobals(options.snapshot_interval_s, self.stats)
        self._leases = LeaseDesk(run_id, self.stats, roster_cap, self._curve.members, self._send_to)

    @property
    def _curve_watch(self) -> FileWatch | None:
        """The CURVE secret key, for a rotation (`ddiloco keys rotate-curve`)."""
        return self._curve.watch

    def receive(self, timeout_s: float) -> list[Inbound]:
        self._curve.take_up_rotation(self._router, self._pub)
        out, self._early = self._early, []
        if out or not self._router.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return out
        members = self._curve.members
        while len(out) < self.max_batch:
            try:
                parts = receive_frames(self._router, self.max_message_bytes, self.stats)
            except zmq.Again:
                break
            if parts is None:
                continue
            if len(parts) < 2 or len(parts) == 3:  # identity, one frame or three parts
                self.stats.rejected["bad_envelope"] += 1
                continue
            identity = parts[0].bytes
            msg = decode_frames(parts[1:], self.max_message_bytes, self.stats)
            if msg is None:
                continue
            if getattr(msg, "run_id", self.run_id) != self.run_id:
                self.stats.rejected["wrong_run"] += 1
                continue
            if self._recall is not None:
                self._recall.heard(identity)
            if self._curve.refused(identity, parts[1], msg):
                continue
            if isinstance(msg, GlobalFragment) and self._recall is not None:
                self._recall.answered(identity, msg, time.monotonic())
            elif isinstance(msg, Delta):
                if msg.fragment in self.fragments:
                    out.append(Inbound(msg, identity))
                else:
                    self.stats.rejected["not_owned"] += 1
            elif isinstance(msg, Heartbeat):
                out.append(Inbound(msg))
            elif isinstance(msg, SnapshotRequest):
                # With keys a peer is its key, which it cannot change at will.
                peer = peer_key(parts[1]).encode() if members else identity
                for answer in self._latest.answers(peer, msg):
                    self._send_to(identity, answer)
            elif isinstance(msg, LeaseRequest):
                owner = peer_key(parts[1]) if members else ""
                self._leases.answer(identity, msg, owner)
            else:
                self.stats.rejected["unexpected_kind"] += 1
        return out

    def _send_to(self, identity: bytes, parts: Parts) -> None:
        try:
            send_parts(self._router, (identity, *parts))
        except zmq.Again:
            # The learner's queue is full: dropped (it will ask again).
            log.warning("a reply to a learner dropped: its queue is full")
            return
        self.stats.bytes_sent += sum(len(part) for part in parts)
        self.stats.messages_sent += 1

    def ack(self, items: list[Inbound]) -> None:
        seqs: dict[tuple[bytes, str, int], list[int]] = defaultdict(list)
        for item in items:
            if isinstance(item.message, Delta) and item.token is not None:
                d = item.message
                seqs[(item.token, d.learner_id, d.incarnation)].append(d.seq)
        for (identity, learner_id, incarnation), batch in seqs.items():
            for start in range(0, len(batch), MAX_LIST_LEN):
                ack = Ack(
                    run_id=self.run_id,
                    learner_id=learner_id,
                    incarnation=incarnation,
                    seqs=batch[start : start + MAX_LIST_LEN],
                    term=self.term,
                )
                self._send_to(identity, (wire.encode(ack),))

    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        return {}  # globals live in this process and its learners only (resume_points)

    def resume_points(
        self, fragments: list[int], held: Mapping[int, Any] | None = None, wait_s: float = 0.0
    ) -> dict[int, ResumePoint]:
        """The learners' latest signed versions of the owned ``fragments`` not in
        ``held`` (:class:`~broker.zmq.recall.Recollection`), each with the
        syncer state published with it and the change that made it. Waits up
        to ``wait_s`` for the learners' claims, then as long as their weights
        take; deltas and heartbeats that come meanwhile are handed out by the
        next receive."""
        wanted = sorted(p for p in fragments if p in self.fragments and p not in (held or {}))
        if not wanted or wait_s <= 0:
            return {}
        recall = Recollection(
            self.run_id, wanted, self._verifier, self.stats, time.monotonic(), wait_s
        )
        self._recall = recall
        try:
            while not recall.done():
                for peer, ask in recall.asks(time.monotonic()):
                    self._send_to(peer, (wire.encode(ask),))
                self._early.extend(self.receive(0.05))
        finally:
            self._recall = None
        claimed = {p: n for p, n in recall.claims().items() if n}
        log.info(
            "recall: %d fragment(s) claimed by learners (%s), %d taken back",
            len(claimed), ", ".join(f"{p}: {n}" for p, n in claimed.items()), len(recall.taken),
        )  # fmt: skip
        return {
            p: ResumePoint(g, bytes(g.resume), recall.changes.get(p))
            for p, g in recall.taken.items()
        }

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
        """Every global carries the version's ``resume`` state and the signature
        of its held form (as learners hold it: fp32 weights), which a learner
        hands back to a successor that lost its checkpoint (:meth:`resume_points`)."""
        held = self._held_form(snapshot or fragment, resume)
        if fragment.is_change or fragment.codec != held.codec:
            sent = self._signed(
                replace(fragment, resume=held.resume, snapshot_signature=held.snapshot_signature)
            )
        else:  # the weights as fp32 are the held form itself
            sent = held
        parts = wire.encode_parts(sent, self.max_message_bytes)
        # held is signed already: encoded as it is, not signed (hashed) again.
        whole = parts if snapshot is None else wire.encode_parts(held, self.max_message_bytes)
        self._latest.store(fragment, whole, self._encoded(held.without_weights()))
        self._broadcast(parts)

    def _held_form(self, snapshot: GlobalFragment, resume: bytes) -> GlobalFragment:
        """``snapshot``'s version as fp32 weights with ``resume``, signed, its
        signature also its ``snapshot_signature``."""
        if len(resume) > MAX_RESUME_BYTES:
            if not self._resume_too_large:
                log.warning(
                    "the syncer's state (%d bytes: many learners) is past what a global "
                    "carries (%d): a successor without this checkpoint starts a new epoch",
                    len(resume), MAX_RESUME_BYTES,
                )  # fmt: skip
                self._resume_too_large = True
            resume = b""
        held = replace(snapshot, resume=resume)
        if held.codec != Codec():  # fp32 through a lossless stage
            held = held.with_weights(held.tensor())
        held = self._signed(held)
        return replace(held, snapshot_signature=held.signature)

    def _encoded(self, fragment: GlobalFragment) -> Parts:
        return wire.encode_parts(self._signed(fragment), self.max_message_bytes)

    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        parts = self._latest.weightless(fragment)
        if parts is None:  # not published by this process: its held form signed now
            parts = self._encoded(self._held_form(fragment, resume).without_weights())
        self._broadcast(parts)

    def _broadcast(self, parts: Parts) -> None:
        """Send ``parts`` to every subscriber, or drop them: PUB does not block, and
        subscribers notice the gap (a missed announcement, at the next one)."""
        try:
            send_parts(self._pub, (GLOBALS_TOPIC, *parts))
        except zmq.Again:
            log.warning("a global dropped: the PUB socket took no more")
            return
        self.stats.bytes_sent += sum(len(part) for part in parts)
        self.stats.messages_sent += 1

    def close(self) -> None:
        self._curve.close()
        self._ctx.destroy(linger=0)
