"""The quality benchmark's statistics and the benchmarks' stored runs (the runs
themselves are checked by .ci/run's --smoke)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.local_run import local_run, resolved_settings, same_settings
from benchmarks.quality import relative_gaps


def test_relative_gaps_pair_seeds_and_give_the_standard_error() -> None:
    decoupled = {0: 2.02, 1: 1.98, 2: 2.10}
    reference = {0: 2.00, 1: 2.00, 2: 2.00, 3: 1.90}  # seed 3 has no pair: left out
    gaps = relative_gaps(decoupled, reference)
    assert gaps["per_seed"] == pytest.approx([0.01, -0.01, 0.05])
    assert gaps["mean"] == pytest.approx(0.05 / 3)
    mean = 0.05 / 3
    spread = math.sqrt(sum((g - mean) ** 2 for g in (0.01, -0.01, 0.05)) / 2)
    assert gaps["stderr"] == pytest.approx(spread / math.sqrt(3))


def test_one_seed_has_no_standard_error() -> None:
    gaps = relative_gaps({0: 2.2}, {0: 2.0})
    assert gaps["mean"] == pytest.approx(0.1) and gaps["stderr"] is None


def test_a_stored_run_is_reused_only_with_the_same_settings(tmp_path: Path) -> None:
    """A benchmark's finished run is kept with every setting it resolved to:
    a rerun reuses it while nothing changed, and the settings tell a changed
    default apart (data parallel ignores DiLoCo's own settings)."""
    args = ["--mode", "decoupled", "--steps", "300", "--seed", "1"]
    settings = resolved_settings(args)
    assert settings["steps"] == "300" and settings["delta_codec"] == "int2+zstd"
    assert resolved_settings([*args, "--delta-codec", "int4"]) != settings
    ddp = resolved_settings(["--mode", "ddp"])
    assert "delta_codec" not in ddp and "outer_lr" not in ddp and "sync_every" not in ddp
    assert ddp == resolved_settings(["--mode", "ddp", "--global-codec", "int4"])
    assert ddp != resolved_settings(["--mode", "ddp", "--lr", "1e-4"])

    stored = tmp_path / "run-seed1-decoupled.json"
    stored.write_text(json.dumps({"final_eval_loss": 2.0, "settings": settings}))

    def never(folder: Path, summary: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("a run with the same settings ran again")

    assert local_run(stored, args, never)["final_eval_loss"] == 2.0


def test_a_setting_a_stored_run_does_not_name_matches_at_its_default() -> None:
    now = resolved_settings(["--seed", "3"])
    older = {k: v for k, v in now.items() if k != "join_at_step"}  # before the setting existed
    assert same_settings(older, now)
    assert not same_settings(older, resolved_settings(["--seed", "3", "--join-at-step", "0,0,5,5"]))
    assert not same_settings(older, resolved_settings(["--seed", "4"]))
    # Keys authenticate, they change nothing computed: a run stored with them matches.
    assert same_settings(older | {"keys": "/elsewhere", "insecure": "true"}, now)
