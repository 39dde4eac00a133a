"""A fragment's published versions: what goes out for each, the last S kept
for rebasing, when each was published, and the shifts between them."""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from broker.codecs import Codec, apply_change
from broker.wire import weights_checksum
from syncer.aggregation import VersionHistory, max_abs

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
    weights_crc: int  # of the version's fp32 bytes (broker.wire.weights_checksum)


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
        return master, as_weights(master)
    payload = codec.encode(master)  # fp32 through a lossless stage: decodes to the master
    version = codec.decode(payload, master.numel())
    return version, Publication(payload, codec, False, weights_checksum(version))


def as_weights(version: torch.Tensor) -> Publication:
    """A version as its exact fp32 bytes."""
    return Publication(fp32_bytes(version), FP32, False, weights_checksum(version))


class Versions:
    """The last ``depth`` (S) published versions of one fragment, exactly as
    learners decode them, with the wall-clock time each was published (a
    delta's step count is bounded by the time since its base was published,
    across restarts too) and the publication of the current one."""

    def __init__(
        self, depth: int, first: torch.Tensor, publication: Publication, version: int, wall_s: float
    ) -> None:
        self.history = VersionHistory(depth)
        # Views of each kept version's memory handed out (its fp32 bytes), so that
        # a version is only recycled once none is left (push).
        self._views: dict[int, list[weakref.ref[Any]]] = {}
        self.publication = self._viewed(version, publication)
        self.history.push(version, first)
        self.published_at: dict[int, float] = {version: wall_s}
        # Theta(current) - Theta(v) and its largest magnitude, per kept version v.
        self._shifts: dict[int, tuple[torch.Tensor | None, float]] = {}
        # Largest magnitudes (or bounds on them) of the kept versions.
        self._magnitudes: dict[int, float] = {}
        # A version no longer kept whose memory nothing references: the compiled
        # close writes the next version into it (fresh memory costs page faults).
        self.spare: torch.Tensor | None = None

    @property
    def version(self) -> int:
        return self.history.current_version

    @property
    def current(self) -> torch.Tensor:
        """The current published global (what learners hold)."""
        return self.history.current

    def get(self, version: int) -> torch.Tensor:
        """A kept version (:class:`syncer.aggregation.StaleDelta` if not kept)."""
        return self.history.get(version)

    @property
    def snapshot(self) -> Publication:
        """The current version as weights, for learners that join or missed a
        change: its exact fp32 bytes, so that they hold what the others hold."""
        if not self.publication.is_change:
            return self.publication
        # The same version as the change: its checksum is known already.
        payload = fp32_bytes(self.current)
        return self._viewed(
            self.version, Publication(payload, FP32, False, self.publication.weights_crc)
        )

    def _viewed(self, version: int, publication: Publication) -> Publication:
        """``publication``, noting that its payload views ``version``'s memory if it does."""
        if isinstance(publication.payload, memoryview):
            self._views.setdefault(version, []).append(weakref.ref(publication.payload.obj))
        return publication

    def shift(self, version: int) -> tuple[torch.Tensor | None, float]:
        """``Theta(current) - Theta(version)`` and its largest magnitude, both
        published versions, exactly as learners hold them.

        A learner's weights are ``Theta(base) - delta``, so its outer gradient
        against the current version is ``shift(base) + delta``: one shift per
        base version serves every delta on it (:class:`StaleDelta` for a
        version not kept). None for the current version itself: the shift is
        +0.0 throughout.
        """
        if version not in self._shifts:
            base = self.get(version)
            if version == self.version:
                self._shifts[version] = (None, 0.0)
            else:
                shift = self.current - base
                self._shifts[version] = (shift, max_abs(shift))
        return self._shifts[version]

    def magnitude(self, version: int) -> float:
        """The largest magnitude of a kept version, or a bound on it."""
        if version not in self._magnitudes:
            self._magnitudes[version] = max_abs(self.get(version))
        return self._magnitudes[version]

    def shift_bound(self, version: int) -> float:
        """A bound on the largest magnitude of ``shift(version)`` without making
        it: the sum of both versions' (StaleDelta for a version not kept)."""
        self.get(version)
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
        recycle_unless: torch.Tensor | None = None,
    ) -> None:
        """Keep ``weights`` as the next version, published at ``wall_s`` as
        ``publication``; ``magnitude``: a bound on its largest magnitude, if
        known. With ``recycle_unless`` (the master), a dropped version that
        nothing else references becomes :attr:`spare`."""
        dropped = self.history.push(self.version + 1, weights)
        while dropped:
            version, old = dropped.pop()
            viewed = any(view() is not None for view in self._views.pop(version, []))
            reusable = recycle_unless is not None and old is not recycle_unless
            if reusable and not viewed and unshared(old):
                self.spare = old
        self.publication = publication
        self.published_at[self.version] = wall_s
        kept = {v for v, _ in self.history.items()}
        self.published_at = {v: t for v, t in self.published_at.items() if v in kept}
        self._magnitudes = {v: m for v, m in self._magnitudes.items() if v in kept}
        if magnitude is not None:
            self._magnitudes[self.version] = magnitude
        self._shifts = {}

    def take_spare(self) -> torch.Tensor | None:
        spare, self.spare = self.spare, None
        return spare

    # -- checkpoint state ------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"version.{v}": w for v, w in self.history.items()}

    def load(self, tensors: dict[str, torch.Tensor], published_at: dict[int, float]) -> None:
        """Restore the versions of a checkpoint (:meth:`tensors`); the current one
        then goes out as weights, whatever the codec was: learners that hold it
        ignore it, the others take it whole. A version whose publication time
        is unknown counts as published long ago (0.0): the step bound may then
        be loose for it, never wrong."""
        numbers = sorted(int(k.split(".", 1)[1]) for k in tensors if k.startswith("version."))
        self.history = VersionHistory(self.history.depth)
        for v in numbers:
            self.history.push(v, tensors[f"version.{v}"].to(torch.float32))
        self._views, self._shifts, self._magnitudes, self.spare = {}, {}, {}, None
        self.publication = self._viewed(self.version, as_weights(self.current))
        self.published_at = {v: published_at.get(v, 0.0) for v, _ in self.history.items()}
