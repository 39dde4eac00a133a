"""The syncer service: transport + fragment states + checkpoints + metrics.

One event loop, one thread. Per iteration: receive deltas and heartbeats
(waiting at most until the next round deadline), offer deltas to their
fragment, close every round that is ready. Closing a round follows the
durability order that makes application exactly-once:

    merge -> checkpoint (atomic rename) -> publish -> ack

A crash before the rename re-delivers the round's deltas to the restarted
syncer, which merges them again from the same old state; a crash after it
re-delivers deltas that the de-duplication state in the checkpoint refuses.

Nothing a learner says is trusted further than the syncer can check it
(:mod:`syncer.trust`): liveness, quorum and step times count only learners on
the roster (:class:`syncer.quorum.Roster`), every figure a delta reports is
bounded, and every refused delta is counted by its reason.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client import Counter as PromCounter

from broker.connect import connect_syncer
from broker.errors import ConfigError
from broker.files import EventLog
from broker.initial_model import read_initial_model
from broker.runtime import freeze_startup_heap
from broker.settings import GONE_AFTER_HEARTBEATS, default_quorum
from broker.transport import Inbound, SyncerTransport
from broker.wire import Delta, GlobalFragment, Heartbeat, WireError
from syncer.checkpoint import load_fragment, load_manifest, save_fragment, save_manifest
from syncer.config import SyncerConfig
from syncer.fragment_state import (
    ACCEPTED,
    DUPLICATE,
    HELD,
    QUARANTINED,
    FragmentState,
    Publication,
    RoundOverflow,
)
from syncer.quorum import Roster
from syncer.trust import credited_step_s

log = logging.getLogger(__name__)


class _Metrics:
    def __init__(self, port: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.deltas_applied = PromCounter(
            "ddiloco_syncer_deltas_applied", "Deltas merged", registry=r
        )
        self.deltas_rejected = PromCounter(
            "ddiloco_syncer_deltas_rejected", "Deltas refused", ["reason"], registry=r
        )
        self.duplicates = PromCounter(
            "ddiloco_syncer_deltas_duplicate", "Deltas already applied (acked)", registry=r
        )
        self.deltas_clipped = PromCounter(
            "ddiloco_syncer_deltas_clipped", "Deltas scaled down to the quarantine bar", registry=r
        )
        self.weights_clipped = PromCounter(
            "ddiloco_syncer_weights_clipped", "Weights capped against the round median", registry=r
        )
        self.heartbeats_ignored = PromCounter(
            "ddiloco_syncer_heartbeats_ignored", "Heartbeats of ids not on the roster", registry=r
        )
        self.roster = Gauge("ddiloco_syncer_roster", "Learner ids on the roster", registry=r)
        self.rounds = PromCounter(
            "ddiloco_syncer_rounds", "Globals published", ["fragment"], registry=r
        )
        self.version = Gauge("ddiloco_syncer_fragment_version", "Version", ["fragment"], registry=r)
        self.live = Gauge(
            "ddiloco_syncer_live_learners", "Learners rounds wait for (deltas arriving)", registry=r
        )
        self.quorum_s = Gauge(
            "ddiloco_syncer_quorum_seconds", "Time to quorum", ["fragment"], registry=r
        )
        self.grace_s = Gauge(
            "ddiloco_syncer_grace_seconds", "Grace window", ["fragment"], registry=r
        )
        self.sync_s = Gauge("ddiloco_syncer_sync_seconds", "Merge+checkpoint+publish", registry=r)
        self.bytes_in = Gauge("ddiloco_syncer_bytes_received", "Bytes received", registry=r)
        self.bytes_out = Gauge("ddiloco_syncer_bytes_sent", "Bytes sent", registry=r)
        if port:
            start_http_server(port, registry=r)


def _lock_folder(folder: Path) -> IO[bytes]:
    """An exclusive lock on the checkpoint folder, held while the syncer lives: two
    syncers writing one folder would each overwrite the other's state."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "wb")  # noqa: SIM115 (held open: it is the lock)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(
            f"{folder} is in use by another syncer: give each syncer its own --checkpoint-dir"
        ) from None
    return handle


