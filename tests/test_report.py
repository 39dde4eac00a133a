"""Run summaries from a hand-written event stream, checked against hand arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from compose.report import (
    _intervals,
    _union_length,
    eval_curve,
    eval_curve_seconds,
    goodput_breakdown,
    load_events,
    merged_by_learner,
    plot_run,
    summarise,
)

Event = dict[str, Any]


def step(
    t: float,
    learner: str,
    incarnation: int,
    step_: int,
    tokens: int,
    rate: float,
    sent: int,
    received: int,
) -> Event:
    return {
        "t": t,
        "event": "step",
        "learner": learner,
        "incarnation": incarnation,
        "step": step_,
        "tokens": tokens,
        "steps_per_s": rate,
        "bytes_sent": sent,
        "bytes_received": received,
        "versions": [0, 0],
        "loss": 3.0,
    }


def run_events() -> list[Event]:
    """Two learners, P = 2 fragments, 100 tokens per step.

    learner-0 trains 1..4, is SIGKILLed at 4, restarts and trains again 5.5..7.5.
    learner-1 trains 1..3 and is done. Nobody trains between 4 and 5.5.
    The syncer is killed once, at 5; a shutdown kill at the end does not count.
    """
    return [
        {"t": 0.0, "event": "run_start", "mode": "decoupled"},
        {"t": 0.2, "event": "process_start", "process": "syncer"},
        {"t": 0.5, "event": "eval", "loss": 5.5, "source": "evaluator"},
        {"t": 1.0, "event": "start", "learner": "learner-0", "incarnation": 0, "step": 0},
        {"t": 1.0, "event": "start", "learner": "learner-1", "incarnation": 0, "step": 0},
        step(2.0, "learner-0", 0, 10, 1000, 10.0, 100, 50),
        step(2.0, "learner-1", 0, 10, 1000, 8.0, 90, 40),
        step(2.5, "learner-1", 0, 20, 2000, 12.0, 180, 80),
        {
            "t": 2.6,
            "event": "round",
            "fragment": 0,
            "version": 1,
            "included": 2,
            "tokens": 3000,
            "learners": ["learner-0", "learner-1"],
            "keys": [["learner-0", 0, 0], ["learner-1", 0, 0]],
        },
        {"t": 2.8, "event": "reject", "reason": "stale", "learner": "learner-1", "fragment": 1},
        {"t": 3.0, "event": "train_end", "learner": "learner-1", "incarnation": 0, "step": 25},
        {
            "t": 3.0,
            "event": "done",
            "learner": "learner-1",
            "incarnation": 0,
            "steps": 25,
            "tokens": 2500,
            "bytes_sent": 300,
            "bytes_received": 120,
        },
        step(3.0, "learner-0", 0, 20, 2000, 10.0, 200, 100),
        {
            "t": 3.2,
            "event": "round",
            "fragment": 1,
            "version": 1,
            "included": 2,
            "tokens": 2000,
            "learners": ["learner-0", "learner-1"],
            "keys": [["learner-0", 0, 1], ["learner-1", 0, 1]],
        },
        {"t": 4.0, "event": "process_kill", "process": "learner-0", "reason": "chaos"},
        {"t": 4.5, "event": "reject", "reason": "quarantined", "learner": "x", "fragment": 0},
        {"t": 5.0, "event": "process_kill", "process": "syncer", "reason": "scheduled"},
        {"t": 5.2, "event": "process_restart", "process": "learner-0"},
        {"t": 5.3, "event": "process_restart", "process": "syncer"},
        {"t": 5.5, "event": "start", "learner": "learner-0", "incarnation": 1, "step": 20},
        step(6.5, "learner-0", 1, 30, 3000, 10.0, 80, 40),
        {
            "t": 7.0,
            "event": "round",
            "fragment": 0,
            "version": 2,
            "included": 1,
            "tokens": 2500,
            "learners": ["learner-0"],
            "keys": [["learner-0", 1, 0]],
            "quorum": 1,  # the syncer's K when it closed this round
        },
        {"t": 7.5, "event": "train_end", "learner": "learner-0", "incarnation": 1, "step": 40},
        {
            "t": 7.5,
            "event": "done",
            "learner": "learner-0",
            "incarnation": 1,
            "steps": 40,
            "tokens": 4000,
            "bytes_sent": 160,
            "bytes_received": 90,
        },
        {"t": 7.6, "event": "process_kill", "process": "learner-1", "reason": "shutdown"},
        {"t": 7.8, "event": "eval", "loss": 2.25, "source": "evaluator", "final": True},
        {
            "t": 7.9,
            "event": "summary",
            "source": "syncer",
            "duplicates": 4,
            "rejected_by_reason": {"stale": 1},
            "transport_refused_by_reason": {"bad_magic": 3},
        },
        {"t": 8.0, "event": "run_end"},
    ]


def test_summary_by_hand() -> None:
    s = summarise(run_events(), mode="decoupled", learners=2, steps=40, fragments=2)
    assert (s["mode"], s["learners"], s["steps_per_learner"], s["quorum"]) == (
        "decoupled",
        2,
        40,
        1,
    )
    # learner-0: max over incarnations (2000 then 4000) = 4000; learner-1: 2500.
    assert s["tokens_total"] == 6500
    assert s["wall_s"] == 8.0
    assert s["initial_eval_loss"] == 5.5 and s["final_eval_loss"] == 2.25
    assert s["eval_curve"] == [[0, 5.5], [6500, 2.25]]
    assert s["fragments_published"] == 3
    assert s["deltas_applied"] == 2 + 2 + 1
    assert s["deltas_rejected"] == 2  # two reject events
    assert s["rejected_by_reason"] == {"quarantined": 1, "stale": 1}
    # Three bad frames, counted apart: they were never deltas.
    assert s["transport_refused"] == 3 and s["transport_refused_by_reason"] == {"bad_magic": 3}
    assert s["duplicates"] == 4
    # Last cumulative counter of each incarnation, summed:
    # learner-0 inc 0 (step at 3.0) + learner-0 inc 1 (done) + learner-1 (done).
    assert s["bytes_up"] == 200 + 160 + 300
    assert s["bytes_down"] == 100 + 90 + 120
    assert s["learner_kills"] == 1  # the shutdown kill is not chaos
    assert s["learner_restarts"] == 1
    assert s["syncer_kills"] == 1
    # Training: [1, 4] and [5.5, 7.5] for learner-0, [1, 3] for learner-1.
    # Union 3 + 2 = 5 over the span 7.5 - 1 = 6.5.
    assert s["uptime"] == round(5 / 6.5, 4)
    # Goodput: merged tokens per fragment (3000 + 2000 + 2500) / 2 = 3750, over
    # undisturbed = steps/s x tokens/step x span from first start to finish, per
    # learner. learner-0 ran 20 steps in 1..3 (its last report before the kill)
    # and 20 in 5.5..7.5: 10 steps/s x 100 x 6.5 = 6500; learner-1 ran 25 steps
    # in 1..3: 12.5 x 100 x 2 = 2500.
    assert s["merged_tokens"] == 3750
    assert s["goodput"] == round(3750 / 9000, 4)
    # The paper's, by time: the time spent on steps kept (40 / 10 + 25 / 12.5)
    # over the spans (6.5 + 2).
    assert s["goodput_time"] == round(6 / 8.5, 4)
    assert s["mean_steps_per_s"] == 10.0
    assert json.loads(json.dumps(s)) == s  # what summary.json will hold


def test_the_eval_curve_places_each_evaluation_by_the_tokens_trained_by_then() -> None:
    events = run_events()
    events.append({"t": 3.1, "event": "eval", "loss": 3.0, "source": "evaluator"})
    events.sort(key=lambda e: e["t"])
    # At 3.1: learner-0 reported 2000 (step at 3.0), learner-1 2500 (done at 3.0).
    assert eval_curve(events) == [(0, 5.5), (4500, 3.0), (6500, 2.25)]
    # A learner that evaluates itself (data parallel) reports its group's tokens.
    events.append({"t": 9.0, "event": "eval", "loss": 2.0, "learner": "learner-0", "tokens": 123})
    assert eval_curve(events)[-1] == (123, 2.0)


def test_a_kill_after_the_last_step_is_no_downtime() -> None:
    """learner-0 is killed after its last step, while it sends its last progress,
    and its restart only finishes: nothing was left to train, so uptime is the
    same as without that kill. Goodput still charges it (time after the last step)."""
    plain = summarise(run_events(), mode="decoupled", learners=2, steps=40, fragments=2)
    events = run_events()
    events += [
        {"t": 7.55, "event": "process_kill", "process": "learner-0", "reason": "chaos"},
        {"t": 9.0, "event": "process_restart", "process": "learner-0"},
        {"t": 9.5, "event": "start", "learner": "learner-0", "incarnation": 2, "step": 40},
        {"t": 9.5, "event": "train_end", "learner": "learner-0", "incarnation": 2, "step": 40},
        {"t": 9.6, "event": "run_end"},
    ]
    events = [e for e in events if e["event"] != "run_end" or e["t"] == 9.6]
    s = summarise(events, mode="decoupled", learners=2, steps=40, fragments=2)
    assert s["learner_kills"] == plain["learner_kills"] + 1
    assert s["uptime"] == plain["uptime"] == round(5 / 6.5, 4)
    assert s["goodput"] < plain["goodput"]
    # A restart that trains a step is a span: the window then runs to its end.
    events[-2] = {**events[-2], "step": 41}
    s = summarise(events, mode="decoupled", learners=2, steps=40, fragments=2)
    assert s["uptime"] == round(5 / 8.5, 4)


def test_ddp_goodput_counts_trained_tokens() -> None:
    s = summarise(run_events(), mode="ddp", learners=2, steps=40, fragments=2)
    assert s["merged_tokens"] == 6500
    assert s["goodput"] == round(6500 / 9000, 4)


def test_goodput_is_not_capped() -> None:
    """An over-count must show, not hide behind a cap at 1."""
    events = run_events()
    for e in events:
        if e["event"] == "round":
            e["tokens"] *= 10
    assert summarise(events, mode="decoupled", learners=2, steps=40, fragments=2)["goodput"] > 1.0


def test_uptime_is_one_without_a_gap() -> None:
    """learner-1 trains until 6 this time, covering learner-0's restart gap."""
    events = run_events()
    for e in events:
        if e["event"] in ("train_end", "done") and e.get("learner") == "learner-1":
            e["t"] = 6.0
    events.sort(key=lambda e: e["t"])
    s = summarise(events, mode="decoupled", learners=2, steps=40, fragments=2)
    assert s["uptime"] == 1.0
    # learner-1 ran its 25 steps over 5 s, no faster: 5 x 100 x 5, the same 2500
    # tokens as before; a slower learner is not a disturbed one.
    assert s["goodput"] == round(3750 / 9000, 4)


