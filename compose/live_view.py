"""What ``ddiloco local`` shows while it runs: a live rich table, or a plain log line
when stderr is not a terminal (or ``--no-progress``)."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table


class LiveView:
    """Per-learner progress and the global model's state, fed from the metrics files."""

    def __init__(self, m: int, steps: int) -> None:
        self.steps = steps
        self.learners: dict[str, dict[str, Any]] = {f"learner-{i}": {} for i in range(m)}
        self.eval_loss: float | None = None
        self.first_eval: float | None = None
        self.rounds: list[float] = []
        self.kills = 0
        self.restarts = 0

    def update_learner(self, name: str, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e["event"] in ("step", "done", "start"):
                self.learners[name].update({k: v for k, v in e.items() if k != "event"})
                self.learners[name]["state"] = e["event"]
            if e["event"] == "eval":
                self._eval(e["loss"])

    def _eval(self, loss: float) -> None:
        self.eval_loss = loss
        if self.first_eval is None:
            self.first_eval = loss

    def update_syncer(self, events: list[dict[str, Any]]) -> None:
        for e in events:
            if e["event"] == "eval":
                self._eval(e["loss"])
            elif e["event"] == "round":
                self.rounds.append(e["t"])

    def fragments_per_s(self) -> float:
        recent = [t for t in self.rounds if t > time.time() - 10]
        return len(recent) / 10

    def table(self) -> Table:
        loss = (
            "-" if self.eval_loss is None else f"{self.eval_loss:.3f} (start {self.first_eval:.3f})"
        )
        t = Table(
            title=f"global eval loss {loss}   fragments/s {self.fragments_per_s():.1f}   "
            f"kills {self.kills}   restarts {self.restarts}"
        )
        for col in ("learner", "step", "steps/s", "train loss", "state"):
            t.add_column(col)
        for name, s in self.learners.items():
            t.add_row(
                name,
                f"{s.get('step', 0)}/{self.steps}",
                f"{s.get('steps_per_s', 0):.1f}",
                f"{s['loss']:.3f}" if "loss" in s else "-",
                s.get("state", "starting"),
            )
        return t

    def line(self) -> str:
        steps = " ".join(f"{s.get('step', 0)}" for s in self.learners.values())
        loss = "-" if self.eval_loss is None else f"{self.eval_loss:.3f}"
        return (
            f"eval loss {loss} | steps {steps} of {self.steps} | "
            f"fragments/s {self.fragments_per_s():.1f} | kills {self.kills}"
        )
