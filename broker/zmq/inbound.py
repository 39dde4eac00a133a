"""What a learner receives over ZeroMQ, each message handed to the part that
handles it: globals to the candidates (a snapshot answer also ends its
resync), acks and refusals to the delta sender, lease grants to the lease
client; a syncer's recall is answered from what the learner holds."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from broker.fragments import owner_shard
from broker.identity.signing import GlobalVerifier
from broker.transport import HeldGlobals, Terms, TransportStats
from broker.wire import messages as wire
from broker.wire.messages import Ack, GlobalFragment, LeaseGrant, Recall, Refusal
from broker.zmq.addressing import ShardSockets
from broker.zmq.curve import IDENTITY_REFUSALS
from broker.zmq.delivery import DeltaSender
from broker.zmq.frames import decode_frames, receive_frames, send_parts
from broker.zmq.leases import LeaseClient
from broker.zmq.snapshots import Candidates, SnapshotRequests

log = logging.getLogger(__name__)


class LearnerInbound:
    """Receives on a learner's sockets and dispatches. ``refused``: forgets a
    fragment's version after a refusal (the transport's own record)."""

    def __init__(
        self,
        sockets: ShardSockets,
        *,
        run_id: str,
        learner_id: str,
        incarnation: int,
        num_fragments: int,
        max_message_bytes: int,
        stats: TransportStats,
        verifier: GlobalVerifier | None,
        deltas: DeltaSender,
        requests: SnapshotRequests,
        candidates: Candidates,
        leases: LeaseClient,
        refused: Callable[[int], None],
    ) -> None:
        self._sockets = sockets
        self._run_id = run_id
        self._learner_id = learner_id
        self._incarnation = incarnation
        self._num_fragments = num_fragments
        self._max_message_bytes = max_message_bytes
        self._stats = stats
        self._verifier = verifier
        self._deltas = deltas
        self._requests = requests
        self._candidates = candidates
        self._leases = leases
        self._refused = refused
        # Per shard (its sockets): the highest term of its globals and acks taken.
        self._terms = Terms(stats)
        # While snapshot() runs: the weights the caller holds.
        self.held: Mapping[int, Any] = {}
        # What a syncer's recall is answered from (LearnerTransport.answer_recalls).
        self.held_globals: HeldGlobals | None = None

    def take(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for messages, and handle every one there is."""
        dealers, subs = self._sockets.dealers, self._sockets.subs
        events = dict(self._sockets.poller.poll(max(0, int(timeout_s * 1000))))
        for sock in dealers + subs:
            if sock not in events:
                continue
            shard = dealers.index(sock) if sock in dealers else subs.index(sock)
            while True:
                try:
                    parts = receive_frames(sock, self._max_message_bytes, self._stats)
                except zmq.Again:
                    break
                if parts is None:
                    continue
                frames = parts if sock in dealers else parts[1:]  # past the topic
                msg = decode_frames(frames, self._max_message_bytes, self._stats)
                if isinstance(msg, GlobalFragment):
                    if self._verifier is not None and not self._verifier.verify(msg):
                        self._stats.rejected["bad_signature"] += 1
                        continue
                    if not self._terms.admits(shard, msg.term):
                        continue
                    if msg.is_weightless and sock in subs:
                        self._candidates.announced(msg)
                        continue
                    if msg.is_weightless:
                        # An answer to our snapshot() naming these weights; one
                        # that comes after snapshot() returned is a duplicate.
                        if msg.fragment not in self.held:
                            continue
                        msg = msg.with_weights(self.held[msg.fragment])
                    if sock in dealers:  # a snapshot answer: the resync is done
                        self._requests.answered(msg.fragment)
                    self._candidates.offer(msg)
                elif isinstance(msg, Ack):
                    if self._terms.admits(shard, msg.term):
                        self._deltas.acked(msg)
                elif isinstance(msg, LeaseGrant) and msg.run_id == self._run_id:
                    self._leases.granted(msg)
                elif isinstance(msg, Refusal):
                    self._handle_refusal(msg)
                elif isinstance(msg, Recall) and sock in dealers and msg.run_id == self._run_id:
                    self._answer_recall(sock, shard, msg)
                elif msg is not None:
                    self._stats.rejected["unexpected_kind"] += 1

    def _answer_recall(self, dealer: zmq.Socket[bytes], shard: int, recall: Recall) -> None:
        """Each fragment of the asking shard this learner holds: its claim, or
        its weights. An answer the socket has no room for is dropped (the
        syncer asks the next holder)."""
        if self.held_globals is None:
            return
        shards = len(self._sockets.dealers)
        for p in sorted(set(recall.fragments)):
            if p >= self._num_fragments or owner_shard(p, shards) != shard:
                self._stats.rejected["recall_not_owned"] += 1
                continue
            for held in self.held_globals(p, recall.weights):
                parts = wire.encode_parts(held, self._max_message_bytes)
                try:
                    send_parts(dealer, parts)
                except zmq.Again:
                    break
                self._stats.messages_sent += 1
                self._stats.bytes_sent += sum(len(part) for part in parts)

    def _handle_refusal(self, refusal: Refusal) -> None:
        if refusal.learner_id != self._learner_id or refusal.incarnation != self._incarnation:
            self._stats.rejected["foreign_refusal"] += 1
            return
        if not self._deltas.settle(refusal.seq):
            return  # already handled (a refusal of a resent delta)
        self._stats.refused[refusal.reason] += 1
        if refusal.reason in IDENTITY_REFUSALS and self._stats.refused[refusal.reason] == 1:
            log.error(
                "learner %s: the syncer refuses our deltas (%s): %s",
                self._learner_id, refusal.reason, IDENTITY_REFUSALS[refusal.reason],
            )  # fmt: skip
        if refusal.fragment < self._num_fragments:
            self._refused(refusal.fragment)
            self._requests.resync(refusal.fragment)