def test_steps_run_again_after_a_restart_take_time_and_are_not_kept() -> None:
    """learner-0's second incarnation starts from its checkpoint at step 10, not
    20: it runs steps 11..20 again."""
    events = run_events()
    for e in events:
        if e["event"] == "start" and e["learner"] == "learner-0" and e["incarnation"] == 1:
            e["step"] = 10
    s = summarise(events, mode="decoupled", learners=2, steps=40, fragments=2)
    # learner-0 ran 20 + 30 steps in 2 + 2 s: 12.5 steps/s x 100 x 6.5 = 8125.
    assert s["goodput"] == round(3750 / (8125 + 2500), 4)
    # It kept 40 of them: 40 / 12.5 = 3.2 s; learner-1 2 s.
    assert s["goodput_time"] == round(5.2 / 8.5, 4)


def test_summary_without_evals_or_run_end() -> None:
    events = [e for e in run_events() if e["event"] not in ("eval", "run_end", "summary")]
    s = summarise(events, mode="decoupled", learners=2, steps=40, fragments=2)
    assert s["initial_eval_loss"] is None and s["final_eval_loss"] is None
    assert s["wall_s"] == 7.6  # the last event stands in for run_end
    assert s["eval_curve"] == []


def test_intervals_close_at_train_end_kill_or_end() -> None:
    events: list[Event] = [
        {"t": 1.0, "event": "start", "learner": "a"},
        {"t": 2.0, "event": "start", "learner": "b"},
        {"t": 3.0, "event": "process_kill", "process": "a", "reason": "chaos"},
        {"t": 3.5, "event": "process_kill", "process": "syncer", "reason": "chaos"},
        {"t": 4.0, "event": "start", "learner": "a"},
        {"t": 5.0, "event": "train_end", "learner": "b"},
        {"t": 5.0, "event": "done", "learner": "b"},
        {"t": 5.5, "event": "train_end", "learner": "nobody"},
        {"t": 5.5, "event": "done", "learner": "nobody"},
    ]
    spans = _intervals(events, end=9.0)
    assert dict(spans) == {"a": [(1.0, 3.0), (4.0, 9.0)], "b": [(2.0, 5.0)]}


