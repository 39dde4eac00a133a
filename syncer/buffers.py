"""Where a fragment's decoded deltas live until their round closes.

A new tensor per delta costs more in page faults than decoding it, so buffers
are pooled and reused round after round: fp32 buffers for deltas the torch
close merges, and rows of int2 codes and scales for deltas the compiled close
(:mod:`syncer.kernels`) decodes where it merges them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch

from broker.errors import ConfigError
from broker.wire.codecs import Codec
from broker.wire.messages import Delta
from syncer import kernels


class _Row:
    """A row of :class:`PackedRows`, taken until the last reference to it goes."""

    def __init__(self, index: int) -> None:
        self.index = index


class PackedRows:
    """Where packed deltas live: a row of scales and one of codes each, in two
    arrays that the compiled close reads as they are (no copy per round), reused
    round after round (no page faults). A row comes back when the last
    :class:`PackedDelta` on it is dropped; the arrays grow by a quarter (at
    least 4 rows) when every row is taken: about a round's deltas and the
    changes its older bases need, not twice that."""

    def __init__(self, numel: int, codec: Codec) -> None:
        self.numel = numel  # the most values a row holds: the largest fragment's
        self.scales, self.codes = kernels.new_rows(0, numel)
        self._free: list[int] = []
        self._raw = bytearray(codec.quantised_size(numel))  # payloads decompress here

    @property
    def rows(self) -> int:
        return len(self.scales)

    @property
    def in_use(self) -> int:
        """Rows some :class:`PackedDelta` still holds."""
        return len(self.scales) - len(self._free)

    def pack(self, delta: Delta) -> PackedDelta:
        """WireError if the payload does not decode."""
        raw = delta.quantised(self._raw)
        return self._packed(np.frombuffer(raw, dtype=np.uint8), delta.numel)

    def pack_payload(self, payload: bytes | memoryview, codec: Codec, numel: int) -> PackedDelta:
        """An int2 payload of ``codec`` (one the syncer published itself) packed."""
        raw = codec.quantised(payload, numel, self._raw)
        return self._packed(np.frombuffer(raw, dtype=np.uint8), numel)

    def _packed(self, raw: np.ndarray, numel: int) -> PackedDelta:
        # numel fits the rows: DeltaBuffers checks its fragment's against them.
        row = self._take()
        scales, codes = self.scales[row.index], self.codes[row.index]
        kernels.unpack_int2(raw, numel, scales, codes)
        # The row may have held a larger fragment's delta: its last tile's
        # padding must be zero scales and codes again (the close reads it).
        blocks, padded = -(-numel // kernels.BLOCK), kernels.padded_blocks(numel)
        scales[blocks:padded] = 0.0
        codes[-(-numel // 4) : padded * kernels.BLOCK // 4] = 0xAA
        squares, largest = kernels.int2_stats(scales[:padded], codes[: padded * kernels.BLOCK // 4])
        return PackedDelta(row, math.sqrt(squares), largest, numel)

    def _take(self) -> _Row:
        if not self._free:
            taken = len(self.scales)
            scales, codes = kernels.new_rows(taken + max(taken // 4, 4), self.numel)
            scales[:taken], codes[:taken] = self.scales, self.codes
            self.scales, self.codes = scales, codes
            # In place: rows taken before come back to this same list
            # (their finalizers hold it).
            self._free.extend(range(len(scales) - 1, taken - 1, -1))
        row = _Row(self._free.pop())
        weakref.finalize(row, self._free.append, row.index)
        return row


@dataclass(frozen=True)
class PackedDelta:
    """A delta kept as its int2 codes and scales, in a row of :class:`PackedRows`:
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


class DeltaBuffers:
    """One fragment's decoded deltas: :meth:`decode` into a pooled fp32 buffer,
    or packed when ``packed`` (the compiled close merges int2 deltas with the
    globals' blocks as codes) into ``rows``, which the fragments of a syncer
    share (a round holds its rows only until it closes, and the fragments'
    rounds close in turn; rows of its own if None); :meth:`release` gives a
    buffer back."""

    def __init__(
        self, numel: int, codec: Codec, packed: bool, rows: PackedRows | None = None
    ) -> None:
        self.numel = numel
        if rows is not None and rows.numel < numel:
            raise ConfigError(f"rows of {rows.numel} values for a fragment of {numel}")
        self.rows = (rows or PackedRows(numel, codec)) if packed else None
        self._free: list[torch.Tensor] = []
        self._pooled: dict[int, weakref.ref[torch.Tensor]] = {}

    def decode(self, delta: Delta) -> torch.Tensor | PackedDelta:
        """The delta's payload decoded, into one of the pool's buffers when it
        has the fragment's size (a new tensor otherwise: it is refused as
        bad_shape), or packed. WireError if it does not decode."""
        if delta.numel != self.numel:
            return delta.tensor()
        codec = delta.codec
        if self.rows is not None and codec == Codec("int2", codec.lossless, kernels.BLOCK):
            return self.rows.pack(delta)
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

    def release(self, tensor: torch.Tensor | PackedDelta) -> None:
        """Take back a buffer of :meth:`decode` (any other tensor is left alone;
        a packed row comes back by itself when its last reference goes)."""
        ref = self._pooled.get(id(tensor))
        if ref is not None and ref() is tensor:
            self._free.append(tensor)
