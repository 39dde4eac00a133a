"""Codecs for fragment tensors on the wire.

A codec turns a flat fp32 vector into bytes and back. Quantisation is
blockwise absmax: each block of ``block_size`` values is scaled by its largest
magnitude, so one outlier only costs precision inside its own block. An
optional lossless stage (zstd or lz4) follows. Accumulation and the outer
optimizer always run in fp32; only the wire is compressed.

Layout of the quantised payload (before the lossless stage), little endian:
``scales (fp32, one per block) | codes`` where codes are int8 (one per value)
or int4 (two per byte, low nibble first, stored as q + 8).
"""

from __future__ import annotations

import io
import sys
import warnings
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import lz4.frame
import numpy as np
import torch
import zstandard

Quant = Literal["fp32", "bf16", "int8", "int4"]
Lossless = Literal["none", "zstd", "lz4"]
QUANTS: tuple[Quant, ...] = ("fp32", "bf16", "int8", "int4")
LOSSLESS: tuple[Lossless, ...] = ("none", "zstd", "lz4")
Buffer: TypeAlias = bytes | bytearray | memoryview  # what decodes: wire payloads are any of them
DEFAULT_BLOCK_SIZE = 64
if sys.byteorder != "little":  # decoding views the little-endian wire bytes as they are
    raise ImportError("ddiloco's codecs need a little-endian machine")
_QMAX = {"int8": 127, "int4": 7}
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


class CodecError(ValueError):
    """Bytes that do not decode under the named codec, or a bad codec name."""


