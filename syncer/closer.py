"""Closing a round in the order that makes application exactly-once:

    merge -> checkpoint (atomic rename) -> publish -> ack

and publishing fragments (after a round, at start, and again while idle)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from broker.transport import Inbound, SyncerTransport
from broker.wire.messages import Delta, GlobalFragment
from syncer.checkpoint import append_change, save_fragment
from syncer.fragment_state import QUARANTINED, FragmentState, Publication, RoundOverflow
from syncer.membership import Membership
from syncer.metrics import SyncerMetrics

log = logging.getLogger(__name__)


class RoundCloser:
    """Closes fragments' rounds, makes them durable, publishes and answers them."""

    def __init__(
        self,
        states: dict[int, FragmentState],
        *,
        run_id: str,
        plan_hash: str,
        checkpoint_dir: Path,
        full_every: int,
        logged: dict[int, int],
        membership: Membership,
        metrics: SyncerMetrics,
        transport: SyncerTransport,
        refuse: Callable[[Inbound, str], None],
        crash_point: Callable[[str], None],
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        term: int,
        confirm: Callable[[], None],
    ) -> None:
        self.states = states
        self.run_id = run_id
        self.plan_hash = plan_hash
        self.checkpoint_dir = checkpoint_dir
        self.full_every = full_every
        self._logged = logged  # per fragment, rounds in its log since its full state
        self.membership = membership
        self.metrics = metrics
        self.transport = transport
        self.refuse = refuse
        self.crash_point = crash_point
        self.clock = clock
        self.wall_clock = wall_clock
        # The shard's lease: its term goes on every global, and confirm() comes
        # before every write that leaves the process (it raises once another
        # syncer holds the shard).
        self.term = term
        self.confirm = confirm
        self._published_at: dict[int, float] = {}  # clock() of each fragment's last publish
        self._first_saves: FirstSaves | None = None

    def close_ready(self, now: float) -> None:
        """Close every round that should close now (:meth:`Round.should_close`)."""
        membership = self.membership
        waited = membership.waited_for(now)
        step_s = membership.roster.median_step_s()
        for p, state in self.states.items():
            quorum = membership.quorum()
            known = len(membership.roster)
            if state.round.should_close(now, waited, step_s, known, quorum):
                if len(state.pending_learners) < quorum and known < quorum:
                    advice = membership.settle_short_run()
                    if advice is not None:
                        self.metrics.event("short_run", roster=known, quorum=quorum)
                self.close_round(p)

    def _answer(self, refs: list[Inbound], refused: list[tuple[str, int, int]]) -> None:
        """Acknowledge a closed round's deltas, except those its quarantine refused."""
        self.confirm()
        keys = set(refused)
        to_ack = []
        for ref in refs:
            d = ref.message
            if isinstance(d, Delta) and (d.learner_id, d.incarnation, d.seq) in keys:
                self.transport.refuse(ref, QUARANTINED)
            else:
                to_ack.append(ref)
        self.transport.ack(to_ack)

    def close_round(self, p: int) -> None:
        state, membership = self.states[p], self.membership
        started = self.clock()
        quorum = membership.quorum()
        reached, opened_at = state.round.quorum_at(quorum), state.round.opened_at
        quorum_s = None if reached is None or opened_at is None else reached - opened_at
        grace_s = state.round.grace_window_s(membership.roster.median_step_s())
        try:
            result = state.close(self.wall_clock(), membership.full_round(started))
        except RoundOverflow as e:
            log.error("%s: refusing its %d deltas", e, len(e.refs))
            for ref in e.refs:
                self.refuse(ref, "overflow")
            state.round_done(0.0, quorum)
            return
        self.crash_point("after_update")
        for learner, _, seq in result.refused:
            self.metrics.reject(QUARANTINED, learner, p, seq)
        if not result.published:  # quarantine refused every delta: nothing changed
            self._answer(result.refs, result.refused)
            state.round_done(0.0, quorum)
            return
        self.checkpoint(p)  # durable before anything leaves
        self.crash_point("after_checkpoint")
        self.publish(p)
        self.crash_point("before_ack")
        self._answer(result.refs, result.refused)
        done = self.clock()
        sync_s = done - started
        state.round_done(sync_s, quorum)
        # The round's latency as learners see it: from its K-th delta to its global.
        latency_s = None if reached is None else done - reached
        timings = {
            "quorum_s": quorum_s,
            "grace_s": grace_s,
            "sync_s": sync_s,
            "quorum_to_publish_s": latency_s,
        }
        self.metrics.round(p, self.states[p].epoch, result, quorum, timings)

    def save_in_background(self, fragments: list[int]) -> None:
        """Write the full state of ``fragments``, rebuilt at start, off the rounds'
        path (:class:`FirstSaves`); each one's first round waits for its own."""
        if fragments:
            self.confirm()
            self._first_saves = FirstSaves(self.checkpoint_dir, self.states, fragments)

    def checkpoint(self, p: int) -> int:
        """Make fragment p's new version durable: its change appended to the log,
        or every ``full_every`` rounds (and for a version published whole) its
        full state. Returns the bytes written."""
        if self._first_saves is not None:
            self._first_saves.wait(p)  # the log's base is on disk before its first record
        self.confirm()
        state = self.states[p]
        logged = self._logged.get(p, 0)
        if state.publication.is_change and logged + 1 < self.full_every:
            written = append_change(
                self.checkpoint_dir, p, state.version, state.publication.payload, state.meta()
            )
            self._logged[p] = logged + 1
        else:
            written = save_fragment(self.checkpoint_dir, p, *state.state())
            self._logged[p] = 0
        self.metrics.checkpoint_bytes += written
        return written

    def republish_idle(self, now: float, period_s: float) -> None:
        """Publish again a fragment that has not moved for ``period_s``.

        Globals go out by publish/subscribe, which drops what a subscriber that is
        (re)connecting misses. A syncer that restarts, with its checkpoint or
        without (a new epoch), publishes once at start; if that is missed and its
        rounds do not move, learners would never hear of it. Idle fragments only:
        a moving fragment is published every round anyway.
        """
        for p, state in self.states.items():
            if now - self._published_at.get(p, now) >= period_s and not state.pending_learners:
                self.publish(p, announce=True)

    def publish_at_start(self) -> None:
        """Joiners and restarted learners need each fragment's snapshot at once:
        published, unless the broker gives them this version already."""
        for p, state in self.states.items():
            if self.transport.serves(p, state.epoch, state.version):
                self._published_at[p] = self.clock()  # for republish_idle
            else:
                self.publish(p)

    def republish_lost(self) -> None:
        """Publish again, whole, each fragment whose snapshot the broker lost (a
        Redis restart or failover): learners that missed a version fetch it,
        and a round waiting on them would otherwise wait for ever."""
        for p in self.transport.lost_snapshots():
            self.publish(p, announce=True)

    def publish(self, p: int, announce: bool = False) -> None:
        """Publish fragment p's version; ``announce``: without its weights (learners
        that hold it, nearly all, need nothing; the others fetch the snapshot)."""
        self.confirm()
        self._published_at[p] = self.clock()
        state = self.states[p]
        # One time for the change and its snapshot: they are one version, which
        # a transport may sign once for both (GlobalFragment.held_form).
        sent_at = time.time()

        def message(publication: Publication) -> GlobalFragment:
            return GlobalFragment(
                run_id=self.run_id,
                fragment=p,
                plan_hash=self.plan_hash,
                epoch=state.epoch,
                version=state.version,
                change_from=state.version - 1 if publication.is_change else -1,
                weights_crc=publication.weights_crc,
                term=self.term,
                codec=publication.codec,
                numel=state.numel,
                payload=publication.payload,
                sent_at=sent_at,
            )

        snapshot = state.snapshot
        published = state.publication
        # Where the broker keeps snapshots, a successor without this checkpoint
        # resumes from the version and this state (syncer.recovery.rebuild_from_broker).
        resume = msgpack.packb(state.meta(), use_bin_type=True)
        if announce:
            self.transport.announce(message(snapshot), resume)
            return
        self.transport.publish(
            message(published),
            snapshot=None if snapshot is published else message(snapshot),
            resume=resume,
        )

    def drain(self) -> None:
        """Close every round that holds deltas now, without waiting for quorum or
        grace (the learners are done): afterwards every delivered delta is merged
        and published, and the syncer goes on serving snapshots."""
        for p, state in self.states.items():
            if state.pending_learners:
                self.close_round(p)
        self.metrics.event("drained", versions={str(p): s.version for p, s in self.states.items()})


