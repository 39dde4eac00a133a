"""One fragment's aggregation state: the syncer's logic, with no I/O.

Offers of deltas come in, rounds close, new versions come out. Transport,
checkpoint files and clocks stay in :mod:`syncer.service`; this module only
sees tensors, numbers and the time passed in, so every decision is testable.
It composes the stages, each with its own state: :class:`Admission` (what
enters a round), :class:`DeltaBuffers` (where deltas wait), a :class:`Merge`
(the merge and outer step), :class:`Versions` (what was published).

Two clocks are passed in, each where it belongs: ``now`` (monotonic seconds)
times rounds; ``wall_s`` (the syncer's wall clock, seconds) dates published
versions, because a delta's step count is bounded by the time since its base
version was published, and that must hold across a syncer restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from broker.errors import ConfigError, DdilocoError, TrustError
from broker.run.settings import RunSettings
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import Delta
from syncer import kernels
from syncer.admission import (
    ACCEPTED,
    DUPLICATE,
    HELD,
    QUARANTINED,
    Admission,
    Verdict,
)
from syncer.aggregation import normalised_weights
from syncer.buffers import DeltaBuffers, PackedDelta, PackedRows
from syncer.config import OuterConfig
from syncer.merge import CompiledMerge, Merge, OuterState, Round, TorchMerge
from syncer.outer import momentum_from_change
from syncer.quorum import Round as OpenRound
from syncer.trust import ReportLimits
from syncer.versions import Publication, Versions, canonical

__all__ = [
    "ACCEPTED",
    "DUPLICATE",
    "HELD",
    "QUARANTINED",
    "FragmentState",
    "PackedDelta",
    "Publication",
    "RoundOverflow",
    "RoundResult",
    "canonical",
]


class RoundOverflow(TrustError):
    """The merged update overflowed; the round's deltas are refused (``refs`` to answer)."""

    def __init__(self, message: str, refs: list[Any]) -> None:
        super().__init__("overflow", message, refs)


@dataclass
class RoundResult:
    version: int
    included: int  # deltas merged
    tokens: int  # tokens whose updates reach the global model for the first time
    refs: list[Any]  # everything to acknowledge once the new state is durable
    learners: list[str] = field(default_factory=list)
    keys: list[tuple[str, int, int]] = field(default_factory=list)  # (learner, incarnation, seq)
    # Per merged delta, the learner steps it covers: (learner, first, last], as sent.
    spans: list[tuple[str, int, int]] = field(default_factory=list)
    # Quarantine on close: deltas scaled down to the bar, and deltas refused
    # (their refs are in ``refs`` too, to ack). Terms whose weight was capped.
    clipped: list[tuple[str, int, int]] = field(default_factory=list)
    refused: list[tuple[str, int, int]] = field(default_factory=list)
    weights_clipped: int = 0

    @property
    def published(self) -> bool:
        """False when quarantine refused every delta: no new version."""
        return self.included > 0


def report_limits(outer: OuterConfig, run: RunSettings) -> ReportLimits:
    """What a delta's figures may claim in this run."""
    return ReportLimits(
        # Twice the steps between two sends of a fragment: a learner's first
        # delta, before its pace is known, covers at most one.
        step_floor=2 * run.sync_every,
        max_tokens_per_step=outer.max_tokens_per_step,
        max_clock_skew_s=outer.max_clock_skew_s,
    )


