"""The quantisers: a flat fp32 vector to a quantised payload and back.

One class per family, each with its own settings and no codec: :class:`Plain`
(fp32, bf16), :class:`Dense` (blockwise int8, int4, int2) and :class:`Sparse`
(blockwise top-k), sharing :class:`Levels` (a quantisation's codes and scales).
:func:`quantiser` picks one for a codec's settings. The payload layouts, and
why the scales are what they are, are in broker/wire/codecs.py; the syncer's
compiled close (syncer/kernels.py) writes the same int2 bytes as
:meth:`Levels.scaled_codes` and :func:`broker.wire.packing.pack`.

Decoding trusts nothing but the payload's size (checked by the caller); a
payload it refuses raises :class:`CodecError` without the codec's name, which
:class:`broker.wire.codecs.Codec` puts in front.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from broker.errors import CodecError
from broker.wire.packing import Buffer, code_bytes, pack, unpack, wire_view

Quant = Literal["fp32", "bf16", "int8", "int4", "int2"]
_QMAX = {"int8": 127, "int4": 7, "int2": 1}
_BITS = {"int8": 8, "int4": 4, "int2": 2}
# Values decoded per chunk: small enough that a chunk's codes, widened, are still
# in the cache when they are scaled.
_CHUNK_VALUES = 1 << 16


class Quantiser(Protocol):
    """What :class:`broker.wire.codecs.Codec` asks of a quantiser."""

    def size(self, numel: int) -> int: ...
    def kept_per_block(self, length: int) -> int: ...
    def kept(self, numel: int) -> int: ...
    def quantise(self, flat: torch.Tensor, fit_scales: bool) -> bytes: ...
    def dequantise(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor: ...


# Bounded: codecs are parsed from peers' messages, so their settings are not
# only the few this process uses.
@functools.lru_cache(maxsize=32)
def quantiser(quant: Quant, block_size: int, density: float) -> Quantiser:
    """The quantiser of a codec's settings (already validated)."""
    if quant == "fp32" or quant == "bf16":
        return Plain(quant)
    if density < 1:
        return Sparse(Levels(quant), block_size, density)
    return Dense(Levels(quant), block_size)


def blocks(numel: int, block_size: int) -> list[tuple[int, int, int]]:
    """(start, blocks, length) of the full blocks and of the last, partial one."""
    full, last = divmod(numel, block_size)
    parts = [(0, full, block_size)] if full else []
    return parts + ([(full * block_size, 1, last)] if last else [])