class FirstSaves:
    """The first full state of fragments rebuilt at start (from the broker or the
    learners, which hold their version already), written by one thread while
    the syncer serves: 4 bytes per parameter, the version and its small state,
    all a rebuilt fragment holds (its master is the version, its momentum
    zero), where its first round wrote the whole state on its path (2 GB at
    250M parameters). A fragment whose round comes first is written by that
    round (:meth:`wait`), not after every fragment before it. The version's
    memory is not written over while a job holds it
    (:meth:`syncer.versions.Versions.writable`). A syncer killed before a
    fragment's is done rebuilds it again."""

    def __init__(self, directory: Path, states: dict[int, FragmentState], fragments: list[int]):
        self._directory = directory
        # Per fragment: what to write, until written (under its lock).
        self._jobs: dict[int, tuple[dict[str, Any], dict[str, Any]] | None] = {
            p: ({f"version.{states[p].version}": states[p].weights}, states[p].meta())
            for p in fragments
        }
        self._locks = {p: threading.Lock() for p in fragments}
        self._error: BaseException | None = None
        threading.Thread(target=self._write_all, name="ddiloco-first-saves", daemon=True).start()

    def _write(self, p: int) -> None:
        with self._locks[p]:
            job = self._jobs[p]
            if job is not None:
                save_fragment(self._directory, p, *job)
                self._jobs[p] = None

    def _write_all(self) -> None:
        try:
            for p in self._locks:
                self._write(p)
        except BaseException as e:  # raised on the syncer's thread by wait()
            self._error = e

    def wait(self, p: int) -> None:
        """Return once fragment ``p``'s first state is on disk (written here if
        the thread has not come to it; at once if it is not one of them)."""
        if self._error is not None:
            raise self._error
        if p in self._locks:
            self._write(p)
