"""The syncer service: transport + fragment states + checkpoints + metrics.

One event loop, one thread. Per iteration: receive deltas and heartbeats
(waiting at most until the next round deadline), offer deltas to their
fragment, close every round that is ready. Closing a round follows the
durability order that makes application exactly-once:

    merge -> checkpoint (atomic rename) -> publish -> ack

A crash before the rename re-delivers the round's deltas to the restarted
syncer, which merges them again from the same old state; a crash after it
re-delivers deltas that the de-duplication state in the checkpoint refuses.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import torch
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client import Counter as PromCounter

from broker.transport import Inbound, SyncerTransport
from broker.wire import Delta, GlobalFragment, Heartbeat, WireError
from learner.data import eval_batches, evaluate, load_corpus
from learner.fragments import FragmentPlan
from learner.model import GPT
from syncer.checkpoint import load_fragment, load_manifest, save_fragment, save_manifest
from syncer.config import SyncerConfig
from syncer.fragment_state import (
    ACCEPTED,
    DUPLICATE,
    HELD,
    AggregationParams,
    FragmentState,
    RoundOverflow,
)
from syncer.quorum import Ema

log = logging.getLogger(__name__)


def connect_syncer(cfg: SyncerConfig, fragments: list[int]) -> SyncerTransport:
    if cfg.transport == "redis":
        from broker.redis_transport import RedisSyncerTransport

        return RedisSyncerTransport(
            cfg.redis_url,
            cfg.run_id,
            consumer=cfg.syncer_id,
            fragments=fragments,
            max_message_bytes=cfg.max_message_bytes,
        )
    from broker.zmq_transport import ZmqSyncerTransport

    return ZmqSyncerTransport(
        cfg.zmq_bind, cfg.run_id, fragments, max_message_bytes=cfg.max_message_bytes
    )


def initial_model(cfg: SyncerConfig) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(cfg.model)


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
        self.rounds = PromCounter(
            "ddiloco_syncer_rounds", "Globals published", ["fragment"], registry=r
        )
        self.version = Gauge("ddiloco_syncer_fragment_version", "Version", ["fragment"], registry=r)
        self.live = Gauge(
            "ddiloco_syncer_live_learners", "Learners with recent heartbeats", registry=r
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
        self.eval_loss = Gauge(
            "ddiloco_syncer_eval_loss", "Held-out loss of the global model", registry=r
        )
        if port:
            start_http_server(port, registry=r)


class Syncer:
    def __init__(
        self,
        cfg: SyncerConfig,
        transport: SyncerTransport | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        model = initial_model(cfg)
        self.model = model
        self.plan = FragmentPlan.for_model(model, cfg.fragments, cfg.sync_every)
        self.owned = list(cfg.owned_fragments or range(cfg.fragments))
        self.checkpoint_dir = Path(cfg.checkpoint_dir)
        self._check_manifest()
        params = AggregationParams(
            quorum=cfg.quorum,
            grace_gamma=cfg.grace_gamma,
            overlap=cfg.overlap,
            staleness=cfg.staleness,
            outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum,
            aggregation=cfg.aggregation,
            codec=cfg.codec,
            quarantine_factor=cfg.quarantine_factor,
        )
        named = dict(model.named_parameters())
        self.states: dict[int, FragmentState] = {}
        resumed = []
        for p in self.owned:
            state = FragmentState(p, self.plan.flatten(named, p), params)
            saved = load_fragment(self.checkpoint_dir, p)
            if saved is not None:
                state.load(*saved)
                resumed.append(f"{p}@v{state.version}")
            self.states[p] = state
        if resumed:
            log.info("resumed fragments from %s: %s", self.checkpoint_dir, ", ".join(resumed))
        self.transport = transport or connect_syncer(cfg, self.owned)
        self.metrics = _Metrics(cfg.metrics_port)
        self.rejected: Counter[str] = Counter()
        self.deltas_applied = 0
        self.duplicates = 0
        self.rounds = 0
        self.merged_tokens = 0
        self.last_heartbeat: dict[str, float] = {}
        self.learner_tokens: dict[str, int] = {}
        self.step_s = Ema(0.1)
        self.eval_loss: float | None = None
        self._events: TextIO | None = None
        if cfg.metrics_file:
            Path(cfg.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._events = open(cfg.metrics_file, "a", buffering=1)  # noqa: SIM115
        self._eval_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._next_eval = 0.0
        self.stop_requested = threading.Event()
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
                "run_id": self.cfg.run_id,
                "plan_hash": self.plan.plan_hash,
                "fragments": self.cfg.fragments,
                "sync_every": self.cfg.sync_every,
                "model": self.cfg.model.__dict__,
            },
        )

    # -- events ----------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(json.dumps({"t": time.time(), "event": kind, **fields}) + "\n")

    def live_learners(self, now: float) -> set[str]:
        timeout = self.cfg.heartbeat_timeout_s
        return {name for name, t in self.last_heartbeat.items() if now - t <= timeout}

    # -- the loop --------------------------------------------------------
    def run(self, max_seconds: float | None = None) -> None:
        end = None if max_seconds is None else self.clock() + max_seconds
        while not self.stop_requested.is_set() and (end is None or self.clock() < end):
            self.step()
        self.shutdown()

    def step(self) -> None:
        now = self.clock()
        deadlines = [
            d for s in self.states.values() if (d := s.close_at(self.step_s.value)) is not None
        ]
        timeout = min([0.2] + [max(0.0, d - now) for d in deadlines])
        items = self.transport.receive(timeout)
        now = self.clock()
        to_ack: list[Inbound] = []
        for item in items:
            if isinstance(item.message, Heartbeat):
                self._on_heartbeat(item.message, now)
            elif isinstance(item.message, Delta) and self._on_delta(item, now):
                to_ack.append(item)
        if to_ack:
            self.transport.ack(to_ack)
        live = self.live_learners(now)
        for p, state in self.states.items():
            if state.should_close(now, live, self.step_s.value, len(self.last_heartbeat)):
                self.close_round(p)
        self.metrics.live.set(len(live))
        self.metrics.bytes_in.set(self.transport.stats.bytes_received)
        self.metrics.bytes_out.set(self.transport.stats.bytes_sent)
        if self.cfg.eval_every_s and self.clock() >= self._next_eval:
            self.evaluate()
            self._next_eval = self.clock() + self.cfg.eval_every_s

    def _on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.last_heartbeat[hb.learner_id] = now
        self.learner_tokens[hb.learner_id] = hb.tokens
        if hb.step_time_s > 0:
            # Capped: one stalled step (or a lying peer) must not stretch every
            # grace window past the time a dead learner takes to be noticed.
            self.step_s.update(min(hb.step_time_s, self.cfg.heartbeat_timeout_s))

    def _reject(self, reason: str, delta: Delta) -> None:
        self.rejected[reason] += 1
        self.metrics.deltas_rejected.labels(reason).inc()
        log.warning(
            "rejected delta %s/%d from %s: %s", delta.fragment, delta.seq, delta.learner_id, reason
        )
        self.event("reject", reason=reason, learner=delta.learner_id, fragment=delta.fragment)

    def _on_delta(self, item: Inbound, now: float) -> bool:
        """Offer a delta; True if it can be acknowledged right away."""
        d = item.message
        assert isinstance(d, Delta)
        state = self.states.get(d.fragment)
        if state is None:
            self._reject("not_owned", d)
            return True
        if d.plan_hash != self.plan.plan_hash:
            self._reject("wrong_plan", d)
            return True
        if d.numel != state.numel:
            self._reject("bad_shape", d)
            return True
        # What the round keeps until it closes: the ack token, not the payload.
        ref = Inbound(replace(d, payload=b""), item.token)
        status = state.precheck(d, ref)
        if status is None:
            try:
                tensor = d.tensor()
            except WireError as e:
                self._reject(e.reason, d)
                return True
            status = state.offer(d, tensor, ref, now)
        if status in (ACCEPTED, HELD):
            self.last_heartbeat[d.learner_id] = now  # a valid delta also proves liveness
            return False
        if status == DUPLICATE:
            self.duplicates += 1
            return True
        self._reject(status, d)
        return True

    def close_round(self, p: int) -> None:
        state = self.states[p]
        started = self.clock()
        quorum_s = None
        if state.round.quorum_at is not None and state.round.opened_at is not None:
            quorum_s = state.round.quorum_at - state.round.opened_at
        grace_s = state.round.grace_window_s(self.step_s.value)
        try:
            result = state.close()
        except RoundOverflow as e:
            log.error("%s: refusing its %d deltas", e, len(e.refs))
            self.rejected["overflow"] += len(e.refs)
            self.metrics.deltas_rejected.labels("overflow").inc(len(e.refs))
            self.transport.ack(e.refs)
            state.round_done(0.0)
            return
        tensors, meta = state.state()
        save_fragment(self.checkpoint_dir, p, tensors, meta)  # durable before anything leaves
        self._publish(p)
        self.transport.ack(result.refs)
        sync_s = self.clock() - started
        state.round_done(sync_s)
        self.rounds += 1
        self.deltas_applied += result.included
        self.merged_tokens += result.tokens
        self.metrics.rounds.labels(str(p)).inc()
        self.metrics.deltas_applied.inc(result.included)
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
            quorum_s=quorum_s,
            grace_s=grace_s,
            sync_s=sync_s,
            merged_tokens=self.merged_tokens,
        )

    def _publish(self, p: int) -> None:
        state = self.states[p]
        self.transport.publish(
            GlobalFragment(
                run_id=self.cfg.run_id,
                fragment=p,
                plan_hash=self.plan.plan_hash,
                version=state.version,
                codec=state.codec.name,
                numel=state.numel,
                payload=state.payload,
                sent_at=time.time(),
            )
        )

    # -- evaluation and shutdown ------------------------------------------
    def global_model(self) -> GPT:
        """The current global weights in a model (needs every fragment owned here)."""
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for p, state in self.states.items():
                for name, tensor in self.plan.unflatten(state.weights, p).items():
                    named[name].copy_(tensor)
        return self.model

    def evaluate(self) -> float | None:
        if len(self.states) != self.cfg.fragments:
            return None  # another syncer holds part of the model
        if self._eval_batches is None:
            corpus = load_corpus(self.cfg.data, self.cfg.model.vocab_size, self.cfg.model.seq_len)
            self._eval_batches = eval_batches(
                corpus.val, self.cfg.model.seq_len, self.cfg.eval_batch_size, self.cfg.eval_batches
            )
        self.eval_loss = evaluate(self.global_model(), self._eval_batches)
        self.metrics.eval_loss.set(self.eval_loss)
        versions = {str(p): s.version for p, s in self.states.items()}
        self.event(
            "eval",
            loss=self.eval_loss,
            merged_tokens=self.merged_tokens,
            learner_tokens=sum(self.learner_tokens.values()),
            versions=versions,
        )
        log.info("eval loss %.4f (merged tokens %d)", self.eval_loss, self.merged_tokens)
        return self.eval_loss

    def shutdown(self) -> None:
        """Merge what is pending (the learners are done), evaluate, record totals."""
        for p, state in self.states.items():
            if state.pending_learners:
                self.close_round(p)
        if self.cfg.eval_every_s:
            self.evaluate()
        self.event("summary", **self.summary())
        self.transport.close()
        if self._events is not None:
            self._events.close()
            self._events = None

    def summary(self) -> dict[str, Any]:
        stats = self.transport.stats
        return {
            "fragments_published": self.rounds,
            "deltas_applied": self.deltas_applied,
            "deltas_rejected": sum(self.rejected.values()),
            "rejected_by_reason": dict(self.rejected)
            | {f"transport_{k}": v for k, v in stats.rejected.items()},
            "duplicates": self.duplicates,
            "merged_tokens": self.merged_tokens,
            "bytes_received": stats.bytes_received,
            "bytes_sent": stats.bytes_sent,
            "versions": {str(p): s.version for p, s in self.states.items()},
            "eval_loss": self.eval_loss,
        }


def run_syncer(cfg: SyncerConfig) -> None:
    syncer = Syncer(cfg)
    signal.signal(signal.SIGTERM, lambda *_: syncer.stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: syncer.stop_requested.set())
    log.info(
        "syncer %s owns fragments %s (plan %s)", cfg.syncer_id, syncer.owned, syncer.plan.plan_hash
    )
    print("ready", flush=True)
    syncer.run()
