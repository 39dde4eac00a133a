"""The learner side of the ZeroMQ backend: :class:`ZmqLearnerTransport`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from broker.errors import ConfigError
from broker.identity.keys import FileWatch, Identity, RunKeys
from broker.identity.signing import GlobalVerifier
from broker.transport import HeldGlobals, LearnerTransport
from broker.wire import messages as wire
from broker.wire.messages import Delta, GlobalFragment, Heartbeat
from broker.zmq.addressing import ShardSockets, resolve_addresses
from broker.zmq.curve import CurveClient, Enrollment
from broker.zmq.delivery import DeltaSender
from broker.zmq.frames import UNSENT_RETRY_S, destroyed_on_error
from broker.zmq.inbound import LearnerInbound
from broker.zmq.leases import LeaseClient
from broker.zmq.options import ZmqOptions
from broker.zmq.snapshots import RESYNC_FIRST_RETRY_S, Candidates, SnapshotRequests

_JOIN_MAX_RETRY_S = 2.0


class ZmqLearnerTransport(LearnerTransport):
    """Learner side: a DEALER and a SUB per syncer shard (:class:`ShardSockets`).
    Deltas go through a :class:`DeltaSender`, globals are collected as
    :class:`Candidates`, snapshots are asked for by :class:`SnapshotRequests`,
    learner slots by a :class:`LeaseClient`; with the run's keys, a
    :class:`CurveClient` and an :class:`Enrollment` say who we are; a
    :class:`LearnerInbound` hands each inbound message to its part.
    ``resolve_host``: how a host name becomes its addresses (one endpoint for
    several shards)."""

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
            raise ConfigError("give at least one syncer endpoint")
        self.run_id = run_id
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.num_fragments = num_fragments
        self.options = options
        self.max_message_bytes = options.max_message_bytes
        super().__init__()
        # With the run's keys: CURVE to every syncer under this process's own
        # key, enrolled with the join secret, and every global's signature checked.
        self._curve = CurveClient(keys, identity, learner_id)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        with destroyed_on_error(self._ctx):
            self._sockets = ShardSockets(
                self._ctx, endpoints, syncer_shards,
                max_message_bytes=options.max_message_bytes, send_hwm=options.send_hwm,
                stats=self.stats, secure=self._curve.secure,
                dealer_identity=(
                    f"{learner_id}/{incarnation}".encode() if self._curve.identity is None else None
                ),
                resolve_host=resolve_host,
            )  # fmt: skip
            self._enrollment = Enrollment(self._sockets, keys, self._curve.identity, run_id, role)
            self._sockets.dial()
        self._enrollment.enroll()
        dealers = self._sockets.dealers
        self._deltas = DeltaSender(
            dealers, learner_id, incarnation, options, self.stats, self._enrollment.enroll_with
        )
        self._requests = SnapshotRequests(dealers, run_id, learner_id, self.stats)
        self._candidates = Candidates(
            run_id, num_fragments, self.stats, self._versions, self._is_new,
            self._requests.resync,
        )  # fmt: skip
        self._leases = LeaseClient(
            run_id, dealers[0], self.stats, self._enrollment.enroll, self._pump
        )
        self._inbound = LearnerInbound(
            self._sockets, run_id=run_id, learner_id=learner_id, incarnation=incarnation,
            num_fragments=num_fragments, max_message_bytes=self.max_message_bytes,
            stats=self.stats, verifier=GlobalVerifier(keys) if keys else None,
            deltas=self._deltas, requests=self._requests, candidates=self._candidates,
            leases=self._leases, refused=self._refused,
        )  # fmt: skip

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

    @property
    def _shard_endpoints(self) -> list[str]:
        return self._sockets.shard_endpoints

    @property
    def _subs(self) -> list[zmq.Socket[bytes]]:
        return self._sockets.subs

    @property
    def _curve_watch(self) -> FileWatch | None:
        """The syncers' CURVE key list, for a rotation (`ddiloco keys rotate-curve`)."""
        return self._curve.watch

    def send_delta(self, delta: Delta) -> None:
        self._deltas.send(delta)

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        self._enrollment.enroll()
        frame = wire.encode(heartbeat)  # liveness only: one not sent is not owed
        for owner in range(len(self._sockets.dealers)):
            if self._sockets.send_small(owner, frame):
                self.stats.messages_sent += 1

    def answer_recalls(self, held: HeldGlobals) -> None:
        self._inbound.held_globals = held

    def resync(self, fragment: int) -> None:
        if 0 <= fragment < self.num_fragments:
            self._requests.resync(fragment)

    def _drain(self, timeout_s: float) -> None:
        self._sockets.redial_due()
        self._curve.take_up_rotation(self._sockets)
        self._enrollment.renew_refused()
        self._inbound.take(timeout_s)

    def _pump(self, timeout_s: float) -> None:
        """Receive for up to ``timeout_s``, then resend the deltas due."""
        self._drain(timeout_s)
        self._deltas.resend_due()

    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        self._enrollment.enroll_due()
        self._drain(timeout_s)
        self._deltas.resend_due()
        self._requests.retry_due()
        return self._candidates.take_all()

    def snapshot(
        self, fragments: list[int], timeout_s: float, held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        self._inbound.held = {p: w for p, w in (held or {}).items() if p in fragments}
        self._requests.held_crcs = {
            p: wire.weights_checksum(w) for p, w in self._inbound.held.items()
        }
        try:
            return self._snapshot(fragments, timeout_s)
        finally:
            self._inbound.held, self._requests.held_crcs = {}, {}

    def _snapshot(self, fragments: list[int], timeout_s: float) -> dict[int, GlobalFragment]:
        wanted = set(fragments)
        got: dict[int, GlobalFragment] = {}
        deadline = time.monotonic() + timeout_s
        next_request = 0.0
        retry_s = RESYNC_FIRST_RETRY_S
        # Forget what we knew so the syncer's current version is taken even if
        # it is not newer (a learner may rejoin a syncer that restarted).
        for p in wanted:
            self._versions.pop(p, None)
        while wanted - got.keys():
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_request:
                self._enrollment.enroll()
                if self._requests.request(sorted(wanted - got.keys())):
                    next_request = now + retry_s
                    # At most 2 s apart: a syncer that starts after its learners is found soon.
                    retry_s = min(retry_s * 2, _JOIN_MAX_RETRY_S)
                else:
                    next_request = now + UNSENT_RETRY_S
            self._pump(min(0.05, max(0.0, next_request - time.monotonic()), deadline - now))
            before = len(got)
            got.update(self._candidates.take_weights(wanted))
            if len(got) > before:
                # Answers are arriving: on a slow link the rest are on their way
                # behind them, and asking again would send them twice.
                next_request = max(next_request, time.monotonic() + retry_s)
        return got

    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        return self._leases.lease(holder, ttl_s, timeout_s, held_slot)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
