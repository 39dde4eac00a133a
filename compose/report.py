"""Turn a run folder's event streams into ``summary.json`` and plots.

Pure over the list of events (except :func:`load_events` and the plotting),
so the accounting is testable: every figure in a summary is derived from what
the processes themselves recorded, nothing is assumed.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

SUMMARY_KEYS = (
    "learners",
    "steps_per_learner",
    "tokens_total",
    "wall_s",
    "initial_eval_loss",
    "final_eval_loss",
    "fragments_published",
    "deltas_applied",
    "deltas_rejected",
    "transport_refused",
    "bytes_up",
    "bytes_down",
    "learner_kills",
    "learner_restarts",
    "goodput",
    "goodput_time",
    "uptime",
)


def load_events(out: Path) -> list[dict[str, Any]]:
    """Every process's JSON lines, tagged with their source, in time order."""
    sources = [(name, out / f"{name}.jsonl") for name in ("launcher", "syncer", "evaluator")]
    sources += [(p.stem, p) for p in sorted((out / "learners").glob("*.jsonl"))]
    events: list[dict[str, Any]] = []
    for source, path in sources:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by SIGKILL
            e.setdefault("source", source)
            events.append(e)
    events.sort(key=lambda e: e["t"])
    return events


def _intervals(
    events: list[dict[str, Any]], end: float, trained_only: bool = False
) -> dict[str, list[tuple[float, float]]]:
    """When each learner was training: from its 'start' to its 'train_end', kill or crash.

    ``trained_only``: leave out a restart that starts at the learner's last
    step and ends there (it was killed after that step, while sending its last
    progress): it trained nothing, and must not stretch the window in which
    uptime is measured past the run's last step. Goodput keeps it: the kill
    shows there as time after the last step (``other``)."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    open_since: dict[str, tuple[float, int | None]] = {}
    for e in events:
        if e["event"] == "start" and "learner" in e:
            open_since[e["learner"]] = (e["t"], e.get("step"))
        elif e["event"] == "train_end" and e.get("learner") in open_since:
            since, from_step = open_since.pop(e["learner"])
            if not (trained_only and from_step is not None and e.get("step") == from_step):
                spans[e["learner"]].append((since, e["t"]))
        elif e["event"] in ("process_kill", "process_crash") and e.get("process") in open_since:
            spans[e["process"]].append((open_since.pop(e["process"])[0], e["t"]))
    for name, (since, _) in open_since.items():
        spans[name].append((since, end))
    return spans


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(spans):
        if cur_end is None or s > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def tokens_at(events: list[dict[str, Any]]) -> list[int]:
    """For each event, the tokens all learners had trained by then (from their own
    progress reports: the newest figure of each learner id, across restarts)."""
    newest: dict[str, int] = {}
    out = []
    for e in events:
        if e["event"] in ("step", "done") and "learner" in e:
            newest[e["learner"]] = max(newest.get(e["learner"], 0), int(e.get("tokens", 0)))
        out.append(sum(newest.values()))
    return out


def eval_curve(events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(tokens trained by all learners, held-out loss of the global model) per evaluation.

    A learner that evaluates itself (data parallel) reports its group's tokens; the
    evaluator does not know them, so its evaluations are placed by the learners'
    progress reports up to that moment."""
    trained = tokens_at(events)
    return [
        (int(e["tokens"]) if "tokens" in e else trained[i], float(e["loss"]))
        for i, e in enumerate(events)
        if e["event"] == "eval"
    ]


