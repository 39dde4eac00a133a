"""The initial model file: how a syncer learns the model without a model class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from broker.errors import ConfigError
from broker.fragments import FragmentPlan
from broker.run.initial_model import read_initial_model, write_initial_model
from broker.run.settings import RunSettings
from broker.run.tensor_files import load_tensors, save_tensors
from learner.config import WorkloadConfig
from learner.model import ModelConfig
from learner.workload import WorkloadContext, load_workload, write_initial

torch.set_num_threads(1)


def build_model(workload: WorkloadConfig) -> torch.nn.Module:
    return load_workload(WorkloadContext(workload)).model


TINY = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=16)


def test_init_writes_the_seeded_model_and_its_plan(tmp_path: Path) -> None:
    run = RunSettings(fragments=3, sync_every=6, initial_model=str(tmp_path / "init.safetensors"))
    workload = WorkloadConfig(model=TINY, seed=7)
    plan = write_initial(run, workload)
    loaded = read_initial_model(Path(run.initial_model))
    model = build_model(workload)  # what every learner builds: the same weights
    assert loaded.plan == plan == FragmentPlan.for_model(model, 3, 6)
    assert loaded.plan.plan_hash == plan.plan_hash
    named = dict(model.named_parameters())
    for p in range(3):
        assert torch.equal(loaded.fragment(p), plan.flatten(named, p))
    # Another seed is another start.
    other = build_model(WorkloadConfig(model=TINY, seed=8))
    assert not torch.equal(plan.flatten(dict(other.named_parameters()), 0), loaded.fragment(0))


def test_plan_json_round_trip_and_rejections() -> None:
    plan = FragmentPlan.for_model(build_model(WorkloadConfig(model=TINY)), 2, 4)
    assert FragmentPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    good = plan.to_json()
    bad_cases = [
        None,
        {},
        {**good, "fragments": 0},
        {**good, "sync_every": 3},
        {**good, "params": good["params"] + [good["params"][0]]},  # a duplicate name
        {**good, "params": [[*row[:3], 0] for row in good["params"]]},  # fragment 1 empty
        {**good, "params": [[row[0], row[1], "float99", row[3]] for row in good["params"]]},
        {**good, "params": [["w", "not a shape", "float32", 0]]},
    ]
    for bad in bad_cases:
        with pytest.raises(ValueError, match="not a fragment plan"):
            FragmentPlan.from_json(bad)


def test_bad_files_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ddiloco init"):
        read_initial_model(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not an initial model file"):
        read_initial_model(garbage)
    other = tmp_path / "other.safetensors"
    save_tensors(other, {"x": torch.zeros(2)}, {"format": "something else"})
    with pytest.raises(ValueError, match="not an initial model file"):
        read_initial_model(other)

    model = build_model(WorkloadConfig(model=TINY))
    plan = FragmentPlan.for_model(model, 2, 4)
    path = tmp_path / "init.safetensors"
    write_initial_model(path, plan, dict(model.named_parameters()))
    tensors, meta = load_tensors(path)
    # A tensor whose shape no longer matches the plan.
    name = plan.specs[0].name
    save_tensors(path, {**tensors, name: torch.zeros(3)}, meta)
    with pytest.raises(ValueError, match=name):
        read_initial_model(path)
    # A plan whose hash was edited.
    save_tensors(path, tensors, {**meta, "plan_hash": "0" * 16})
    with pytest.raises(ValueError, match="hash"):
        read_initial_model(path)
    with pytest.raises(ValueError, match="not given"):
        write_initial_model(path, plan, {})
