"""The initial global model: the file through which the syncer learns the model.

The learner side writes it (``ddiloco init``): every parameter's initial value
plus the fragment plan (names, shapes, dtypes, which fragment each belongs to,
H, and the plan hash). A syncer starts from it and never needs a model class;
it is the same file whoever connects first, so no learner decides the start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from broker.errors import ConfigError
from broker.fragments import FragmentPlan
from broker.run.tensor_files import load_tensors, save_tensors

FORMAT = "ddiloco-initial-model/1"


@dataclass(frozen=True)
class InitialModel:
    plan: FragmentPlan
    tensors: dict[str, torch.Tensor]  # parameter name -> initial value

    def fragment(self, p: int) -> torch.Tensor:
        """Fragment ``p``'s initial weights as one flat fp32 vector."""
        return self.plan.flatten(self.tensors, p)


def write_initial_model(
    path: Path, plan: FragmentPlan, parameters: Mapping[str, torch.Tensor]
) -> None:
    missing = [s.name for s in plan.specs if s.name not in parameters]
    if missing:
        raise ConfigError(f"parameters {missing[:3]} of the plan are not given")
    tensors = {s.name: parameters[s.name].detach().to("cpu").clone() for s in plan.specs}
    save_tensors(
        path, tensors, {"format": FORMAT, "plan": plan.to_json(), "plan_hash": plan.plan_hash}
    )


def read_initial_model(path: Path) -> InitialModel:
    """Load and check the file; ``ValueError`` says what is wrong with it."""
    if not path.is_file():
        raise ConfigError(
            f"no initial model at {path}: write one with `ddiloco init` (same settings)"
        )
    try:
        tensors, meta = load_tensors(path)
    except Exception as e:  # safetensors raises its own error types for bad files
        raise ConfigError(f"{path} is not an initial model file: {e}") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an initial model file (format {meta.get('format')!r})")
    plan = FragmentPlan.from_json(meta.get("plan"))
    if plan.plan_hash != meta.get("plan_hash"):
        raise ConfigError(f"{path}: the stored plan hash does not match its plan")
    for spec in plan.specs:
        t = tensors.get(spec.name)
        if t is None or tuple(t.shape) != spec.shape or str(t.dtype) != f"torch.{spec.dtype}":
            raise ConfigError(f"{path}: parameter {spec.name} is missing or not {spec}")
    return InitialModel(plan, tensors)