def test_intervals_close_at_a_crash() -> None:
    events: list[Event] = [
        {"t": 1.0, "event": "start", "learner": "a"},
        {"t": 3.0, "event": "process_crash", "process": "a", "code": 1},
        {"t": 4.0, "event": "process_restart", "process": "a"},
        {"t": 4.0, "event": "start", "learner": "a"},
        {"t": 5.0, "event": "train_end", "learner": "a"},
        {"t": 5.0, "event": "done", "learner": "a"},
    ]
    assert dict(_intervals(events, end=6.0)) == {"a": [(1.0, 3.0), (4.0, 5.0)]}


@pytest.mark.parametrize(
    ("spans", "length"),
    [
        ([], 0.0),
        ([(1.0, 2.0)], 1.0),
        ([(0.0, 2.0), (1.0, 3.0)], 3.0),  # overlapping
        ([(0.0, 10.0), (2.0, 3.0)], 10.0),  # nested
        ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
        ([(5.0, 6.0), (0.0, 1.0), (5.5, 5.7), (6.0, 7.5)], 3.5),  # unsorted, gap
    ],
)
def test_union_length(spans: list[tuple[float, float]], length: float) -> None:
    assert _union_length(spans) == pytest.approx(length)


def test_load_events_merges_sources_in_time_order(tmp_path: Path) -> None:
    (tmp_path / "learners").mkdir()
    (tmp_path / "launcher.jsonl").write_text(
        json.dumps({"t": 0.0, "event": "run_start"})
        + "\n"
        + json.dumps({"t": 3.0, "event": "run_end"})
    )
    (tmp_path / "syncer.jsonl").write_text(json.dumps({"t": 2.0, "event": "round"}) + "\n")
    (tmp_path / "learners" / "learner-0.jsonl").write_text(
        json.dumps({"t": 1.0, "event": "step"}) + "\n" + '{"t": 2.5, "ev'
    )  # cut by SIGKILL
    events = load_events(tmp_path)
    assert [(e["t"], e["source"]) for e in events] == [
        (0.0, "launcher"),
        (1.0, "learner-0"),
        (2.0, "syncer"),
        (3.0, "launcher"),
    ]


