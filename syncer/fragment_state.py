"""One fragment's aggregation state: the syncer's logic, with no I/O.

Offers of deltas come in, rounds close, new versions come out. Transport,
checkpoint files and clocks stay in :mod:`syncer.service`; this module only
sees tensors, numbers and the time passed in, so every decision is testable.

Two clocks are passed in, each where it belongs: ``now`` (monotonic seconds)
times rounds; ``wall_s`` (the syncer's wall clock, seconds) dates published
versions, because a delta's step count is bounded by the time since its base
version was published, and that must hold across a syncer restart.
"""

from __future__ import annotations

import math
import os
import sys
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import numpy as np
import torch

from broker.codecs import Codec, apply_change
from broker.wire import Delta, weights_checksum
from syncer import kernels
from syncer.aggregation import (
    SAFE_MAGNITUDE,
    StaleDelta,
    VersionHistory,
    accumulate_rebased,
    coordinate_median,
    l2_norm,
    magnitude_below,
    max_abs,
    normalised_weights,
    radial_directional_mean,
    token_step_weight,
    trimmed_mean,
)
from syncer.outer import nesterov_step
from syncer.quorum import Round
from syncer.trust import ReportLimits, TypicalSize, check_report

# Statuses of an offer. Anything else is a rejection reason.
ACCEPTED = "accepted"
DUPLICATE = "duplicate"  # already applied: ack at once
HELD = "held"  # a resend or an older delta of a learner already in the round: ack on close
QUARANTINED = "quarantined"  # refused on close: its norm per step was above the bar

# A published global: bytes, or (fp32) a read-only view of the weights' own memory.
Payload: TypeAlias = bytes | memoryview
# Values per chunk of a round's merge and outer step, done chunk by chunk so
# that each chunk's merged values are still in the cache for the step.
_CHUNK_VALUES = 1 << 16


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
    aggregation: str  # "mean", "radial", "trimmed_mean" or "coordinate_median"
    codec: Codec  # of published globals
    limits: ReportLimits  # what a delta's figures may claim
    weight_clip: float  # a weight is capped at this x the round's median weight
    quarantine_factor: float  # Q: the bar is Q x the median norm per step ...
    quarantine_window: int  # W: ... of the fragment's last W merged deltas
    quarantine_action: str  # "clip" an outlier to the bar or "refuse" it
    trim_per_side: int = 1  # trimmed_mean only
    # How long a round whose every live learner reported waits for the missing
    # ones of a quorum that never joined (learners still starting, or a run
    # scaled to fewer learners than its quorum).
    absent_wait_s: float = math.inf


class _Row:
    """A row of :class:`_PackedRows`, taken until the last reference to it goes."""

    def __init__(self, index: int) -> None:
        self.index = index


class _PackedRows:
    """Where packed deltas live: a row of scales and one of codes each, in two
    arrays that the compiled close reads as they are (no copy per round), reused
    round after round (no page faults). A row comes back when the last
    :class:`PackedDelta` on it is dropped; the arrays double when every row is
    taken."""

    def __init__(self, numel: int, codec: Codec) -> None:
        self.numel = numel
        self.scales, self.codes = kernels.new_rows(0, numel)
        self._free: list[int] = []
        self._raw = bytearray(codec.quantised_size(numel))  # payloads decompress here

    def pack(self, delta: Delta) -> PackedDelta:
        """WireError if the payload does not decode."""
        raw = np.frombuffer(delta.quantised(self._raw), dtype=np.uint8)
        row = self._take()
        scales, codes = self.scales[row.index], self.codes[row.index]
        kernels.unpack_int2(raw, self.numel, scales, codes)
        squares, largest = kernels.int2_stats(scales, codes)
        return PackedDelta(row, math.sqrt(squares), largest, self.numel)

    def _take(self) -> _Row:
        if not self._free:
            taken = len(self.scales)
            scales, codes = kernels.new_rows(max(2 * taken, 4), self.numel)
            scales[:taken], codes[:taken] = self.scales, self.codes
            self.scales, self.codes = scales, codes
            self._free = list(range(len(scales) - 1, taken - 1, -1))
        row = _Row(self._free.pop())
        weakref.finalize(row, self._free.append, row.index)
        return row


