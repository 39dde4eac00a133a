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
"""

from __future__ import annotations

import io
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import lz4.frame
import torch
import zstandard

from broker.errors import CodecError as CodecError  # re-exported: defined in broker.errors

Quant = Literal["fp32", "bf16", "int8", "int4", "int2"]
Lossless = Literal["none", "zstd", "lz4"]
QUANTS: tuple[Quant, ...] = ("fp32", "bf16", "int8", "int4", "int2")
LOSSLESS: tuple[Lossless, ...] = ("none", "zstd", "lz4")
Buffer: TypeAlias = bytes | bytearray | memoryview  # what decodes: wire payloads are any of them
DEFAULT_BLOCK_SIZE = 64
SPARSE_BLOCK_SIZE = 4096  # top-k picks per block: large, so that k is not all ties
if sys.byteorder != "little":  # decoding views the little-endian wire bytes as they are
    raise ImportError("ddiloco's codecs need a little-endian machine")
_QMAX = {"int8": 127, "int4": 7, "int2": 1}
_BITS = {"int8": 8, "int4": 4, "int2": 2}
# Quantised codes hold few repeats: what zstd gains on them is its entropy
# stage, and its search for matches only costs time. With a small match table
# and long minimum matches it is 1.5x faster than level 1 and 2% smaller on
# int2 codes (4x faster and 7% smaller than level 3), and decodes 20% faster:
# 1.12 bits per int2 value, 6.6 ms per 16 M values here.
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
)
# Values decoded per chunk: small enough that a chunk's codes, widened, are still
# in the cache when they are scaled.
_CHUNK_VALUES = 1 << 16


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
        if self.sparse and self.quant not in _QMAX:
            raise CodecError(f"a sparse codec sends int8, int4 or int2 values, not {self.quant}")
        if self.block_size == 0:
            object.__setattr__(self, "block_size", self._default_block)
        if not 8 <= self.block_size <= 4096 or self.block_size % 2:
            raise CodecError(f"block_size must be even and in [8, 4096], got {self.block_size}")
        if self.quant not in _QMAX and self.block_size != DEFAULT_BLOCK_SIZE:
            # fp32 and bf16 have no blocks: one spelling, so equal codecs compare equal.
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)

    @property
    def sparse(self) -> bool:
        return self.density < 1

    @property
    def _default_block(self) -> int:
        return SPARSE_BLOCK_SIZE if self.sparse else DEFAULT_BLOCK_SIZE

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
        if self.quant in _QMAX and self.block_size != self._default_block:
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
        if self.quant == "fp32":
            return 4 * numel
        if self.quant == "bf16":
            return 2 * numel
        blocks = -(-numel // self.block_size)
        kept = self.kept(numel)
        indices = 2 * kept if self.sparse else 0
        return self._scale_bytes * blocks + indices + self._code_bytes(kept)

    @property
    def _scale_bytes(self) -> int:
        # int2's codes take a quarter of a byte: an fp32 scale per 64 of them would be
        # a fifth of the message, and ternary values need no 24-bit scale.
        return 2 if self.quant == "int2" else 4

    def _wire_scales(self, scales: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The scales' bytes, and the scales they decode to (what codes are
        computed with, so that the decoded values are the ones quantised)."""
        if self._scale_bytes == 2:
            rounded = scales.to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().astype("<i2").tobytes(), rounded.float()
        return scales.numpy().astype("<f4").tobytes(), scales

    def _read_scales(self, raw: Buffer, blocks: int) -> torch.Tensor:
        if self._scale_bytes == 2:
            return _wire_view(raw, torch.int16, 0, blocks).view(torch.bfloat16).float()
        return _wire_view(raw, torch.float32, 0, blocks)

    def _code_bytes(self, count: int) -> int:
        return -(-count * _BITS[self.quant] // 8)

    def kept_per_block(self, length: int) -> int:
        """How many of a block of ``length`` values a sparse codec sends."""
        return max(1, math.ceil(self.density * length)) if self.sparse else length

    def kept(self, numel: int) -> int:
        """How many of ``numel`` values go out."""
        return sum(count * self.kept_per_block(length) for _, count, length in self._blocks(numel))

    # -- encode / decode -------------------------------------------------
    def encode(self, x: torch.Tensor, fit_scales: bool = False) -> bytes:
        """``fit_scales``: send each block's least-squares scale for its codes
        instead of the scale they were rounded under (the same codes and
        bytes, less error). Rounded under the block's largest magnitude over
        qmax, ternary codes send every value above half the largest as the
        largest; the fitted scale sends those values' mean magnitude."""
        flat = x.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        return self.compressed(self._quantise(flat, fit_scales))

    def compressed(self, raw: Buffer) -> bytes:
        """The lossless stage over a quantised payload: what goes on the wire."""
        if self.lossless == "zstd":
            return zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS).compress(raw)
        if self.lossless == "lz4":
            return cast(bytes, lz4.frame.compress(raw))
        return bytes(raw)

    def decode(self, data: Buffer, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode ``numel`` fp32 values; every size is checked before use.

        ``out``: a contiguous fp32 tensor of ``numel`` values to decode into
        (returned), so that a caller decoding fragment after fragment reuses
        memory already paged in instead of faulting in a new tensor each time.
        """
        if out is not None and (
            out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous()
        ):
            raise ValueError(f"out must be a contiguous fp32 tensor of {numel} values")
        return self.dequantised(self.quantised(data, numel), numel, out)

    def dequantised(self, raw: Buffer, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``numel`` fp32 values of a quantised payload that :meth:`quantised`
        returned (its size already checked), into ``out`` if given."""
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        self._dequantise(raw, out.view(-1))
        return out

    def quantised(self, data: Buffer, numel: int, out: bytearray | None = None) -> Buffer:
        """The quantised payload of ``numel`` values under the lossless stage,
        its size checked (CodecError if it is not ``quantised_size(numel)``).

        ``out``: a buffer of at least that size that a zstd stage decompresses
        into (a view of it is returned), so that a caller decoding payload
        after payload reuses memory already paged in."""
        expected = self.quantised_size(numel)
        raw = self._decompress(data, expected, out)
        size = memoryview(raw).nbytes
        if size != expected:
            raise CodecError(f"{self.name}: {numel} values need {expected} bytes, got {size}")
        return raw

    def _decompress(self, data: Buffer, expected: int, out: bytearray | None = None) -> Buffer:
        if self.lossless == "none":
            return data
        # Read at most expected + 1 bytes so a decompression bomb cannot
        # allocate more than the message is allowed to hold.
        try:
            if self.lossless == "lz4":
                dec = lz4.frame.LZ4FrameDecompressor()
                return cast(bytes, dec.decompress(data, max_length=expected + 1))
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
            if out is None or len(out) < expected:
                return cast(bytes, reader.read(expected + 1))
            view = memoryview(out)[:expected]
            size = 0
            while size < expected and (got := reader.readinto(view[size:])):
                size += got
            longer = size == expected and bool(reader.read(1))
        except (zstandard.ZstdError, RuntimeError, ValueError) as e:
            raise CodecError(f"{self.name}: corrupt {self.lossless} stream: {e}") from None
        if longer:
            raise CodecError(f"{self.name}: the stream holds more than {expected} bytes")
        return view[:size]

    def _quantise(self, flat: torch.Tensor, fit_scales: bool) -> bytes:
        if self.quant == "fp32":
            return flat.numpy().astype("<f4", copy=False).tobytes()
        if self.quant == "bf16":
            # torch rounds to nearest even; the bits are the top half of fp32.
            return flat.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
        if self.sparse:
            return self._quantise_sparse(flat, fit_scales)
        scales, codes = [], []
        for start, blocks, length in self._blocks(flat.numel()):
            rows = flat[start : start + blocks * length].view(blocks, length)
            low, high = torch.aminmax(rows, dim=1)  # no |x| copy of the whole fragment
            scale_bytes, block_codes = self._scaled_codes(
                rows, torch.maximum(high, low.neg_()), fit_scales
            )
            scales.append(scale_bytes)
            codes.append(block_codes.view(-1))
        if not scales:
            return b""
        return b"".join(scales) + self._packed(codes[0] if len(codes) == 1 else torch.cat(codes))

    def _scaled_codes(
        self, values: torch.Tensor, absmax: torch.Tensor, fit_scales: bool
    ) -> tuple[bytes, torch.Tensor]:
        """The scales' bytes and the int8 codes of ``values`` (one row per block,
        ``absmax`` each row's largest magnitude)."""
        scale_bytes, scales = self._wire_scales(absmax / _QMAX[self.quant])
        codes = self._codes(values, scales)
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
            scale_bytes, _ = self._wire_scales(fitted)
        return scale_bytes, codes

    def _codes(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """int8 codes of ``values`` (one row per block) under the blocks' scales."""
        qmax = _QMAX[self.quant]
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        quotient = torch.div(values, safe[:, None])
        return quotient.round_().clamp_(-qmax, qmax).to(torch.int8)

    def _packed(self, codes: torch.Tensor) -> bytes:
        if self.quant == "int8":
            return codes.numpy().tobytes()
        bits = _BITS[self.quant]
        per_byte, offset = 8 // bits, 1 << (bits - 1)  # the padding code is a zero
        count = codes.numel()
        stored = torch.full((count + -count % per_byte,), offset, dtype=torch.int8)
        torch.add(codes, offset, out=stored[:count])
        # Read as little-endian words, code j of a byte is byte j of its word:
        # shifting it right by j * (8 - bits) puts it at bits * j of byte 0.
        words = stored.view(torch.int32 if per_byte == 4 else torch.int16)
        packed = words.clone()
        for j in range(1, per_byte):
            packed |= words >> (j * (8 - bits))
        return packed.view(torch.uint8)[::per_byte].numpy().tobytes()

    def _unpacked(
        self,
        body: torch.Tensor,
        start: int,
        count: int,
        out: torch.Tensor,
        scratch: list[torch.Tensor] | None = None,
    ) -> None:
        """Codes ``start .. start + count`` of the packed ``body`` into ``out`` (fp32);
        ``start`` is a multiple of the codes per byte. ``scratch``: three int16
        buffers of at least ``count / 2`` values, reused chunk after chunk."""
        if self.quant == "int8":
            out.copy_(body[start : start + count].view(torch.int8))
            return
        bits = _BITS[self.quant]
        per_byte = 8 // bits
        packed = body[start // per_byte : (start + count + per_byte - 1) // per_byte]
        pairs, high, more = scratch or [
            torch.empty(2 * packed.numel(), dtype=torch.int16) for _ in range(3)
        ]
        codes = _split(packed, 4, pairs, high)  # int4: the codes; int2: two codes each
        if bits == 2:
            codes = _split(codes, 2, high, more)
        out.copy_(codes[:count]).sub_(1 << (bits - 1))

    def _blocks(self, numel: int) -> list[tuple[int, int, int]]:
        """(start, blocks, length) of the full blocks and of the last, partial one."""
        full, last = divmod(numel, self.block_size)
        parts = [(0, full, self.block_size)] if full else []
        return parts + ([(full * self.block_size, 1, last)] if last else [])

    def _quantise_sparse(self, flat: torch.Tensor, fit_scales: bool) -> bytes:
        scales, indices, codes = [], [], []
        for start, blocks, length in self._blocks(flat.numel()):
            rows = flat[start : start + blocks * length].view(blocks, length)
            # The largest magnitudes, sent in index order (the canonical form the
            # decoder checks).
            index = rows.abs().topk(self.kept_per_block(length), dim=1, sorted=False).indices
            index = index.sort(dim=1).values
            values = rows.gather(1, index)
            scale_bytes, block_codes = self._scaled_codes(
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
            + self._packed(torch.cat(codes))
        )

    def _dequantise(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor:
        numel = out.numel()
        if numel == 0:
            return out
        if self.quant == "fp32":
            return out.copy_(_wire_view(raw, torch.float32, 0, numel))
        if self.quant == "bf16":
            return out.copy_(_wire_view(raw, torch.int16, 0, numel).view(torch.bfloat16))
        if self.sparse:
            return self._dequantise_sparse(raw, out)
        # Codes widened into the output, then scaled per block in place: never a
        # repeated copy of the scales (a mixed int8 x fp32 multiply is 4x slower).
        # Chunk by chunk, so the scaling finds the widened values in the cache.
        block = self.block_size
        blocks = -(-numel // block)
        scales = self._read_scales(raw, blocks)
        head = self._scale_bytes * blocks
        body = _wire_view(raw, torch.uint8, head, memoryview(raw).nbytes - head)
        # Whole blocks, and (blocks being even) a multiple of four codes per chunk.
        chunk = _CHUNK_VALUES // (2 * block) * (2 * block)
        scratch = [torch.empty(chunk // 2, dtype=torch.int16) for _ in range(3)]
        for start in range(0, numel, chunk):
            piece = out[start : start + chunk]
            n = piece.numel()
            self._unpacked(body, start, n, piece, scratch)
            # A hostile payload may carry inf scales: the NaN that makes is refused by
            # the caller's finiteness check.
            full = n // block * block
            first = start // block
            piece[:full].view(-1, block).mul_(scales[first : first + full // block, None])
            if full < n:  # the last, partial block
                piece[full:].mul_(scales[-1])
        return out

    def _dequantise_sparse(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor:
        numel = out.numel()
        blocks = -(-numel // self.block_size)
        kept = self.kept(numel)
        scales = self._read_scales(raw, blocks)
        head = self._scale_bytes * blocks
        indices = _wire_view(raw, torch.int16, head, kept).view(torch.uint16)
        body = _wire_view(raw, torch.uint8, head + 2 * kept, self._code_bytes(kept))
        values = torch.empty(kept, dtype=torch.float32)
        self._unpacked(body, 0, kept, values)
        out.zero_()
        block, at = 0, 0
        for start, count, length in self._blocks(numel):
            k = self.kept_per_block(length)
            index = indices[at : at + count * k].to(torch.int64).view(count, k)
            # Untrusted: every index inside its block, strictly increasing, so no
            # value lands outside the block or twice.
            if int(index[:, -1].max()) >= length or (
                k > 1 and not bool((index[:, 1:] > index[:, :-1]).all())
            ):
                raise CodecError(f"{self.name}: indices out of order or outside their block")
            row_values = values[at : at + count * k].view(count, k)
            row_values.mul_(scales[block : block + count, None])
            out[start : start + count * length].view(count, length).scatter_(1, index, row_values)
            block, at = block + count, at + count * k
        return out


def _split(packed: torch.Tensor, bits: int, wide: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Each byte ``b = low + 2**bits * high`` of ``packed`` (fields in [0, 2**bits)
    and below) as two int8 values ``low, high``, in order, using the int16 buffers
    ``wide`` and ``high``. As int16, ``b + (256 - 2**bits) * high = low + 256 high``
    puts them in two bytes, low first (little endian), interleaved as the values
    are. Every step is contiguous, so vectorised."""
    m = packed.numel()
    both = wide[:m].copy_(packed)
    both.add_(torch.bitwise_right_shift(both, bits, out=high[:m]), alpha=256 - (1 << bits))
    return both.view(torch.int8)


def _wire_view(raw: Buffer, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``raw``, without a copy.

    Only ever read: torch warns that a read-only buffer (``bytes``) could be
    written through the tensor, which is why the warning is silenced here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype, offset=offset, count=count)
