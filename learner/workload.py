"""The workload: the model and data a run trains, built the same way everywhere.

``ddiloco init`` writes the initial global model from here, and learners and
the evaluator build the same model class around the globals they receive.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from broker.fragments import FragmentPlan
from broker.initial_model import write_initial_model
from broker.settings import RunSettings
from learner.config import WorkloadConfig
from learner.model import GPT

log = logging.getLogger(__name__)


def build_model(workload: WorkloadConfig) -> GPT:
    """The model with its seeded initial weights (equal in every process)."""
    torch.manual_seed(workload.seed)
    return GPT(workload.model)


def write_initial(run: RunSettings, workload: WorkloadConfig) -> FragmentPlan:
    """``ddiloco init``: write the initial global model and its fragment plan."""
    model = build_model(workload)
    plan = FragmentPlan.for_model(model, run.fragments, run.sync_every)
    write_initial_model(Path(run.initial_model), plan, dict(model.named_parameters()))
    log.info(
        "wrote %s: %d parameters in %d fragments (plan %s)",
        run.initial_model,
        sum(s.numel for s in plan.specs),
        plan.num_fragments,
        plan.plan_hash,
    )
    return plan
