"""benchmarks.hetero's arithmetic, on hand-made runs."""

from __future__ import annotations

from typing import Any

from benchmarks.hetero import loss_at, summarise


def test_loss_at_reads_a_curve_between_its_points() -> None:
    curve = [[0, 5.0], [100, 3.0], [300, 2.0]]
    assert loss_at(curve, 50) == 4.0
    assert loss_at(curve, 200) == 2.5
    assert loss_at(curve, 400) == 2.0  # past the end: the last loss
    assert loss_at([[10, 5.0]], 5) is None  # before the first point


def run(system: str, tokens: int, curve_s: list[list[float]], final: float) -> dict[str, Any]:
    return {
        "system": system,
        "seed": 0,
        "final_eval_loss": final,
        "wall_s": curve_s[-1][0],
        "tokens": tokens,
        "goodput": 0.9,
        "merged_tokens_by_learner": {"learner-0": tokens},
        "curve_tokens": [[0, 5.0], [tokens, final]],
        "curve_seconds": curve_s,
    }


def test_time_to_target_and_loss_at_equal_tokens() -> None:
    runs = [
        run("reference", 1200, [[0, 5.0], [100, 2.0]], 2.0),
        # Decoupled reaches 2.0 at 40 s; synchronous DiLoCo at 200 s: 5x sooner.
        run("decoupled", 1000, [[0, 5.0], [30, 2.5], [50, 1.5]], 1.5),
        run("diloco", 1200, [[0, 5.0], [200, 2.0]], 2.0),
        run("ddp", 1200, [[0, 5.0], [300, 2.5]], 2.5),  # never reaches it
    ]
    result = summarise(runs, [0])
    systems = result["systems"]
    assert systems["decoupled"]["per_seed"]["0"]["time_to_target_s"] == 40.0
    assert systems["ddp"]["per_seed"]["0"]["time_to_target_s"] is None
    assert systems["ddp"]["reached_target"] == 0
    assert result["speedup_vs_diloco"]["per_seed"] == [5.0]
    # Equal tokens: the fewest trained (decoupled's 1000): diloco's curve read there.
    diloco_at_1000 = 5.0 + (2.0 - 5.0) * 1000 / 1200
    assert systems["diloco"]["per_seed"]["0"]["loss_at_equal_tokens"] == diloco_at_1000
    assert result["loss_gap_at_equal_tokens"]["per_seed"] == [1.5 / diloco_at_1000 - 1]