@dataclass(frozen=True)
class PackedDelta:
    """A delta kept as its int2 codes and scales, in a row of :class:`_PackedRows`:
    the compiled close (:func:`syncer.kernels.close_int2`) decodes it where it
    merges it, so it never becomes a fragment of fp32 values in memory."""

    row: _Row
    norm: float  # of the values it decodes to, times ``factor``
    magnitude: float  # their largest magnitude, inf if one is not finite
    numel: int
    factor: float = 1.0  # quarantine clipping scales a delta

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)

    def scaled(self, factor: float) -> PackedDelta:
        """The same codes, times ``factor`` (on the same row)."""
        return replace(
            self,
            norm=self.norm * factor,
            magnitude=self.magnitude * factor,
            factor=self.factor * factor,
        )


@dataclass
class _Contribution:
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
            raise TypeError("a packed delta is only merged by the compiled close")
        return self.delta


@dataclass
class _Term:
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
    parts: list[_Contribution]

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
    # (their refs are in ``refs`` too, to ack). Weights capped by the clip.
    clipped: list[tuple[str, int, int]] = field(default_factory=list)
    refused: list[tuple[str, int, int]] = field(default_factory=list)
    weights_clipped: int = 0

    @property
    def published(self) -> bool:
        """False when quarantine refused every delta: no new version."""
        return self.included > 0


def _token(ref: Any) -> Any:
    """The transport's ack token of a ref, if it has a hashable one."""
    token = getattr(ref, "token", ref)
    try:
        hash(token)
    except TypeError:
        return id(ref)
    return token


FP32 = Codec("fp32")
# MEASUREMENT ONLY (removed once measured): rebase on the fp32 master, not on
# the published version.
_REBASE_ON_MASTER = os.environ.get("DDILOCO_REBASE_ON_MASTER") == "1"


@dataclass(frozen=True)
class Publication:
    """What goes out for a version: its payload under ``codec``, and whether
    that is the change from the version before (else the weights themselves)."""

    payload: Payload
    codec: Codec
    is_change: bool
    weights_crc: int  # of the version's fp32 bytes (broker.wire.weights_checksum)


def _fp32_bytes(weights: torch.Tensor) -> Payload:
    """A read-only view of fp32 weights' own bytes, no copy (a version's memory is
    only written again once no such view of it is left: FragmentState._push)."""
    flat = weights.detach().reshape(-1).to("cpu", torch.float32).contiguous()
    return flat.numpy().data.cast("B").toreadonly()


def _unshared(tensor: torch.Tensor) -> bool:
    """Whether nothing references ``tensor`` but the caller's one name (CPython's
    count: that name, this call's argument and getrefcount's)."""
    return sys.getrefcount(tensor) <= 3


def canonical(
    codec: Codec, master: torch.Tensor, previous: torch.Tensor | None = None
) -> tuple[torch.Tensor, Publication]:
    """The next version to publish for ``master``, exactly as learners will hold
    it, and what goes out for it.

    ``previous``: the version learners hold now (None for the first one). A lossy
    codec quantises the change ``master - previous``, and the new version is
    ``previous`` plus the decoded change (:func:`broker.codecs.apply_change`),
    not the master: the rounding error stays in ``master - version`` and goes
    out with the next change (error feedback), so versions follow the master
    without drift. The first version, and every fp32 one, goes out as the
    weights; fp32 without a lossless stage as the master's own bytes.
    """
    if codec.sends_changes and previous is not None:
        # Learners train from the version, so its rounding error is corrected
        # twice: by their deltas and by the next change. The least-squares scale
        # keeps it small (with absmax scales, ternary changes together with
        # ternary deltas sometimes diverged; benchmarks/README.md).
        payload = codec.encode(master - previous, fit_scales=True)
        version = apply_change(previous, codec.decode(payload, master.numel()))
        return version, Publication(payload, codec, True, weights_checksum(version))
    if codec.quant != "fp32" or codec.lossless == "none":
        return master, _as_weights(master)
    payload = codec.encode(master)  # fp32 through a lossless stage: decodes to the master
    version = codec.decode(payload, master.numel())
    return version, Publication(payload, codec, False, weights_checksum(version))


