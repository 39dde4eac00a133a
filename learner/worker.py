"""The built-in learner: a training loop around a workload, synced by the library.

Reads top to bottom like a plain training loop. Everything Decoupled DiLoCo
adds is one call per step, ``sync.step(weight)``, on the same
:class:`~learner.library.DecoupledDiLoCo` object that users put in their own
loops; this file adds only what a service needs around it: the learning-rate
schedule, progress events, and held-out evaluation when there is no syncer
(data parallel).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (a first optimizer imports it: seconds, here with the rest)

from broker.files import EventLog
from broker.identity.keys import Identity
from broker.runtime import freeze_startup_heap
from learner.config import LearnerConfig, LearnerSettings, TrainConfig
from learner.evaluator import DeferredEvaluations
from learner.group import TorchrunGroup
from learner.library import DecoupledDiLoCo
from learner.telemetry import ProgressFile
from learner.workload import Workload, WorkloadContext, load_workload

log = logging.getLogger(__name__)
IMPORTED_AT = time.time()  # this process has its imports (torch): what a restart waits for first


class SlowHardware:
    """Paces steps as on hardware ``factor`` times slower than this machine at its
    best: a step lasts at least ``factor`` times the fastest compute seen so far.

    Not ``factor`` times this step's own compute: a process frozen mid-step
    (SIGSTOP, a paused VM) would then sleep ``factor`` times the freeze. Nor a
    running mean: a CPU that idled computes the next step slower, so each sleep
    would lengthen the next one until the pace settles far below the factor.
    """

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.fastest_s = math.inf

    def rest_s(self, compute_s: float) -> float:
        """How long to sleep after a step that computed for ``compute_s``."""
        self.fastest_s = min(self.fastest_s, compute_s)
        return max(0.0, self.factor * self.fastest_s - compute_s)


def lr_at(step: int, train: TrainConfig, steps: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = min(1.0, (step - train.warmup_steps) / max(1, steps - train.warmup_steps))
    floor = train.lr * train.min_lr_ratio
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * progress))


def inner_optimizer(model: torch.nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (its lr is set each step by lr_at)."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=train.lr,
        weight_decay=train.weight_decay,
        betas=(0.9, 0.95),
    )


def inner_step(
    workload: Workload,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    train: TrainConfig,
    lr: float,
    reduce_grads: Callable[[torch.nn.Module], None] | None = None,
) -> torch.Tensor:
    """One optimizer step of the workload's model on ``batch`` at learning rate
    ``lr``; ``reduce_grads`` (data parallel) runs between backward and clipping.
    Returns the batch's loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = workload.loss(workload.model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if reduce_grads is not None:
        reduce_grads(workload.model)
    if train.grad_clip:
        torch.nn.utils.clip_grad_norm_(workload.model.parameters(), train.grad_clip)
    optimizer.step()
    return loss