def test_plot_run_writes_two_pngs(tmp_path: Path) -> None:
    written = plot_run(run_events(), tmp_path / "plots")
    assert sorted(p.name for p in written) == ["loss_vs_tokens.png", "timeline.png"]
    for p in written:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def restart_events(mode: str) -> list[Event]:
    """100 tokens per step, 10 steps/s when training, one fragment.

    learner-0 trains 2..4.5 (steps 0..20 reported), is SIGKILLed at 4.5, its
    process starts again at 7.5 (imports done 9.0, ready 9.5), it trains again
    from its checkpoint at step 20 at 10 and finishes step 40 at 12. learner-1
    (decoupled only) trains 2..6 undisturbed. In data parallel the group is
    learner-0; rank 1 is the one killed, and the launcher stops rank 0 after.
    """
    victim = "learner-1" if mode == "ddp" else "learner-0"
    events: list[Event] = [
        {"t": 0.0, "event": "run_start", "mode": mode},
        {"t": 0.0, "event": "process_start", "process": "learner-0"},
        {"t": 1.0, "event": "ready", "learner": "learner-0", "incarnation": 0, "imported": 0.8},
        {"t": 2.0, "event": "start", "learner": "learner-0", "incarnation": 0, "step": 0},
        step(3.0, "learner-0", 0, 10, 1000, 10.0, 0, 0),
        step(4.0, "learner-0", 0, 20, 2000, 10.0, 0, 0),
        {"t": 4.5, "event": "process_kill", "process": victim, "reason": "chaos"},
        {"t": 7.5, "event": "process_start", "process": "learner-0"},
        {"t": 7.5, "event": "process_restart", "process": "learner-0"},
        {"t": 9.5, "event": "ready", "learner": "learner-0", "incarnation": 1, "imported": 9.0},
        {"t": 10.0, "event": "start", "learner": "learner-0", "incarnation": 1, "step": 20},
        step(11.0, "learner-0", 1, 30, 3000, 10.0, 0, 0),
        {"t": 12.0, "event": "train_end", "learner": "learner-0", "incarnation": 1, "step": 40},
        {"t": 12.0, "event": "done", "learner": "learner-0", "incarnation": 1, "tokens": 4000},
        {"t": 12.5, "event": "run_end"},
    ]
    if mode == "ddp":
        events += [
            {"t": 4.7, "event": "group_stop", "failed": ["learner-1"]},
            {"t": 4.7, "event": "process_kill", "process": "learner-0", "reason": "group_stop"},
            {"t": 7.5, "event": "process_start", "process": "learner-1"},
            {"t": 7.5, "event": "process_restart", "process": "learner-1"},
        ]
    else:
        events += [
            {"t": 2.0, "event": "start", "learner": "learner-1", "incarnation": 0, "step": 0},
            step(4.0, "learner-1", 0, 20, 2000, 10.0, 0, 0),
            {"t": 6.0, "event": "train_end", "learner": "learner-1", "incarnation": 0, "step": 40},
            {"t": 6.0, "event": "done", "learner": "learner-1", "incarnation": 0, "tokens": 4000},
            {"t": 6.0, "event": "round", "fragment": 0, "included": 2, "tokens": 7500},
        ]
    return sorted(events, key=lambda e: e["t"])


