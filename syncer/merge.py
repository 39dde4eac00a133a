"""A round's merge and outer step: one interface, two implementations.

:class:`TorchMerge` merges any codec's deltas with any aggregator, chunk by
chunk in torch; :class:`CompiledMerge` closes a round of int2 globals merged
by the mean in one compiled pass (:mod:`syncer.kernels`). Both take the
round's deltas with their shares, take each one's gradient against the fp32
master (the shift of its base to the published version,
:meth:`syncer.versions.Versions.shift`, plus the master's lead over that
version: docs/design.md, rule 1) and step the master with Nesterov momentum;
neither does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from broker.errors import ConfigError
from broker.wire.codecs import Codec
from broker.wire.messages import weights_checksum
from syncer import kernels
from syncer.admission import Contribution, Term
from syncer.aggregation import (
    SAFE_MAGNITUDE,
    accumulate_rebased,
    coordinate_median,
    l2_norm,
    magnitude_below,
    max_abs,
    radial_directional_mean,
    trimmed_mean,
)
from syncer.buffers import PackedDelta, PackedRows
from syncer.config import OuterConfig
from syncer.outer import nesterov_step
from syncer.versions import Publication, Versions, canonical

# Values per chunk of a round's merge and outer step, done chunk by chunk so
# that each chunk's merged values are still in the cache for the step.
_CHUNK_VALUES = 1 << 16


@dataclass
class OuterState:
    """A fragment's fp32 master, which the outer optimizer steps, and its momentum."""

    master: torch.Tensor
    momentum: torch.Tensor | None = None


@dataclass
class Round:
    """What a merge is given: the round's terms and their (capped) weights, their
    deltas and each delta's share of the merged update, and ``share``, the
    share of a full outer step the round takes (None: all of it)."""

    terms: list[Term]
    weights: list[float]
    parts: list[Contribution]
    fractions: list[float]
    share: float | None


@dataclass
class Stepped:
    """An outer step's result: the new master and momentum, and the version to
    publish with what goes out for it."""

    master: torch.Tensor
    momentum: torch.Tensor
    version: torch.Tensor
    publication: Publication
    version_magnitude: float | None = None  # a bound on it, when known


class Merge(Protocol):
    def shift_magnitude(self, version: int) -> float:
        """The largest magnitude of the shift of ``version`` to the current one, or
        a bound on it (StaleDelta for a version not kept)."""

    def step(self, state: OuterState, merged: Round) -> Stepped | None:
        """The merged update (times ``share``) and the outer step on it; None if
        the step overflowed (``state`` is then unchanged)."""

    def accepted(self, old: OuterState, new: Stepped) -> None:
        """The step became the fragment's state: what of ``old`` is spare now."""

    def reset(self) -> None:
        """The fragment's state was replaced (a checkpoint): forget spares and bounds."""