def _as_weights(version: torch.Tensor) -> Publication:
    """A version as its exact fp32 bytes."""
    return Publication(_fp32_bytes(version), FP32, False, weights_checksum(version))


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
        self,
        fragment: int,
        weights: torch.Tensor,
        params: AggregationParams,
        version: int = 0,
        *,
        published_s: float,
        epoch: int = 0,
    ) -> None:
        self.fragment = fragment
        self.epoch = epoch  # the lineage of these versions (kept in the checkpoint)
        self.params = params
        self.codec = params.codec
        self.numel = weights.numel()
        self.master = weights.detach().to(torch.float32).clone()
        self.history = VersionHistory(params.staleness)
        # Views of each kept version's memory handed out (its fp32 bytes), so that
        # a version is only recycled once none is left (_push).
        self._views: dict[int, list[weakref.ref[Any]]] = {}
        published, self.publication = canonical(self.codec, self.master)
        self._viewed(version, self.publication)
        self.history.push(version, published)
        # Wall-clock time each kept version was published (for the step bound).
        self.published_at: dict[int, float] = {version: published_s}
        self.momentum: torch.Tensor | None = None
        # The momentum buffer and master before the last step, written over by
        # the next one (the new buffer cannot be the old one: an overflowing step
        # keeps it).
        self._spare_momentum: torch.Tensor | None = None
        self._spare_master: torch.Tensor | None = None
        # A version no longer kept, whose memory the next compiled close writes the
        # new version into: fresh memory costs page faults, more than the close.
        self._spare_version: torch.Tensor | None = None
        # int2 globals merged by the mean: rounds close in one compiled pass
        # (:mod:`syncer.kernels`), and int2 deltas with the globals' blocks are
        # kept packed until then.
        self._compiled = (
            params.aggregation == "mean"
            and self.codec.quant == "int2"
            and not self.codec.sparse
            and self.codec.block_size == kernels.BLOCK
        )
        if self._compiled:
            kernels.warm_up()
        self._packed = _PackedRows(self.numel, self.codec) if self._compiled else None
        # Largest magnitudes (or bounds on them) of the master, the momentum and
        # the kept versions: the compiled close checks a shift against the bound,
        # and steps in place when the bounds rule out an overflow.
        self._master_magnitude: float | None = None
        self._momentum_magnitude: float | None = None
        self._magnitudes: dict[int, float] = {}
        # Buffers that deltas decode into (:meth:`decode`), reused round after
        # round: a new tensor per delta costs more in page faults than the
        # decoding. A buffer comes back when its offer is not kept, or its
        # round closes; the pool grows to the most deltas held at once.
        self._free: list[torch.Tensor] = []
        self._pooled: dict[int, weakref.ref[torch.Tensor]] = {}
        self.applied: dict[str, tuple[int, int]] = {}  # newest (incarnation, seq) merged
        self.merged_step: dict[str, int] = {}  # newest learner step merged (token accounting)
        self.round = Round(params.quorum, params.grace_gamma, params.overlap, params.absent_wait_s)
        # One contribution per (learner, base version): a newer delta on the same
        # base supersedes the older (it contains that progress); one on another
        # base does not (the learner overwrote its weights in between).
        self._pending: dict[tuple[str, int], _Contribution] = {}
        # Refs to ack on close: one per (learner, incarnation, seq, transport token),
        # so repeated resends over one connection cost one entry.
        self._held: dict[tuple[Any, ...], Any] = {}
        # The typical norm per step and weight of the last merged terms: the
        # quarantine bar is Q x the one, the weight cap weight_clip x the other.
        self.norm_sizes = TypicalSize(params.quarantine_window, params.quarantine_factor)
        self.weight_sizes = TypicalSize(params.quarantine_window, params.weight_clip)
        # master - Theta(v) and its largest magnitude, per base version v, while
        # the master stays: rebasing a delta on v is adding it (see _shift).
        self._shifts: dict[int, tuple[torch.Tensor | None, float]] = {}

    @property
    def version(self) -> int:
        return self.history.current_version

    @property
    def weights(self) -> torch.Tensor:
        """The current published global (what learners hold)."""
        return self.history.current

    @property
    def snapshot(self) -> Publication:
        """The current version as weights, for learners that join or missed a
        change: its exact fp32 bytes, so that they hold what the others hold."""
        if not self.publication.is_change:
            return self.publication
        # The same version as the change: its checksum is known already.
        payload = _fp32_bytes(self.weights)
        return self._viewed(
            self.version, Publication(payload, FP32, False, self.publication.weights_crc)
        )

    def _viewed(self, version: int, publication: Publication) -> Publication:
        """``publication``, noting that its payload views ``version``'s memory if it does."""
        if isinstance(publication.payload, memoryview):
            self._views.setdefault(version, []).append(weakref.ref(publication.payload.obj))
        return publication

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

    def decode(self, delta: Delta) -> torch.Tensor | PackedDelta:
        """The delta's payload decoded, into one of this fragment's buffers when
        it has the fragment's size, or packed (:class:`PackedDelta`) when the
        compiled close will merge it; give the result to :meth:`offer`, which
        takes the buffer back unless it keeps the delta. WireError if it does
        not decode."""
        if delta.numel != self.numel:
            return delta.tensor()  # offer refuses it (bad_shape)
        codec = delta.codec
        if self._packed is not None and codec == Codec("int2", codec.lossless, kernels.BLOCK):
            return self._packed.pack(delta)
        buffer = self._free.pop() if self._free else self._new_buffer()
        try:
            delta.tensor(out=buffer)
            return buffer
        except Exception:
            self._free.append(buffer)
            raise

    def _new_buffer(self) -> torch.Tensor:
        buffer = torch.empty(self.numel, dtype=torch.float32)
        self._pooled[id(buffer)] = weakref.ref(buffer)
        return buffer

    def _release(self, tensor: torch.Tensor | PackedDelta) -> None:
        """Take back a buffer of :meth:`decode` (any other tensor is left alone)."""
        ref = self._pooled.get(id(tensor))
        if ref is not None and ref() is tensor:
            self._free.append(tensor)

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
        status = self._admit(delta, tensor, ref, now, wall_s, step_s)
        if status != ACCEPTED:
            self._release(tensor)
        return status

    def _admit(
        self,
        delta: Delta,
        tensor: torch.Tensor | PackedDelta,
        ref: Any,
        now: float,
        wall_s: float,
        step_s: float | None,
    ) -> str:
        early = self.precheck(delta, ref)
        if early is not None:
            return early
        if delta.base_epoch != self.epoch:
            return "wrong_epoch"  # based on another syncer lineage: the learner resyncs
        if tensor.shape != self.weights.shape:
            return "bad_shape"
        if isinstance(tensor, PackedDelta):
            norm, magnitude = tensor.norm, tensor.magnitude
        else:
            norm = l2_norm(tensor)
            magnitude = magnitude_below(norm, tensor)
        if math.isinf(magnitude):
            return "non_finite"
        if delta.c_tokens == 0 or delta.c_steps == 0:
            return "empty"
        try:
            shift_magnitude = self._shift_magnitude(delta.base_version)
        except StaleDelta as e:
            return e.reason
        impossible = check_report(
            delta,
            base_published_s=self.published_at.get(delta.base_version, 0.0),
            wall_s=wall_s,
            step_s=step_s,
            limits=self.params.limits,
        )
        if impossible is not None:
            return impossible
        # Finite inputs can still overflow when rebased (shift + delta); find out
        # now, not on close.
        if max(magnitude, shift_magnitude) >= SAFE_MAGNITUDE:
            return "non_finite"
        slot = (delta.learner_id, delta.base_version)
        current = self._pending.get(slot)
        if current is not None:
            self._held[(current.learner, *current.key, _token(current.ref))] = current.ref
            self._release(current.delta)
        self._pending[slot] = _Contribution(
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
        self.round.add(delta.learner_id, now)
        return ACCEPTED

    def should_close(
        self, now: float, live: set[str], step_s: float | None, known: int = 0
    ) -> bool:
        return self.round.should_close(now, live, step_s, known)

    def close_at(self, step_s: float | None) -> float | None:
        return self.round.close_at(step_s)

    def close(self, wall_s: float, learners: int = 0) -> RoundResult:
        """Merge the round into a new version. The caller makes it durable, then
        publishes :attr:`publication` and acks ``refs``, then calls :meth:`round_done`.

        ``learners``: the deltas of a full round (M, or the live learners when
        fewer). A round of n fewer takes n/M of an outer step, so that every
        learner's delta, in whatever rounds, moves the model as far as one
        synchronous round of all M would: a full step per round of one delta
        (K = 1 at M = 2) pulled the model to each learner in turn and, with
        outer momentum, diverged. 0: a full step whatever n.

        First the quarantine: a delta whose norm per step is above the bar
        (:func:`syncer.trust.quarantine_bar`) is scaled down to it or refused.
        If every delta was refused, nothing is published (``published`` is
        False) and the refs are only to be acked. ``wall_s`` dates the version.
        """
        if not self._pending:
            raise RuntimeError("no deltas to merge")
        contributions = [self._pending[slot] for slot in sorted(self._pending)]
        terms = [
            _Term(learner, [c for c in contributions if c.learner == learner])
            for learner in sorted({c.learner for c in contributions})
        ]
        kept, clipped, refused = self._quarantine(terms)
        refs = [c.ref for c in contributions] + list(self._held.values())
        self._pending = {}
        self._held = {}
        refused_keys = [self._key(c) for t in refused for c in t.parts]
        if not kept:
            self._release_all(contributions)
            return RoundResult(self.version, 0, 0, refs, refused=refused_keys)
        cap = self.weight_sizes.limit([t.weight for t in kept])
        weights = [t.weight if cap is None else min(t.weight, cap) for t in kept]
        share = len(kept) / learners if len(kept) < learners else None  # kept is not empty
        parts = [c for t in kept for c in t.parts]
        fractions = [
            f * part for t, f in zip(kept, normalised_weights(weights, len(kept)), strict=True)
            for part in t.part_shares()
        ]  # fmt: skip
        try:
            if self._compiled:
                stepped = self._compiled_step(parts, fractions, share)
            else:
                stepped = self._step(kept, weights, parts, fractions, share)
        finally:
            self._release_all(contributions)
        if stepped is None:
            # Finite inputs can still overflow; never publish a broken model.
            raise RoundOverflow(f"fragment {self.fragment}: outer step overflowed", refs)
        master, momentum, published, self.publication = stepped
        if self._compiled and master is not self.master:  # not in place: the old one is spare
            self._spare_master = self.master
        if momentum is not self.momentum:
            self._spare_momentum = self.momentum
        self.master, self.momentum = master, momentum
        self._shifts = {}
        self._push(published, wall_s)
        for c in parts:
            self.applied[c.learner] = max(c.key, self.applied.get(c.learner, c.key))
        self.norm_sizes.record([t.norm_per_step for t in kept])
        self.weight_sizes.record(weights)
        return RoundResult(
            self.version,
            len(parts),
            self._new_tokens(parts),
            refs,
            [t.learner for t in kept],
            [self._key(c) for c in parts],
            spans=[(c.learner, c.step - c.c_steps, c.step) for c in parts],
            clipped=[self._key(c) for t in clipped for c in t.parts],
            refused=refused_keys,
            weights_clipped=sum(w < t.weight for w, t in zip(weights, kept, strict=True)),
        )

    @staticmethod
    def _key(c: _Contribution) -> tuple[str, int, int]:
        return (c.learner, *c.key)

    def _quarantine(self, terms: list[_Term]) -> tuple[list[_Term], list[_Term], list[_Term]]:
        """(kept, clipped among the kept, refused). A term above the bar has each
        of its deltas scaled by bar / its norm per step (its direction is kept),
        or is refused whole."""
        bar = self.norm_sizes.limit([t.norm_per_step for t in terms])
        if bar is None:
            return terms, [], []
        outliers = [t for t in terms if t.norm_per_step > bar]
        if self.params.quarantine_action == "refuse":
            return [t for t in terms if t.norm_per_step <= bar], [], outliers
        for t in outliers:
            factor = bar / t.norm_per_step
            for c in t.parts:
                if isinstance(c.delta, PackedDelta):
                    scaled: torch.Tensor | PackedDelta = c.delta.scaled(factor)
                else:
                    scaled = c.delta * factor  # not in place: it may be the caller's
                self._release(c.delta)
                c.delta, c.norm_per_step = scaled, c.norm_per_step * factor
                c.magnitude *= factor
        return terms, outliers, []

    def _shift(self, version: int) -> tuple[torch.Tensor | None, float]:
        """``Theta(current) - Theta(version)`` and its largest magnitude, both
        published versions, exactly as learners hold them.

        A learner's weights are ``Theta(base) - delta``, so its outer gradient
        against the current version is ``shift(base) + delta``: one shift per
        base version serves every delta on it (:class:`StaleDelta` for a
        version not kept). None for the current version itself: the shift is
        +0.0 throughout. The fp32 master's lead over the current version (a
        lossy global codec's rounding error, which goes out with the next
        change) never enters a gradient.
        """
        if version not in self._shifts:
            base = self.history.get(version)
            reference = self.master if _REBASE_ON_MASTER else self.weights
            if base is reference:
                self._shifts[version] = (None, 0.0)
            else:
                shift = reference - base
                self._shifts[version] = (shift, max_abs(shift))
        return self._shifts[version]

    def _shift_magnitude(self, version: int) -> float:
        """The largest magnitude of ``Theta(current) - Theta(version)``, or, for
        the compiled close, which makes no shift tensor, a bound on it: the sum
        of both largest magnitudes (StaleDelta for a version not kept)."""
        if not self._compiled:
            return self._shift(version)[1]
        base = self.history.get(version)
        if _REBASE_ON_MASTER:
            return (
                0.0
                if base is self.master
                else self._master_bound() + self._version_magnitude(version)
            )
        if version == self.version:
            return 0.0
        return self._version_magnitude(self.version) + self._version_magnitude(version)

    def _master_bound(self) -> float:
        if self._master_magnitude is None:
            self._master_magnitude = max_abs(self.master)
        return self._master_magnitude

    def _momentum_bound(self) -> float:
        if self._momentum_magnitude is None:
            self._momentum_magnitude = 0.0 if self.momentum is None else max_abs(self.momentum)
        return self._momentum_magnitude

    def _version_magnitude(self, version: int) -> float:
        """The largest magnitude of a kept version, or a bound on it."""
        if version not in self._magnitudes:
            self._magnitudes[version] = max_abs(self.history.get(version))
        return self._magnitudes[version]

    def _compiled_step(
        self, kept: list[_Contribution], fractions: list[float], share: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Publication] | None:
        """:meth:`_step` for int2 globals merged by the mean, in one compiled pass
        (:func:`syncer.kernels.close_int2`); None if the step overflowed."""
        p = self.params
        packed: list[PackedDelta] = []
        factors: list[float] = []
        dense: dict[int, tuple[torch.Tensor, float]] = {}  # other deltas, older bases' shifts
        rebase = 0.0  # MEASUREMENT ONLY: the weight of the deltas rebased on the master
        for c, fraction in zip(kept, fractions, strict=True):
            if isinstance(c.delta, PackedDelta):
                packed.append(c.delta)
                factors.append(fraction * c.delta.factor)
            else:
                dense[id(c.delta)] = (c.delta, fraction)
            if _REBASE_ON_MASTER and c.base_version == self.version:
                rebase += fraction
            elif c.base_version != self.version:
                shift = self._shift(c.base_version)[0]
                assert shift is not None  # only the current version has none
                _, total = dense.get(id(shift), (shift, 0.0))
                dense[id(shift)] = (shift, total + fraction)
        merged_dense = torch.zeros(self.numel if dense else 0, dtype=torch.float32)
        for tensor, fraction in dense.values():
            merged_dense.add_(tensor, alpha=fraction)
        # Bounds on the step's magnitudes: when they rule out an overflow, the
        # master and momentum are stepped in place (a fragment's memory less, and
        # no second copy to stream), since the state can no longer be broken.
        scale = 1.0 if share is None else share
        update_bound = scale * sum(
            fraction * (c.magnitude + self._shift_magnitude(c.base_version))
            for c, fraction in zip(kept, fractions, strict=True)
        )
        momentum_bound = p.outer_momentum * self._momentum_bound() + update_bound
        master_bound = self._master_bound() + p.outer_lr * (
            update_bound + p.outer_momentum * momentum_bound
        )
        previous_magnitude = self._version_magnitude(self.version)
        in_place = max(master_bound + previous_magnitude, momentum_bound) < SAFE_MAGNITUDE and all(
            self.master is not w for _, w in self.history.items()
        )
        blocks = kernels.padded_blocks(self.numel)
        if in_place:
            master = self.master
            momentum = torch.empty(self.numel) if self.momentum is None else self.momentum
        else:
            master = self._reusable("_spare_master")
            momentum = self._reusable("_spare_momentum")
        version = self._reusable("_spare_version")
        new_scales = np.empty(blocks, dtype=np.float32)
        new_codes = np.empty(blocks * kernels.BLOCK // 4, dtype=np.uint8)
        no_momentum = torch.empty(0, dtype=torch.float32)
        assert self._packed is not None  # made with the compiled close
        finite, largest_change, largest_scale = kernels.close_int2(
            self._packed.scales,
            self._packed.codes,
            np.array([delta.row.index for delta in packed], dtype=np.int64),
            np.array(factors, dtype=np.float32),
            merged_dense.numpy(),
            np.float32(rebase),
            np.float32(1.0 if share is None else share),
            np.float32(p.outer_lr),
            np.float32(p.outer_momentum),
            self.master.numpy(),
            (no_momentum if self.momentum is None else self.momentum).numpy(),
            self.weights.numpy(),
            # In place: empty outputs (the kernel writes through its inputs).
            (no_momentum if in_place else master).numpy(),
            (no_momentum if in_place and self.momentum is not None else momentum).numpy(),
            version.numpy(),
            new_scales,
            new_codes,
        )
        if not finite:
            if in_place:  # the bounds above say this cannot happen
                raise AssertionError(f"fragment {self.fragment}: in-place step overflowed")
            return None
        # Bounds, not maxima: |new| <= |previous| + |new - previous|.
        self._master_magnitude = previous_magnitude + float(largest_change)
        self._momentum_magnitude = momentum_bound
        self._magnitudes[self.version + 1] = previous_magnitude + float(largest_scale)
        change = kernels.pack_int2(new_scales, new_codes, self.numel)
        publication = Publication(
            self.codec.compressed(change.data), self.codec, True, weights_checksum(version)
        )
        return master, momentum, version, publication

    def _reusable(self, name: str) -> torch.Tensor:
        """The spare tensor of attribute ``name``, taken, to write new values into;
        a new one if there is none or anything else holds it (the first version
        is the master itself; a caller may hold the momentum)."""
        spare = getattr(self, name)
        setattr(self, name, None)
        if spare is None or not _unshared(spare):
            return torch.empty(self.numel, dtype=torch.float32)
        return spare

    def _step(
        self,
        terms: list[_Term],
        weights: list[float],
        kept: list[_Contribution],
        fractions: list[float],
        share: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Publication] | None:
        """The merged update (times ``share``, if any) and the outer step on it:
        new (master, momentum, version, publication); None if the step overflowed.

        ``kept`` are the terms' deltas and ``fractions`` their shares of the
        merged update. The mean merges and steps chunk by chunk, so the merged update is never
        a whole fragment in memory and each chunk is still in the cache when
        it is stepped (every operation is elementwise: the result is the same
        bit for bit). The robust aggregators need all deltas at once.
        """
        p = self.params
        shifts = [self._shift(c.base_version)[0] for c in kept]
        merged = None if p.aggregation == "mean" else self._merge(terms, weights)
        master = torch.empty(self.numel, dtype=torch.float32)
        momentum = self._spare_momentum
        if momentum is None:
            momentum = torch.empty(self.numel, dtype=torch.float32)
        scratch = torch.empty(min(_CHUNK_VALUES, self.numel), dtype=torch.float32)
        for start in range(0, self.numel, _CHUNK_VALUES):
            part = slice(start, start + _CHUNK_VALUES)
            if merged is None:
                deltas = [c.tensor[part] for c in kept]
                # One slice per shift tensor: deltas on one base share it.
                sliced = {id(s): s[part] for s in shifts if s is not None}
                parts = [None if s is None else sliced[id(s)] for s in shifts]
                grad = accumulate_rebased(deltas, parts, fractions, scratch[: deltas[0].numel()])
            else:
                grad = merged[part]
            if share is not None:
                grad.mul_(share)
            old = None if self.momentum is None else self.momentum[part]
            out = (master[part], momentum[part])
            nesterov_step(self.master[part], grad, old, p.outer_lr, p.outer_momentum, out)
        if math.isinf(magnitude_below(l2_norm(master), master)):
            return None
        version, publication = canonical(self.codec, master, self.weights)
        return master, momentum, version, publication

    def _release_all(self, contributions: list[_Contribution]) -> None:
        for c in contributions:
            self._release(c.delta)

    def _merge(self, terms: list[_Term], weights: list[float]) -> torch.Tensor:
        """The robust aggregators' merged update, over whole fragments: one
        outer gradient per term."""
        grads = []
        for t in terms:
            shifts = [self._shift(c.base_version)[0] for c in t.parts]
            grads.append(accumulate_rebased([c.tensor for c in t.parts], shifts, t.part_shares()))
        aggregation = self.params.aggregation
        if aggregation == "radial":
            return radial_directional_mean(grads, weights)
        if aggregation == "trimmed_mean":
            return trimmed_mean(grads, self.params.trim_per_side)
        if aggregation == "coordinate_median":
            return coordinate_median(grads)
        raise ValueError(f"unknown aggregation {aggregation!r}")

    def _push(self, weights: torch.Tensor, wall_s: float) -> None:
        """Keep ``weights`` as the next version, published at ``wall_s``."""
        dropped = self.history.push(self.version + 1, weights)
        while dropped:
            version, old = dropped.pop()
            viewed = any(view() is not None for view in self._views.pop(version, []))
            if self._compiled and not viewed and old is not self.master and _unshared(old):
                self._spare_version = old
        self.published_at[self.version] = wall_s
        kept = {v for v, _ in self.history.items()}
        self.published_at = {v: t for v, t in self.published_at.items() if v in kept}
        self._magnitudes = {v: m for v, m in self._magnitudes.items() if v in kept}

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
        if self.master is not self.weights:  # fp32 globals are the master itself
            tensors["master"] = self.master
        if self.momentum is not None:
            tensors["momentum"] = self.momentum
        meta = {
            "fragment": self.fragment,
            "epoch": self.epoch,
            "version": self.version,
            "codec": self.codec.name,
            "applied": {k: list(v) for k, v in self.applied.items()},
            "merged_step": self.merged_step,
            "published_at": {str(v): t for v, t in self.published_at.items()},
            "recent_norms": list(self.norm_sizes.values),
            "recent_weights": list(self.weight_sizes.values),
        }
        return tensors, meta

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore :meth:`state`. The current version then goes out as weights
        (:attr:`snapshot`), whatever the codec was: learners that hold it ignore
        it, the others take it whole."""
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
        self._shifts = {}
        self.momentum = None if momentum is None else momentum.to(torch.float32).clone()
        self._spare_momentum = self._spare_master = self._spare_version = None
        self._views = {}
        self._master_magnitude = self._momentum_magnitude = None
        self._magnitudes = {}
        self.epoch = int(meta.get("epoch", self.epoch))
        self.applied = {k: (int(v[0]), int(v[1])) for k, v in meta["applied"].items()}
        self.merged_step = {k: int(v) for k, v in meta.get("merged_step", {}).items()}
        # A version whose publication time is unknown counts as published long
        # ago (0.0): the step bound may then be loose for it, never wrong.
        published_at = {int(v): float(t) for v, t in meta.get("published_at", {}).items()}
        self.published_at = {v: published_at.get(v, 0.0) for v in versions}
        self.norm_sizes.values.clear()
        self.norm_sizes.values.extend(float(x) for x in meta.get("recent_norms", []))
        self.weight_sizes.values.clear()
        self.weight_sizes.values.extend(float(x) for x in meta.get("recent_weights", []))
        self.publication = self._viewed(self.version, _as_weights(self.weights))