def eval_curve_seconds(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(seconds from the first learner's start, held-out loss) per evaluation."""
    learners_start = min(e["t"] for e in events if e["event"] == "start")
    return [(e["t"] - learners_start, float(e["loss"])) for e in events if e["event"] == "eval"]


# Why a learner's time in its goodput window was not spent on kept steps, in the
# order a restart goes through them (see goodput_breakdown).
LOSS_CAUSES = ("restart_delay", "process_start", "join", "progress_lost")
# The event that puts a learner in each state: (event, field naming the learner).
_STATE_OF = {
    ("start", "learner"): "training",
    ("train_end", "learner"): "finished",
    ("process_kill", "process"): "restart_delay",
    ("process_crash", "process"): "restart_delay",
    ("process_start", "process"): "process_start",
    ("ready", "learner"): "join",
}


def _last_counters(
    events: list[dict[str, Any]],
) -> tuple[dict[tuple[str, int], dict[str, Any]], dict[str, list[float]]]:
    """Per learner incarnation, the last cumulative counters it reported; per learner,
    its reported step rates."""
    last: dict[tuple[str, int], dict[str, Any]] = {}
    rates: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if "learner" not in e or "incarnation" not in e:
            continue
        if e["event"] in ("step", "done"):
            last[(e["learner"], e["incarnation"])] = e
        if e["event"] == "step" and e.get("steps_per_s"):
            rates[e["learner"]].append(e["steps_per_s"])
    return last, rates


def _tokens_per_learner(last: dict[tuple[str, int], dict[str, Any]]) -> dict[str, int]:
    """The most tokens each learner id reported, across its incarnations."""
    tokens: dict[str, int] = defaultdict(int)
    for (name, _), e in last.items():
        tokens[name] = max(tokens[name], int(e.get("tokens", 0)))
    return tokens


def _time_in_states(
    events: list[dict[str, Any]], name: str, window: tuple[float, float], group: bool
) -> dict[str, float]:
    """Seconds learner ``name`` spent in each state within ``window``, from the
    events that move it between states (``_STATE_OF``); 'unknown' before any.
    A data-parallel ``group`` stops, and starts again, with any of its ranks."""

    def mine(key: str, value: Any) -> bool:
        if group and key == "process":
            return str(value).startswith("learner-")
        return bool(value == name)

    seconds: dict[str, float] = defaultdict(float)
    state, since = "unknown", window[0]
    for e in events:
        moves = [
            st
            for (kind, key), st in _STATE_OF.items()
            if kind == e["event"] and mine(key, e.get(key))
        ]
        if not moves:
            continue
        t = min(max(e["t"], window[0]), window[1])
        seconds[state] += t - since
        state, since = moves[0], t
    seconds[state] += window[1] - since
    return seconds


def _restarts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every restarted learner process that trained again: from its process start to
    its 'ready' (interpreter, imports, model; imports_s of it to its imports done)
    and on to its 'start' (joining)."""
    start = next((e["t"] for e in events if e["event"] == "run_start"), events[0]["t"])
    out = []
    pending: dict[str, dict[str, float]] = {}
    for e in events:
        name = str(e.get("process") or e.get("learner") or "")
        if e["event"] == "process_restart" and name in pending:
            pending[name]["restart"] = 1.0
        elif e["event"] == "process_start":
            pending[name] = {"spawned": e["t"]}
        elif e["event"] in ("process_kill", "process_crash"):
            pending.pop(name, None)
        elif e["event"] == "ready" and name in pending:
            pending[name]["ready"] = e["t"]
            pending[name]["imported"] = float(e.get("imported", e["t"]))
        elif e["event"] == "start" and name in pending:
            p = pending.pop(name)
            if "restart" in p and "ready" in p:
                out.append(
                    {
                        "learner": name,
                        "at_s": round(p["spawned"] - start, 3),
                        "process_start_s": round(p["ready"] - p["spawned"], 3),
                        # A warm spare did its imports before it was started: none left.
                        "imports_s": round(max(0.0, p["imported"] - p["spawned"]), 3),
                        "join_s": round(e["t"] - p["ready"], 3),
                        "restart_to_train_s": round(e["t"] - p["spawned"], 3),
                    }
                )
    return out


def goodput_breakdown(events: list[dict[str, Any]], mode: str, fragments: int) -> dict[str, Any]:
    """Goodput, and where the rest went, from a run's events.

    Goodput: tokens that reached the global model over what the learners would
    have trained, at their own speed, had nothing stopped them from their first
    start to their finish (their windows). A learner's speed is the steps it ran
    over the time it ran them, from each incarnation's start to its last report
    (steps it ran again after a restart count: they took time). Every delta
    covers its learner's tokens once per fragment, hence the division by P.
    Data parallel's group is one learner: its useful tokens are those trained.

    Each second of a learner's window is worth its undisturbed tokens per second,
    and is spent in one state, which the events set: training (from 'start'),
    restart_delay (from a kill or crash: the wait the experiment sets, plus the
    supervisor's poll), process_start (from the launcher starting the process:
    interpreter, imports, model, and data parallel's rendezvous), join (from
    'ready': connecting, loading the global or the checkpoint). Training time
    whose tokens did not reach the model (steps run again after a restart,
    progress never merged) is progress_lost. So goodput + the four causes + other
    = 1, where other is time in no known state (none when the events are whole).
    """
    start = next(e["t"] for e in events if e["event"] == "run_start")
    end = next((e["t"] for e in reversed(events) if e["event"] == "run_end"), events[-1]["t"])
    rounds = [e for e in events if e["event"] == "round"]
    last, _ = _last_counters(events)
    tokens = _tokens_per_learner(last)
    started: dict[tuple[str, int], tuple[float, int]] = {}
    reached: dict[tuple[str, int], tuple[float, int]] = {}
    for e in events:
        if "learner" not in e or "incarnation" not in e:
            continue
        key = (e["learner"], e["incarnation"])
        if e["event"] == "start":
            started[key] = (e["t"], int(e.get("step", 0)))
        elif e["event"] in ("step", "train_end") and "step" in e:
            reached[key] = (e["t"], int(e["step"]))

    undisturbed = 0.0
    lost_tokens: dict[str, float] = defaultdict(float)  # undisturbed tokens per state
    kept_s = 0.0  # time spent on steps that were kept (not run again after a restart)
    window_s = 0.0
    for name, learner_spans in _intervals(events, end).items():
        runs = [(started[k], reached[k]) for k in started if k[0] == name and k in reached]
        ran_steps = sum(step - from_step for (_, from_step), (_, step) in runs)
        ran_s = sum(t - from_t for (from_t, _), (t, _) in runs)
        if ran_steps <= 0 or ran_s <= 0:
            continue
        steps_per_s = ran_steps / ran_s
        furthest = max(step for _, (_, step) in runs)
        tokens_per_s = steps_per_s * tokens[name] / furthest
        window = (min(s for s, _ in learner_spans), max(e for _, e in learner_spans))
        undisturbed += tokens_per_s * (window[1] - window[0])
        for state, seconds in _time_in_states(events, name, window, mode == "ddp").items():
            lost_tokens[state] += tokens_per_s * seconds
        kept_s += (furthest - min(from_step for (_, from_step), _ in runs)) / steps_per_s
        window_s += window[1] - window[0]
    if mode == "ddp":
        useful = float(sum(tokens.values()))
    else:
        useful = sum(e["tokens"] for e in rounds) / fragments
    lost_tokens["progress_lost"] = lost_tokens.pop("training", 0.0) - useful

    def share(x: float) -> float:
        return round(x / undisturbed, 4) if undisturbed > 0 else 0.0

    lost = {cause: share(lost_tokens.pop(cause, 0.0)) for cause in LOSS_CAUSES}
    lost["other"] = share(sum(lost_tokens.values()))
    return {
        "goodput": share(useful),
        "goodput_time": round(kept_s / window_s, 4) if window_s > 0 else 0.0,
        "lost": lost,
        "useful_tokens": useful,
        "undisturbed_tokens": round(undisturbed, 1),
        "restarts": _restarts(events),
        "wall_s": round(end - start, 2),
    }


def merged_by_learner(events: list[dict[str, Any]], fragments: int) -> dict[str, dict[str, Any]]:
    """Per learner whose deltas rounds merged: ``merged_tokens``, its share of
    each round's tokens (split among the round's deltas by the steps each
    covers) summed over rounds and divided by the P fragments, as goodput
    counts them; and ``first_merge_s``, seconds from its first process start
    to the first round that merged one of its deltas. A learner the launcher
    did not start (a container) counts from its first process's imports done
    (its first ``ready`` event's ``imported``): the interpreter's own start,
    and the container's, came a few seconds before."""
    started: dict[str, float] = {}
    imported: dict[str, float] = {}
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "process_start":
            started.setdefault(e["process"], e["t"])
        elif e["event"] == "ready" and "learner" in e:
            imported.setdefault(e["learner"], float(e.get("imported", e["t"])))
        elif e["event"] == "round" and e.get("spans"):
            steps: dict[str, int] = {}
            for learner, from_step, to_step in e["spans"]:
                steps[learner] = steps.get(learner, 0) + max(0, to_step - from_step)
            total = sum(steps.values())
            for learner, n in steps.items():
                mine = out.setdefault(learner, {"merged_tokens": 0.0, "first_merge_s": None})
                if total:
                    mine["merged_tokens"] += e["tokens"] * n / total / fragments
                since = started.get(learner, imported.get(learner))
                if mine["first_merge_s"] is None and since is not None:
                    mine["first_merge_s"] = round(e["t"] - since, 3)
    for mine in out.values():
        mine["merged_tokens"] = round(mine["merged_tokens"], 1)
    return dict(sorted(out.items()))


def summarise(
    events: list[dict[str, Any]],
    mode: str,
    learners: int,
    steps: int,
    fragments: int,
) -> dict[str, Any]:
    """A run's summary from its events. ``quorum`` is the K the syncer closed
    its last round with (it follows the learners that joined, when fewer than
    the run's did), None without rounds (data parallel)."""
    start = next(e["t"] for e in events if e["event"] == "run_start")
    end = next((e["t"] for e in reversed(events) if e["event"] == "run_end"), events[-1]["t"])
    evals = [e for e in events if e["event"] == "eval"]
    curve = eval_curve(events)
    rounds = [e for e in events if e["event"] == "round"]

    last, rates = _last_counters(events)
    tokens_total = sum(_tokens_per_learner(last).values())

    spans = _intervals(events, end, trained_only=True)
    all_spans = [s for v in spans.values() for s in v]
    train_start = min((s for s, _ in all_spans), default=start)
    train_end = max((e for _, e in all_spans), default=end)
    uptime = (
        _union_length(all_spans) / (train_end - train_start) if train_end > train_start else 0.0
    )

    accounting = goodput_breakdown(events, mode, fragments)

    # Deltas the syncer refused: its reject events (written as they happen, so a
    # killed syncer's count survives). Apart from them, what its transport refused
    # before it was a delta (malformed, unauthenticated: each incarnation's totals).
    syncer_totals = [e for e in events if e["event"] == "summary"]
    rejected: Counter[str] = Counter(e["reason"] for e in events if e["event"] == "reject")
    transport_refused: Counter[str] = Counter()
    for totals in syncer_totals:
        for reason, count in totals.get("transport_refused_by_reason", {}).items():
            transport_refused[reason] += int(count)
    # Failures: neither the stops at the end nor data parallel's group stops.
    kills = [
        e
        for e in events
        if e["event"] == "process_kill" and e.get("reason") not in ("shutdown", "group_stop")
    ]
    restarts = [e for e in events if e["event"] == "process_restart"]
    summary: dict[str, Any] = {
        "mode": mode,
        "learners": learners,
        "quorum": rounds[-1].get("quorum") if rounds else None,
        "steps_per_learner": steps,
        "tokens_total": tokens_total,
        "wall_s": round(end - start, 2),
        "initial_eval_loss": evals[0]["loss"] if evals else None,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "fragments_published": len(rounds),
        "deltas_applied": sum(e["included"] for e in rounds),
        "deltas_rejected": sum(rejected.values()),
        "rejected_by_reason": dict(sorted(rejected.items())),
        "transport_refused": sum(transport_refused.values()),
        "transport_refused_by_reason": dict(sorted(transport_refused.items())),
        "duplicates": sum(int(e.get("duplicates", 0)) for e in syncer_totals),
        "bytes_up": sum(int(e.get("bytes_sent", 0)) for e in last.values()),
        "bytes_down": sum(int(e.get("bytes_received", 0)) for e in last.values()),
        "learner_kills": sum(1 for e in kills if e["process"].startswith("learner")),
        "learner_restarts": sum(1 for e in restarts if e["process"].startswith("learner")),
        "syncer_kills": sum(1 for e in kills if e["process"] == "syncer"),
        "group_stops": sum(1 for e in events if e["event"] == "group_stop"),
        "goodput": accounting["goodput"],
        "goodput_time": accounting["goodput_time"],
        "uptime": round(uptime, 4),
        "merged_tokens": accounting["useful_tokens"],
        "merged_by_learner": merged_by_learner(events, fragments),
        "goodput_lost": accounting["lost"],
        "restart_to_train_s": [r["restart_to_train_s"] for r in accounting["restarts"]],
        "mean_steps_per_s": round(statistics.mean(statistics.median(r) for r in rates.values()), 3)
        if rates
        else None,
        "steps_per_s_sync_on": _mean_of(events, "steps_per_s_sync_on"),
        "steps_per_s_sync_off": _mean_of(events, "steps_per_s_sync_off"),
        "eval_curve": [list(point) for point in curve],
    }
    return summary


def _mean_of(events: list[dict[str, Any]], key: str) -> float | None:
    values = [e[key] for e in events if e["event"] == "done" and e.get(key)]
    return round(statistics.mean(values), 4) if values else None


def plot_run(events: list[dict[str, Any]], folder: Path) -> list[Path]:
    """loss_vs_tokens.png and timeline.png; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    curve = eval_curve(events)
    fig, ax = plt.subplots(figsize=(6, 4))
    if curve:
        ax.plot([t for t, _ in curve], [loss for _, loss in curve], marker="o", ms=3)
    ax.set_xlabel("tokens trained (all learners)")
    ax.set_ylabel("held-out loss of the global model")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "loss_vs_tokens.png", dpi=110)
    plt.close(fig)
    written.append(folder / "loss_vs_tokens.png")

    start = events[0]["t"]
    end = events[-1]["t"]
    spans = _intervals(events, end)
    names = sorted(spans)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    for row, name in enumerate(names):
        for began, ended in spans[name]:
            ax.barh(row, ended - began, left=began - start, color="tab:blue", height=0.5)
    for e in events:
        if e["event"] == "process_kill" and e.get("reason") != "shutdown" and e["process"] in names:
            ax.plot(e["t"] - start, names.index(e["process"]), "rx", ms=10)
        if e["event"] == "process_restart" and e["process"] in names:
            ax.plot(e["t"] - start, names.index(e["process"]), "g>", ms=7)
        if e["event"] == "process_kill" and e["process"] == "syncer":
            ax.axvline(e["t"] - start, color="red", ls="--", lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel(
        "seconds since start (bars: training; x: SIGKILL; >: restart; dashed: syncer killed)"
    )
    fig.tight_layout()
    fig.savefig(folder / "timeline.png", dpi=110)
    plt.close(fig)
    written.append(folder / "timeline.png")
    return written
