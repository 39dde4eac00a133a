"""The syncer service: transport + fragment states + checkpoints + metrics.

One event loop, one thread. Per iteration: receive deltas and heartbeats
(waiting at most until the next round deadline), take them in
(:class:`syncer.intake.Intake`), close every round that is ready
(:class:`syncer.closer.RoundCloser`). Closing a round follows the
durability order that makes application exactly-once:

    merge -> checkpoint (atomic rename) -> publish -> ack

A crash before the rename re-delivers the round's deltas to the restarted
syncer, which merges them again from the same old state; a crash after it
re-delivers deltas that the de-duplication state in the checkpoint refuses.

Nothing a learner says is trusted further than the syncer can check it
(:mod:`syncer.trust`): liveness, quorum and step times count only learners on
the roster (:class:`syncer.membership.Membership`), every figure a delta
reports is bounded, and every refused delta is counted by its reason.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from broker.checks import MAX_ID_LEN
from broker.connect import connect_syncer, lease_shard
from broker.errors import ConfigError, Fenced, TransportError
from broker.fragments import owned_fragments
from broker.run.initial_model import InitialModel, read_initial_model
from broker.runtime import default_holder, freeze_startup_heap
from broker.transport import Inbound, SyncerTransport
from syncer.buffers import PackedRows
from syncer.checkpoint import (
    save_fragment,
)
from syncer.closer import RoundCloser
from syncer.config import AUTO_ID, AUTO_SHARD, SyncerConfig
from syncer.fragment_state import FragmentState
from syncer.intake import Intake
from syncer.membership import Membership
from syncer.metrics import SyncerMetrics
from syncer.quorum import Roster
from syncer.recovery import check_manifest, rebuild_from_broker, resume_from_folder
from syncer.trust import newest_marks, restart_marks

if TYPE_CHECKING:
    from broker.redis.shards import ShardLease

log = logging.getLogger(__name__)


def _shard_folder(checkpoint_dir: Path, shard: int, shards: int) -> Path:
    """Where shard ``shard`` keeps its checkpoint: with several shards, each its
    own folder of ``checkpoint_dir``, on a volume they share."""
    return checkpoint_dir / f"shard-{shard}" if shards > 1 else checkpoint_dir


def _try_lock_folder(folder: Path) -> IO[bytes] | None:
    """An exclusive lock on the checkpoint folder, held while the syncer lives (the
    kernel drops it when the process dies), or None if a live syncer holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / ".lock", "wb")  # noqa: SIM115 (held open: it is the lock)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _lock_folder(folder: Path) -> IO[bytes]:
    """The folder's lock: two syncers writing one folder would each overwrite the
    other's state."""
    handle = _try_lock_folder(folder)
    if handle is None:
        raise ConfigError(
            f"{folder} is in use by another syncer: give each syncer its own --checkpoint-dir"
        )
    return handle


def _take_shard_folder(checkpoint_dir: Path, shards: int) -> tuple[int, IO[bytes]]:
    """``syncer_shard=auto`` over ZeroMQ, which has no server to lease shards
    from: the lowest shard whose folder no live syncer holds, waiting as a
    standby while all are held. The replicas share ``checkpoint_dir`` (one host,
    or a file system whose locks span hosts); a restarted replica takes the
    folder its own death freed, unless a standby took it first."""
    said = False
    while True:
        for shard in range(shards):
            handle = _try_lock_folder(_shard_folder(checkpoint_dir, shard, shards))
            if handle is not None:
                return shard, handle
        if not said:
            log.warning(
                "all %d shard folder(s) of %s are held by live syncers: this one waits as a "
                "standby and takes the first that frees",
                shards, checkpoint_dir,
            )  # fmt: skip
            said = True
        time.sleep(1.0)


