"""What a learner tells the outside: Prometheus metrics, and the progress file
that lets a restarted learner resume its schedule (events: :class:`broker.files.EventLog`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from broker.files import atomic_write


class LearnerMetrics:
    def __init__(self, port: int, host: str) -> None:
        r = self.registry = CollectorRegistry()
        self.steps = Counter("ddiloco_learner_steps", "Inner steps", registry=r)
        self.tokens = Counter("ddiloco_learner_tokens", "Tokens trained on", registry=r)
        self.step_rate = Gauge("ddiloco_learner_steps_per_second", "Recent step rate", registry=r)
        self.deltas_sent = Counter(
            "ddiloco_learner_deltas_sent", "Deltas handed to the comm thread", registry=r
        )
        self.globals_applied = Counter(
            "ddiloco_learner_globals_applied", "Globals applied", registry=r
        )
        self.bytes_up = Gauge("ddiloco_learner_bytes_sent", "Bytes sent on the wire", registry=r)
        self.bytes_down = Gauge(
            "ddiloco_learner_bytes_received", "Bytes received on the wire", registry=r
        )
        self.version = Gauge(
            "ddiloco_learner_fragment_version", "Base version", ["fragment"], registry=r
        )
        if port:
            start_http_server(port, addr=host, registry=r)


class ProgressFile:
    """(step, tokens, incarnation) of a learner id, written atomically as it trains."""

    def __init__(self, state_dir: str | None, learner_id: str) -> None:
        self.path = Path(state_dir) / f"{learner_id}.json" if state_dir else None

    def load(self) -> tuple[int, int, int]:
        """What the previous incarnation saved last, or zeros."""
        if self.path is None or not self.path.exists():
            return 0, 0, 0
        saved = json.loads(self.path.read_text())
        return int(saved["step"]), int(saved["tokens"]), int(saved.get("incarnation", 0))

    def save(self, step: int, tokens: int, incarnation: int) -> None:
        if self.path is not None:
            progress = {"step": step, "tokens": tokens, "incarnation": incarnation}
            atomic_write(self.path, json.dumps(progress).encode())


class StepClock:
    """Each step's time (training since the last call plus the call's own work),
    and steps per second with syncing on and with it off."""

    def __init__(self) -> None:
        self.last_step_s = 0.0
        self._last_end: float | None = None
        self._began = 0.0
        self._seconds = {True: 0.0, False: 0.0}
        self._steps = {True: 0, False: 0}

    def begin(self) -> None:
        self._began = time.perf_counter()

    def end(self, sync_on: bool) -> None:
        now = time.perf_counter()
        since_last = self._began - self._last_end if self._last_end is not None else 0.0
        self.last_step_s = since_last + (now - self._began)
        if self._last_end is not None:  # the first step has no time of its own
            self._seconds[sync_on] += self.last_step_s
            self._steps[sync_on] += 1
        self._last_end = now

    def steps_per_s(self, sync_on: bool) -> float | None:
        seconds = self._seconds[sync_on]
        return self._steps[sync_on] / seconds if seconds > 0 else None
