"""Which deltas enter a fragment's round, and as what: the syncer's trust in
a learner, with no I/O.

Duplicates and resends are answered from metadata alone; a delta's figures
are bounded (:func:`syncer.trust.check_report`); what is kept is one term per
learner; on close, the quarantine bar and the weight cap
(:class:`syncer.trust.TypicalSize`) judge the terms. The rules are stated in
docs/design.md, "Admission and merge rules".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from broker.errors import DdilocoError
from broker.wire.messages import Delta
from syncer.aggregation import (
    SAFE_MAGNITUDE,
    StaleDelta,
    l2_norm,
    magnitude_below,
    normalised_weights,
    token_step_weight,
)
from syncer.buffers import PackedDelta
from syncer.config import OuterConfig
from syncer.trust import ReportLimits, TypicalSize, check_report

# Statuses of an offer. Anything else is a rejection reason.
ACCEPTED = "accepted"
DUPLICATE = "duplicate"  # already applied: ack at once
HELD = "held"  # a resend or an older delta of a learner already in the round: ack on close
QUARANTINED = "quarantined"  # refused on close: its norm per step was above the bar


@dataclass
class Contribution:
    learner: str
    key: tuple[int, int]  # (incarnation, seq)
    base_version: int
    delta: torch.Tensor | PackedDelta  # as sent: clipping scales it, then it is rebased on close
    norm_per_step: float
    weight: float
    c_tokens: int
    c_steps: int
    step: int  # the learner's step when it sent the delta
    ref: Any
    magnitude: float = 0.0  # of the delta's values, or a bound on it

    @property
    def tensor(self) -> torch.Tensor:
        """The delta as a tensor: each is one, unless the compiled close merges it."""
        if isinstance(self.delta, PackedDelta):
            raise DdilocoError("a packed delta is only merged by the compiled close")
        return self.delta

    @property
    def full_key(self) -> tuple[str, int, int]:
        return (self.learner, *self.key)


@dataclass
class Term:
    """One learner's part of a round: its deltas, one per base version it sent on.

    A learner enters a round once, whatever it sent: its deltas on different
    bases (it sent on one version, then overwrote the fragment with the next
    and sent again) are one term, whose outer gradient is their token-step
    weighted mean (each rebased on its own base), whose weight is that of
    their summed steps and tokens, and whose norm per step, for the
    quarantine, is the largest of theirs. Two terms would give it twice the
    say of a learner that sent once, and two entries in the quarantine's
    window.
    """

    learner: str
    parts: list[Contribution]

    @property
    def weight(self) -> float:
        tokens = sum(c.c_tokens for c in self.parts)
        return token_step_weight(tokens, sum(c.c_steps for c in self.parts))

    @property
    def norm_per_step(self) -> float:
        return max(c.norm_per_step for c in self.parts)

    def part_shares(self) -> list[float]:
        """Each delta's share of the term: its token-step weight over theirs."""
        return normalised_weights([c.weight for c in self.parts], len(self.parts))


def _token(ref: Any) -> Any:
    """The transport's ack token of a ref, if it has a hashable one."""
    token = getattr(ref, "token", ref)
    try:
        hash(token)
    except TypeError:
        return id(ref)
    return token


@dataclass
class Verdict:
    """The terms of a closing round, judged: ``kept`` with their (capped)
    ``weights``; ``clipped`` among them; ``refused`` whole."""

    kept: list[Term]
    weights: list[float]
    clipped: list[Term]
    refused: list[Term]