@dataclass(frozen=True)
class Plain:
    """fp32 or bf16: every value as it is (bf16: rounded), no blocks."""

    quant: Literal["fp32", "bf16"]

    def size(self, numel: int) -> int:
        return (4 if self.quant == "fp32" else 2) * numel

    def kept_per_block(self, length: int) -> int:
        return length

    def kept(self, numel: int) -> int:
        return numel

    def quantise(self, flat: torch.Tensor, fit_scales: bool) -> bytes:
        if self.quant == "fp32":
            return flat.numpy().astype("<f4", copy=False).tobytes()
        # torch rounds to nearest even; the bits are the top half of fp32.
        return flat.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()

    def dequantise(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor:
        numel = out.numel()
        if numel == 0:
            return out
        if self.quant == "fp32":
            return out.copy_(wire_view(raw, torch.float32, 0, numel))
        return out.copy_(wire_view(raw, torch.int16, 0, numel).view(torch.bfloat16))


@dataclass(frozen=True)
class Levels:
    """The codes of one blockwise quantisation (int8, int4 or int2): their range
    and width, and how the blocks' scales are sent."""

    quant: Quant

    @property
    def qmax(self) -> int:
        return _QMAX[self.quant]

    @property
    def bits(self) -> int:
        return _BITS[self.quant]

    @property
    def scale_bytes(self) -> int:
        # int2's codes take a quarter of a byte: an fp32 scale per 64 of them would be
        # a fifth of the message, and ternary values need no 24-bit scale.
        return 2 if self.quant == "int2" else 4

    def code_bytes(self, count: int) -> int:
        return code_bytes(count, self.bits)

    def wire_scales(self, scales: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The scales' bytes, and the scales they decode to (what codes are
        computed with, so that the decoded values are the ones quantised)."""
        if self.scale_bytes == 2:
            rounded = scales.to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().astype("<i2").tobytes(), rounded.float()
        return scales.numpy().astype("<f4").tobytes(), scales

    def read_scales(self, raw: Buffer, blocks: int) -> torch.Tensor:
        """The first ``blocks`` scales of a payload, as fp32."""
        if self.scale_bytes == 2:
            return wire_view(raw, torch.int16, 0, blocks).view(torch.bfloat16).float()
        return wire_view(raw, torch.float32, 0, blocks)

    def scaled_codes(
        self, values: torch.Tensor, absmax: torch.Tensor, fit_scales: bool
    ) -> tuple[bytes, torch.Tensor]:
        """The scales' bytes and the int8 codes of ``values`` (one row per block,
        ``absmax`` each row's largest magnitude). ``fit_scales``: the bytes are
        each block's least-squares scale for its codes instead."""
        scale_bytes, scales = self.wire_scales(absmax / self.qmax)
        codes = self.codes(values, scales)
        if fit_scales:
            # In float64 each product is exact, and so is each block's sum, in any
            # order (the values with a nonzero code are within a factor 2 qmax of
            # each other): the syncer's compiled close (syncer/kernels.py) sends
            # the same scales, bit for bit.
            fitted = torch.empty_like(scales)
            rows = max(1, _CHUNK_VALUES // values.shape[1])  # a chunk stays in the cache
            for start in range(0, values.shape[0], rows):
                part = slice(start, start + rows)
                levels = codes[part].double()
                energy = torch.linalg.vecdot(levels, levels)
                dot = torch.linalg.vecdot(values[part].double(), levels)
                fitted[part] = torch.where(energy > 0, dot / energy.clamp(min=1), scales[part])
            scale_bytes, _ = self.wire_scales(fitted)
        return scale_bytes, codes

    def codes(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """int8 codes of ``values`` (one row per block) under the blocks' scales."""
        qmax = self.qmax
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        quotient = torch.div(values, safe[:, None])
        return quotient.round_().clamp_(-qmax, qmax).to(torch.int8)


@dataclass(frozen=True)
class Dense:
    """Every value, blockwise absmax: ``scales | codes``."""

    levels: Levels
    block_size: int

    def size(self, numel: int) -> int:
        count = -(-numel // self.block_size)
        return self.levels.scale_bytes * count + self.levels.code_bytes(numel)

    def kept_per_block(self, length: int) -> int:
        return length

    def kept(self, numel: int) -> int:
        return numel

    def quantise(self, flat: torch.Tensor, fit_scales: bool) -> bytes:
        scales, codes = [], []
        for start, count, length in blocks(flat.numel(), self.block_size):
            rows = flat[start : start + count * length].view(count, length)
            low, high = torch.aminmax(rows, dim=1)  # no |x| copy of the whole fragment
            scale_bytes, block_codes = self.levels.scaled_codes(
                rows, torch.maximum(high, low.neg_()), fit_scales
            )
            scales.append(scale_bytes)
            codes.append(block_codes.view(-1))
        if not scales:
            return b""
        all_codes = codes[0] if len(codes) == 1 else torch.cat(codes)
        return b"".join(scales) + pack(all_codes, self.levels.bits)

    def dequantise(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor:
        numel = out.numel()
        if numel == 0:
            return out
        # Codes widened into the output, then scaled per block in place: never a
        # repeated copy of the scales (a mixed int8 x fp32 multiply is 4x slower).
        # Chunk by chunk, so the scaling finds the widened values in the cache.
        block, bits = self.block_size, self.levels.bits
        count = -(-numel // block)
        scales = self.levels.read_scales(raw, count)
        head = self.levels.scale_bytes * count
        body = wire_view(raw, torch.uint8, head, memoryview(raw).nbytes - head)
        # Whole blocks, and (blocks being even) a multiple of four codes per chunk.
        chunk = _CHUNK_VALUES // (2 * block) * (2 * block)
        scratch = [torch.empty(chunk // 2, dtype=torch.int16) for _ in range(3)]
        for start in range(0, numel, chunk):
            piece = out[start : start + chunk]
            n = piece.numel()
            unpack(body, bits, start, n, piece, scratch)
            # A hostile payload may carry inf scales: the NaN that makes is refused by
            # the caller's finiteness check.
            full = n // block * block
            first = start // block
            piece[:full].view(-1, block).mul_(scales[first : first + full // block, None])
            if full < n:  # the last, partial block
                piece[full:].mul_(scales[-1])
        return out


@dataclass(frozen=True)
class Sparse:
    """Top-k per block: of each block only the ``ceil(density * length)`` largest
    magnitudes, quantised by the block's largest: ``scales | indices | codes``."""

    levels: Levels
    block_size: int
    density: float  # in (0, 1)

    def kept_per_block(self, length: int) -> int:
        return max(1, math.ceil(self.density * length))

    def kept(self, numel: int) -> int:
        return sum(
            count * self.kept_per_block(length)
            for _, count, length in blocks(numel, self.block_size)
        )

    def size(self, numel: int) -> int:
        count = -(-numel // self.block_size)
        kept = self.kept(numel)
        return self.levels.scale_bytes * count + 2 * kept + self.levels.code_bytes(kept)

    def quantise(self, flat: torch.Tensor, fit_scales: bool) -> bytes:
        scales, indices, codes = [], [], []
        for start, count, length in blocks(flat.numel(), self.block_size):
            rows = flat[start : start + count * length].view(count, length)
            # The largest magnitudes, sent in index order (the canonical form the
            # decoder checks).
            index = rows.abs().topk(self.kept_per_block(length), dim=1, sorted=False).indices
            index = index.sort(dim=1).values
            values = rows.gather(1, index)
            scale_bytes, block_codes = self.levels.scaled_codes(
                values, values.abs().amax(dim=1), fit_scales
            )
            scales.append(scale_bytes)
            indices.append(index.reshape(-1))
            codes.append(block_codes.reshape(-1))
        if not scales:
            return b""
        return (
            b"".join(scales)
            + torch.cat(indices).numpy().astype("<u2").tobytes()
            + pack(torch.cat(codes), self.levels.bits)
        )

    def dequantise(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor:
        numel = out.numel()
        if numel == 0:
            return out
        count = -(-numel // self.block_size)
        kept = self.kept(numel)
        scales = self.levels.read_scales(raw, count)
        head = self.levels.scale_bytes * count
        indices = wire_view(raw, torch.int16, head, kept).view(torch.uint16)
        body = wire_view(raw, torch.uint8, head + 2 * kept, self.levels.code_bytes(kept))
        values = torch.empty(kept, dtype=torch.float32)
        unpack(body, self.levels.bits, 0, kept, values)
        out.zero_()
        block, at = 0, 0
        for start, rows, length in blocks(numel, self.block_size):
            k = self.kept_per_block(length)
            index = indices[at : at + rows * k].to(torch.int64).view(rows, k)
            # Untrusted: every index inside its block, strictly increasing, so no
            # value lands outside the block or twice.
            if int(index[:, -1].max()) >= length or (
                k > 1 and not bool((index[:, 1:] > index[:, :-1]).all())
            ):
                raise CodecError("indices out of order or outside their block")
            row_values = values[at : at + rows * k].view(rows, k)
            row_values.mul_(scales[block : block + rows, None])
            out[start : start + rows * length].view(rows, length).scatter_(1, index, row_values)
            block, at = block + rows, at + rows * k
        return out