def test_lost_goodput_by_cause_decoupled() -> None:
    """Undisturbed: 1000 tokens/s each, learner-0 over 2..12, learner-1 over 2..6:
    14000. learner-0 lost 3 s waiting to restart (4.5..7.5), 2 s starting its
    process, 0.5 s joining; 4.5 + 4 s of training made 8500 tokens, 7500 merged."""
    b = goodput_breakdown(restart_events("decoupled"), "decoupled", fragments=1)
    assert b["undisturbed_tokens"] == 14000
    assert b["goodput"] == round(7500 / 14000, 4)
    assert b["lost"] == {
        "restart_delay": round(3000 / 14000, 4),
        "process_start": round(2000 / 14000, 4),
        "join": round(500 / 14000, 4),
        "progress_lost": round(1000 / 14000, 4),
        "other": 0.0,
    }
    assert b["goodput"] + sum(b["lost"].values()) == pytest.approx(1, abs=1e-3)
    assert b["restarts"] == [
        {"learner": "learner-0", "at_s": 7.5, "process_start_s": 2.0, "imports_s": 1.5,
         "join_s": 0.5, "restart_to_train_s": 2.5}
    ]  # fmt: skip


def test_lost_goodput_by_cause_elastic_data_parallel() -> None:
    """The group stops when rank 1 dies (4.5), not when the launcher stops rank 0;
    its useful tokens are those it trained, 4000 of the 4500 its training time made
    (steps after the checkpoint at 20 ran again)."""
    b = goodput_breakdown(restart_events("ddp"), "ddp", fragments=1)
    assert b["undisturbed_tokens"] == 10000
    assert b["goodput"] == 0.4
    assert b["lost"] == {
        "restart_delay": 0.3,
        "process_start": 0.2,
        "join": 0.05,
        "progress_lost": 0.05,
        "other": 0.0,
    }
    assert [r["restart_to_train_s"] for r in b["restarts"]] == [2.5]


