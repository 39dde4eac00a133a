"""Codecs for fragment tensors on the wire.

A codec turns a flat fp32 vector into bytes and back. Quantisation is
blockwise absmax: each block of ``block_size`` values is scaled by its largest
magnitude, so one outlier only costs precision inside its own block. Codes
are rounded under that scale; an encoder may then send the least-squares
scale for those codes instead (``fit_scales``; the syncer does for changes).
A value decodes to its code times its block's scale either way. An
optional lossless stage (zstd or lz4) follows. Accumulation and the outer
optimizer always run in fp32; only the wire is compressed.

Layout of the quantised payload (before the lossless stage), little endian:
``scales (one per block: fp32, bf16 for int2) | codes`` where codes are int8
(one per value), int4 (two per byte, low nibble first, stored as q + 8) or
int2 (ternary: q in {-1, 0, 1}, four per byte, lowest bits first, stored as
q + 2).

Sparse (``int4+top0.03``): of each block of ``block_size`` values (4096 by
default) only the ``ceil(density * block length)`` largest in magnitude go out,
quantised by the block's largest. Layout: ``scales (one per block, as above) |
indices (uint16, within the block, strictly increasing per block) | codes``
(as above, over the kept values in order). Everything else decodes
to zero; with error feedback (the learner's residual, the syncer's
``master - version``) what a message leaves out goes out later, as in SparseLoCo.

:class:`Codec` is the spec (settings, name, sizes); the work is done by its
parts: the quantisers in broker/wire/quantise.py (codes packed by broker/wire/packing.py)
and the lossless stage in broker/wire/lossless.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from broker.errors import CodecError as CodecError  # re-exported: defined in broker.errors
from broker.wire import lossless as _lossless
from broker.wire.lossless import Lossless as Lossless
from broker.wire.packing import Buffer as Buffer
from broker.wire.quantise import Quant as Quant
from broker.wire.quantise import Quantiser, quantiser

QUANTS: tuple[Quant, ...] = ("fp32", "bf16", "int8", "int4", "int2")
LOSSLESS: tuple[Lossless, ...] = ("none", "zstd", "lz4")
_BLOCKWISE: tuple[Quant, ...] = ("int8", "int4", "int2")  # the quantisations with blocks
DEFAULT_BLOCK_SIZE = 64
SPARSE_BLOCK_SIZE = 4096  # top-k picks per block: large, so that k is not all ties


def apply_change(base: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
    """The version a published change makes of the version it is the change from.

    One definition for the syncer, which keeps the version it publishes, and
    every learner, which builds the version it holds: an elementwise fp32 sum
    is rounded the same on every machine, so all of them hold the same bits.
    A new tensor; ``base`` is shared with others and never written.
    """
    return torch.add(base, change)


@dataclass(frozen=True)
class Codec:
    """A codec's settings, parsed from and named as ``quant[+topDENSITY][+lossless][@block]``;
    encodes and decodes through its quantiser and lossless stage."""

    quant: Quant = "fp32"
    lossless: Lossless = "none"
    block_size: int = 0  # 0: the default, 64 values (4096 for a sparse codec)
    density: float = 1.0  # the share of each block sent (top-k); 1: every value

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise CodecError(f"unknown quantisation {self.quant!r}; choose one of {QUANTS}")
        if self.lossless not in LOSSLESS:
            raise CodecError(f"unknown lossless stage {self.lossless!r}; choose one of {LOSSLESS}")
        if not isinstance(self.density, float | int) or not 0 < self.density <= 1:
            raise CodecError(f"density must be in (0, 1], got {self.density!r}")
        # As its name writes it, so that the name parses back to an equal codec.
        object.__setattr__(self, "density", float(f"{self.density:g}"))
        if self.sparse and self.quant not in _BLOCKWISE:
            raise CodecError(f"a sparse codec sends int8, int4 or int2 values, not {self.quant}")
        if self.block_size == 0:
            object.__setattr__(self, "block_size", self._default_block)
        if not 8 <= self.block_size <= 4096 or self.block_size % 2:
            raise CodecError(f"block_size must be even and in [8, 4096], got {self.block_size}")
        if self.quant not in _BLOCKWISE and self.block_size != DEFAULT_BLOCK_SIZE:
            # fp32 and bf16 have no blocks: one spelling, so equal codecs compare equal.
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)

    @property
    def sparse(self) -> bool:
        return self.density < 1

    @property
    def _default_block(self) -> int:
        return SPARSE_BLOCK_SIZE if self.sparse else DEFAULT_BLOCK_SIZE

    @property
    def _quantiser(self) -> Quantiser:
        return quantiser(self.quant, self.block_size, self.density)

    @classmethod
    def parse(cls, spec: str) -> Codec:
        """Parse ``quant[+topDENSITY][+lossless][@block]``, e.g. ``int4+zstd``,
        ``int8@128`` or ``int4+top0.03`` (the largest 3% of each block)."""
        if not isinstance(spec, str) or len(spec) > 32:
            raise CodecError(f"bad codec spec {spec!r}")
        body, _, block = spec.partition("@")
        quant, *stages = body.split("+")
        density, lossless = 1.0, "none"
        try:
            block_size = int(block) if block else 0
            if stages and stages[0].startswith("top"):
                density = float(stages.pop(0)[3:])
        except ValueError:
            raise CodecError(f"bad number in codec spec {spec!r}") from None
        if len(stages) > 1:
            raise CodecError(f"bad codec spec {spec!r}: quant[+topDENSITY][+lossless][@block]")
        if stages:
            lossless = stages[0]
        return cls(cast(Quant, quant), cast(Lossless, lossless), block_size, density)

    @property
    def name(self) -> str:
        s: str = self.quant
        if self.sparse:
            s += f"+top{self.density:g}"
        if self.lossless != "none":
            s += "+" + self.lossless
        if self.quant in _BLOCKWISE and self.block_size != self._default_block:
            s += f"@{self.block_size}"
        return s

    def __str__(self) -> str:
        return self.name

    @property
    def sends_changes(self) -> bool:
        """As the global codec: whether each version goes out as the change from
        the one before it. Lossy codecs quantise the change (a small tensor, so
        small errors), not the weights; fp32 sends the weights as they are."""
        return self.quant != "fp32"

    # -- sizes -----------------------------------------------------------
    def quantised_size(self, numel: int) -> int:
        """Exact byte size of the payload before the lossless stage."""
        return self._quantiser.size(numel)

    def kept_per_block(self, length: int) -> int:
        """How many of a block of ``length`` values a sparse codec sends."""
        return self._quantiser.kept_per_block(length)

    def kept(self, numel: int) -> int:
        """How many of ``numel`` values go out."""
        return self._quantiser.kept(numel)

    # -- encode / decode -------------------------------------------------
    def encode(self, x: torch.Tensor, fit_scales: bool = False) -> bytes:
        """``fit_scales``: send each block's least-squares scale for its codes
        instead of the scale they were rounded under (the same codes and
        bytes, less error). Rounded under the block's largest magnitude over
        qmax, ternary codes send every value above half the largest as the
        largest; the fitted scale sends those values' mean magnitude."""
        flat = x.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        return self.compressed(self._quantiser.quantise(flat, fit_scales))

    def compressed(self, raw: Buffer) -> bytes:
        """The lossless stage over a quantised payload: what goes on the wire."""
        return _lossless.compress(self.lossless, raw)

    def decode(self, data: Buffer, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``numel`` fp32 values; every size is checked before use.

        ``out``: a contiguous fp32 tensor of ``numel`` values to decode into
        (returned), so that a caller decoding fragment after fragment reuses
        memory already paged in instead of faulting in a new tensor each time.
        """
        if out is not None and (
            out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous()
        ):
            raise CodecError(f"out must be a contiguous fp32 tensor of {numel} values")
        return self.dequantised(self.quantised(data, numel), numel, out)

    def dequantised(self, raw: Buffer, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``numel`` fp32 values of a quantised payload that :meth:`quantised`
        returned (its size already checked), into ``out`` if given."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        try:
            self._quantiser.dequantise(raw, out.view(-1))
        except CodecError as e:
            raise CodecError(f"{self.name}: {e}") from None
        return out

    def quantised(self, data: Buffer, numel: int, out: bytearray | None = None) -> Buffer:
        """The quantised payload of ``numel`` values under the lossless stage,
        its size checked (CodecError if it is not ``quantised_size(numel)``).

        ``out``: a buffer of at least that size that a zstd stage decompresses
        into (a view of it is returned), so that a caller decoding payload
        after payload reuses memory already paged in."""
        expected = self.quantised_size(numel)
        try:
            raw = _lossless.decompress(self.lossless, data, expected, out)
        except CodecError as e:
            raise CodecError(f"{self.name}: {e}") from None
        size = memoryview(raw).nbytes
        if size != expected:
            raise CodecError(f"{self.name}: {numel} values need {expected} bytes, got {size}")
        return raw
