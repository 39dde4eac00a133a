"""Workloads: what a run trains, built the same way by every process.

A workload factory (``--workload module:factory``) takes a
:class:`WorkloadContext` and returns a :class:`Workload`: the model, this
shard's batches, the loss of a batch, the weight of a batch (tokens or
samples, for token-step weighting) and optionally a held-out evaluation.
``ddiloco init`` writes the initial global model from the factory's model;
learners train its batches; the evaluator runs its evaluation. The default is
the byte-level GPT on the Python standard library (:func:`byte_gpt`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from broker.errors import ConfigError
from broker.fragments import FragmentPlan, synced_parameters
from broker.run.initial_model import write_initial_model
from broker.run.settings import RunSettings
from learner.config import EvalConfig, TrainConfig, WorkloadConfig
from learner.data import BatchSampler, eval_batches, evaluate, load_corpus
from learner.model import GPT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkloadContext:
    """What a factory is told: which shard to load, and the run's settings for it."""

    config: WorkloadConfig
    shard: int = 0  # this process's shard of the training data ...
    num_shards: int = 1  # ... out of this many
    start_step: int = 0  # a restarted learner goes on from here (vary the data order)
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()


@dataclass
class Workload:
    model: torch.nn.Module
    batches: Iterator[Any]  # this shard's training batches, without end
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]  # mean training loss of a batch
    weight: Callable[[Any], int]  # what a batch trains on: tokens, or samples
    evaluate: Callable[[torch.nn.Module], float] | None = None  # held-out loss
    # Figures about the model that each evaluation logs beside its loss, taken
    # right after ``evaluate`` (e.g. a mixture of experts' shares of the tokens).
    eval_report: Callable[[torch.nn.Module], dict[str, Any]] | None = None

    def evaluation(self, model: torch.nn.Module) -> dict[str, Any]:
        """An ``eval`` event's fields for ``model``: its held-out ``loss`` and what
        ``eval_report`` adds."""
        if self.evaluate is None:
            raise ConfigError("this workload has no evaluate function")
        fields: dict[str, Any] = {"loss": self.evaluate(model)}
        if self.eval_report is not None:
            fields |= self.eval_report(model)
        return fields


def load_workload(context: WorkloadContext) -> Workload:
    """Import the factory named by ``context.config.workload`` and call it, seeded,
    so that every process builds the same initial model."""
    module_name, _, attr = context.config.workload.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"workload={context.config.workload!r}: {e}") from None
    torch.manual_seed(context.config.seed)
    workload = factory(context)
    if not isinstance(workload, Workload):
        raise ConfigError(
            f"workload={context.config.workload!r} returned {type(workload).__name__}, "
            "not a learner.workload.Workload"
        )
    return workload


def byte_gpt(context: WorkloadContext) -> Workload:
    """The default: a byte-level GPT on the Python standard library (or ``--data``)."""
    return byte_lm(context, GPT(context.config.model))


def _cross_entropy(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    return model(*batch)


def byte_lm(
    context: WorkloadContext,
    model: torch.nn.Module,
    loss: Callable[[torch.nn.Module, Any], torch.Tensor] = _cross_entropy,
) -> Workload:
    """A byte-level language model's workload on the Python standard library (or
    ``--data``): ``model(x, y)`` is its mean cross-entropy, which evaluation
    reports; ``loss`` is what training minimizes (by default the same)."""
    cfg = context.config
    corpus = load_corpus(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)
    sampler = BatchSampler(
        corpus.train,
        cfg.model.seq_len,
        context.train.batch_size,
        context.shard,
        context.num_shards,
        seed=cfg.seed * 100_003 + context.shard + 7919 * context.start_step,
    )
    held_out = eval_batches(
        corpus.val, cfg.model.seq_len, context.eval.eval_batch_size, context.eval.eval_batches
    )

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield sampler.next()

    return Workload(
        model=model,
        batches=batches(),
        loss=loss,
        weight=lambda batch: int(batch[0].numel()),
        evaluate=lambda m: evaluate(m, held_out),
    )


def write_initial(run: RunSettings, workload: WorkloadConfig) -> FragmentPlan:
    """``ddiloco init``: write the initial global model and its fragment plan."""
    model = load_workload(WorkloadContext(workload)).model
    plan = FragmentPlan.for_model(model, run.fragments, run.sync_every)
    write_initial_model(Path(run.initial_model), plan, synced_parameters(model))
    log.info(
        "wrote %s: %d parameters in %d fragments (plan %s)",
        run.initial_model,
        sum(s.numel for s in plan.specs),
        plan.num_fragments,
        plan.plan_hash,
    )
    return plan
