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
QUARANTINE_MIN_SAMPLES = 5  # peer observations needed before anything is refused
QUARANTINE_WINDOW = 8  # observations kept per learner


class RoundOverflow(FloatingPointError):
    """The merged update overflowed; the round's deltas are refused (``refs`` to ack)."""

    def __init__(self, message: str, refs: list[Any]) -> None:
        super().__init__(message)
        self.refs = refs


@dataclass(frozen=True)
class AggregationParams:
    quorum: int
    grace_gamma: float
    overlap: int
    staleness: int
    outer_lr: float
    outer_momentum: float
    aggregation: str  # "mean" or "radial"
    codec: Codec  # of published globals
    quarantine_factor: float


@dataclass
class _Contribution:
    learner: str
    key: tuple[int, int]  # (incarnation, seq)
    base_version: int
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
    tokens: int  # tokens whose updates reach the global model for the first time
    refs: list[Any]  # everything to acknowledge once the new state is durable
    learners: list[str] = field(default_factory=list)
    keys: list[tuple[str, int, int]] = field(default_factory=list)  # (learner, incarnation, seq)


def _token(ref: Any) -> Any:
    """The transport's ack token of a ref, if it has a hashable one."""
    token = getattr(ref, "token", ref)
    try:
        hash(token)
    except TypeError:
        return id(ref)
    return token


