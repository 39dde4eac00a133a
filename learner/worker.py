"""The learner: trains on its shard and never waits for the network.

Reads top to bottom like a plain training loop; the decoupled-DiLoCo parts
are three small additions per step: apply globals that arrived, send the
fragments that are due, send a heartbeat. All network work happens on the
comm thread (:mod:`learner.comm`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter as Tally
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from broker.codecs import Codec
from broker.transport import LearnerTransport
from broker.wire import Delta, GlobalFragment, Heartbeat, WireError
from learner.comm import CommThread, OutgoingDelta, connect_learner
from learner.config import LearnerConfig
from learner.data import BatchSampler, eval_batches, evaluate, load_corpus
from learner.fragments import FragmentPlan
from learner.model import GPT
from syncer.checkpoint import atomic_write

log = logging.getLogger(__name__)


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


class _Group:
    """A learner that is itself a torch.distributed group: rank 0 speaks for it."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share_globals(
        self, arrived: list[tuple[int, int, torch.Tensor]], plan: FragmentPlan
    ) -> list[tuple[int, int, torch.Tensor]]:
        """(fragment, version, weights) that every rank applies this step."""
        if self.world == 1:
            return arrived
        header = torch.full((plan.num_fragments,), -1, dtype=torch.int64)
        if self.leader:
            for p, version, _ in arrived:
                header[p] = version
        dist.broadcast(header, 0)
        by_fragment = {p: flat for p, _, flat in arrived}
        out = []
        for p in range(plan.num_fragments):
            if header[p] < 0:
                continue
            flat = by_fragment[p] if self.leader else torch.empty(plan.fragment_numel(p))
            dist.broadcast(flat, 0)
            out.append((p, int(header[p]), flat))
        return out

    def allreduce_grads(self, model: torch.nn.Module) -> None:
        if self.world == 1:
            return
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= self.world

    def consistent(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds bit-identical weights (they must, always)."""
        if self.world == 1:
            return True
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return bool(torch.equal(lo, hi))

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            # Tear down together: a rank that destroys its group while a peer's
            # gloo threads still talk to it can abort ("terminate called ...").
            dist.barrier()
            dist.destroy_process_group()


class _Metrics:
    def __init__(self, port: int) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("ddiloco_learner_steps", "Inner steps", registry=r)
        self.tokens = Counter("ddiloco_learner_tokens", "Tokens trained on", registry=r)
        self.step_rate = Gauge("ddiloco_learner_steps_per_second", "Recent step rate", registry=r)
        self.deltas_sent = Counter(
            "ddiloco_learner_deltas_sent", "Deltas handed to the comm thread", registry=r
        )
        self.globals_applied = Counter(
            "ddiloco_learner_globals_applied", "Globals applied", registry=r
        )
        self.bytes_up = Gauge("ddiloco_learner_bytes_sent", "Bytes sent on the wire", registry=r)
        self.bytes_down = Gauge(
            "ddiloco_learner_bytes_received", "Bytes received on the wire", registry=r
        )
        self.version = Gauge(
            "ddiloco_learner_fragment_version", "Base version", ["fragment"], registry=r
        )
        if port:
            start_http_server(port, registry=r)


class Learner:
    def __init__(self, cfg: LearnerConfig, transport: LearnerTransport | None = None) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.torch_threads)
        self.group = _Group()
        self.syncing = cfg.transport != "none"
        torch.manual_seed(cfg.seed)  # same initial weights on every rank and in every mode
        self.model = GPT(cfg.model)
        self.plan = FragmentPlan.for_model(self.model, cfg.fragments, cfg.sync_every)
        self.params = dict(self.model.named_parameters())
        self.start_step, start_tokens, last_incarnation = self._load_progress()
        # Strictly newer than any earlier incarnation even if the clock stepped
        # back: the syncer would take a lower one for a replay.
        self.incarnation = max(time.time_ns(), last_incarnation + 1)
        if cfg.blocking and self.group.world > 1:
            raise ValueError("blocking (synchronous DiLoCo) learners cannot run under torchrun")
        corpus = load_corpus(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)
        self.eval_set = eval_batches(corpus.val, cfg.model.seq_len, 16, 8)
        shard = cfg.shard * self.group.world + self.group.rank
        self.sampler = BatchSampler(
            corpus.train,
            cfg.model.seq_len,
            cfg.batch_size,
            shard,
            cfg.num_shards * self.group.world,
            seed=cfg.seed * 100_003 + shard + 7919 * self.start_step,
        )
        self.tokens_per_step = cfg.batch_size * cfg.model.seq_len * self.group.world
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95)
        )
        self.base: dict[int, torch.Tensor] = {}  # the global each fragment started from
        self.base_version: dict[int, int] = {}
        self.c_steps = [0] * cfg.fragments
        self.c_tokens = [0] * cfg.fragments
        self.seq = 0
        self.last_sent_step: dict[int, int] = {}
        self.globals_rejected: Tally[str] = Tally()
        self.tokens = start_tokens
        self.phase_time = {True: 0.0, False: 0.0}  # seconds spent in steps with sync on / off
        self.phase_steps = {True: 0, False: 0}
        self.comm: CommThread | None = None
        self.metrics = _Metrics(cfg.metrics_port if self.group.leader else 0)
        self._events: TextIO | None = None
        if cfg.metrics_file and self.group.leader:
            Path(cfg.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._events = open(cfg.metrics_file, "a", buffering=1)  # noqa: SIM115
        self.transport: LearnerTransport | None = None
        if self.group.leader and self.syncing:
            self.transport = transport or connect_learner(cfg, self.incarnation)

    # -- progress file ----------------------------------------------------------
    def _progress_path(self) -> Path | None:
        return (
            Path(self.cfg.state_dir) / f"{self.cfg.learner_id}.json" if self.cfg.state_dir else None
        )

    def _load_progress(self) -> tuple[int, int, int]:
        """(step, tokens, incarnation) of this learner's previous incarnation."""
        path = self._progress_path()
        if path is None or not path.exists():
            return 0, 0, 0
        saved = json.loads(path.read_text())
        return int(saved["step"]), int(saved["tokens"]), int(saved.get("incarnation", 0))

    def _save_progress(self, step: int) -> None:
        path = self._progress_path()
        if path is not None and self.group.leader:
            progress = {"step": step, "tokens": self.tokens, "incarnation": self.incarnation}
            atomic_write(path, json.dumps(progress).encode())

    def event(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "event": kind,
                        "learner": self.cfg.learner_id,
                        "incarnation": self.incarnation,
                        **fields,
                    }
                )
                + "\n"
            )

    # -- globals ------------------------------------------------------------------
    def join(self) -> None:
        """Load every fragment of the current global model before training."""
        arrived: list[tuple[int, int, torch.Tensor] | None] = []
        if self.transport is not None:
            deadline = time.monotonic() + self.cfg.join_timeout_s
            wanted = list(range(self.cfg.fragments))
            got: dict[int, GlobalFragment] = {}
            while len(got) < len(wanted):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no snapshot of fragments {sorted(set(wanted) - got.keys())} within "
                        f"{self.cfg.join_timeout_s}s: is the syncer running and reachable?"
                    )
                got.update(
                    self.transport.snapshot([p for p in wanted if p not in got], timeout_s=2.0)
                )
                if len(got) < len(wanted):
                    time.sleep(0.2)  # the syncer has not published those fragments yet
            for g in got.values():
                if g.plan_hash != self.plan.plan_hash:
                    raise ValueError(
                        f"the syncer's model plan {g.plan_hash} differs from this learner's "
                        f"{self.plan.plan_hash}: use the same model, --fragments and --sync-every"
                    )
            arrived = [self._decode_global(g) for g in got.values()]
            if any(a is None for a in arrived):
                raise ValueError("the syncer's snapshot does not decode; see the log")
        ready = [a for a in arrived if a is not None]
        for p, version, flat in self.group.share_globals(ready, self.plan):
            self._apply(p, version, flat, mix_alpha=0.0)

    def _apply(self, p: int, version: int, flat: torch.Tensor, mix_alpha: float) -> None:
        with torch.no_grad():
            for name, tensor in self.plan.unflatten(flat, p).items():
                param = self.params[name]
                if mix_alpha:
                    param.mul_(mix_alpha).add_(tensor, alpha=1 - mix_alpha)
                else:
                    param.copy_(tensor)
        self.base[p] = flat.clone()
        self.base_version[p] = version
        self.c_steps[p] = 0
        self.c_tokens[p] = 0
        self.metrics.version.labels(str(p)).set(version)

    def _decode_global(self, g: GlobalFragment) -> tuple[int, int, torch.Tensor] | None:
        """Validate a global against this learner's plan; None (and counted) if bad."""
        reason = None
        if g.plan_hash != self.plan.plan_hash:
            reason = "wrong_plan"
        elif g.fragment >= self.cfg.fragments or g.numel != self.plan.fragment_numel(g.fragment):
            reason = "bad_shape"
        else:
            try:
                flat = g.tensor()
            except WireError as e:
                reason = e.reason
            else:
                if torch.isfinite(flat).all():
                    return g.fragment, g.version, flat
                reason = "non_finite"
        self.globals_rejected[reason] += 1
        log.warning("refused global %d v%d: %s", g.fragment, g.version, reason)
        return None

    def _apply_arrived(self, step: int) -> None:
        arrived = [self._decode_global(g) for g in self.comm.take_globals()] if self.comm else []
        shared = self.group.share_globals([a for a in arrived if a is not None], self.plan)
        for p, version, flat in shared:
            if version > self.base_version.get(p, -1):
                # A round closed without this learner's latest progress on p, and
                # overwriting would erase it: send it first. The syncer rebases
                # it onto the new version, so it counts as if sent in time.
                unsent = min(self.c_steps[p], step - self.last_sent_step.get(p, -(10**9)))
                if self.cfg.flush_before_overwrite and unsent > 2 * self.cfg.overlap:
                    self._send(p, step)
                self._apply(p, version, flat, self.cfg.mix_alpha)
                self.metrics.globals_applied.inc()

    def _send(self, p: int, step: int) -> None:
        if self.c_steps[p] == 0 or not self.group.leader or self.comm is None:
            return
        self.seq += 1
        self.last_sent_step[p] = step
        delta = self.base[p] - self.plan.flatten(self.params, p)
        meta = Delta(
            run_id=self.cfg.run_id,
            learner_id=self.cfg.learner_id,
            incarnation=self.incarnation,
            seq=self.seq,
            fragment=p,
            plan_hash=self.plan.plan_hash,
            base_version=self.base_version[p],
            step=step,
            c_steps=self.c_steps[p],
            c_tokens=self.c_tokens[p],
            sent_at=time.time(),
        )
        self.comm.send_delta(OutgoingDelta(delta, meta))
        self.metrics.deltas_sent.inc()

    def _wait_for_new_global(self, p: int, timeout_s: float = 60.0) -> None:
        """Synchronous DiLoCo only: block until fragment p moved past our base."""
        assert self.comm is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for g in self.comm.take_globals():
                decoded = self._decode_global(g)
                if decoded is not None and decoded[1] > self.base_version.get(decoded[0], -1):
                    self._apply(*decoded, mix_alpha=self.cfg.mix_alpha)
            if self.c_steps[p] == 0:
                return
            time.sleep(0.002)
        log.warning("fragment %d: no new global within %.0fs; continuing", p, timeout_s)

    # -- the loop ---------------------------------------------------------------
    def _evaluate(self, step: int) -> None:
        """Without a syncer (data parallel) the learner reports the held-out loss itself."""
        if not self.syncing and self.group.leader:
            self.event(
                "eval", step=step, loss=evaluate(self.model, self.eval_set), tokens=self.tokens
            )

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.syncing:
            self.join()
        else:
            self._evaluate(self.start_step)
        if self.transport is not None:
            self.comm = CommThread(self.transport, Codec.parse(cfg.codec), cfg.error_feedback)
            self.comm.start()
        self.event("start", step=self.start_step)
        self._save_progress(self.start_step)
        log.info("learner %s starts at step %d of %d", cfg.learner_id, self.start_step, cfg.steps)
        window_start, window_steps = time.perf_counter(), 0
        loss_value = float("nan")
        for step in range(self.start_step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(step - 1, cfg)
            x, y = self.sampler.next()
            loss = self.model(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.group.allreduce_grads(self.model)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            compute_s = time.perf_counter() - t0
            if cfg.slowdown > 1:
                time.sleep(compute_s * (cfg.slowdown - 1))  # emulate slower hardware
            self.tokens += self.tokens_per_step
            for p in range(cfg.fragments):
                self.c_steps[p] += 1
                self.c_tokens[p] += self.tokens_per_step

            # Decoupled DiLoCo: take what arrived, send what is due, never wait.
            sync_on = not cfg.sync_pause_every or (step // cfg.sync_pause_every) % 2 == 0
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
                        run_id=cfg.run_id,
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
            if step % cfg.log_every == 0 or step == cfg.steps:
                elapsed = time.perf_counter() - window_start
                rate = window_steps / elapsed if elapsed > 0 else 0.0
                self.metrics.step_rate.set(rate)
                stats = self.transport.stats if self.transport is not None else None
                if stats is not None:
                    self.metrics.bytes_up.set(stats.bytes_sent)
                    self.metrics.bytes_down.set(stats.bytes_received)
                self.event(
                    "step",
                    step=step,
                    loss=loss_value,
                    tokens=self.tokens,
                    steps_per_s=rate,
                    lr=lr_at(step - 1, cfg),
                    compute_s=compute_s,
                    step_s=step_s,
                    bytes_sent=stats.bytes_sent if stats else 0,
                    bytes_received=stats.bytes_received if stats else 0,
                    versions=[self.base_version.get(p, -1) for p in range(cfg.fragments)],
                )
                self._save_progress(step)
                window_start, window_steps = time.perf_counter(), 0
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                self._evaluate(step)
        self.event("train_end", step=cfg.steps)
        self._evaluate(cfg.steps)
        return self.finish(loss_value)

    def _rate(self, sync_on: bool) -> float | None:
        seconds = self.phase_time[sync_on]
        return self.phase_steps[sync_on] / seconds if seconds > 0 else None

    def finish(self, loss_value: float) -> dict[str, Any]:
        """Send every fragment's remaining progress, deliver what is queued, stop."""
        delivered = True
        if self.comm is not None:
            for p in range(self.cfg.fragments):
                self._send(p, self.cfg.steps)
            delivered = self.comm.stop(flush_timeout_s=self.cfg.finish_timeout_s)
        stats = self.transport.stats if self.transport is not None else None
        result = {
            "steps": self.cfg.steps,
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
        self.event("done", **result)
        # Never close sockets under a comm thread that still uses them.
        if self.transport is not None and (self.comm is None or not self.comm.is_alive()):
            self.transport.close()
        self.group.close()
        if self._events is not None:
            self._events.close()
        return result