class TorchMerge:
    """Any codec, any aggregator. The mean merges and steps chunk by chunk, so
    the merged update is never a whole fragment in memory and each chunk is
    still in the cache when it is stepped (every operation is elementwise: the
    result is the same bit for bit). The robust aggregators need all deltas at
    once, one outer gradient per term."""

    def __init__(self, outer: OuterConfig, codec: Codec, versions: Versions) -> None:
        self.outer = outer
        self.codec = codec
        self.versions = versions
        # The momentum before the last step, written over by the next one (the
        # new buffer cannot be the old one: an overflowing step keeps it).
        self._spare_momentum: torch.Tensor | None = None

    def shift_magnitude(self, version: int) -> float:
        return self.versions.shift(version)[1]

    def step(self, state: OuterState, merged: Round) -> Stepped | None:
        o = self.outer
        numel = state.master.numel()
        parts, fractions = merged.parts, merged.fractions
        shifts = [self.versions.shift(c.base_version)[0] for c in parts]
        current = self.versions.current
        whole = None if o.aggregation == "mean" else self._robust(merged, state.master)
        # Every gradient is taken against the master: its lead over the version,
        # once per delta's share.
        rebase = sum(fractions)
        master = torch.empty(numel, dtype=torch.float32)
        momentum = self._spare_momentum
        if momentum is None:
            momentum = torch.empty(numel, dtype=torch.float32)
        scratch = torch.empty(min(_CHUNK_VALUES, numel), dtype=torch.float32)
        for start in range(0, numel, _CHUNK_VALUES):
            part = slice(start, start + _CHUNK_VALUES)
            if whole is None:
                deltas = [c.tensor[part] for c in parts]
                # One slice per shift tensor: deltas on one base share it.
                sliced = {id(s): s[part] for s in shifts if s is not None}
                on = [None if s is None else sliced[id(s)] for s in shifts]
                grad = accumulate_rebased(deltas, on, fractions, scratch[: deltas[0].numel()])
                grad.add_(state.master[part] - current[part], alpha=rebase)
            else:
                grad = whole[part]
            if merged.share is not None:
                grad.mul_(merged.share)
            old = None if state.momentum is None else state.momentum[part]
            out = (master[part], momentum[part])
            nesterov_step(state.master[part], grad, old, o.outer_lr, o.outer_momentum, out)
        if math.isinf(magnitude_below(l2_norm(master), master)):
            return None
        version, publication = canonical(self.codec, master, self.versions.current)
        return Stepped(master, momentum, version, publication)

    def _robust(self, merged: Round, master: torch.Tensor) -> torch.Tensor:
        """The robust aggregators' merged update, over whole fragments."""
        lead = master - self.versions.current  # the master's lead over the version
        grads = []
        for t in merged.terms:
            shifts = [self.versions.shift(c.base_version)[0] for c in t.parts]
            rebased = accumulate_rebased([c.tensor for c in t.parts], shifts, t.part_shares())
            grads.append(rebased.add_(lead))
        aggregation = self.outer.aggregation
        if aggregation == "radial":
            return radial_directional_mean(grads, merged.weights)
        if aggregation == "trimmed_mean":
            return trimmed_mean(grads, self.outer.trim_per_side)
        if aggregation == "coordinate_median":
            return coordinate_median(grads)
        raise ConfigError(f"unknown aggregation {aggregation!r}")  # OuterConfig checks it

    def accepted(self, old: OuterState, new: Stepped) -> None:
        if new.momentum is not old.momentum:
            self._spare_momentum = old.momentum

    def reset(self) -> None:
        self._spare_momentum = None


