"""The evaluator: follows the global model like a learner and reports held-out loss.

It joins with a snapshot of every fragment, applies globals as they arrive,
and evaluates every ``eval_every_s`` seconds. It never sends deltas or
heartbeats, so the syncer never counts it as a learner. When asked to stop
(SIGTERM) it takes one last snapshot, so the final figure is the model the
syncer holds at the end of the run.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from broker.connect import connect_learner
from broker.errors import ConfigError
from broker.files import EventLog
from broker.fragments import FragmentPlan, synced_parameters
from broker.transport import LearnerTransport, TransportError
from learner.config import EvaluatorConfig
from learner.fragment_sync import FragmentSync
from learner.join import GlobalDecoder, join_snapshot
from learner.workload import WorkloadContext, load_workload

log = logging.getLogger(__name__)
EVALUATOR_ID = "evaluator"


class DeferredEvaluations:
    """Copies of a model taken to be evaluated later (``eval_deferred``), each with
    the wall-clock time it was taken and the fields of its event. The copies
    wait in a temporary folder (``TMPDIR``), not in memory, so a long run with
    frequent evaluations holds one model however many copies it takes."""

    def __init__(self) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="ddiloco-deferred-")
        self._copies: list[tuple[float, dict[str, Any], Path]] = []

    @property
    def folder(self) -> Path:
        """Where the copies not evaluated yet wait."""
        return Path(self._folder.name)

    def keep(self, model: torch.nn.Module, **fields: Any) -> None:
        taken_at = time.time()
        # Numbered among the copies waiting: an evaluated copy's file is gone.
        path = self.folder / f"copy-{len(self._copies):06d}.pt"
        torch.save([t.detach() for t in model.state_dict().values()], path)
        self._copies.append((taken_at, fields, path))

    def evaluate_all(
        self,
        model: torch.nn.Module,
        evaluation: Callable[[torch.nn.Module], dict[str, Any]],
        events: EventLog,
    ) -> list[float]:
        """Evaluate every copy in ``model`` (restored afterwards) and write its
        ``eval`` event at the time the copy was taken; returns the losses.
        ``evaluation``: the event's fields for a model (``Workload.evaluation``)."""
        current = [t.detach().clone() for t in model.state_dict().values()]
        losses = []
        for taken_at, fields, path in self._copies:
            _load(model, torch.load(path, weights_only=True))
            path.unlink()
            result = evaluation(model)
            events.write_at(taken_at, "eval", deferred=True, **result, **fields)
            losses.append(result["loss"])
        _load(model, current)
        if self._copies:
            log.info("evaluated %d deferred copies of the model", len(self._copies))
        self._copies.clear()
        return losses


def _load(model: torch.nn.Module, state: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for target, source in zip(model.state_dict().values(), state, strict=True):
            target.copy_(source)


class Evaluator:
    def __init__(self, cfg: EvaluatorConfig, transport: LearnerTransport | None = None) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.process.torch_threads)
        workload = load_workload(WorkloadContext(cfg.workload, eval=cfg.eval))
        if workload.evaluate is None:
            raise ConfigError(f"workload={cfg.workload.workload!r} has no evaluate function")
        self._evaluation = workload.evaluation
        self.model = workload.model
        self.plan = FragmentPlan.for_model(self.model, cfg.run.fragments, cfg.run.sync_every)
        self.params = synced_parameters(self.model)
        self.fragments = FragmentSync(
            self.plan, cfg.run.overlap, flush_before_overwrite=False, keep_unsent=False
        )
        self.events = EventLog(cfg.metrics_file, source=EVALUATOR_ID)
        self.stop_requested = threading.Event()
        self.losses: list[float] = []
        self.transport = transport or connect_learner(
            cfg.run.url,
            run_id=cfg.run.run_id,
            learner_id=EVALUATOR_ID,
            incarnation=time.time_ns(),
            num_fragments=cfg.run.fragments,
            syncer_shards=cfg.run.syncer_shards,
            max_message_bytes=self.plan.max_message_bytes,
            keys=cfg.run.run_keys("reader"),
            role="reader",
        )
        self.decoder = GlobalDecoder(self.plan, self.transport)
        self.deferred = DeferredEvaluations() if cfg.eval.eval_deferred else None

    def _catch_up(self, timeout_s: float) -> None:
        """Apply the globals that arrived within ``timeout_s``."""
        for g in self.transport.poll(timeout_s):
            decoded = self.decoder.decode(g)
            if isinstance(decoded, str):
                log.warning("refused global %d v%d: %s", g.fragment, g.version, decoded)
                continue
            self.transport.accepted(g)
            if self.fragments.is_newer(decoded[0], decoded[1]):
                self.fragments.apply(*decoded, self.params)

    def _load_snapshot(self, timeout_s: float) -> None:
        for p, stamp, flat in join_snapshot(self.transport, self.decoder, timeout_s):
            if self.fragments.is_newer(p, stamp):
                self.fragments.apply(p, stamp, flat, self.params)

    def evaluate(self, final: bool = False) -> float | None:
        """The held-out loss of the global model now; with ``eval_deferred``
        (except the final one) a copy of it to evaluate when the run ends."""
        versions = self.fragments.versions()
        if self.deferred is not None and not final:
            self.deferred.keep(self.model, versions=versions, final=False)
            return None
        result = self._evaluation(self.model)
        loss = result["loss"]
        self.losses.append(loss)
        self.events.write("eval", versions=versions, final=final, **result)
        log.info("eval loss %.4f at versions %s", loss, versions)
        return loss

    def run(self, max_seconds: float | None = None) -> list[float]:
        """Evaluate until stopped (or for ``max_seconds``); returns every loss."""
        self._load_snapshot(self.cfg.process.join_timeout_s)
        self.evaluate()
        period = self.cfg.eval.eval_every_s
        started = time.monotonic()
        next_eval = started + period if period else None
        while not self.stop_requested.is_set():
            now = time.monotonic()
            if max_seconds is not None and now - started >= max_seconds:
                break
            self._catch_up(0.2)
            if next_eval is not None and time.monotonic() >= next_eval:
                self.evaluate()
                next_eval = time.monotonic() + period
        try:
            self._load_snapshot(timeout_s=10.0)
        except TransportError as e:
            log.warning("no final snapshot (%s); evaluating the last globals received", e)
        if self.deferred is not None:
            self.losses += self.deferred.evaluate_all(self.model, self._evaluation, self.events)
        self.evaluate(final=True)
        self.transport.close()
        self.events.close()
        return self.losses