class Syncer:
    def __init__(
        self,
        cfg: SyncerConfig,
        transport: SyncerTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.clock = clock  # times rounds
        self.wall_clock = wall_clock  # dates versions: step bounds hold across restarts
        run, outer = cfg.run, cfg.outer
        initial = read_initial_model(Path(run.initial_model))
        self.plan = initial.plan
        if (self.plan.num_fragments, self.plan.sync_every) != (run.fragments, run.sync_every):
            raise ValueError(
                f"{run.initial_model} was written for fragments={self.plan.num_fragments}, "
                f"sync_every={self.plan.sync_every}, not fragments={run.fragments}, "
                f"sync_every={run.sync_every}: run `ddiloco init` with the same settings"
            )
        self.owned = list(cfg.owned_fragments or range(run.fragments))
        self.checkpoint_dir = Path(cfg.checkpoint_dir)
        self._lock = _lock_folder(self.checkpoint_dir)
        self._check_manifest()
        self.states: dict[int, FragmentState] = {}
        resumed, fresh = [], []
        started_s = self.wall_clock()
        # A fragment without a checkpoint starts a new epoch; a resumed one keeps
        # the epoch of its checkpoint, so learners' versions stay comparable.
        fresh_epoch = time.time_ns()
        for p in self.owned:
            state = FragmentState(
                p, initial.fragment(p), outer, run, published_s=started_s, epoch=fresh_epoch
            )
            saved = load_fragment(self.checkpoint_dir, p)
            if saved is not None:
                state.load(*saved)
                resumed.append(f"{p}@v{state.version}")
            else:
                fresh.append(p)
            self.states[p] = state
        if resumed:
            log.info("resumed fragments from %s: %s", self.checkpoint_dir, ", ".join(resumed))
        self.transport = transport or connect_syncer(
            run.url,
            run_id=run.run_id,
            syncer_id=cfg.syncer_id,
            fragments=self.owned,
            max_message_bytes=self.plan.max_message_bytes,
        )
        if fresh and not cfg.new_epoch:
            self._refuse_to_forget(fresh)
        # Version 0 is durable before it is published, like every later one: a
        # syncer killed before its first round comes back in the same epoch
        # instead of refusing every delta in flight (wrong_epoch).
        for p in fresh:
            save_fragment(self.checkpoint_dir, p, *self.states[p].state())
        self.metrics = _Metrics(cfg.metrics_port)
        self.rejected: Counter[str] = Counter()
        self.deltas_applied = 0
        self.duplicates = 0
        self.deltas_clipped = 0
        self.weights_clipped = 0
        self.heartbeats_ignored = 0
        self._unheard: dict[str, Heartbeat] = {}  # this batch's, of learners not on the roster
        self._short_run = False  # fewer learners joined than the quorum expects
        self.rounds = 0
        self.merged_tokens = 0
        # After a restart, the learners the checkpoint has applied deltas of.
        members = {name for s in self.states.values() for name in s.applied}
        self.roster = Roster(cfg.roster_cap, run.heartbeat_timeout_s, self.clock(), members)
        self.events = EventLog(cfg.metrics_file)
        self._published_at: dict[int, float] = {}  # clock() of each fragment's last publish
        self.stop_requested = threading.Event()
        self.drain_requested = threading.Event()
        for p in self.owned:  # joiners and restarted learners need a snapshot at once
            self._publish(p)

    def _check_manifest(self) -> None:
        manifest = load_manifest(self.checkpoint_dir)
        if manifest is not None and manifest.get("plan_hash") != self.plan.plan_hash:
            raise ValueError(
                f"{self.checkpoint_dir} holds a checkpoint of another model (plan "
                f"{manifest.get('plan_hash')} != {self.plan.plan_hash}); point "
                "checkpoint_dir elsewhere or delete it"
            )
        save_manifest(
            self.checkpoint_dir,
            {
                "run_id": self.cfg.run.run_id,
                "plan_hash": self.plan.plan_hash,
                "fragments": self.plan.num_fragments,
                "sync_every": self.plan.sync_every,
                "initial_model": self.cfg.run.initial_model,
            },
        )

    def _crash_point(self, point: str) -> None:
        """Fault tests: die here as a power cut would, with no cleanup at all."""
        if self.cfg.crash_at == point:
            os.kill(os.getpid(), signal.SIGKILL)

    # -- events ----------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        self.events.write(kind, **fields)

    def live_learners(self, now: float) -> set[str]:
        """The learners rounds wait for (:meth:`Roster.waited_for`)."""
        return self.roster.waited_for(now, self.plan.sync_every)

    # -- the loop --------------------------------------------------------
    def run(self, max_seconds: float | None = None) -> None:
        freeze_startup_heap()
        end = None if max_seconds is None else self.clock() + max_seconds
        while not self.stop_requested.is_set() and (end is None or self.clock() < end):
            self.step()
        self.shutdown()

    def step(self) -> None:
        now = self.clock()
        self._republish_idle(now)
        step_s = self.roster.median_step_s()
        deadlines = [d for s in self.states.values() if (d := s.close_at(step_s)) is not None]
        timeout = min([0.2] + [max(0.0, d - now) for d in deadlines])
        self.handle(self.transport.receive(timeout))
        if self.drain_requested.is_set():
            self.drain_requested.clear()
            self.drain()

    def _refuse_to_forget(self, fresh: list[int]) -> None:
        """A syncer without a checkpoint for fragments whose globals the broker
        holds has lost the run's state: starting over would throw the run's
        progress away. Only on request (``new_epoch``)."""
        existing = self.transport.existing_globals(fresh)
        if existing:
            self.transport.close()
            self._lock.close()
            found = ", ".join(f"{p}@v{v}" for p, (_, v) in sorted(existing.items()))
            raise ConfigError(
                f"run {self.cfg.run.run_id!r} already has globals ({found}) but "
                f"{self.checkpoint_dir} has no checkpoint of them: point --checkpoint-dir "
                "at the run's checkpoint, or pass --new-epoch to start over from the "
                "initial model"
            )

    def handle(self, items: list[Inbound]) -> None:
        """Take in what :meth:`step` received, ack what is done with, close ready rounds."""
        now, wall_s = self.clock(), self.wall_clock()
        # Heartbeats first: a learner's pace, which bounds its deltas' step
        # counts, is then known even when its first heartbeat after a syncer
        # restart arrived in the same batch as its delta.
        # A heartbeat of a learner not on the roster yet is kept for this batch:
        # if its delta below makes it a member, its step time counts at once, so
        # the batch's next deltas from it are bounded by its pace, not the floor.
        self._unheard = {}
        for item in items:
            if isinstance(item.message, Heartbeat) and not self._on_heartbeat(item.message, now):
                self._unheard[item.message.learner_id] = item.message
        if any(isinstance(item.message, Delta) for item in items):
            self._crash_point("after_receive")
        to_ack = [
            item
            for item in items
            if isinstance(item.message, Delta) and self._on_delta(item, now, wall_s)
        ]
        if to_ack:
            self.transport.ack(to_ack)
        # Not on the roster: anyone can send a heartbeat under a made-up id.
        self.heartbeats_ignored += len(self._unheard)
        self.metrics.heartbeats_ignored.inc(len(self._unheard))
        live = self.live_learners(now)
        step_s = self.roster.median_step_s()
        quorum = self.quorum()
        for p, state in self.states.items():
            state.round.set_quorum(quorum, now)
            if state.should_close(now, live, step_s, len(self.roster)):
                if len(state.pending_learners) < quorum and len(self.roster) < quorum:
                    self._settle_short_run(quorum)
                self.close_round(p)
        self.metrics.live.set(len(live))
        self.metrics.roster.set(len(self.roster))
        self.metrics.bytes_in.set(self.transport.stats.bytes_received)
        self.metrics.bytes_out.set(self.transport.stats.bytes_sent)

    def quorum(self) -> int:
        """K: ``DDILOCO_QUORUM`` when set, else M - 1 and at least 2 where M
        allows (``default_quorum``; M: see :meth:`learners`).
        Learners that die are the rounds' business (they do not wait for the
        dead); a restart keeps K, since the roster comes back with the checkpoint."""
        return self.cfg.run.quorum or default_quorum(self.learners())

    def learners(self) -> int:
        """M, which sets K and how far a round of fewer than M deltas moves the
        model: the run's learners until a round waited for missing ones in vain
        (a cluster started with fewer), then the learners that joined, as they
        join, up to the run's. Never more: anyone can join the roster under
        made-up ids, and a K they raised would hold every round for reports
        they never send."""
        run = self.cfg.run
        return min(len(self.roster), run.learners) if self._short_run else run.learners

    def _expected_deltas(self, now: float) -> int:
        """How many deltas make a full round: M, or the live learners when fewer
        are live (the dead do not shrink every round's step for ever)."""
        live = len(self.live_learners(now))
        return min(self.learners(), live) if live else self.learners()

    def _settle_short_run(self, quorum: int) -> None:
        """A round closed after waiting for learners that never joined: fewer run
        than the quorum expects. Said once; K then follows the learners that joined."""
        if self._short_run:
            return
        self._short_run = True
        joined, run = len(self.roster), self.cfg.run
        if run.quorum:
            wait_s = GONE_AFTER_HEARTBEATS * run.heartbeat_timeout_s
            advice = f"each round waits {wait_s:.0f} s for them: lower DDILOCO_QUORUM"
        else:
            advice = f"K is now {self.quorum()}, and follows the learners that join"
        log.warning(
            "only %d learner(s) joined, fewer than the quorum K=%d (of M=%d learners): %s",
            joined, quorum, run.learners, advice,
        )  # fmt: skip
        self.event("short_run", roster=joined, quorum=quorum)

    def _on_heartbeat(self, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; False when its learner is not on the roster."""
        return self.roster.heard(hb.learner_id, now, hb.step_time_s, hb.step)

    def _reject(self, reason: str, learner: str, fragment: int, seq: int) -> None:
        self.rejected[reason] += 1
        self.metrics.deltas_rejected.labels(reason).inc()
        log.warning("rejected delta %s/%d from %s: %s", fragment, seq, learner, reason)
        self.event("reject", reason=reason, learner=learner, fragment=fragment)

    def _credited_step_s(self, learner: str) -> float | None:
        times = self.roster.pace_times()
        return credited_step_s(times.get(learner), list(times.values()))

    def _refusal_by_metadata(self, d: Delta, state: FragmentState | None, now: float) -> str | None:
        """Why a delta is refused before its payload is looked at, or None."""
        if state is None:
            return "not_owned"
        if d.plan_hash != self.plan.plan_hash:
            return "wrong_plan"
        if d.numel != state.numel:
            return "bad_shape"
        if not self.roster.admits(d.learner_id, now):
            return "roster_full"  # a new id, and every member is live
        return None

    def _on_delta(self, item: Inbound, now: float, wall_s: float) -> bool:
        """Offer a delta; True if it can be acknowledged right away."""
        d = item.message
        assert isinstance(d, Delta)
        state = self.states.get(d.fragment)
        refusal = self._refusal_by_metadata(d, state, now)
        if refusal is not None or state is None:
            self._refuse(item, refusal or "not_owned")
            return False
        # What the round keeps until it closes: the ack token, not the payload.
        ref = Inbound(replace(d, payload=b""), item.token)
        status = state.precheck(d, ref)
        if status is None:
            try:
                tensor = state.decode(d)
            except WireError as e:
                self._refuse(item, e.reason)
                return False
            step_s = self._credited_step_s(d.learner_id)
            status = state.offer(d, tensor, ref, now, wall_s=wall_s, step_s=step_s)
        if status in (ACCEPTED, HELD):
            evicted = self.roster.join(d.learner_id, now)  # a valid delta also proves liveness
            if evicted is not None:
                log.info("%s joins the roster in place of %s (silent)", d.learner_id, evicted)
                self.event("roster_replace", learner=d.learner_id, replaced=evicted)
            unheard = self._unheard.pop(d.learner_id, None)
            if unheard is not None:
                self._on_heartbeat(unheard, now)
            return False
        if status == DUPLICATE:
            self.duplicates += 1
            self.metrics.duplicates.inc()
            return True
        self._refuse(item, status)
        return False

    def _refuse(self, item: Inbound, reason: str) -> None:
        """Count and log a refused delta, and answer its learner "refused, resync"
        (never a silent acknowledgement)."""
        d = item.message
        assert isinstance(d, Delta)
        self._reject(reason, d.learner_id, d.fragment, d.seq)
        self.transport.refuse(item, reason)

    def _answer_round(self, refs: list[Inbound], refused: list[tuple[str, int, int]]) -> None:
        """Acknowledge a closed round's deltas, except those its quarantine refused."""
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
        state = self.states[p]
        started = self.clock()
        quorum_s = None
        if state.round.quorum_at is not None and state.round.opened_at is not None:
            quorum_s = state.round.quorum_at - state.round.opened_at
        grace_s = state.round.grace_window_s(self.roster.median_step_s())
        try:
            result = state.close(self.wall_clock(), self._expected_deltas(started))
        except RoundOverflow as e:
            log.error("%s: refusing its %d deltas", e, len(e.refs))
            for ref in e.refs:
                self._refuse(ref, "overflow")
            state.round_done(0.0)
            return
        self._crash_point("after_update")
        for learner, _, seq in result.refused:
            self._reject(QUARANTINED, learner, p, seq)
        if not result.published:  # quarantine refused every delta: nothing changed
            self._answer_round(result.refs, result.refused)
            state.round_done(0.0)
            return
        tensors, meta = state.state()
        save_fragment(self.checkpoint_dir, p, tensors, meta)  # durable before anything leaves
        self._crash_point("after_checkpoint")
        self._publish(p)
        self._crash_point("before_ack")
        self._answer_round(result.refs, result.refused)
        sync_s = self.clock() - started
        state.round_done(sync_s)
        self.rounds += 1
        self.deltas_applied += result.included
        self.merged_tokens += result.tokens
        self.metrics.rounds.labels(str(p)).inc()
        self.metrics.deltas_applied.inc(result.included)
        self.deltas_clipped += len(result.clipped)
        self.weights_clipped += result.weights_clipped
        self.metrics.deltas_clipped.inc(len(result.clipped))
        self.metrics.weights_clipped.inc(result.weights_clipped)
        self.metrics.version.labels(str(p)).set(result.version)
        self.metrics.sync_s.set(sync_s)
        self.metrics.grace_s.labels(str(p)).set(grace_s)
        if quorum_s is not None:
            self.metrics.quorum_s.labels(str(p)).set(quorum_s)
        self.event(
            "round",
            fragment=p,
            version=result.version,
            included=result.included,
            tokens=result.tokens,
            learners=result.learners,
            keys=result.keys,
            spans=result.spans,
            clipped=result.clipped,
            weights_clipped=result.weights_clipped,
            quorum=state.round.quorum,
            quorum_s=quorum_s,
            grace_s=grace_s,
            sync_s=sync_s,
            merged_tokens=self.merged_tokens,
        )

    def _republish_idle(self, now: float) -> None:
        """Publish again a fragment that has not moved for a heartbeat timeout.

        Globals go out by publish/subscribe, which drops what a subscriber that is
        (re)connecting misses. A syncer that restarts, with its checkpoint or
        without (a new epoch), publishes once at start; if that is missed and its
        rounds do not move, learners would never hear of it. Idle fragments only:
        a moving fragment is published every round anyway.
        """
        period = self.cfg.run.heartbeat_timeout_s
        for p, state in self.states.items():
            if now - self._published_at.get(p, now) >= period and not state.pending_learners:
                self._publish(p, announce=True)

    def _publish(self, p: int, announce: bool = False) -> None:
        """Publish fragment p's version; ``announce``: without its weights (learners
        that hold it, nearly all, need nothing; the others fetch the snapshot)."""
        self._published_at[p] = self.clock()
        state = self.states[p]

        def message(publication: Publication) -> GlobalFragment:
            return GlobalFragment(
                run_id=self.cfg.run.run_id,
                fragment=p,
                plan_hash=self.plan.plan_hash,
                epoch=state.epoch,
                version=state.version,
                change_from=state.version - 1 if publication.is_change else -1,
                weights_crc=publication.weights_crc,
                codec=publication.codec,
                numel=state.numel,
                payload=publication.payload,
                sent_at=time.time(),
            )

        snapshot = state.snapshot
        published = state.publication
        if announce:
            self.transport.announce(message(snapshot))
            return
        self.transport.publish(
            message(published), snapshot=None if snapshot is published else message(snapshot)
        )

    # -- draining and shutdown ----------------------------------------------
    def drain(self) -> None:
        """Close every round that holds deltas now, without waiting for quorum or
        grace (the learners are done): afterwards every delivered delta is merged
        and published, and the syncer goes on serving snapshots."""
        for p, state in self.states.items():
            if state.pending_learners:
                self.close_round(p)
        self.event("drained", versions={str(p): s.version for p, s in self.states.items()})

    def shutdown(self) -> None:
        """Merge what is pending, record totals, close."""
        self.drain()
        self.event("summary", **self.summary())
        self.transport.close()
        self.events.close()
        self._lock.close()  # releases the checkpoint folder

    def summary(self) -> dict[str, Any]:
        """Totals of the run. ``deltas_rejected`` is every refused entry, whatever
        its reason (frames the transport refused too, as ``transport_<reason>``):
        it is the sum of ``rejected_by_reason``. Duplicates are acked, not
        refused, and counted beside it."""
        stats = self.transport.stats
        by_reason = dict(self.rejected) | {f"transport_{k}": v for k, v in stats.rejected.items()}
        return {
            "fragments_published": self.rounds,
            "deltas_applied": self.deltas_applied,
            "deltas_rejected": sum(by_reason.values()),
            "rejected_by_reason": by_reason,
            "duplicates": self.duplicates,
            "snapshot_requests_rate_limited": stats.rate_limited,
            "deltas_clipped": self.deltas_clipped,
            "weights_clipped": self.weights_clipped,
            "heartbeats_ignored": self.heartbeats_ignored,
            "roster": sorted(self.roster.members),
            "merged_tokens": self.merged_tokens,
            "bytes_received": stats.bytes_received,
            "bytes_sent": stats.bytes_sent,
            "versions": {str(p): s.version for p, s in self.states.items()},
        }


def run_syncer(cfg: SyncerConfig) -> None:
    syncer = Syncer(cfg)
    signal.signal(signal.SIGTERM, lambda *_: syncer.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: syncer.stop_requested.set())
    # SIGUSR1: the learners are done; merge what is pending now and keep serving.
    signal.signal(signal.SIGUSR1, lambda *_: syncer.drain_requested.set())
    log.info(
        "syncer %s owns fragments %s (plan %s)", cfg.syncer_id, syncer.owned, syncer.plan.plan_hash
    )
    print("ready", flush=True)
    syncer.run()
