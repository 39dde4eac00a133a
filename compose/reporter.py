"""``ddiloco report``: a run folder's events into ``summary.json``, ``metrics.jsonl``
and plots, once or (``--follow``) as the run goes.

``ddiloco local`` reports its own run at the end. A cluster has no launcher:
its services write their events into one shared folder (the syncer
``syncer.jsonl``, the evaluator ``evaluator.jsonl``, each learner
``learners/<id>.jsonl``, ``ddiloco chaos`` ``chaos.jsonl``) and the reporter
service turns them into the same outputs, every ``every_s`` seconds while
anything changed, when every learner has finished, and once more when it is
stopped. Each report prints one progress line (``docker compose logs``).

Chaos kills containers, not learner ids: a learner's ``lease`` event names
the container (its host name) that holds the id, so a kill of that container
counts as a kill of that learner in the summary and on the timeline.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.checks import check_positive
from broker.run.settings import RunSettings
from compose.report import load_events, plot_run, summarise

log = logging.getLogger(__name__)
CHAOS_EVENTS = "chaos.jsonl"


@dataclass
class ReportConfig:
    run: RunSettings = field(default_factory=RunSettings)
    out: str = "."  # the run folder: event files in; summary.json, metrics.jsonl, plots/ out
    follow: bool = False  # report every every_s seconds until stopped (SIGTERM)
    every_s: float = 30.0  # the period of --follow

    def __post_init__(self) -> None:
        check_positive("every_s", self.every_s)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill, or being written
    return events


def chaos_as_process_events(
    chaos: list[dict[str, Any]], leases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``ddiloco chaos`` container kills and restarts as the launcher's process
    events: a learner container by the learner id its host held at that time."""
    holders = sorted(
        ((e["t"], e["holder"], e["learner"]) for e in leases if "holder" in e), key=lambda x: x[0]
    )

    def process_of(e: dict[str, Any]) -> str | None:
        if e.get("role") != "learner":
            return e.get("role")
        held = [name for t, holder, name in holders if holder == e.get("hostname") and t <= e["t"]]
        return held[-1] if held else None

    out = []
    for e in chaos:
        kind = {"kill": "process_kill", "restart": "process_restart"}.get(e.get("event", ""))
        process = process_of(e) if kind else None
        if kind and process:
            out.append({"t": e["t"], "event": kind, "process": process, "reason": "chaos"})
    return out


def cluster_events(out: Path) -> list[dict[str, Any]]:
    """Every event of a cluster's run folder, in time order, framed by run_start
    and run_end (the first and the last event) as a launcher would write them."""
    events = load_events(out)
    leases = [e for e in events if e["event"] == "lease"]
    events += chaos_as_process_events(read_jsonl(out / CHAOS_EVENTS), leases)
    events.sort(key=lambda e: e["t"])
    if events and not any(e["event"] == "run_start" for e in events):
        events.insert(0, {"t": events[0]["t"], "event": "run_start", "mode": "decoupled"})
        events.append({"t": events[-1]["t"], "event": "run_end"})
    return events


def finished(events: list[dict[str, Any]]) -> bool:
    """Every learner id that started has finished (its newest incarnation is done)."""
    state: dict[str, str] = {}
    for e in events:
        if "learner" in e and e["event"] in ("start", "done"):
            state[e["learner"]] = e["event"]
    return bool(state) and all(s == "done" for s in state.values())


def report(cfg: ReportConfig) -> dict[str, Any] | None:
    """Write the outputs from what the folder holds now; None when it holds no events."""
    out = Path(cfg.out)
    events = cluster_events(out)
    if not events:
        return None
    learner_ids = {e["learner"] for e in events if "learner" in e and e["event"] == "start"}
    summary = summarise(
        events,
        mode="decoupled",
        learners=len(learner_ids),
        steps=cfg.run.steps,
        fragments=cfg.run.fragments,
    )
    summary["finished"] = finished(events)
    with open(out / "metrics.jsonl.tmp", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    (out / "metrics.jsonl.tmp").replace(out / "metrics.jsonl")
    (out / "summary.json.tmp").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.json.tmp").replace(out / "summary.json")
    plot_run(events, out / "plots")
    return summary


def _progress_line(summary: dict[str, Any]) -> str:
    loss = summary.get("final_eval_loss")
    return (
        f"learners {summary['learners']}  tokens {summary['tokens_total']}  "
        f"rounds {summary['fragments_published']}  deltas {summary['deltas_applied']}  "
        f"eval loss {loss if loss is None else round(loss, 4)}  "
        f"kills {summary['learner_kills']}  finished {summary['finished']}"
    )


def _inputs_size(out: Path) -> int:
    """Bytes of every event file: unchanged size, nothing new to report."""
    files = [out / n for n in ("syncer.jsonl", "evaluator.jsonl", CHAOS_EVENTS)]
    files += list((out / "learners").glob("*.jsonl"))
    return sum(p.stat().st_size for p in files if p.exists())


def _wait_until_quiet(out: Path, quiet_s: float = 2.0, max_s: float = 20.0) -> None:
    """Stopped: wait until no event file grew for ``quiet_s`` (at most ``max_s``,
    within compose's 30 s stop grace). Services stopped together (``docker
    compose down``, ``stop``) write their last events as they stop: the syncer
    its final round, the evaluator its last evaluation."""
    deadline = time.monotonic() + max_s
    last, since = _inputs_size(out), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        size = _inputs_size(out)
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def run_report(cfg: ReportConfig, stop: threading.Event | None = None) -> int:
    """Report once, or with ``follow`` until ``stop`` is set (by SIGTERM or SIGINT
    when none is given), then once more."""
    if not cfg.follow:
        summary = report(cfg)
        if summary is None:
            print(f"ddiloco report: no events in {cfg.out}", flush=True)
            return 2
        print(_progress_line(summary), flush=True)
        return 0
    if stop is None:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("ready", flush=True)
    reported_size = -1
    done_reported = False
    while True:
        # Read before reporting: a stop that comes during a report (plots take a
        # while) gets one more, of what the services wrote as they stopped.
        stopping = stop.is_set()
        if stopping:
            _wait_until_quiet(Path(cfg.out))
        size = _inputs_size(Path(cfg.out))
        if size != reported_size or stopping:
            summary = report(cfg)
            reported_size = size
            if summary is not None:
                print(_progress_line(summary), flush=True)
                if summary["finished"] and not done_reported:
                    print(f"run finished: summary and plots in {cfg.out}", flush=True)
                done_reported = summary["finished"]
        if stopping:
            return 0
        stop.wait(cfg.every_s)