def test_a_learner_killed_while_it_starts_waits_again() -> None:
    """Killed at 8.5, before it was ready; started again at 9.0. The whole gap
    from 4.5 to 10 is restart delay (3 + 0.5 s), process start (1 + 0.5 s) and join, and
    the interrupted start is no restart that trained."""
    events = restart_events("decoupled")
    events += [
        {"t": 8.5, "event": "process_kill", "process": "learner-0", "reason": "chaos"},
        {"t": 9.0, "event": "process_start", "process": "learner-0"},
        {"t": 9.0, "event": "process_restart", "process": "learner-0"},
    ]
    events.sort(key=lambda e: e["t"])
    b = goodput_breakdown(events, "decoupled", fragments=1)
    assert b["lost"]["restart_delay"] == round(3500 / 14000, 4)
    assert b["lost"]["process_start"] == round(1500 / 14000, 4)
    assert b["lost"]["join"] == round(500 / 14000, 4)
    assert [r["at_s"] for r in b["restarts"]] == [9.0]


def test_the_summary_carries_the_breakdown() -> None:
    s = summarise(restart_events("decoupled"), mode="decoupled", learners=2, steps=40,
                  fragments=1)  # fmt: skip
    assert s["goodput_lost"]["restart_delay"] == round(3000 / 14000, 4)
    assert s["restart_to_train_s"] == [2.5]


def test_a_warm_spare_has_no_imports_left() -> None:
    """Its imports were done before the restart started it (at 3.0, not after 7.5)."""
    events = restart_events("decoupled")
    for e in events:
        if e["event"] == "ready" and e["incarnation"] == 1:
            e["imported"] = 3.0
    (restart,) = goodput_breakdown(events, "decoupled", fragments=1)["restarts"]
    assert (restart["imports_s"], restart["process_start_s"]) == (0.0, 2.0)


def test_merged_tokens_are_shared_by_the_steps_each_delta_covers() -> None:
    events: list[Event] = [
        {"t": 0.0, "event": "process_start", "process": "learner-0"},
        {"t": 5.0, "event": "process_start", "process": "learner-1"},
        # Fragment 0: learner-0's 10 steps alone; fragment 1: with learner-1's 30.
        {"t": 6.0, "event": "round", "tokens": 1000, "spans": [["learner-0", 0, 10]]},
        {"t": 9.5, "event": "round", "tokens": 4000,
         "spans": [["learner-0", 0, 10], ["learner-1", 0, 30]]},
        {"t": 10.0, "event": "round", "tokens": 500, "spans": [["learner-2", 4, 9]]},
        # A container's learner: from its imports done.
        {"t": 11.0, "event": "ready", "learner": "learner-3", "imported": 10.5},
        {"t": 13.0, "event": "round", "tokens": 800, "spans": [["learner-3", 0, 4]]},
    ]  # fmt: skip
    merged = merged_by_learner(events, fragments=2)
    assert merged == {
        "learner-0": {"merged_tokens": (1000 + 4000 * 10 / 40) / 2, "first_merge_s": 6.0},
        "learner-1": {"merged_tokens": 4000 * 30 / 40 / 2, "first_merge_s": 4.5},
        # Neither started by the launcher nor ready: no start to count from.
        "learner-2": {"merged_tokens": 500 / 2, "first_merge_s": None},
        "learner-3": {"merged_tokens": 800 / 2, "first_merge_s": 2.5},
    }


def test_the_seconds_curve_counts_from_the_first_learner_start() -> None:
    events: list[Event] = [
        {"t": 100.0, "event": "eval", "loss": 5.5},  # the initial model, before any start
        {"t": 102.0, "event": "start", "learner": "learner-1"},
        {"t": 101.0, "event": "start", "learner": "learner-0"},
        {"t": 111.0, "event": "eval", "loss": 3.0},
    ]
    assert eval_curve_seconds(events) == [(-1.0, 5.5), (10.0, 3.0)]
