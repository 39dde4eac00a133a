"""The fuzzer over the decoder and the syncer's message handling, 5,000 inputs (the
100,000-input run is ``python -m benchmarks.fuzz``; its result is committed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fuzz


@pytest.mark.timeout(120)
def test_five_thousand_hostile_inputs_crash_nothing(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    assert fuzz.main(["--inputs", "5000", "--seed", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["crashes"] == 0, result["first_crashes"]
    outcomes = result["outcomes"]
    # The inputs reached every layer: the decoder refused some, the syncer others.
    assert sum(v for k, v in outcomes.items() if k.startswith("wire:")) > 1000
    assert sum(result["syncer_rejected_by_reason"].values()) > 500
    assert result["peak_traced_bytes"] < 64 * 2**20
