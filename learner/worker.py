"""The learner: trains on its shard and never waits for the network.

Reads top to bottom like a plain training loop; the decoupled-DiLoCo parts
are three small additions per step: apply globals that arrived, send the
fragments that are due, send a heartbeat. All network work happens on the
comm thread (:mod:`learner.comm`); the per-fragment bookkeeping is pure
(:mod:`learner.fragment_sync`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter as Tally
from typing import Any

import torch

from broker.connect import connect_learner
from broker.files import EventLog
from broker.fragments import FragmentPlan
from broker.settings import NO_BROKER
from broker.transport import LearnerTransport
from broker.wire import Delta, GlobalFragment, Heartbeat, WireError
from learner.comm import CommThread, DeltaEncoder, OutgoingDelta
from learner.config import LearnerConfig, TrainConfig
from learner.data import BatchSampler, eval_batches, evaluate, load_corpus
from learner.fragment_sync import FragmentSync
from learner.group import TorchrunGroup
from learner.telemetry import LearnerMetrics, ProgressFile
from learner.workload import build_model

log = logging.getLogger(__name__)


def lr_at(step: int, train: TrainConfig, steps: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, steps - train.warmup_steps))
    floor = train.lr * train.min_lr_ratio
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * progress))


def decode_global(g: GlobalFragment, plan: FragmentPlan) -> tuple[int, int, torch.Tensor] | str:
    """(fragment, version, weights) of a global that fits ``plan``, else why not."""
    if g.plan_hash != plan.plan_hash:
        return "wrong_plan"
    if g.fragment >= plan.num_fragments or g.numel != plan.fragment_numel(g.fragment):
        return "bad_shape"
    try:
        flat = g.tensor()
    except WireError as e:
        return e.reason
    if not torch.isfinite(flat).all():
        return "non_finite"
    return g.fragment, g.version, flat


def join_snapshot(
    transport: LearnerTransport, plan: FragmentPlan, timeout_s: float
) -> list[tuple[int, int, torch.Tensor]]:
    """Every fragment of the current global model, for joining or rejoining."""
    deadline = time.monotonic() + timeout_s
    wanted = list(range(plan.num_fragments))
    got: dict[int, GlobalFragment] = {}
    while len(got) < len(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no snapshot of fragments {sorted(set(wanted) - got.keys())} within "
                f"{timeout_s}s: is the syncer running and reachable?"
            )
        got.update(transport.snapshot([p for p in wanted if p not in got], timeout_s=2.0))
        if len(got) < len(wanted):
            time.sleep(0.2)  # the syncer has not published those fragments yet
    arrived = []
    for g in got.values():
        if g.plan_hash != plan.plan_hash:
            raise ValueError(
                f"the syncer's model plan {g.plan_hash} differs from this learner's "
                f"{plan.plan_hash}: use the same model, --fragments and --sync-every "
                "as `ddiloco init`"
            )
        decoded = decode_global(g, plan)
        if isinstance(decoded, str):
            raise ValueError(f"the syncer's snapshot of fragment {g.fragment} is bad: {decoded}")
        arrived.append(decoded)
    return arrived


class Learner:
    def __init__(self, cfg: LearnerConfig, transport: LearnerTransport | None = None) -> None:
        self.cfg = cfg
        run = cfg.run
        torch.set_num_threads(cfg.process.torch_threads)
        self.group = TorchrunGroup()
        self.syncing = run.url != NO_BROKER
        if cfg.blocking and self.group.world > 1:
            raise ValueError("blocking (synchronous DiLoCo) learners cannot run under torchrun")
        self.model = build_model(cfg.workload)  # same initial weights on every rank and mode
        self.plan = FragmentPlan.for_model(self.model, run.fragments, run.sync_every)
        self.params = dict(self.model.named_parameters())
        self.fragments = FragmentSync(self.plan, run.overlap, cfg.sync.flush_before_overwrite)
        self.progress = ProgressFile(cfg.state_dir if self.group.leader else None, cfg.learner_id)
        self.start_step, self.tokens, last_incarnation = self.progress.load()
        # Strictly newer than any earlier incarnation even if the clock stepped
        # back: the syncer would take a lower one for a replay.
        self.incarnation = max(time.time_ns(), last_incarnation + 1)
        model_cfg = cfg.workload.model
        corpus = load_corpus(cfg.workload.data, model_cfg.vocab_size, model_cfg.seq_len)
        self.eval_set = eval_batches(
            corpus.val, model_cfg.seq_len, cfg.eval.eval_batch_size, cfg.eval.eval_batches
        )
        shard = cfg.shard * self.group.world + self.group.rank
        self.sampler = BatchSampler(
            corpus.train,
            model_cfg.seq_len,
            cfg.train.batch_size,
            shard,
            cfg.num_shards * self.group.world,
            seed=cfg.workload.seed * 100_003 + shard + 7919 * self.start_step,
        )
        self.tokens_per_step = cfg.train.batch_size * model_cfg.seq_len * self.group.world
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            betas=(0.9, 0.95),
        )
        self.seq = 0
        self.globals_rejected: Tally[str] = Tally()
        self.phase_time = {True: 0.0, False: 0.0}  # seconds spent in steps with sync on / off
        self.phase_steps = {True: 0, False: 0}
        self.comm: CommThread | None = None
        self.metrics = LearnerMetrics(cfg.metrics_port if self.group.leader else 0)
        self.events = EventLog(
            cfg.metrics_file if self.group.leader else None,
            learner=cfg.learner_id,
            incarnation=self.incarnation,
        )
        self.transport: LearnerTransport | None = None
        if self.group.leader and self.syncing:
            self.transport = transport or connect_learner(
                run.url,
                run_id=run.run_id,
                learner_id=cfg.learner_id,
                incarnation=self.incarnation,
                num_fragments=run.fragments,
            )

    # -- globals ------------------------------------------------------------------
    def join(self) -> None:
        """Load every fragment of the current global model before training."""
        arrived = []
        if self.transport is not None:
            arrived = join_snapshot(self.transport, self.plan, self.cfg.process.join_timeout_s)
        for p, version, flat in self.group.share_globals(arrived, self.plan):
            self._apply(p, version, flat, mix_alpha=0.0)

    def _apply(self, p: int, version: int, flat: torch.Tensor, mix_alpha: float) -> None:
        self.fragments.apply(p, version, flat, self.params, mix_alpha)
        self.metrics.version.labels(str(p)).set(version)

    def _decode(self, g: GlobalFragment) -> tuple[int, int, torch.Tensor] | None:
        """Validate a global against this learner's plan; None (and counted) if bad."""
        decoded = decode_global(g, self.plan)
        if isinstance(decoded, str):
            self.globals_rejected[decoded] += 1
            log.warning("refused global %d v%d: %s", g.fragment, g.version, decoded)
            return None
        return decoded

    def _apply_arrived(self, step: int) -> None:
        arrived = [self._decode(g) for g in self.comm.take_globals()] if self.comm else []
        shared = self.group.share_globals([a for a in arrived if a is not None], self.plan)
        for p, version, flat in shared:
            if self.fragments.is_newer(p, version):
                if self.fragments.must_flush(p, step):
                    self._send(p, step)
                self._apply(p, version, flat, self.cfg.sync.mix_alpha)
                self.metrics.globals_applied.inc()

    def _send(self, p: int, step: int) -> None:
        if not self.fragments.has_progress(p) or not self.group.leader or self.comm is None:
            return
        self.seq += 1
        self.fragments.sent(p, step)
        meta = Delta(
            run_id=self.cfg.run.run_id,
            learner_id=self.cfg.learner_id,
            incarnation=self.incarnation,
            seq=self.seq,
            fragment=p,
            plan_hash=self.plan.plan_hash,
            base_version=self.fragments.base_version[p],
            step=step,
            c_steps=self.fragments.c_steps[p],
            c_tokens=self.fragments.c_tokens[p],
            sent_at=time.time(),
        )
        self.comm.send_delta(OutgoingDelta(self.fragments.delta(p, self.params), meta))
        self.metrics.deltas_sent.inc()

    def _wait_for_new_global(self, p: int, timeout_s: float = 60.0) -> None:
        """Synchronous DiLoCo only: block until fragment p moved past our base."""
        assert self.comm is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for g in self.comm.take_globals():
                decoded = self._decode(g)
                if decoded is not None and self.fragments.is_newer(decoded[0], decoded[1]):
                    self._apply(*decoded, mix_alpha=self.cfg.sync.mix_alpha)
            if self.fragments.c_steps[p] == 0:
                return
            time.sleep(0.002)
        log.warning("fragment %d: no new global within %.0fs; continuing", p, timeout_s)

    # -- the loop ---------------------------------------------------------------
    def _evaluate(self, step: int) -> None:
        """Without a syncer (data parallel) the learner reports the held-out loss itself."""
        if not self.syncing and self.group.leader:
            loss = evaluate(self.model, self.eval_set)
            self.events.write("eval", step=step, loss=loss, tokens=self.tokens)

    def run(self) -> dict[str, Any]:
        cfg, steps = self.cfg, self.cfg.run.steps
        if self.syncing:
            self.join()
        else:
            self._evaluate(self.start_step)
        if self.transport is not None:
            encoder = DeltaEncoder(cfg.run.delta_codec, cfg.sync.error_feedback)
            self.comm = CommThread(self.transport, encoder)
            self.comm.start()
        self.events.write("start", step=self.start_step)
        self.progress.save(self.start_step, self.tokens, self.incarnation)
        log.info("learner %s starts at step %d of %d", cfg.learner_id, self.start_step, steps)
        window_start, window_steps = time.perf_counter(), 0
        loss_value = float("nan")
        for step in range(self.start_step + 1, steps + 1):
            t0 = time.perf_counter()
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(step - 1, cfg.train, steps)
            x, y = self.sampler.next()
            loss = self.model(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.group.allreduce_grads(self.model)
            if cfg.train.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip)
            self.optimizer.step()
            compute_s = time.perf_counter() - t0
            if cfg.slowdown > 1:
                time.sleep(compute_s * (cfg.slowdown - 1))  # emulate slower hardware
            self.tokens += self.tokens_per_step
            self.fragments.trained(self.tokens_per_step)

            # Decoupled DiLoCo: take what arrived, send what is due, never wait.
            pause = cfg.sync.sync_pause_every
            sync_on = not pause or (step // pause) % 2 == 0
            if sync_on:
                self._apply_arrived(step)
                for p in self.plan.fragments_due(step):
                    self._send(p, step)
                    if cfg.blocking and self.comm is not None:
                        self._wait_for_new_global(p)
            step_s = time.perf_counter() - t0
            self.phase_time[sync_on] += step_s
            self.phase_steps[sync_on] += 1
            if self.comm is not None:
                if self.comm.error is not None:
                    raise RuntimeError("comm thread failed") from self.comm.error
                self.comm.heartbeat(
                    Heartbeat(
                        run_id=cfg.run.run_id,
                        learner_id=cfg.learner_id,
                        incarnation=self.incarnation,
                        step=step,
                        tokens=self.tokens,
                        step_time_s=step_s,
                        sent_at=time.time(),
                    )
                )
            self.metrics.steps.inc()
            self.metrics.tokens.inc(self.tokens_per_step)
            window_steps += 1
            loss_value = loss.item()
            if step % cfg.log_every == 0 or step == steps:
                elapsed = time.perf_counter() - window_start
                rate = window_steps / elapsed if elapsed > 0 else 0.0
                self.metrics.step_rate.set(rate)
                stats = self.transport.stats if self.transport is not None else None
                if stats is not None:
                    self.metrics.bytes_up.set(stats.bytes_sent)
                    self.metrics.bytes_down.set(stats.bytes_received)
                self.events.write(
                    "step",
                    step=step,
                    loss=loss_value,
                    tokens=self.tokens,
                    steps_per_s=rate,
                    lr=lr_at(step - 1, cfg.train, steps),
                    compute_s=compute_s,
                    step_s=step_s,
                    bytes_sent=stats.bytes_sent if stats else 0,
                    bytes_received=stats.bytes_received if stats else 0,
                    versions=self.fragments.versions(),
                )
                self.progress.save(step, self.tokens, self.incarnation)
                window_start, window_steps = time.perf_counter(), 0
            if cfg.eval.eval_every and step % cfg.eval.eval_every == 0 and step != steps:
                self._evaluate(step)
        self.events.write("train_end", step=steps)
        self._evaluate(steps)
        return self.finish(loss_value)

    def _rate(self, sync_on: bool) -> float | None:
        seconds = self.phase_time[sync_on]
        return self.phase_steps[sync_on] / seconds if seconds > 0 else None

    def finish(self, loss_value: float) -> dict[str, Any]:
        """Send every fragment's remaining progress, deliver what is queued, stop."""
        delivered = True
        if self.comm is not None:
            for p in range(self.cfg.run.fragments):
                self._send(p, self.cfg.run.steps)
            delivered = self.comm.stop(flush_timeout_s=self.cfg.sync.finish_timeout_s)
        stats = self.transport.stats if self.transport is not None else None
        result = {
            "steps": self.cfg.run.steps,
            "tokens": self.tokens,
            "final_train_loss": loss_value,
            "bytes_sent": stats.bytes_sent if stats else 0,
            "bytes_received": stats.bytes_received if stats else 0,
            "delivered": delivered,
            "dropped": self.comm.dropped if self.comm else 0,
            "ranks": self.group.world,
            "ranks_consistent": self.group.consistent(self.model),
            "globals_rejected": dict(self.globals_rejected),
            "steps_per_s_sync_on": self._rate(True),
            "steps_per_s_sync_off": self._rate(False),
        }
        self.events.write("done", **result)
        # Never close sockets under a comm thread that still uses them.
        if self.transport is not None and (self.comm is None or not self.comm.is_alive()):
            self.transport.close()
        self.group.close()
        self.events.close()
        return result