class Syncer:
    """The event loop around the stages: it builds them, feeds them what the
    transport receives, and shuts them down."""

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
        self._pause_at = cfg.pause_at  # cleared once reached
        run = cfg.run
        initial = read_initial_model(Path(run.initial_model))
        self.plan = initial.plan
        if (self.plan.num_fragments, self.plan.sync_every) != (run.fragments, run.sync_every):
            raise ConfigError(
                f"{run.initial_model} was written for fragments={self.plan.num_fragments}, "
                f"sync_every={self.plan.sync_every}, not fragments={run.fragments}, "
                f"sync_every={run.sync_every}: run `ddiloco init` with the same settings"
            )
        self.shard_lease: ShardLease | None = None
        held: IO[bytes] | None = None  # the shard's checkpoint folder's lock, if taken here
        fixed = None if cfg.syncer_shard == AUTO_SHARD else int(cfg.syncer_shard)
        if fixed is not None:
            # Locked first: the lease's holder names this folder, which the lock
            # keeps to one live process on this host.
            held = _lock_folder(_shard_folder(Path(cfg.checkpoint_dir), fixed, run.syncer_shards))
        # A transport given by the caller (tests, tools) is served without a lease.
        lease = (
            None
            if transport is not None
            else lease_shard(
                run.url,
                lease_store=cfg.lease_store,
                run_id=run.run_id,
                syncer_shards=run.syncer_shards,
                # auto: in a container its id and pid 1, the same after a restart.
                holder=f"{default_holder()}:"
                + (str(os.getpid()) if fixed is None else str(Path(cfg.checkpoint_dir).resolve())),
                ttl_s=run.gone_after_s,
                keys=run.run_keys("syncer"),
            )
        )
        try:
            if lease is not None:  # Redis, or a lease store: a lease and its term
                self.shard_lease = lease
                self.shard = lease.take(only=fixed)
            elif fixed is not None:
                self.shard = fixed
            else:
                self.shard, held = _take_shard_folder(Path(cfg.checkpoint_dir), run.syncer_shards)
            self.syncer_id = (
                cfg.syncer_id
                if cfg.syncer_id != AUTO_ID
                else f"syncer-{self.shard}-{default_holder()}"[:MAX_ID_LEN]
            )
            self._start(initial, transport, held)
        except BaseException:
            if self.shard_lease is not None:
                self.shard_lease.close()
            if held is not None:
                held.close()
            raise

    def _start(
        self, initial: InitialModel, transport: SyncerTransport | None, held: IO[bytes] | None
    ) -> None:
        """Everything but the shard: the fragments' states from the checkpoint
        (its folder's lock ``held`` already, or taken here), the transport and
        the stages."""
        cfg, run, outer = self.cfg, self.cfg.run, self.cfg.outer
        self.owned = owned_fragments(self.shard, run.syncer_shards, run.fragments)
        self.checkpoint_dir = _shard_folder(Path(cfg.checkpoint_dir), self.shard, run.syncer_shards)
        self._lock = held or _lock_folder(self.checkpoint_dir)
        check_manifest(self.checkpoint_dir, self.plan, cfg.run)
        started_s = self.wall_clock()
        # A fragment without a checkpoint starts a new epoch; a resumed one keeps
        # the epoch of its checkpoint, so learners' versions stay comparable.
        fresh_epoch = time.time_ns()
        # One pool of packed delta rows for every owned fragment: a round holds
        # rows only until it closes (syncer/buffers.py).
        rows = PackedRows(max(self.plan.fragment_numel(p) for p in self.owned), run.delta_codec)

        def new_state(p: int, weights: torch.Tensor) -> FragmentState:
            return FragmentState(
                p, weights, outer, run, published_s=started_s, epoch=fresh_epoch, rows=rows
            )

        # logged: per fragment, rounds in its log.
        self.states, logged, fresh = resume_from_folder(
            self.checkpoint_dir, self.owned, new_state, initial.fragment
        )
        # Redis: every write that publishes or acknowledges checks the shard's term.
        self.fence = (
            None if self.shard_lease is None or cfg.lease_store else self.shard_lease.fence()
        )
        term = 0 if self.shard_lease is None else self.shard_lease.term
        self.transport = transport or connect_syncer(
            run.url,
            run_id=run.run_id,
            syncer_id=self.syncer_id,
            fragments=self.owned,
            max_message_bytes=self.plan.max_message_bytes,
            num_fragments=self.plan.num_fragments,
            keys=run.run_keys("syncer"),
            roster_cap=cfg.roster_cap,
            shard=self.shard,
            syncer_shards=run.syncer_shards,
            fence=self.fence,
            term=term,
            identity_hold_s=run.gone_after_s,
        )
        rebuilt = (
            []
            if cfg.new_epoch
            else rebuild_from_broker(
                self.transport,
                self.states,
                self.owned,
                self.plan,
                self.checkpoint_dir,
                cfg.recall_s,
                cfg.outer.outer_lr,
                new_state,
            )
        )
        if unrebuilt := [p for p in fresh if p not in rebuilt and not cfg.new_epoch]:
            self._refuse_to_forget(unrebuilt)
        for p in fresh:
            if p not in rebuilt:
                self.states[p] = new_state(p, initial.fragment(p))
        self.states = {p: self.states[p] for p in self.owned}
        # Version 0 is durable before it is published, like every later one: a
        # syncer killed before its first round comes back in the same epoch
        # instead of refusing every delta in flight (wrong_epoch). A rebuilt
        # version is durable in the broker (or held by the learners) already:
        # its full state is written while the syncer serves (RoundCloser.
        # save_in_background; a successor killed before then rebuilds again).
        for p in sorted(set(fresh) - set(rebuilt)):
            save_fragment(self.checkpoint_dir, p, *self.states[p].state())
        for p in rebuilt:  # its new full state replaces any log of an older one
            logged[p] = 0
        self.metrics = SyncerMetrics(cfg.metrics_port, cfg.metrics_file, run.metrics_host)
        # After a restart, the learners the checkpoint has applied deltas of, and
        # where their paces go on from.
        members = {name for s in self.states.values() for name in s.applied}
        marks = newest_marks(
            restart_marks(s.applied, s.admission.merged_step, s.published_at.get(s.version, 0.0))
            for s in self.states.values()
        )
        self.membership = Membership(run, cfg.roster_cap, self.clock(), members, marks)
        self.intake = Intake(
            self.states, self.plan.plan_hash, self.membership, self.metrics, self.transport,
            self._crash_point,
        )  # fmt: skip
        self.closer = RoundCloser(
            self.states,
            run_id=run.run_id,
            plan_hash=self.plan.plan_hash,
            checkpoint_dir=self.checkpoint_dir,
            full_every=cfg.full_checkpoint_every,
            logged=logged,
            membership=self.membership,
            metrics=self.metrics,
            transport=self.transport,
            refuse=self.intake.refuse,
            crash_point=self._crash_point,
            clock=self.clock,
            wall_clock=self.wall_clock,
            term=term,
            confirm=self.shard_lease.confirm if self.shard_lease is not None else lambda: None,
        )
        self.stop_requested = threading.Event()
        self.drain_requested = threading.Event()
        self.closer.save_in_background(rebuilt)
        self.closer.publish_at_start()

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

    def _crash_point(self, point: str) -> None:
        """Fault tests: die here as a power cut would, with no cleanup at all; or
        stop here, once, until continued."""
        if self.cfg.crash_at == point:
            os.kill(os.getpid(), signal.SIGKILL)
        if self._pause_at == point:
            self._pause_at = ""
            os.kill(os.getpid(), signal.SIGSTOP)

    # -- what tests and tools read ---------------------------------------
    @property
    def roster(self) -> Roster:
        return self.membership.roster

    def quorum(self) -> int:
        return self.membership.quorum()

    def live_learners(self, now: float) -> set[str]:
        """The learners rounds wait for (:meth:`Membership.waited_for`)."""
        return self.membership.waited_for(now)

    # -- the loop --------------------------------------------------------
    def run(self, max_seconds: float | None = None) -> None:
        freeze_startup_heap()
        end = None if max_seconds is None else self.clock() + max_seconds
        try:
            while not self.stop_requested.is_set() and (end is None or self.clock() < end):
                self.step()
        except Fenced as e:
            # Another syncer serves the shard now: stop without writing anything
            # more (no drain, no last publish), as a crash would.
            lease = self.shard_lease
            assert lease is not None
            refused = lease.refused + (0 if self.fence is None else self.fence.refused)
            log.error("%s", e)
            self.metrics.event("fenced", term=lease.term, refused_writes=refused)
            self.metrics.close()
            raise
        self.shutdown()

    def step(self) -> None:
        if self.shard_lease is not None and self.shard_lease.lost.is_set():
            # Another syncer may serve these fragments now: stop before publishing
            # again, as a crash would (unacked deltas go to the shard's next holder).
            raise TransportError(f"syncer shard {self.shard}'s lease was lost: stopping")
        now = self.clock()
        self.closer.republish_idle(now, self.cfg.run.heartbeat_timeout_s)
        self.closer.republish_lost()
        step_s = self.roster.median_step_s()
        quorum = self.membership.quorum()
        deadlines = [
            d for s in self.states.values() if (d := s.round.close_at(step_s, quorum)) is not None
        ]
        timeout = min([0.2] + [max(0.0, d - now) for d in deadlines])
        self.handle(self.transport.receive(timeout))
        if self.drain_requested.is_set():
            self.drain_requested.clear()
            self.drain()

    def handle(self, items: list[Inbound]) -> None:
        """Take in what :meth:`step` received, ack what is done with, close ready rounds."""
        now, wall_s = self.clock(), self.wall_clock()
        to_ack = self.intake.take(items, now, wall_s)
        if to_ack:
            self.transport.ack(to_ack)
        self.closer.close_ready(now)
        membership = self.membership
        self.metrics.gauges(
            len(membership.waited_for(now)), len(membership.roster), membership.quorum(),
            self.transport.stats,
        )  # fmt: skip

    # -- draining and shutdown ----------------------------------------------
    def drain(self) -> None:
        """Merge every delivered delta now (the learners are done)."""
        self.closer.drain()

    def shutdown(self) -> None:
        """Merge what is pending, record totals, close."""
        self.drain()
        self.metrics.event("summary", **self.summary())
        self.transport.close()
        self.metrics.close()
        self._lock.close()  # releases the checkpoint folder
        if self.shard_lease is not None:
            self.shard_lease.close()  # frees the shard for a standby

    def summary(self) -> dict[str, Any]:
        """Totals of the run (:meth:`SyncerMetrics.summary`), the roster, K and
        the fragments' versions."""
        return self.metrics.summary(self.transport.stats) | {
            "syncer_shard": self.shard,
            "roster": sorted(self.roster.members),
            "quorum": self.membership.quorum(),
            "versions": {str(p): s.version for p, s in self.states.items()},
        }


def run_syncer(cfg: SyncerConfig) -> None:
    syncer = Syncer(cfg)
    signal.signal(signal.SIGTERM, lambda *_: syncer.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: syncer.stop_requested.set())
    # SIGUSR1: the learners are done; merge what is pending now and keep serving.
    signal.signal(signal.SIGUSR1, lambda *_: syncer.drain_requested.set())
    log.info(
        "syncer %s, shard %d of %d, owns fragments %s (plan %s)",
        syncer.syncer_id,
        syncer.shard,
        cfg.run.syncer_shards,
        syncer.owned,
        syncer.plan.plan_hash,
    )
    print("ready", flush=True)
    syncer.run()