class CompiledMerge:
    """int2 globals merged by the mean, in one compiled pass
    (:func:`syncer.kernels.close_int2`): int2 deltas with the globals' blocks are
    read packed where they lie (:class:`syncer.buffers.PackedRows`), anything
    else (other codecs' deltas, older bases' shifts) is summed into one dense
    input first. When bounds on the magnitudes rule out an overflow, the master
    and momentum are stepped in place (a fragment's memory less, and no second
    copy to stream)."""

    def __init__(
        self, outer: OuterConfig, codec: Codec, versions: Versions, rows: PackedRows
    ) -> None:
        self.outer = outer
        self.codec = codec
        self.versions = versions
        self.rows = rows
        kernels.warm_up()
        # Bounds on the largest magnitudes of the master and the momentum.
        self._master_magnitude: float | None = None
        self._momentum_magnitude: float | None = None

    def shift_magnitude(self, version: int) -> float:
        """A bound, without making the shift: the sum of both versions' magnitudes."""
        return self.versions.shift_bound(version)

    def _master_bound(self, state: OuterState) -> float:
        if self._master_magnitude is None:
            self._master_magnitude = max_abs(state.master)
        return self._master_magnitude

    def _momentum_bound(self, state: OuterState) -> float:
        if self._momentum_magnitude is None:
            momentum = state.momentum
            self._momentum_magnitude = 0.0 if momentum is None else max_abs(momentum)
        return self._momentum_magnitude

    def step(self, state: OuterState, merged: Round) -> Stepped | None:
        o, versions = self.outer, self.versions
        numel = state.master.numel()
        packed: list[PackedDelta] = []
        factors: list[float] = []
        dense: list[tuple[torch.Tensor, float]] = []  # deltas of other codecs
        behind: dict[int, float] = {}  # per older base: its deltas' total fraction
        for c, fraction in zip(merged.parts, merged.fractions, strict=True):
            if isinstance(c.delta, PackedDelta):
                packed.append(c.delta)
                factors.append(fraction * c.delta.factor)
            else:
                dense.append((c.delta, fraction))
            if c.base_version != versions.version:
                behind[c.base_version] = behind.get(c.base_version, 0.0) + fraction
        # An older base's shift is the sum of the changes published since it:
        # each kept change goes in once, packed as it was published, weighted
        # by the fractions of the deltas on the bases it is newer than. A base
        # kept as weights (from before a restart) has its shift made whole.
        chained = {b: f for b, f in behind.items() if not versions.kept_as_weights(b)}
        for base in behind.keys() - chained.keys():
            dense.append((versions.shift(base)[0], behind[base]))  # type: ignore[arg-type]
        for made, published in versions.changes_since(min(chained)) if chained else []:
            packed.append(self.rows.pack_payload(published.payload, published.codec, numel))
            factors.append(sum(f for base, f in chained.items() if base < made))
        merged_dense = torch.zeros(numel if dense else 0, dtype=torch.float32)
        for tensor, fraction in dense:
            merged_dense.add_(tensor, alpha=fraction)
        # Bounds on the step's magnitudes: when they rule out an overflow, the
        # master and momentum are stepped in place, since the state can no
        # longer be broken.
        share = 1.0 if merged.share is None else merged.share
        # Every gradient is taken against the master: its lead over the
        # version, once per delta's share (in the kernel's step).
        rebase = sum(merged.fractions)
        previous_magnitude = versions.magnitude(versions.version)
        lead_bound = self._master_bound(state) + previous_magnitude
        update_bound = share * (
            rebase * lead_bound
            + sum(
                fraction * (c.magnitude + self.shift_magnitude(c.base_version))
                for c, fraction in zip(merged.parts, merged.fractions, strict=True)
            )
        )
        momentum_bound = o.outer_momentum * self._momentum_bound(state) + update_bound
        master_bound = self._master_bound(state) + o.outer_lr * (
            update_bound + o.outer_momentum * momentum_bound
        )
        safe = max(master_bound + previous_magnitude, momentum_bound) < SAFE_MAGNITUDE
        in_place = safe and state.master is not versions.current
        if in_place:
            master = state.master
            momentum = torch.empty(numel) if state.momentum is None else state.momentum
        else:
            # New memory, the old state kept until the step is accepted: the
            # first step (the first version is the master itself), or one the
            # bounds cannot clear. No spare is kept for it: 8 bytes per
            # parameter held for a rare step.
            master = torch.empty(numel, dtype=torch.float32)
            momentum = torch.empty(numel, dtype=torch.float32)
        # The new version goes over the current one when the step cannot
        # overflow and nothing else holds it (a transport may still serve its
        # bytes as the snapshot; the first version is the master itself): each
        # value of it is read before it is written. Else into new memory.
        version = (
            versions.current
            if in_place and versions.writable()
            else torch.empty(numel, dtype=torch.float32)
        )
        blocks = kernels.padded_blocks(numel)
        new_scales = np.empty(blocks, dtype=np.float32)
        new_codes = np.empty(blocks * kernels.BLOCK // 4, dtype=np.uint8)
        no_momentum = torch.empty(0, dtype=torch.float32)
        finite, largest_change, largest_scale = kernels.close_int2(
            self.rows.scales,
            self.rows.codes,
            np.array([delta.row.index for delta in packed], dtype=np.int64),
            np.array(factors, dtype=np.float32),
            merged_dense.numpy(),
            np.float32(rebase),
            np.float32(share),
            np.float32(o.outer_lr),
            np.float32(o.outer_momentum),
            state.master.numpy(),
            (no_momentum if state.momentum is None else state.momentum).numpy(),
            versions.current.numpy(),
            # In place: empty outputs (the kernel writes through its inputs).
            (no_momentum if in_place else master).numpy(),
            (no_momentum if in_place and state.momentum is not None else momentum).numpy(),
            version.numpy(),
            new_scales,
            new_codes,
        )
        if not finite:
            if in_place:  # the bounds above say this cannot happen
                raise AssertionError("an in-place outer step overflowed")
            return None
        # Bounds, not maxima: |new| <= |previous| + |new - previous|.
        self._master_magnitude = previous_magnitude + float(largest_change)
        self._momentum_magnitude = momentum_bound
        change = kernels.pack_int2(new_scales, new_codes, numel)
        publication = Publication(
            self.codec.compressed(change.data), self.codec, True, weights_checksum(version)
        )
        return Stepped(
            master, momentum, version, publication, previous_magnitude + float(largest_scale)
        )

    def accepted(self, old: OuterState, new: Stepped) -> None:
        pass  # nothing of the old state is kept

    def reset(self) -> None:
        self._master_magnitude = self._momentum_magnitude = None