class Admission:
    """One fragment's open round of deltas, what was merged of each learner,
    and the typical sizes that judge the next round."""

    def __init__(self, outer: OuterConfig, limits: ReportLimits) -> None:
        self.limits = limits
        self.refuse_outliers = outer.quarantine_action == "refuse"
        self.applied: dict[str, tuple[int, int]] = {}  # newest (incarnation, seq) merged
        self.merged_step: dict[str, int] = {}  # newest learner step merged (token accounting)
        # One contribution per (learner, base version): a newer delta on the same
        # base supersedes the older (it contains that progress); one on another
        # base does not (the learner overwrote its weights in between).
        self.pending: dict[tuple[str, int], Contribution] = {}
        # Refs to ack on close: one per (learner, incarnation, seq, transport token),
        # so repeated resends over one connection cost one entry.
        self.held: dict[tuple[Any, ...], Any] = {}
        # The quarantine bar is Q x the typical norm per step, the weight cap
        # weight_clip x the typical weight, of the last merged terms.
        self.norm_sizes = TypicalSize(outer.quarantine_window, outer.quarantine_factor)
        self.weight_sizes = TypicalSize(outer.quarantine_window, outer.weight_clip)

    @property
    def pending_learners(self) -> list[str]:
        return sorted({learner for learner, _ in self.pending})

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
        current = self.pending.get((delta.learner_id, delta.base_version))
        if current is not None and key <= current.key:
            self.held[(delta.learner_id, *key, _token(ref))] = ref
            return HELD
        return None

    def admit(
        self,
        delta: Delta,
        tensor: torch.Tensor | PackedDelta,
        ref: Any,
        *,
        epoch: int,
        numel: int,
        shift_magnitude: Callable[[int], float],
        base_published_s: float,
        wall_s: float,
        step_s: float | None,
    ) -> tuple[str, torch.Tensor | PackedDelta | None]:
        """Take a decoded delta into the round if it may enter. Returns its
        status (or the reason it is refused) and the delta it superseded, if
        any, whose buffer the caller takes back.

        ``epoch``, ``numel``: the fragment's lineage and size;
        ``shift_magnitude(base)``: the largest magnitude (or a bound) of the
        base's shift to the current version, StaleDelta if not kept;
        ``base_published_s``, ``wall_s``: when the base was published, and now
        (the syncer's wall clock); ``step_s``: the learner's credited step time.
        """
        early = self.precheck(delta, ref)
        if early is not None:
            return early, None
        if delta.base_epoch != epoch:
            return "wrong_epoch", None  # based on another syncer lineage: the learner resyncs
        if tensor.shape != (numel,):
            return "bad_shape", None
        if isinstance(tensor, PackedDelta):
            norm, magnitude = tensor.norm, tensor.magnitude
        else:
            norm = l2_norm(tensor)
            magnitude = magnitude_below(norm, tensor)
        if math.isinf(magnitude):
            return "non_finite", None
        if delta.c_tokens == 0 or delta.c_steps == 0:
            return "empty", None
        try:
            shift = shift_magnitude(delta.base_version)
        except StaleDelta as e:
            return e.reason, None
        impossible = check_report(
            delta, base_published_s=base_published_s, wall_s=wall_s, step_s=step_s,
            limits=self.limits,
        )  # fmt: skip
        if impossible is not None:
            return impossible, None
        # Finite inputs can still overflow when rebased (shift + delta); find out
        # now, not on close.
        if max(magnitude, shift) >= SAFE_MAGNITUDE:
            return "non_finite", None
        slot = (delta.learner_id, delta.base_version)
        superseded = self.pending.get(slot)
        if superseded is not None:
            self.held[(*superseded.full_key, _token(superseded.ref))] = superseded.ref
        self.pending[slot] = Contribution(
            delta.learner_id,
            (delta.incarnation, delta.seq),
            delta.base_version,
            tensor,
            norm / delta.c_steps,
            token_step_weight(delta.c_tokens, delta.c_steps),
            delta.c_tokens,
            delta.c_steps,
            delta.step,
            ref,
            magnitude,
        )
        return ACCEPTED, None if superseded is None else superseded.delta

    def take_round(self) -> tuple[list[Term], list[Any]]:
        """The round's terms, one per learner, and every ref to answer on close;
        the round is empty afterwards."""
        contributions = [self.pending[slot] for slot in sorted(self.pending)]
        terms = [
            Term(learner, [c for c in contributions if c.learner == learner])
            for learner in sorted({c.learner for c in contributions})
        ]
        refs = [c.ref for c in contributions] + list(self.held.values())
        self.pending, self.held = {}, {}
        return terms, refs

    def judge(
        self, terms: list[Term], release: Callable[[torch.Tensor | PackedDelta], None]
    ) -> Verdict:
        """The quarantine, then the weight cap. A term above the bar has each of
        its deltas scaled by bar / its norm per step (its direction is kept;
        ``release`` takes back the buffers replaced), or is refused whole."""
        kept, clipped, refused = self._quarantine(terms, release)
        cap = self.weight_sizes.limit([t.weight for t in kept]) if kept else None
        weights = [t.weight if cap is None else min(t.weight, cap) for t in kept]
        return Verdict(kept, weights, clipped, refused)

    def _quarantine(
        self, terms: list[Term], release: Callable[[torch.Tensor | PackedDelta], None]
    ) -> tuple[list[Term], list[Term], list[Term]]:
        """(kept, clipped among the kept, refused)."""
        bar = self.norm_sizes.limit([t.norm_per_step for t in terms])
        if bar is None:
            return terms, [], []
        outliers = [t for t in terms if t.norm_per_step > bar]
        if self.refuse_outliers:
            return [t for t in terms if t.norm_per_step <= bar], [], outliers
        for t in outliers:
            factor = bar / t.norm_per_step
            for c in t.parts:
                if isinstance(c.delta, PackedDelta):
                    scaled: torch.Tensor | PackedDelta = c.delta.scaled(factor)
                else:
                    scaled = c.delta * factor  # not in place: it may be the caller's
                release(c.delta)
                c.delta, c.norm_per_step = scaled, c.norm_per_step * factor
                c.magnitude *= factor
        return terms, outliers, []

    def merged(self, verdict: Verdict) -> int:
        """Record a published round: what each learner had merged, the typical
        sizes' new values. Returns the tokens whose updates reach the global
        model for the first time.

        A delta covers its learner's steps (step - c_steps, step]; a learner may
        send progress that an earlier merged delta already covered, so only
        steps past the last merged one count.
        """
        parts = [c for t in verdict.kept for c in t.parts]
        for c in parts:
            self.applied[c.learner] = max(c.key, self.applied.get(c.learner, c.key))
        self.norm_sizes.record([t.norm_per_step for t in verdict.kept])
        self.weight_sizes.record(verdict.weights)
        total = 0.0
        for c in sorted(parts, key=lambda c: c.step):
            first = c.step - c.c_steps
            covered_from = max(first, self.merged_step.get(c.learner, first))
            total += max(0, c.step - covered_from) * c.c_tokens / c.c_steps
            self.merged_step[c.learner] = max(c.step, self.merged_step.get(c.learner, c.step))
        return round(total)

    # -- checkpoint state ------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "applied": {k: list(v) for k, v in self.applied.items()},
            "merged_step": self.merged_step,
            "recent_norms": list(self.norm_sizes.values),
            "recent_weights": list(self.weight_sizes.values),
        }

    def load(self, meta: dict[str, Any]) -> None:
        self.applied = {k: (int(v[0]), int(v[1])) for k, v in meta["applied"].items()}
        self.merged_step = {k: int(v) for k, v in meta.get("merged_step", {}).items()}
        for sizes, key in (
            (self.norm_sizes, "recent_norms"),
            (self.weight_sizes, "recent_weights"),
        ):
            sizes.values.clear()
            sizes.values.extend(float(x) for x in meta.get(key, []))
