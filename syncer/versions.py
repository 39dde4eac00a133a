"""A fragment's published versions: what goes out for each, the last S kept
for rebasing, when each was published, and the shifts between them.

Only the current version is kept as fp32 weights. With a global codec that
publishes changes (int2 at the defaults), each older kept version is kept as
the change that was published after it, compressed as it went out (about 0.2
bytes per parameter at int2+zstd): S kept versions cost 4 bytes per
parameter plus S - 1 compact changes, not 4 S bytes. A codec that publishes
weights keeps the older versions' weights.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from broker.errors import ConfigError, DdilocoError
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import weights_checksum
from syncer.aggregation import StaleDelta, max_abs

# A published global: bytes, or (fp32) a read-only view of the weights' own memory.
Payload: TypeAlias = bytes | memoryview
FP32 = Codec("fp32")


@dataclass(frozen=True)
class Publication:
    """What goes out for a version: its payload under ``codec``, and whether
    that is the change from the version before (else the weights themselves)."""

    payload: Payload
    codec: Codec
    is_change: bool
    weights_crc: int  # of the version's fp32 bytes (broker.wire.messages.weights_checksum)


def fp32_bytes(weights: torch.Tensor) -> Payload:
    """A read-only view of fp32 weights' own bytes, no copy (a version's memory is
    only written again once no such view of it is left: :meth:`Versions.push`)."""
    flat = weights.detach().reshape(-1).to("cpu", torch.float32).contiguous()
    return flat.numpy().data.cast("B").toreadonly()


def unshared(tensor: torch.Tensor) -> bool:
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
    ``previous`` plus the decoded change (:func:`broker.wire.codecs.apply_change`),
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
        return master, as_weights(master)
    payload = codec.encode(master)  # fp32 through a lossless stage: decodes to the master
    version = codec.decode(payload, master.numel())
    return version, Publication(payload, codec, False, weights_checksum(version))


def as_weights(version: torch.Tensor) -> Publication:
    """A version as its exact fp32 bytes."""
    return Publication(fp32_bytes(version), FP32, False, weights_checksum(version))


class Versions:
    """The last ``depth`` (S) published versions of one fragment: the current
    one exactly as learners decode it, each older one as the published change
    that followed it (or as its weights, for a codec that publishes weights),
    with the wall-clock time each was published (a delta's step count is
    bounded by the time since its base was published, across restarts too)
    and the publication of the current one."""

    def __init__(
        self, depth: int, first: torch.Tensor, publication: Publication, version: int, wall_s: float
    ) -> None:
        if depth < 1:
            raise ConfigError(f"staleness depth must be >= 1, got {depth}")
        self.depth = depth
        self.version = version
        self.current = first  # the current published global (what learners hold)
        # Per older kept version v: the change published as version v + 1.
        self._changes: OrderedDict[int, Publication] = OrderedDict()
        # Per older kept version: its weights (a codec that publishes weights).
        self._weights: OrderedDict[int, torch.Tensor] = OrderedDict()
        # Views of the current version's memory handed out (its fp32 bytes), so
        # that it is only written over once none is left (:meth:`writable`).
        self._views: list[weakref.ref[Any]] = []
        self.publication = self._viewed(publication)
        self.published_at: dict[int, float] = {version: wall_s}
        # Theta(current) - Theta(v) and its largest magnitude, per kept version v.
        self._shifts: dict[int, tuple[torch.Tensor | None, float]] = {}
        # Largest magnitudes (or bounds on them) of the kept versions.
        self._magnitudes: dict[int, float] = {}

    @property
    def kept(self) -> list[int]:
        """The versions a delta may be based on, oldest first (any kept as weights
        are older than those kept as changes: they come from before a restart
        under a codec that publishes changes)."""
        return [*self._weights, *self._changes, self.version]

    def kept_as_weights(self, version: int) -> bool:
        return version in self._weights

    def check(self, version: int) -> None:
        """:class:`syncer.aggregation.StaleDelta` unless ``version`` is kept."""
        if version == self.version or version in self._changes or version in self._weights:
            return
        if version > self.version:
            raise StaleDelta("future_version", f"base {version} > current {self.version}")
        raise StaleDelta("stale", f"base {version} is older than the {self.depth} kept versions")

    def changes_since(self, version: int) -> list[tuple[int, Publication]]:
        """The published changes from kept ``version`` to the current one, each
        with the version it made (empty for the current version; StaleDelta if
        not kept). ValueError where an older version is kept as weights."""
        self.check(version)
        if version in self._weights:
            raise DdilocoError(f"version {version} is kept as weights, not as changes")
        return [(v + 1, change) for v, change in self._changes.items() if v >= version]

    @property
    def snapshot(self) -> Publication:
        """The current version as weights, for learners that join or missed a
        change: its exact fp32 bytes, so that they hold what the others hold."""
        if not self.publication.is_change:
            return self.publication
        # The same version as the change: its checksum is known already.
        payload = fp32_bytes(self.current)
        return self._viewed(Publication(payload, FP32, False, self.publication.weights_crc))

    def _viewed(self, publication: Publication) -> Publication:
        """``publication``, noting whether its payload views the current version."""
        if isinstance(publication.payload, memoryview):
            self._views.append(weakref.ref(publication.payload.obj))
        return publication

    def writable(self) -> bool:
        """Whether the next version may be written over the current one's memory:
        nothing else holds it (no view of its bytes is left, e.g. a snapshot a
        transport still serves, and it is no other state's tensor)."""
        self._views = [view for view in self._views if view() is not None]
        return not self._views and unshared(self.current)

    def shift(self, version: int) -> tuple[torch.Tensor | None, float]:
        """``Theta(current) - Theta(version)`` and its largest magnitude, both
        published versions, as learners hold them: the sum of the published
        changes between them (each decoded as learners decode it; the sum is
        rounded once per change, which the exact difference is not: within
        a few fp32 roundings of it, docs/design.md, rule 1), or, for versions
        kept as weights, their difference.

        A learner's weights are ``Theta(base) - delta``, so its outer gradient
        against the current version is ``shift(base) + delta``: one shift per
        base version serves every delta on it (:class:`StaleDelta` for a
        version not kept). None for the current version itself: the shift is
        +0.0 throughout.
        """
        self.check(version)
        if version not in self._shifts:
            shift: torch.Tensor | None
            if version == self.version:
                self._shifts[version] = (None, 0.0)
            elif version in self._weights:
                shift = self.current - self._weights[version]
                self._shifts[version] = (shift, max_abs(shift))
            else:
                shift = torch.zeros(self.current.numel(), dtype=torch.float32)
                for _, change in self.changes_since(version):
                    shift.add_(change.codec.decode(change.payload, shift.numel()))
                self._shifts[version] = (shift, max_abs(shift))
        return self._shifts[version]

    def magnitude(self, version: int) -> float:
        """The largest magnitude of a kept version, or a bound on it."""
        self.check(version)
        if version not in self._magnitudes:
            if version == self.version:
                self._magnitudes[version] = max_abs(self.current)
            elif version in self._weights:
                self._magnitudes[version] = max_abs(self._weights[version])
            else:  # unknown only after a checkpoint that did not say
                self._magnitudes[version] = self.magnitude(self.version) + self.shift(version)[1]
        return self._magnitudes[version]

    def shift_bound(self, version: int) -> float:
        """A bound on the largest magnitude of ``shift(version)`` without making
        it: the sum of both versions' (StaleDelta for a version not kept)."""
        self.check(version)
        if version == self.version:
            return 0.0
        return self.magnitude(self.version) + self.magnitude(version)

    def push(
        self,
        weights: torch.Tensor,
        publication: Publication,
        wall_s: float,
        *,
        magnitude: float | None = None,
    ) -> None:
        """Keep ``weights`` as the next version, published at ``wall_s`` as
        ``publication``; ``magnitude``: a bound on its largest magnitude, if
        known. The version before is kept as this change when it is one, else
        as its weights (``weights`` may be written over it, in its memory)."""
        self.magnitude(self.version)  # known while its weights are at hand
        if publication.is_change:
            self._changes[self.version] = publication
        else:
            self._weights[self.version] = self.current
            self._changes.clear()  # changes lead to the current version only
        self._trim()
        self.version += 1
        self.current = weights
        self._views = []
        self.publication = self._viewed(publication)
        self.published_at[self.version] = wall_s
        self._forget_unkept()
        if magnitude is not None:
            self._magnitudes[self.version] = magnitude
        self._shifts = {}

    def _trim(self) -> None:
        """Drop the oldest older versions past the S - 1 kept."""
        while len(self._weights) + len(self._changes) > self.depth - 1:
            (self._weights or self._changes).popitem(last=False)  # weights are older

    def _forget_unkept(self) -> None:
        """Publication times and magnitudes of versions no longer kept go."""
        kept = set(self.kept)
        self.published_at = {v: t for v, t in self.published_at.items() if v in kept}
        self._magnitudes = {v: m for v, m in self._magnitudes.items() if v in kept}

    def restarted(self, codec: Codec) -> None:
        """After a restart: the current version goes out whole (learners that hold
        it ignore it, the others take it), and older versions are kept only
        through changes in ``codec`` (the run's codec now)."""
        while any(change.codec != codec for change in self._changes.values()):
            self._changes.popitem(last=False)
        if self._changes:
            self._weights.clear()  # older than the changes' chain: it no longer reaches them
        self._views, self._shifts = [], {}
        self._forget_unkept()
        self.publication = self._viewed(as_weights(self.current))

    # -- checkpoint state ------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """``version.N``: the current version (and older ones kept as weights);
        ``change.N``: the published change that made version N, as it went out."""
        tensors = {f"version.{v}": w for v, w in self._weights.items()}
        tensors[f"version.{self.version}"] = self.current
        for v, change in self._changes.items():
            tensors[f"change.{v + 1}"] = torch.frombuffer(
                bytearray(change.payload), dtype=torch.uint8
            )
        return tensors

    def magnitudes(self) -> dict[str, float]:
        return {str(v): m for v, m in self._magnitudes.items()}

    def load(
        self,
        tensors: dict[str, torch.Tensor],
        published_at: dict[int, float],
        magnitudes: dict[int, float],
        codec: Codec,
    ) -> None:
        """Restore the versions of a checkpoint (:meth:`tensors`; its changes are
        in ``codec``); the current one then goes out as weights, whatever the
        codec was: learners that hold it ignore it, the others take it whole.
        A version whose publication time is unknown counts as published long
        ago (0.0): the step bound may then be loose for it, never wrong."""
        numbers = sorted(int(k.split(".", 1)[1]) for k in tensors if k.startswith("version."))
        self.version = numbers[-1]
        self.current = tensors[f"version.{self.version}"].to(torch.float32)
        older = [v for v in numbers[:-1] if v > self.version - self.depth]
        self._weights = OrderedDict((v, tensors[f"version.{v}"].to(torch.float32)) for v in older)
        # Changes in this codec only (a checkpoint of another codec has none to read).
        made = sorted(int(k.split(".", 1)[1]) for k in tensors if k.startswith("change."))
        made = made if codec.sends_changes else []
        # Only an unbroken run of changes up to the current version leads to it.
        self._changes = OrderedDict()
        for v in reversed(made):
            if v != self.version - len(self._changes) or v - 1 in self._weights:
                break
            payload = tensors[f"change.{v}"].numpy().tobytes()
            self._changes[v - 1] = Publication(payload, codec, True, 0)
        self._changes = OrderedDict(reversed(self._changes.items()))
        self._trim()
        self._magnitudes = dict(magnitudes)
        self.published_at = {v: published_at.get(v, 0.0) for v in self.kept}
        self.restarted(codec)
