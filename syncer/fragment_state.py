"""One fragment's aggregation state: the syncer's logic, with no I/O.

Offers of deltas come in, rounds close, new versions come out. Transport,
checkpoint files and clocks stay in :mod:`syncer.service`; this module only
sees tensors, numbers and a ``now`` passed in, so every decision is testable.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from broker.codecs import Codec
from broker.wire import Delta
from syncer.aggregation import (
    StaleDelta,
    VersionHistory,
    outer_gradient,
    radial_directional_mean,
    token_step_weight,
    weighted_mean,
)
from syncer.outer import nesterov_step
from syncer.quorum import Round

# Statuses of an offer. Anything else is a rejection reason.
ACCEPTED = "accepted"
DUPLICATE = "duplicate"  # already applied: ack at once
HELD = "held"  # a resend or an older delta of a learner already in the round: ack on close
QUARANTINE_MIN_SAMPLES = 5


@dataclass(frozen=True)
class AggregationParams:
    quorum: int
    grace_gamma: float
    overlap: int
    staleness: int
    outer_lr: float
    outer_momentum: float
    aggregation: str  # "mean" or "radial"
    codec: str  # of published globals
    quarantine_factor: float


@dataclass
class _Contribution:
    key: tuple[int, int]  # (incarnation, seq)
    grad: torch.Tensor
    weight: float
    c_tokens: int
    c_steps: int
    step: int  # the learner's step when it sent the delta
    ref: Any


@dataclass
class RoundResult:
    version: int
    payload: bytes  # the published global, encoded
    included: int  # deltas merged
    tokens: int  # tokens behind them
    refs: list[Any]  # everything to acknowledge once the new state is durable
    learners: list[str] = field(default_factory=list)
    keys: list[tuple[str, int, int]] = field(default_factory=list)  # (learner, incarnation, seq)


def canonical(codec: Codec, weights: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """Encode weights for publishing, and the exact weights learners will decode.

    The syncer keeps the decoded copy as its global so that learner and syncer
    rebase against bit-identical weights even with a lossy downlink codec.
    """
    payload = codec.encode(weights)
    return codec.decode(payload, weights.numel()), payload


class FragmentState:
    def __init__(
        self, fragment: int, weights: torch.Tensor, params: AggregationParams, version: int = 0
    ) -> None:
        self.fragment = fragment
        self.params = params
        self.codec = Codec.parse(params.codec)
        self.numel = weights.numel()
        self.history = VersionHistory(params.staleness)
        weights, self.payload = canonical(self.codec, weights.to(torch.float32))
        self.history.push(version, weights)
        self.momentum: torch.Tensor | None = None
        self.applied: dict[str, tuple[int, int]] = {}  # newest (incarnation, seq) merged
        self.merged_step: dict[str, int] = {}  # newest learner step merged (token accounting)
        self.round = Round(params.quorum, params.grace_gamma, params.overlap)
        self._pending: dict[str, _Contribution] = {}
        self._held_refs: list[Any] = []
        self._recent_norms: deque[float] = deque(maxlen=64)

    @property
    def version(self) -> int:
        return self.history.current_version

    @property
    def weights(self) -> torch.Tensor:
        return self.history.current

    @property
    def pending_learners(self) -> list[str]:
        return sorted(self._pending)

    def offer(self, delta: Delta, tensor: torch.Tensor, ref: Any, now: float) -> str:
        """Take a decoded delta into the open round; returns a status or a rejection reason."""
        key = (delta.incarnation, delta.seq)
        done = self.applied.get(delta.learner_id)
        if done is not None and key <= done:
            return DUPLICATE
        current = self._pending.get(delta.learner_id)
        if current is not None and key <= current.key:
            self._held_refs.append(ref)
            return HELD
        if tensor.shape != self.weights.shape:
            return "bad_shape"
        if not torch.isfinite(tensor).all():
            return "non_finite"
        if delta.c_tokens == 0 or delta.c_steps == 0:
            return "empty"
        try:
            base = self.history.get(delta.base_version)
        except StaleDelta as e:
            return e.reason
        grad = outer_gradient(tensor, base, self.weights)
        if self._quarantined(float(tensor.norm()) / delta.c_steps):
            return "quarantined"
        if current is not None:
            # The newer delta of the same learner already contains the older one's
            # progress (it is measured from a base, not from the last send).
            self._held_refs.append(current.ref)
        self._pending[delta.learner_id] = _Contribution(
            key,
            grad,
            token_step_weight(delta.c_tokens, delta.c_steps),
            delta.c_tokens,
            delta.c_steps,
            delta.step,
            ref,
        )
        self.round.add(delta.learner_id, now)
        return ACCEPTED

    def _quarantined(self, norm_per_step: float) -> bool:
        """Whether a delta's size is far outside what learners recently sent.

        The statistic is the delta's norm per inner step, so a delta covering
        more steps is not mistaken for an attack. Every observation enters the
        window, refused or not: if all learners legitimately grow (say, after
        warmup) the median follows them, while a single bad learner among M
        supplies too few observations to move it.
        """
        window = self._recent_norms
        outlier = (
            len(window) >= QUARANTINE_MIN_SAMPLES
            and norm_per_step > self.params.quarantine_factor * statistics.median(window)
        )
        window.append(norm_per_step)
        return outlier

    def should_close(self, now: float, live: set[str], step_s: float | None) -> bool:
        return self.round.should_close(now, live, step_s)

    def close_at(self, step_s: float | None) -> float | None:
        return self.round.close_at(step_s)

    def close(self) -> RoundResult:
        """Merge the round into a new version. The caller makes it durable, then
        publishes ``payload`` and acks ``refs``, then calls :meth:`round_done`."""
        if not self._pending:
            raise RuntimeError("no deltas to merge")
        learners = sorted(self._pending)
        contributions = [self._pending[name] for name in learners]
        grads = [c.grad for c in contributions]
        weights = [c.weight for c in contributions]
        merge = radial_directional_mean if self.params.aggregation == "radial" else weighted_mean
        merged = merge(grads, weights)
        new_weights, self.momentum = nesterov_step(
            self.weights, merged, self.momentum, self.params.outer_lr, self.params.outer_momentum
        )
        new_weights, self.payload = canonical(self.codec, new_weights)
        self.history.push(self.version + 1, new_weights)
        for name, c in zip(learners, contributions, strict=True):
            self.applied[name] = max(c.key, self.applied.get(name, c.key))
        refs = [c.ref for c in contributions] + self._held_refs
        result = RoundResult(
            self.version,
            self.payload,
            len(contributions),
            self._new_tokens(learners, contributions),
            refs,
            learners,
            [(name, *c.key) for name, c in zip(learners, contributions, strict=True)],
        )
        self._pending = {}
        self._held_refs = []
        return result

    def _new_tokens(self, learners: list[str], contributions: list[_Contribution]) -> int:
        """Tokens whose updates reach the global model for the first time in this round.

        A delta covers its learner's steps (step - c_steps, step]; a learner may
        send progress that an earlier merged delta already covered (it flushes
        before a global overwrites it), so only steps past the last merged one count.
        """
        total = 0.0
        for name, c in zip(learners, contributions, strict=True):
            covered_from = max(c.step - c.c_steps, self.merged_step.get(name, c.step - c.c_steps))
            total += max(0, c.step - covered_from) * c.c_tokens / c.c_steps
            self.merged_step[name] = max(c.step, self.merged_step.get(name, c.step))
        return round(total)

    def round_done(self, sync_s: float) -> None:
        self.round.closed(sync_s)

    # -- checkpoint state ------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"version.{v}": w for v, w in self.history.items()}
        # The exact bytes learners decode, so a restart republishes them bit for bit.
        tensors["payload"] = torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)
        if self.momentum is not None:
            tensors["momentum"] = self.momentum
        meta = {
            "fragment": self.fragment,
            "version": self.version,
            "codec": self.codec.name,
            "applied": {k: list(v) for k, v in self.applied.items()},
            "merged_step": self.merged_step,
        }
        return tensors, meta

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        versions = sorted(int(k.split(".", 1)[1]) for k in tensors if k.startswith("version."))
        if not versions or versions[-1] != meta["version"]:
            raise ValueError(
                f"fragment {self.fragment}: checkpoint versions {versions} "
                f"do not end at {meta['version']}"
            )
        expected = (self.numel,)
        momentum = tensors.get("momentum")
        sizes = [tensors[f"version.{v}"].shape for v in versions]
        if momentum is not None:
            sizes.append(momentum.shape)
        if any(tuple(shape) != expected for shape in sizes):
            raise ValueError(
                f"fragment {self.fragment}: checkpoint tensors do not have the plan's "
                f"{self.numel} elements (the plan needs ({self.numel},)); another model?"
            )
        history = VersionHistory(self.params.staleness)
        for v in versions:
            history.push(v, tensors[f"version.{v}"].to(torch.float32))
        self.history = history
        self.momentum = None if momentum is None else momentum.to(torch.float32)
        self.applied = {k: (int(v[0]), int(v[1])) for k, v in meta["applied"].items()}
        self.merged_step = {k: int(v) for k, v in meta.get("merged_step", {}).items()}
        if meta.get("codec", self.codec.name) == self.codec.name:
            self.payload = tensors["payload"].numpy().tobytes()
        else:
            # The downlink codec changed across the restart: publish the weights
            # under the new codec as a new version, so learners rebase on exactly
            # what they decode while deltas on the old version stay exact too.
            weights, self.payload = canonical(self.codec, self.weights)
            self.history.push(self.version + 1, weights)