def canonical(codec: Codec, weights: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """Encode weights for publishing, and the exact weights learners will decode."""
    payload = codec.encode(weights)
    return codec.decode(payload, weights.numel()), payload


class FragmentState:
    """The global weights of one fragment, its open round, and what was applied.

    Two copies of the weights: ``master`` in fp32, which the outer optimizer
    updates, and the published versions in ``history``, exactly as learners
    decode them (they differ only with a lossy downlink codec). Rebasing uses
    the published copies, so a learner's weights are reconstructed bit for bit;
    the outer step runs on the master, so the downlink's rounding error is not
    fed back into the outer optimizer's trajectory every round.
    """

    def __init__(
        self, fragment: int, weights: torch.Tensor, params: AggregationParams, version: int = 0
    ) -> None:
        self.fragment = fragment
        self.params = params
        self.codec = params.codec
        self.numel = weights.numel()
        self.master = weights.detach().to(torch.float32).clone()
        self.history = VersionHistory(params.staleness)
        published, self.payload = canonical(self.codec, self.master)
        self.history.push(version, published)
        self.momentum: torch.Tensor | None = None
        self.applied: dict[str, tuple[int, int]] = {}  # newest (incarnation, seq) merged
        self.merged_step: dict[str, int] = {}  # newest learner step merged (token accounting)
        self.round = Round(params.quorum, params.grace_gamma, params.overlap)
        # One contribution per (learner, base version): a newer delta on the same
        # base supersedes the older (it contains that progress); one on another
        # base does not (the learner overwrote its weights in between).
        self._pending: dict[tuple[str, int], _Contribution] = {}
        # Refs to ack on close: one per (learner, incarnation, seq, transport token),
        # so repeated resends over one connection cost one entry.
        self._held: dict[tuple[Any, ...], Any] = {}
        self._norms: dict[str, deque[float]] = {}  # recent norm per step, per learner

    @property
    def version(self) -> int:
        return self.history.current_version

    @property
    def weights(self) -> torch.Tensor:
        """The current published global (what learners hold)."""
        return self.history.current

    @property
    def pending_learners(self) -> list[str]:
        return sorted({learner for learner, _ in self._pending})

    def precheck(self, delta: Delta, ref: Any) -> str | None:
        """DUPLICATE or HELD from metadata alone, before any payload is decoded.

        A learner resends unacknowledged deltas while a round is open; those
        resends must cost neither decoding nor memory (``ref`` should not hold
        the payload).
        """
        key = (delta.incarnation, delta.seq)
        done = self.applied.get(delta.learner_id)
        if done is not None and key <= done:
            return DUPLICATE
        current = self._pending.get((delta.learner_id, delta.base_version))
        if current is not None and key <= current.key:
            self._held[(delta.learner_id, *key, _token(ref))] = ref
            return HELD
        return None

    def offer(self, delta: Delta, tensor: torch.Tensor, ref: Any, now: float) -> str:
        """Take a decoded delta into the open round; returns a status or a rejection reason."""
        early = self.precheck(delta, ref)
        if early is not None:
            return early
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
        # Against the fp32 master: the learner's weights are base - delta exactly.
        grad = outer_gradient(tensor, base, self.master)
        if not torch.isfinite(grad).all():
            return "non_finite"
        if self._quarantined(delta.learner_id, float(tensor.norm()) / delta.c_steps):
            return "quarantined"
        slot = (delta.learner_id, delta.base_version)
        current = self._pending.get(slot)
        if current is not None:
            self._held[(current.learner, *current.key, _token(current.ref))] = current.ref
        self._pending[slot] = _Contribution(
            delta.learner_id,
            (delta.incarnation, delta.seq),
            delta.base_version,
            grad,
            token_step_weight(delta.c_tokens, delta.c_steps),
            delta.c_tokens,
            delta.c_steps,
            delta.step,
            ref,
        )
        self.round.add(delta.learner_id, now)
        return ACCEPTED

    def _quarantined(self, learner: str, norm_per_step: float) -> bool:
        """Whether a delta's size is far outside what the *other* learners recently sent.

        The statistic is the delta's norm per inner step, so a delta covering
        more steps is not mistaken for an attack. A learner is compared with its
        peers only, and each learner keeps just its last few observations, so
        one bad learner can neither raise its own bar nor flood the window.
        Refused observations still count: if every learner legitimately grows
        (say, after warmup), the peers' values follow and the bar moves with them.
        """
        peers = [x for name, window in self._norms.items() if name != learner for x in window]
        outlier = (
            len(peers) >= QUARANTINE_MIN_SAMPLES
            and norm_per_step > self.params.quarantine_factor * statistics.median(peers)
        )
        self._norms.setdefault(learner, deque(maxlen=QUARANTINE_WINDOW)).append(norm_per_step)
        return outlier

    def should_close(
        self, now: float, live: set[str], step_s: float | None, known: int = 0
    ) -> bool:
        return self.round.should_close(now, live, step_s, known)

    def close_at(self, step_s: float | None) -> float | None:
        return self.round.close_at(step_s)

    def close(self) -> RoundResult:
        """Merge the round into a new version. The caller makes it durable, then
        publishes ``payload`` and acks ``refs``, then calls :meth:`round_done`."""
        if not self._pending:
            raise RuntimeError("no deltas to merge")
        contributions = [self._pending[slot] for slot in sorted(self._pending)]
        merge = radial_directional_mean if self.params.aggregation == "radial" else weighted_mean
        merged = merge([c.grad for c in contributions], [c.weight for c in contributions])
        master, momentum = nesterov_step(
            self.master, merged, self.momentum, self.params.outer_lr, self.params.outer_momentum
        )
        if not torch.isfinite(master).all():
            # Finite inputs can still overflow; never publish a broken model.
            refs = [c.ref for c in contributions] + list(self._held.values())
            self._pending = {}
            self._held = {}
            raise RoundOverflow(f"fragment {self.fragment}: outer step overflowed", refs)
        self.master, self.momentum = master, momentum
        published, self.payload = canonical(self.codec, self.master)
        self.history.push(self.version + 1, published)
        for c in contributions:
            self.applied[c.learner] = max(c.key, self.applied.get(c.learner, c.key))
        result = RoundResult(
            self.version,
            self.payload,
            len(contributions),
            self._new_tokens(contributions),
            [c.ref for c in contributions] + list(self._held.values()),
            sorted({c.learner for c in contributions}),
            [(c.learner, *c.key) for c in contributions],
        )
        self._pending = {}
        self._held = {}
        return result

    def _new_tokens(self, contributions: list[_Contribution]) -> int:
        """Tokens whose updates reach the global model for the first time in this round.

        A delta covers its learner's steps (step - c_steps, step]; a learner may
        send progress that an earlier merged delta already covered, so only
        steps past the last merged one count.
        """
        total = 0.0
        for c in sorted(contributions, key=lambda c: c.step):
            first = c.step - c.c_steps
            covered_from = max(first, self.merged_step.get(c.learner, first))
            total += max(0, c.step - covered_from) * c.c_tokens / c.c_steps
            self.merged_step[c.learner] = max(c.step, self.merged_step.get(c.learner, c.step))
        return round(total)

    def round_done(self, sync_s: float) -> None:
        self.round.closed(sync_s)

    # -- checkpoint state ------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"version.{v}": w for v, w in self.history.items()}
        tensors["master"] = self.master
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
        if meta.get("fragment", self.fragment) != self.fragment:
            raise ValueError(f"checkpoint of fragment {meta['fragment']} given to {self.fragment}")
        expected = (self.numel,)
        momentum = tensors.get("momentum")
        master = tensors.get("master")
        sizes = [tensors[f"version.{v}"].shape for v in versions]
        sizes += [t.shape for t in (momentum, master) if t is not None]
        if any(tuple(shape) != expected for shape in sizes):
            raise ValueError(
                f"fragment {self.fragment}: checkpoint tensors do not have the plan's "
                f"{self.numel} elements (the plan needs ({self.numel},)); another model?"
            )
        history = VersionHistory(self.params.staleness)
        for v in versions:
            history.push(v, tensors[f"version.{v}"].to(torch.float32))
        self.history = history
        self.master = (history.current if master is None else master).to(torch.float32).clone()
        self.momentum = None if momentum is None else momentum.to(torch.float32)
        self.applied = {k: (int(v[0]), int(v[1])) for k, v in meta["applied"].items()}
        self.merged_step = {k: int(v) for k, v in meta.get("merged_step", {}).items()}
        payload = tensors["payload"].numpy().tobytes()
        if meta.get("codec") == self.codec.name and self._decodes_to_current(payload):
            self.payload = payload
        else:
            # The downlink codec changed across the restart (or the bytes are
            # unusable): publish the master under the current codec as a new
            # version, so learners rebase on exactly what they decode while
            # deltas on older versions stay exact too.
            published, self.payload = canonical(self.codec, self.master)
            self.history.push(self.version + 1, published)

    def _decodes_to_current(self, payload: bytes) -> bool:
        try:
            return torch.equal(self.codec.decode(payload, self.numel), self.weights)
        except ValueError:
            return False
