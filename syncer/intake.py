"""What the syncer does with a batch from the transport: heartbeats to the
roster, deltas offered to their fragment's round, refusals answered."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from broker.transport import Inbound, SyncerTransport
from broker.wire.messages import Delta, Heartbeat, WireError
from syncer.fragment_state import ACCEPTED, DUPLICATE, HELD, FragmentState
from syncer.membership import Membership
from syncer.metrics import SyncerMetrics

log = logging.getLogger(__name__)


class Intake:
    """Takes a received batch in; refuses what cannot be taken, counted by
    reason, with an answer to its learner ("refused, resync"), never a silent
    acknowledgement."""

    def __init__(
        self,
        states: dict[int, FragmentState],
        plan_hash: str,
        membership: Membership,
        metrics: SyncerMetrics,
        transport: SyncerTransport,
        crash_point: Callable[[str], None],
    ) -> None:
        self.states = states
        self.plan_hash = plan_hash
        self.membership = membership
        self.metrics = metrics
        self.transport = transport
        self.crash_point = crash_point
        self._unheard: dict[str, Heartbeat] = {}  # this batch's, of learners not on the roster

    def take(self, items: list[Inbound], now: float, wall_s: float) -> list[Inbound]:
        """Heartbeats, then deltas; returns what can be acknowledged at once."""
        # Heartbeats first, for liveness only: a delta's step count is bounded by
        # the pace its learner's deltas show, whatever came first.
        # A heartbeat of a learner not on the roster yet is kept for this batch:
        # if its delta below makes it a member, it counts as heard at once.
        self._unheard = {}
        for item in items:
            if isinstance(item.message, Heartbeat) and not self._heard(item.message, now):
                self._unheard[item.message.learner_id] = item.message
        deltas = [(item, item.message) for item in items if isinstance(item.message, Delta)]
        if deltas:
            self.crash_point("after_receive")
        # Each learner's deltas in the order of its steps, whatever order the
        # transport read them in (Redis: stream by stream): the first of a burst
        # is then the one its pace is measured from (syncer.trust.delta_pace).
        deltas.sort(key=lambda pair: (pair[1].incarnation, pair[1].step))
        to_ack = [item for item, _ in deltas if self._on_delta(item, now, wall_s)]
        # Not on the roster: anyone can send a heartbeat under a made-up id.
        self.metrics.ignored_heartbeats(len(self._unheard))
        return to_ack

    def _heard(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; False when its learner is not on the roster."""
        return self.membership.roster.heard(hb.learner_id, now, hb.step_time_s)

    def _refusal_by_metadata(self, d: Delta, state: FragmentState | None, now: float) -> str | None:
        """Why a delta is refused before its payload is looked at, or None."""
        if state is None:
            return "not_owned"
        if d.plan_hash != self.plan_hash:
            return "wrong_plan"
        if d.numel != state.numel:
            return "bad_shape"
        if not self.membership.roster.admits(d.learner_id, now):
            return "roster_full"  # a new id, and every member is live
        return None

    def _on_delta(self, item: Inbound, now: float, wall_s: float) -> bool:
        """Offer a delta; True if it can be acknowledged right away."""
        d = item.message
        assert isinstance(d, Delta)
        state = self.states.get(d.fragment)
        refusal = self._refusal_by_metadata(d, state, now)
        if refusal is not None or state is None:
            self.refuse(item, refusal or "not_owned")
            return False
        # What the round keeps until it closes: the ack token, not the payload.
        ref = Inbound(replace(d, payload=b""), item.token)
        status = state.precheck(d, ref)
        if status is None:
            try:
                tensor = state.decode(d)
            except WireError as e:
                self.refuse(item, e.reason)
                return False
            step_s = self.membership.roster.credited_step_s(
                d.learner_id, incarnation=d.incarnation, step=d.step, wall_s=wall_s
            )
            status = state.offer(d, tensor, ref, now, wall_s=wall_s, step_s=step_s)
        if status in (ACCEPTED, HELD):
            roster = self.membership.roster
            evicted = roster.join(d.learner_id, now)  # a valid delta also proves liveness
            if evicted is not None:
                log.info("%s joins the roster in place of %s (silent)", d.learner_id, evicted)
                self.metrics.event("roster_replace", learner=d.learner_id, replaced=evicted)
            if status == ACCEPTED:  # its pace bounds the learner's next deltas
                roster.paced(d.learner_id, d.incarnation, d.step, wall_s)
            unheard = self._unheard.pop(d.learner_id, None)
            if unheard is not None:
                self._heard(unheard, now)
            return False
        if status == DUPLICATE:
            self.metrics.duplicate()
            return True
        self.refuse(item, status)
        return False

    def refuse(self, item: Inbound, reason: str) -> None:
        """Count and log a refused delta, and answer its learner "refused, resync"."""
        d = item.message
        assert isinstance(d, Delta)
        self.metrics.reject(reason, d.learner_id, d.fragment, d.seq)
        self.transport.refuse(item, reason)
