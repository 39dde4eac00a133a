"""Decoupled DiLoCo for any PyTorch model, in the user's own training loop.

    with DecoupledDiLoCo(model, url="zmq://syncer:5555", fragments=4,
                         sync_every=12, delta_codec="int4") as sync:
        for batch in loader:
            loss = ...; loss.backward(); opt.step(); opt.zero_grad()
            sync.step(weight=n)   # once per optimizer step; never waits on the network

Entering the context joins the run: it loads the current global model (or,
with ``load_global=False``, keeps the weights as given). ``step()`` then does
the three things decoupled DiLoCo adds to a training step: apply the globals
that arrived, hand the fragments that are due to the comm thread, send a
heartbeat. Leaving the context, even through an exception, sends the
remaining progress and stops the threads.

Decisions, each tested (``tests/test_library.py``):

* The inner optimizer's state is kept when a global overwrites the weights,
  as in DiLoCo: only parameter values change.
* Buffers (batch-norm statistics, ...) stay local; only parameters sync.
* Frozen parameters (``requires_grad=False``) are never sent or changed.
* Tied parameters (one tensor under two names) are sent once.
* A model wrapped in DistributedDataParallel (``module.`` prefixes) or
  compiled maps to the same plan as the bare model.
* Parameters on a GPU are copied to the CPU for sending and back when a
  global arrives; bf16 and fp16 parameters round-trip (deltas and globals
  travel as fp32 before the codec, so nothing is lost to the dtype on the wire).
* Under torchrun, rank 0 speaks for the group; the other ranks receive the
  globals by broadcast, so every rank must call ``step()`` at the same steps.
* With ``state_dir``, the step, tokens and incarnation are saved as the loop
  goes (and the optimizer's state, if ``optimizer`` is given), so a restarted
  learner resumes its schedule: ``start_step`` says where to go on from.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from broker.cli_config import dataclass_to_args
from broker.connect import connect_learner
from broker.errors import ConfigError, DdilocoError
from broker.fragments import FragmentPlan, synced_parameters
from broker.identity.keys import JOIN_SECRET, Identity, identity_path
from broker.run.initial_model import write_initial_model
from broker.run.key_folder import make_keys
from broker.run.settings import NO_BROKER, RunSettings
from broker.transport import LearnerTransport, TransportStats
from broker.wire.messages import Delta, Heartbeat
from learner.comm import CommThread, Decoded, DeltaEncoder, OutgoingDelta
from learner.config import LearnerSettings, SyncConfig
from learner.fragment_sync import FragmentSync, Stamp
from learner.group import TorchrunGroup
from learner.join import GlobalDecoder, join_snapshot
from learner.saved_state import SavedState
from learner.telemetry import LearnerMetrics, StepClock

log = logging.getLogger(__name__)

# Queued deltas of a small model cost little: keep at least this many bytes of them.
MIN_QUEUED_BYTES = 64 * 2**20
# The first step waits at most this long for the globals that arrived while the
# learner started to be decoded (a poll and its decoding: milliseconds, or about a
# second for the fragments of a large model).
_FIRST_ARRIVALS_TIMEOUT_S = 5.0


def _connect(
    run: RunSettings, plan: FragmentPlan, learner_id: str, incarnation: int, identity: Identity
) -> LearnerTransport:
    return connect_learner(
        run.url,
        run_id=run.run_id,
        learner_id=learner_id,
        incarnation=incarnation,
        num_fragments=run.fragments,
        syncer_shards=run.syncer_shards,
        max_message_bytes=plan.max_message_bytes,
        keys=run.run_keys("learner"),
        identity=identity,
    )


def _comm_thread(
    transport: LearnerTransport,
    decoder: GlobalDecoder,
    run: RunSettings,
    sync: SyncConfig,
    plan: FragmentPlan,
) -> CommThread:
    """The thread that encodes, sends and receives, started; it may queue
    ``max_queued_models`` models' worth of raw deltas (at least MIN_QUEUED_BYTES)."""
    comm = CommThread(
        transport,
        DeltaEncoder(run.delta_codec, sync.error_feedback),
        check=decoder.decode,
        max_queued_bytes=max(MIN_QUEUED_BYTES, int(sync.max_queued_models * 4 * plan.total_numel)),
    )
    comm.start()
    return comm