class FragmentState:
    """The global weights of one fragment, its open round, and what was applied.

    Two copies of the weights: the fp32 master (:attr:`master`), which the
    outer optimizer steps, and the published versions (:attr:`versions`),
    exactly as learners decode them (they differ only with a lossy global
    codec). A learner's weights are rebuilt from the published version it
    holds, and its gradient is taken against the master (rule 1 of
    docs/design.md: the master's lead, the global codec's rounding error not
    yet published, enters every gradient).
    """

    def __init__(
        self,
        fragment: int,
        weights: torch.Tensor,
        outer: OuterConfig,
        run: RunSettings,
        version: int = 0,
        *,
        published_s: float,
        epoch: int = 0,
        rows: PackedRows | None = None,
    ) -> None:
        """``rows``: where int2 deltas wait packed, shared by a syncer's fragments
        (:class:`DeltaBuffers`)."""
        self.fragment = fragment
        self.epoch = epoch  # the lineage of these versions (kept in the checkpoint)
        self.outer, self.run = outer, run
        self.codec = run.global_codec
        self.numel = weights.numel()
        master = weights.detach().to(torch.float32).clone()
        first, publication = canonical(self.codec, master)
        self.versions = Versions(outer.staleness, first, publication, version, published_s)
        self.outer_state = OuterState(master)
        # int2 globals merged by the mean: rounds close in one compiled pass
        # (:mod:`syncer.kernels`), and int2 deltas with the globals' blocks are
        # kept packed until then.
        compiled = (
            outer.aggregation == "mean"
            and self.codec.quant == "int2"
            and not self.codec.sparse
            and self.codec.block_size == kernels.BLOCK
        )
        self.buffers = DeltaBuffers(self.numel, self.codec, packed=compiled, rows=rows)
        self.merge: Merge
        if self.buffers.rows is not None:
            self.merge = CompiledMerge(outer, self.codec, self.versions, self.buffers.rows)
        else:
            self.merge = TorchMerge(outer, self.codec, self.versions)
        self.admission = Admission(outer, report_limits(outer, run))
        self.round = OpenRound(
            outer.grace_gamma,
            run.overlap,
            run.gone_after_s,
        )

    # -- what the rest of the syncer reads ---------------------------------
    @property
    def version(self) -> int:
        return self.versions.version

    @property
    def weights(self) -> torch.Tensor:
        """The current published global (what learners hold)."""
        return self.versions.current

    @property
    def master(self) -> torch.Tensor:
        return self.outer_state.master

    @property
    def momentum(self) -> torch.Tensor | None:
        return self.outer_state.momentum

    @property
    def publication(self) -> Publication:
        return self.versions.publication

    @property
    def snapshot(self) -> Publication:
        return self.versions.snapshot

    @property
    def published_at(self) -> dict[int, float]:
        return self.versions.published_at

    @property
    def applied(self) -> dict[str, tuple[int, int]]:
        return self.admission.applied

    @property
    def pending_learners(self) -> list[str]:
        return self.admission.pending_learners

    # -- intake ----------------------------------------------------------
    def precheck(self, delta: Delta, ref: Any) -> str | None:
        """DUPLICATE or HELD from metadata alone, before any payload is decoded."""
        return self.admission.precheck(delta, ref)

    def decode(self, delta: Delta) -> torch.Tensor | PackedDelta:
        """The delta's payload decoded (:meth:`DeltaBuffers.decode`); give the
        result to :meth:`offer`, which takes the buffer back unless it keeps
        the delta. WireError if it does not decode."""
        return self.buffers.decode(delta)

    def offer(
        self,
        delta: Delta,
        tensor: torch.Tensor | PackedDelta,
        ref: Any,
        now: float,
        *,
        wall_s: float,
        step_s: float | None,
    ) -> str:
        """Take a decoded delta into the open round; returns a status or a rejection reason.

        ``now`` times the round; ``wall_s`` is the wall clock and ``step_s`` the
        step time credited to the learner (:func:`syncer.trust.credited_step_s`),
        which bound the figures it reports.
        """
        status, superseded = self.admission.admit(
            delta,
            tensor,
            ref,
            epoch=self.epoch,
            numel=self.numel,
            shift_magnitude=self.merge.shift_magnitude,
            base_published_s=self.published_at.get(delta.base_version, 0.0),
            wall_s=wall_s,
            step_s=step_s,
        )
        if superseded is not None:
            self.buffers.release(superseded)
        if status != ACCEPTED:
            self.buffers.release(tensor)
            return status
        self.round.add(delta.learner_id, now)
        return ACCEPTED

    # -- close -----------------------------------------------------------
    def close(self, wall_s: float, learners: int = 0) -> RoundResult:
        """Merge the round into a new version. The caller makes it durable, then
        publishes :attr:`publication` and acks ``refs``, then calls :meth:`round_done`.

        ``learners``: the deltas of a full round (M, or the waited-for learners
        when fewer); a round of n fewer takes n/M of an outer step
        (docs/design.md, rule 7); 0: a full step whatever n. First the
        quarantine and the weight cap (:meth:`Admission.judge`); if every term
        was refused, nothing is published (``published`` is False) and the
        refs are only to be answered. ``wall_s`` dates the version.
        """
        terms, refs = self.admission.take_round()
        if not terms:
            raise DdilocoError("no deltas to merge")  # the service closes open rounds only
        verdict = self.admission.judge(terms, self.buffers.release)
        refused = [c.full_key for t in verdict.refused for c in t.parts]
        try:
            if not verdict.kept:
                return RoundResult(self.version, 0, 0, refs, refused=refused)
            stepped = self.merge.step(self.outer_state, self._round(verdict, learners))
        finally:
            for t in terms:
                for c in t.parts:
                    self.buffers.release(c.delta)
        if stepped is None:
            # Finite inputs can still overflow; never publish a broken model.
            raise RoundOverflow(f"fragment {self.fragment}: outer step overflowed", refs)
        old = self.outer_state
        self.merge.accepted(old, stepped)
        self.outer_state = OuterState(stepped.master, stepped.momentum)
        self.versions.push(
            stepped.version, stepped.publication, wall_s, magnitude=stepped.version_magnitude
        )
        tokens = self.admission.merged(verdict)
        parts = [c for t in verdict.kept for c in t.parts]
        return RoundResult(
            self.version,
            len(parts),
            tokens,
            refs,
            [t.learner for t in verdict.kept],
            [c.full_key for c in parts],
            spans=[(c.learner, c.step - c.c_steps, c.step) for c in parts],
            clipped=[c.full_key for t in verdict.clipped for c in t.parts],
            refused=refused,
            weights_clipped=sum(
                w < t.weight for w, t in zip(verdict.weights, verdict.kept, strict=True)
            ),
        )

    @staticmethod
    def _round(verdict: Verdict, learners: int) -> Round:
        kept = verdict.kept
        # The share counts sends, not terms: each of a learner's deltas carries
        # about H steps of its progress (docs/design.md, rule 7).
        sends = sum(len(t.parts) for t in kept)
        share = sends / learners if sends < learners else None
        term_fractions = normalised_weights(verdict.weights, len(kept))
        fractions = [
            fraction * part
            for t, fraction in zip(kept, term_fractions, strict=True)
            for part in t.part_shares()
        ]
        parts = [c for t in kept for c in t.parts]
        return Round(kept, verdict.weights, parts, fractions, share)

    def round_done(self, sync_s: float, quorum: int) -> None:
        self.round.closed(sync_s, quorum)

    # -- checkpoint state ------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The full state: tensors and :meth:`meta`."""
        tensors = self.versions.tensors()
        if self.master is not self.weights:  # fp32 globals are the master itself
            tensors["master"] = self.master
        if self.momentum is not None:
            tensors["momentum"] = self.momentum
        return tensors, self.meta()

    def meta(self) -> dict[str, Any]:
        """The small state (what a logged round holds beside its change)."""
        return {
            "fragment": self.fragment,
            "epoch": self.epoch,
            "version": self.version,
            "codec": self.codec.name,
            "published_at": {str(v): t for v, t in self.published_at.items()},
            "magnitudes": self.versions.magnitudes(),
            **self.admission.state(),
        }

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore :meth:`state`. The current version then goes out as weights
        (:attr:`snapshot`), whatever the codec was: learners that hold it ignore
        it, the others take it whole."""
        versions = sorted(int(k.split(".", 1)[1]) for k in tensors if k.startswith("version."))
        if not versions or versions[-1] != meta["version"]:
            raise ConfigError(
                f"fragment {self.fragment}: checkpoint versions {versions} "
                f"do not end at {meta['version']}"
            )
        if meta.get("fragment", self.fragment) != self.fragment:
            raise ConfigError(f"checkpoint of fragment {meta['fragment']} given to {self.fragment}")
        expected = (self.numel,)
        momentum = tensors.get("momentum")
        master = tensors.get("master")
        sizes = [tensors[f"version.{v}"].shape for v in versions]
        sizes += [t.shape for t in (momentum, master) if t is not None]
        if any(tuple(shape) != expected for shape in sizes):
            raise ConfigError(
                f"fragment {self.fragment}: checkpoint tensors do not have the plan's "
                f"{self.numel} elements (the plan needs ({self.numel},)); another model?"
            )
        published_at = {int(v): float(t) for v, t in meta.get("published_at", {}).items()}
        magnitudes = {int(v): float(m) for v, m in meta.get("magnitudes", {}).items()}
        self.versions.load(tensors, published_at, magnitudes, self.codec)
        self.outer_state = OuterState(
            (self.versions.current if master is None else master).to(torch.float32).clone(),
            None if momentum is None else momentum.to(torch.float32).clone(),
        )
        self.merge.reset()
        self.epoch = int(meta.get("epoch", self.epoch))
        self.admission.load(meta)

    def replay(self, records: list[tuple[int, bytes, dict[str, Any]]]) -> None:
        """The rounds logged after the loaded state (:mod:`syncer.checkpoint`'s
        records, in order; those not newer than it are from before it and
        skipped): each change rebuilds the version exactly as learners built
        it, and the small state (de-duplication, token accounting, quarantine
        windows) is the last round's. The master becomes the last version,
        losing its lead (the rounding error not yet published, which the log
        does not hold), and the momentum stays the loaded one; where none was
        loaded, it is estimated from the last change
        (:func:`syncer.outer.momentum_from_change`)."""
        newer = [r for r in records if r[0] > self.version]
        for version, change, meta in newer:
            if version != self.version + 1 or meta.get("epoch", self.epoch) != self.epoch:
                raise ConfigError(
                    f"fragment {self.fragment}: a logged round of version {version} does "
                    f"not follow version {self.version}"
                )
            codec = Codec.parse(meta["codec"])
            decoded = codec.decode(change, self.numel)
            rebuilt = apply_change(self.weights, decoded)
            # Its checksum is not needed: only the last version goes out, whole.
            published_s = float(meta.get("published_at", {}).get(str(version), 0.0))
            self.versions.push(rebuilt, Publication(change, codec, True, 0), published_s)
        if not newer:
            return
        momentum = self.momentum
        if momentum is None:  # ``decoded``: the last logged change
            momentum = momentum_from_change(decoded, self.outer.outer_lr)
        self.versions.restarted(self.codec)
        self.outer_state = OuterState(self.weights, momentum)
        self.merge.reset()
        self.admission.load(newer[-1][2])