@dataclass(frozen=True)
class Codec:
    quant: Quant = "fp32"
    lossless: Lossless = "none"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise CodecError(f"unknown quantisation {self.quant!r}; choose one of {QUANTS}")
        if self.lossless not in LOSSLESS:
            raise CodecError(f"unknown lossless stage {self.lossless!r}; choose one of {LOSSLESS}")
        if not 8 <= self.block_size <= 4096 or self.block_size % 2:
            raise CodecError(f"block_size must be even and in [8, 4096], got {self.block_size}")
        if self.quant not in _QMAX and self.block_size != DEFAULT_BLOCK_SIZE:
            # fp32 and bf16 have no blocks: one spelling, so equal codecs compare equal.
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)

    @classmethod
    def parse(cls, spec: str) -> Codec:
        """Parse ``quant[+lossless][@block]``, e.g. ``int4+zstd`` or ``int8@128``."""
        if not isinstance(spec, str) or len(spec) > 32:
            raise CodecError(f"bad codec spec {spec!r}")
        body, _, block = spec.partition("@")
        quant, _, lossless = body.partition("+")
        try:
            block_size = int(block) if block else DEFAULT_BLOCK_SIZE
        except ValueError:
            raise CodecError(f"bad block size in codec spec {spec!r}") from None
        return cls(cast(Quant, quant), cast(Lossless, lossless or "none"), block_size)

    @property
    def name(self) -> str:
        s: str = self.quant
        if self.lossless != "none":
            s += "+" + self.lossless
        if self.quant in _QMAX and self.block_size != DEFAULT_BLOCK_SIZE:
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
        codes = numel if self.quant == "int8" else -(-numel // 2)
        return 4 * blocks + codes

    # -- encode / decode -------------------------------------------------
    def encode(self, x: torch.Tensor) -> bytes:
        flat = x.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        raw = self._quantise(flat)
        if self.lossless == "zstd":
            return zstandard.ZstdCompressor(level=3).compress(raw)
        if self.lossless == "lz4":
            return cast(bytes, lz4.frame.compress(raw))
        return raw

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
        expected = self.quantised_size(numel)
        raw = self._decompress(data, expected)
        size = memoryview(raw).nbytes
        if size != expected:
            raise CodecError(f"{self.name}: {numel} values need {expected} bytes, got {size}")
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        self._dequantise(raw, out.view(-1))
        return out

    def _decompress(self, data: Buffer, expected: int) -> Buffer:
        if self.lossless == "none":
            return data
        # Read at most expected + 1 bytes so a decompression bomb cannot
        # allocate more than the message is allowed to hold.
        try:
            if self.lossless == "zstd":
                reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))
                return cast(bytes, reader.read(expected + 1))
            dec = lz4.frame.LZ4FrameDecompressor()
            return cast(bytes, dec.decompress(data, max_length=expected + 1))
        except (zstandard.ZstdError, RuntimeError, ValueError) as e:
            raise CodecError(f"{self.name}: corrupt {self.lossless} stream: {e}") from None

    def _quantise(self, flat: torch.Tensor) -> bytes:
        if self.quant == "fp32":
            return flat.numpy().astype("<f4", copy=False).tobytes()
        if self.quant == "bf16":
            # torch rounds to nearest even; the bits are the top half of fp32.
            return flat.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
        qmax = _QMAX[self.quant]
        n = flat.numel()
        blocks = -(-n // self.block_size)
        padded = torch.zeros(blocks * self.block_size, dtype=torch.float32)
        padded[:n] = flat
        padded = padded.view(blocks, self.block_size)
        scales = padded.abs().amax(dim=1) / qmax
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(padded / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
        codes_np = codes.reshape(-1)[:n].numpy()
        scales_bytes = scales.numpy().astype("<f4").tobytes()
        if self.quant == "int8":
            return scales_bytes + codes_np.tobytes()
        nibbles = (codes_np.astype(np.int16) + 8).astype(np.uint8)
        if n % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        return scales_bytes + packed.astype(np.uint8).tobytes()

    def _dequantise(self, raw: Buffer, out: torch.Tensor) -> torch.Tensor:
        numel = out.numel()
        if numel == 0:
            return out
        if self.quant == "fp32":
            return out.copy_(_wire_view(raw, torch.float32, 0, numel))
        if self.quant == "bf16":
            return out.copy_(_wire_view(raw, torch.int16, 0, numel).view(torch.bfloat16))
        # Codes widened into the output, then scaled per block in place: never a
        # repeated copy of the scales (a mixed int8 x fp32 multiply is 4x slower).
        # Chunk by chunk, so the scaling finds the widened values in the cache.
        block = self.block_size
        blocks = -(-numel // block)
        scales = _wire_view(raw, torch.float32, 0, blocks)
        body = _wire_view(raw, torch.uint8, 4 * blocks, memoryview(raw).nbytes - 4 * blocks)
        chunk = _CHUNK_VALUES // block * block
        if self.quant == "int4":
            pairs = torch.empty(chunk // 2, dtype=torch.int16)
            high = torch.empty(chunk // 2, dtype=torch.int16)
        for start in range(0, numel, chunk):
            piece = out[start : start + chunk]
            n = piece.numel()
            if self.quant == "int8":
                piece.copy_(body[start : start + n].view(torch.int8))
            else:
                # Two nibbles q + 8 in [0, 15] per byte b = low + 16 high: as int16,
                # b + 240 high = low + 256 high puts them in two bytes, low first
                # (little endian), interleaved as the values are; then back to q.
                # Every step is contiguous, so vectorised.
                packed = body[start // 2 : (start + n + 1) // 2]
                m = packed.numel()
                both = pairs[:m].copy_(packed)
                both.add_(torch.bitwise_right_shift(both, 4, out=high[:m]), alpha=240)
                piece.copy_(both.view(torch.int8)[:n].sub_(8))
            # A hostile payload may carry inf scales: the NaN that makes is refused by
            # the caller's finiteness check.
            full = n // block * block
            first = start // block
            piece[:full].view(-1, block).mul_(scales[first : first + full // block, None])
            if full < n:  # the last, partial block
                piece[full:].mul_(scales[-1])
        return out


def _wire_view(raw: Buffer, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``raw``, without a copy.

    Only ever read: torch warns that a read-only buffer (``bytes``) could be
    written through the tensor, which is why the warning is silenced here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype, offset=offset, count=count)