class Learner:
    def __init__(self, cfg: LearnerConfig, identity: Identity | None = None) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.process.torch_threads)
        self.group = TorchrunGroup()
        # Where a restarted learner goes on from decides its data order.
        start_step, _, _ = ProgressFile(cfg.state_dir, cfg.learner_id).load()
        self.workload = load_workload(
            WorkloadContext(
                cfg.workload,
                shard=cfg.shard * self.group.world + self.group.rank,
                num_shards=cfg.num_shards * self.group.world,
                start_step=start_step,
                train=cfg.train,
                eval=cfg.eval,
            )
        )
        self.model = self.workload.model
        # Set from a signal handler (``docker stop``): end after this step, as at the last one.
        self.stop_requested = threading.Event()
        self.optimizer = inner_optimizer(self.model, cfg.train)
        self.sync = DecoupledDiLoCo(
            self.model,
            learner_id=cfg.learner_id,
            optimizer=self.optimizer if cfg.resume_optimizer else None,
            state_dir=cfg.state_dir,
            metrics_port=cfg.metrics_port,
            settings=LearnerSettings(cfg.run, cfg.sync, cfg.process),
            identity=identity,
        )
        self.events = EventLog(
            cfg.metrics_file if self.group.leader else None,
            learner=cfg.learner_id,
            incarnation=self.sync.incarnation,
        )
        self.deferred = DeferredEvaluations() if cfg.eval.eval_deferred else None
        # Built and about to join: what a restart spends before this (interpreter,
        # imports, model) and after it (joining, to 'start') are told apart.
        self.events.write("ready", step=self.sync.start_step, imported=IMPORTED_AT)

    def _evaluate(self, step: int, final: bool = False) -> None:
        """Without a syncer (data parallel) the learner reports the held-out loss
        itself: at once, or with ``eval_deferred`` (except the final one) from a
        copy of the model, evaluated before the final one."""
        workload = self.workload
        if self.sync.syncing or not self.group.leader or workload.evaluate is None:
            return
        if self.deferred is not None:
            if not final:
                self.deferred.keep(self.model, step=step, tokens=self.sync.tokens)
                return
            self.deferred.evaluate_all(self.model, workload.evaluation, self.events)
        self.events.write(
            "eval", step=step, tokens=self.sync.tokens, **workload.evaluation(self.model)
        )

    def run(self) -> dict[str, Any]:
        cfg, sync, steps = self.cfg, self.sync, self.cfg.run.steps
        loss_value = float("nan")
        with sync:
            if sync.start_step == 0:  # the curve's first point; a restart goes on with it
                self._evaluate(sync.start_step)
            freeze_startup_heap()  # built and joined: what lives from here on is the run's
            self.events.write("start", step=sync.start_step)
            log.info("learner %s starts at step %d of %d", cfg.learner_id, sync.start_step, steps)
            window_start, window_steps = time.perf_counter(), 0
            pace = SlowHardware(cfg.slowdown)
            last_step = sync.start_step
            for step in range(sync.start_step + 1, steps + 1):
                last_step = step
                t0 = time.perf_counter()
                batch = next(self.workload.batches)
                loss = inner_step(
                    self.workload,
                    self.optimizer,
                    batch,
                    cfg.train,
                    lr_at(step - 1, cfg.train, steps),
                    self.group.allreduce_grads,
                )
                compute_s = time.perf_counter() - t0
                time.sleep(pace.rest_s(compute_s))
                # Decoupled DiLoCo: take what arrived, send what is due, never wait.
                sync.step(weight=self.workload.weight(batch))
                window_steps += 1
                loss_value = loss.item()
                if step % cfg.log_every == 0 or step == steps:
                    elapsed = time.perf_counter() - window_start
                    rate = window_steps / elapsed if elapsed > 0 else 0.0
                    sync.metrics.step_rate.set(rate)
                    sync.metrics.bytes_up.set(sync.stats.bytes_sent)
                    sync.metrics.bytes_down.set(sync.stats.bytes_received)
                    self.events.write(
                        "step",
                        step=step,
                        loss=loss_value,
                        tokens=sync.tokens,
                        steps_per_s=rate,
                        lr=lr_at(step - 1, cfg.train, steps),
                        compute_s=compute_s,
                        step_s=sync.clock.last_step_s,
                        bytes_sent=sync.stats.bytes_sent,
                        bytes_received=sync.stats.bytes_received,
                        versions=sync.fragments.versions(),
                        queued_bytes=sync.queued[0],
                        unacked=sync.queued[1],
                    )
                    sync.save_progress()
                    window_start, window_steps = time.perf_counter(), 0
                if cfg.eval.eval_every and step % cfg.eval.eval_every == 0 and step != steps:
                    self._evaluate(step)
                if self.group.anyone(self.stop_requested.is_set()):
                    log.info("learner %s stops at step %d of %d", cfg.learner_id, step, steps)
                    sync.save_progress()
                    break
            self.events.write("train_end", step=last_step)
            self._evaluate(last_step, final=True)
        # Leaving the context sent the remaining progress and stopped the comm thread.
        result = {
            "steps": last_step,
            "stopped_early": last_step < steps,
            "tokens": sync.tokens,
            "final_train_loss": loss_value,
            "bytes_sent": sync.stats.bytes_sent,
            "bytes_received": sync.stats.bytes_received,
            "delivered": sync.delivered,
            "dropped": sync.dropped,
            "ranks": self.group.world,
            "ranks_consistent": self.group.consistent(self.model),
            "globals_rejected": dict(sync.globals_rejected),
            "deltas_refused": dict(sync.stats.refused),  # by the syncer, by reason
            "broker_out_of_memory": sync.stats.out_of_memory,  # refusals waited out
            "steps_per_s_sync_on": sync.clock.steps_per_s(True),
            "steps_per_s_sync_off": sync.clock.steps_per_s(False),
        }
        self.events.write("done", **result)
        self.group.close()
        self.events.close()
        return result