class DecoupledDiLoCo:
    """A learner's side of Decoupled DiLoCo around the user's model and loop.

    Keyword settings are the run's shared settings (:class:`~broker.run.settings.RunSettings`:
    ``fragments``, ``sync_every``, ``delta_codec``, ...), the learner's syncing
    options (:class:`~learner.config.SyncConfig`) and process options
    (:class:`~learner.config.ProcessConfig`), each by its own name; or
    ``settings``, all three typed (:class:`~learner.config.LearnerSettings`,
    which the CLI learner passes), with no url or keyword settings beside it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        url: str | None = None,
        *,
        learner_id: str = "learner-0",
        load_global: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        state_dir: str | None = None,
        metrics_port: int = 0,
        transport: LearnerTransport | None = None,
        settings: LearnerSettings | None = None,
        identity: Identity | None = None,
        **keywords: Any,
    ) -> None:
        if settings is None:
            settings = LearnerSettings.from_keywords(url=url or RunSettings.url, **keywords)
        elif url is not None or keywords:
            raise ConfigError("give settings= or the url and keyword settings, not both")
        self.run, self.sync_cfg, self.process = settings.run, settings.sync, settings.process
        self.model = model
        self.learner_id = learner_id
        self.load_global = load_global
        self.optimizer = optimizer
        self.group = TorchrunGroup()
        if self.sync_cfg.blocking and self.group.world > 1:
            raise ConfigError("blocking (synchronous DiLoCo) learners cannot run under torchrun")
        self.params = synced_parameters(model)
        self.plan = FragmentPlan.for_model(model, self.run.fragments, self.run.sync_every)
        self.fragments = FragmentSync(
            self.plan,
            self.run.overlap,
            self.sync_cfg.flush_before_overwrite,
            self.sync_cfg.keep_unsent,
        )
        # Every rank of a group resumes from what rank 0 saved; rank 0 alone writes.
        self.saved = SavedState(
            state_dir, learner_id, model, optimizer, keeps_weights=self.run.url == NO_BROKER
        )
        # Who this learner is to the syncers (docs/security.md): kept in its
        # home (broker.identity.keys.identity_path), made by the rank that connects.
        self.identity = identity
        self.start_step, self.tokens, last_incarnation = self.saved.load()
        # Strictly newer than any earlier incarnation even if the clock stepped
        # back: the syncer would take a lower one for a replay.
        self.incarnation = max(time.time_ns(), last_incarnation + 1)
        self.step_count = self.start_step
        self.seq = 0
        self.metrics = LearnerMetrics(
            metrics_port if self.group.leader else 0, self.run.metrics_host
        )
        self.syncing = self.run.url != NO_BROKER
        self.transport = transport
        self.comm: CommThread | None = None
        self.clock = StepClock()
        self.delivered = True
        self._closed = False
        # Fragments found non-finite and put back on a good global (see _non_finite).
        self.non_finite_restored = 0

    # -- joining and leaving ---------------------------------------------------
    def __enter__(self) -> DecoupledDiLoCo:
        try:
            self.join()
        except BaseException:
            # ``with`` calls no __exit__ when __enter__ raises: release the sockets
            # here (a ZeroMQ context left to the garbage collector can hang the
            # collecting thread). Progress is not saved: nothing was trained, and
            # the weights may not be restored yet.
            self._disconnect(flush_timeout_s=0.0)
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc is not None)

    def join(self) -> None:
        """Connect, load the current global model (unless told not to), start the
        comm thread. Called by ``with``."""
        if self.group.leader and self.syncing and self.transport is None:
            self.identity = self.identity or Identity.kept_in(
                identity_path(self.run.run_id, self.learner_id)
            )
            self.transport = _connect(self.run, self.plan, self.learner_id, self.incarnation,
                                      self.identity)  # fmt: skip
        arrived: list[tuple[int, Stamp, torch.Tensor]] = []
        decoder = GlobalDecoder(self.plan, self.transport)
        if self.transport is not None:
            # Weights that are already the current version (a learner starting
            # from the run's initial model) need not be downloaded.
            held = {p: self.plan.flatten(self.params, p) for p in range(self.plan.num_fragments)}
            arrived = join_snapshot(self.transport, decoder, self.process.join_timeout_s, held)
        for p, stamp, flat in self.group.share_globals(arrived, self.plan):
            if self.load_global:
                self._apply(p, stamp, flat, mix_alpha=0.0)
            else:
                # The weights as given stand in for this version: deltas measure
                # this learner's progress from them.
                self.fragments.apply(p, stamp, self.plan.flatten(self.params, p), self.params)
        self.saved.restore()
        if self.transport is not None:
            self.comm = _comm_thread(self.transport, decoder, self.run, self.sync_cfg, self.plan)
        self.save_progress()
        log.info(
            "learner %s joined at step %d (plan %s)",
            self.learner_id,
            self.start_step,
            self.plan.plan_hash,
        )

    def close(self, failed: bool = False) -> None:
        """Send every fragment's remaining progress, deliver what is queued (up to
        ``finish_timeout_s``), stop the comm thread, close the transport."""
        if self._closed:
            return
        self._closed = True
        if self.comm is not None:
            if failed:
                log.warning("learner %s: the loop failed; sending what it trained", self.learner_id)
            if self.comm.is_alive():
                for p in range(self.plan.num_fragments):
                    self._send(p, self.step_count)
        self._disconnect(flush_timeout_s=self.sync_cfg.finish_timeout_s)
        self.save_progress()

    def _disconnect(self, flush_timeout_s: float) -> None:
        """Deliver what is queued (up to the timeout), stop the comm thread, close
        the transport."""
        self._closed = True
        if self.comm is not None:
            self.delivered = self.comm.stop(flush_timeout_s=flush_timeout_s)
        # Never close sockets under a comm thread that still uses them.
        if self.transport is not None and (self.comm is None or not self.comm.is_alive()):
            self.transport.close()

    # -- the step ----------------------------------------------------------------
    def step(self, weight: int) -> None:
        """Call once after each optimizer step. ``weight``: what this step trained
        on in this process (tokens, or samples); under torchrun each rank passes
        its own and the group's is taken as world size times rank 0's."""
        self.clock.begin()
        self.step_count += 1
        step = self.step_count
        group_weight = int(weight) * self.group.world
        self.tokens += group_weight
        self.fragments.trained(group_weight)
        pause = self.sync_cfg.sync_pause_every
        sync_on = not pause or (step // pause) % 2 == 0
        if sync_on and self.syncing:
            if step == self.start_step + 1 and self.comm is not None:
                self.comm.wait_for_arrivals(_FIRST_ARRIVALS_TIMEOUT_S)
            self._apply_arrived(step)
            for p in self.plan.fragments_due(step):
                self._send(p, step)
                if self.sync_cfg.blocking and self.comm is not None:
                    self._wait_for_new_global(p)
        self.clock.end(sync_on)
        if self.comm is not None:
            if self.comm.error is not None:
                if isinstance(self.comm.error, DdilocoError):
                    raise self.comm.error  # the transport's own words (a TransportError, say)
                raise DdilocoError("the communication thread failed") from self.comm.error
            self.comm.heartbeat(
                Heartbeat(
                    run_id=self.run.run_id,
                    learner_id=self.learner_id,
                    incarnation=self.incarnation,
                    step=step,
                    tokens=self.tokens,
                    step_time_s=self.clock.last_step_s,
                    sent_at=time.time(),
                )
            )
        self.metrics.steps.inc()
        self.metrics.tokens.inc(group_weight)
        if step % self.run.sync_every == 0:
            self.save_progress()

    # -- globals in, deltas out ------------------------------------------------
    def _apply(self, p: int, stamp: Stamp, flat: torch.Tensor, mix_alpha: float) -> None:
        if not self.fragments.apply(p, stamp, flat, self.params, mix_alpha):
            self._non_finite(p, "the global taken as it is")
        self.metrics.version.labels(str(p)).set(stamp[1])

    def _non_finite(self, p: int, what: str) -> None:
        """Fragment ``p``'s own weights were not finite (its training blew up):
        counted, logged, and the optimizer's state of its parameters dropped
        (it saw the same values), so nothing non-finite stays behind."""
        self.non_finite_restored += 1
        log.warning(
            "learner %s: fragment %d's weights are not finite: %s (%d so far)",
            self.learner_id, p, what, self.non_finite_restored,
        )  # fmt: skip
        if self.optimizer is not None:
            names = {spec.name for spec in self.plan.fragment_specs(p)}
            for name, param in self.params.items():
                if name in names:
                    self.optimizer.state.pop(param, None)

    @property
    def globals_rejected(self) -> Counter[str]:
        """Globals refused by reason (malformed, of another plan)."""
        return self.comm.globals_rejected if self.comm is not None else Counter()

    def _take_new_globals(self) -> list[Decoded]:
        """The arrived globals this learner applies: newer than its base, or of a
        fragment the syncer refused a delta of (its base may be a version the
        syncer never published: it takes the syncer's global whatever its version).
        Decided on rank 0 and shared, so every rank applies the same."""
        arrived, forced = self.comm.take_globals() if self.comm else ([], set())
        new = [a for a in arrived if a[0] in forced or self.fragments.is_newer(a[0], a[1])]
        return self.group.share_globals(new, self.plan)

    def _apply_arrived(self, step: int) -> None:
        for p, stamp, flat in self._take_new_globals():
            if self.fragments.must_flush(p, step):
                self._send(p, step)
            self._apply(p, stamp, flat, self.sync_cfg.mix_alpha)
            self.metrics.globals_applied.inc()

    def _send(self, p: int, step: int) -> None:
        if not self.fragments.has_progress(p):
            return
        # Every rank of a group marks the progress as sent, rank 0 sends it: the
        # ranks then land the next global under the same unsent progress.
        delta = self.fragments.send(p, step, self.params)
        if delta is None:
            self.fragments.restore(p, self.params)
            self._non_finite(p, "put back on the last good global, nothing sent")
            return
        if not self.group.leader or self.comm is None:
            return
        self.seq += 1
        meta = Delta(
            run_id=self.run.run_id,
            learner_id=self.learner_id,
            incarnation=self.incarnation,
            seq=self.seq,
            fragment=p,
            plan_hash=self.plan.plan_hash,
            base_epoch=self.fragments.base_epoch[p],
            base_version=self.fragments.base_version[p],
            step=step,
            c_steps=self.fragments.c_steps[p],
            c_tokens=self.fragments.c_tokens[p],
            sent_at=time.time(),
        )
        self.comm.send_delta(OutgoingDelta(delta, meta))
        self.metrics.deltas_sent.inc()

    def _wait_for_new_global(self, p: int, timeout_s: float = 60.0) -> None:
        """Synchronous DiLoCo only: block until fragment p moved past our base."""
        assert self.comm is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p_new, stamp, flat in self._take_new_globals():
                self._apply(p_new, stamp, flat, mix_alpha=self.sync_cfg.mix_alpha)
            if self.fragments.c_steps[p] == 0:
                return
            time.sleep(0.002)
        log.warning("fragment %d: no new global within %.0fs; continuing", p, timeout_s)

    def save_progress(self) -> None:
        """Write what a restart resumes from (:class:`~learner.saved_state.SavedState`);
        rank 0 writes for its group."""
        if self.group.leader:
            self.saved.save(self.step_count, self.tokens, self.incarnation)

    # -- what happened -----------------------------------------------------------------
    @property
    def stats(self) -> TransportStats:
        return self.transport.stats if self.transport is not None else TransportStats()

    @property
    def dropped(self) -> int:
        return self.comm.dropped if self.comm is not None else 0

    @property
    def queued(self) -> tuple[int, int]:
        """(raw bytes of deltas the comm thread holds, deltas the transport holds
        unacknowledged): the two queues a network outage fills, each bounded."""
        if self.comm is None:
            return 0, 0
        return self.comm.queued_bytes, self.comm.transport.unacked


def load_global_model(
    model: torch.nn.Module, url: str = RunSettings.url, **settings: Any
) -> list[int]:
    """Load the current global model into ``model`` without taking part in the run
    (nothing is sent); returns each fragment's version. For evaluation."""
    given = LearnerSettings.from_keywords(url=url, **settings)
    run, process = given.run, given.process
    plan = FragmentPlan.for_model(model, run.fragments, run.sync_every)
    params = synced_parameters(model)
    fragments = FragmentSync(plan, run.overlap, flush_before_overwrite=False, keep_unsent=False)
    transport = connect_learner(
        run.url,
        run_id=run.run_id,
        learner_id="reader",
        incarnation=time.time_ns(),
        num_fragments=run.fragments,
        syncer_shards=run.syncer_shards,
        max_message_bytes=plan.max_message_bytes,
        keys=run.run_keys("reader"),
        role="reader",
    )
    try:
        decoder = GlobalDecoder(plan, transport)
        for p, stamp, flat in join_snapshot(transport, decoder, process.join_timeout_s):
            fragments.apply(p, stamp, flat, params)
    finally:
        transport.close()
    return fragments.versions()


def save_initial_model(model: torch.nn.Module, path: str | Path, **settings: Any) -> FragmentPlan:
    """Write ``model`` as a run's initial global model (what ``ddiloco init`` does
    for the built-in workloads); a syncer started on this file needs no model class."""
    run = LearnerSettings.from_keywords(**settings).run
    plan = FragmentPlan.for_model(model, run.fragments, run.sync_every)
    write_initial_model(Path(path), plan, synced_parameters(model))
    return plan


@contextmanager
def local_syncer(
    model: torch.nn.Module, url: str, workdir: str | Path, **settings: Any
) -> Iterator[subprocess.Popen[bytes]]:
    """A syncer process (``python -m syncer``) on this machine for ``model``, for trying the
    library without a cluster: writes the initial model into ``workdir``, starts
    the syncer, waits until it serves, and stops it on leaving (after merging
    what is pending). ``settings`` are the run settings the learners use too;
    the run's key folder (``keys``) is made there first when it holds none,
    so learners given the same settings enroll without another step."""
    run = LearnerSettings.from_keywords(url=url, **settings).run
    folder = Path(workdir)
    initial = folder / "initial-model.safetensors"
    save_initial_model(model, initial, **settings)
    if not run.insecure and not (Path(run.keys) / JOIN_SECRET).exists():
        make_keys(run.keys)
    served = dataclasses.replace(run, initial_model=str(initial))
    cmd = [sys.executable, "-m", "syncer", *dataclass_to_args(served)]
    cmd += [
        f"--checkpoint-dir={folder / 'checkpoint'}",
        f"--metrics-file={folder / 'syncer.jsonl'}",
        # Its learners start once it serves: none holds a global to take back.
        "--recall-s=0",
    ]
    log_file = open(folder / "syncer.log", "ab")  # noqa: SIM115 (closed below)
    syncer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file)
    try:
        assert syncer.stdout is not None
        if syncer.stdout.readline().strip() != b"ready":
            raise DdilocoError(f"the syncer did not start; see {folder / 'syncer.log'}")
        yield syncer
    finally:
        if syncer.poll() is None:
            syncer.send_signal(signal.SIGTERM)  # merges what is pending, then exits
            try:
                syncer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                syncer.kill()
        log_file.close()
