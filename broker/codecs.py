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
from dataclasses import dataclass
from typing import Literal, cast

import lz4.frame
import numpy as np
import torch
import zstandard

Quant = Literal["fp32", "bf16", "int8", "int4"]
Lossless = Literal["none", "zstd", "lz4"]
QUANTS: tuple[Quant, ...] = ("fp32", "bf16", "int8", "int4")
LOSSLESS: tuple[Lossless, ...] = ("none", "zstd", "lz4")
DEFAULT_BLOCK_SIZE = 64
if sys.byteorder != "little":  # decoding views the little-endian wire bytes as they are
    raise ImportError("ddiloco's codecs need a little-endian machine")
_QMAX = {"int8": 127, "int4": 7}


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

    def decode(self, data: bytes | memoryview, numel: int) -> torch.Tensor:
        """Decode ``numel`` fp32 values; every size is checked before use."""
        expected = self.quantised_size(numel)
        raw = self._decompress(data, expected)
        if len(raw) != expected:
            raise CodecError(f"{self.name}: {numel} values need {expected} bytes, got {len(raw)}")
        return self._dequantise(raw, numel)

    def _decompress(self, data: bytes | memoryview, expected: int) -> bytes | memoryview:
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

    def _dequantise(self, raw: bytes | memoryview, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        if self.quant == "fp32":
            return torch.frombuffer(bytearray(raw), dtype=torch.float32)
        if self.quant == "bf16":
            bits = torch.frombuffer(bytearray(raw), dtype=torch.int16)
            return bits.view(torch.bfloat16).to(torch.float32)
        # Codes widened into the output, then scaled per block in place: never a
        # repeated copy of the scales (a mixed int8 x fp32 multiply is 4x slower).
        blocks = -(-numel // self.block_size)
        view = memoryview(raw)
        scales = torch.frombuffer(bytearray(view[: 4 * blocks]), dtype=torch.float32)
        body = torch.frombuffer(bytearray(view[4 * blocks :]), dtype=torch.int8)
        if self.quant == "int8":
            codes = body
        else:
            # Two nibbles q + 8 in [0, 15] per byte, low first: back to q, interleaved.
            nibbles = body.view(torch.uint8)
            codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=1).view(torch.int8).sub_(8)
            codes = codes.view(-1)[:numel]
        out = torch.empty(numel, dtype=torch.float32)
        out.copy_(codes)
        # A hostile payload may carry inf scales: the NaN that makes is refused by
        # the caller's finiteness check.
        full = numel // self.block_size * self.block_size
        out[:full].view(-1, self.block_size).mul_(scales[: full // self.block_size, None])
        if full < numel:  # the last, partial block
            out[full:].mul_(scales[-1])
        return out
