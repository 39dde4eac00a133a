"""Codes in and out of bytes: int8 as they are, int4 and int2 packed.

Pure functions over tensors, no codec: ``bits`` says the width. int4 packs two
codes per byte (low nibble first, stored as q + 8), int2 four (lowest bits
first, stored as q + 2); see broker/wire/codecs.py for the whole payload's layout.
"""

from __future__ import annotations

import sys
import warnings
from typing import TypeAlias

import torch

Buffer: TypeAlias = bytes | bytearray | memoryview  # what decodes: wire payloads are any of them
if sys.byteorder != "little":  # decoding views the little-endian wire bytes as they are
    raise ImportError("ddiloco's codecs need a little-endian machine")


def code_bytes(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits each take, packed."""
    return -(-count * bits // 8)


def pack(codes: torch.Tensor, bits: int) -> bytes:
    """The flat int8 ``codes`` (each within ``bits`` bits, signed) as wire bytes."""
    if bits == 8:
        return codes.numpy().tobytes()
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


def unpack(
    body: torch.Tensor,
    bits: int,
    start: int,
    count: int,
    out: torch.Tensor,
    scratch: list[torch.Tensor] | None = None,
) -> None:
    """Codes ``start .. start + count`` of the packed ``body`` (uint8) into ``out``
    (fp32); ``start`` is a multiple of the codes per byte. ``scratch``: three int16
    buffers of at least ``count / 2`` values, reused chunk after chunk."""
    if bits == 8:
        out.copy_(body[start : start + count].view(torch.int8))
        return
    per_byte = 8 // bits
    packed = body[start // per_byte : (start + count + per_byte - 1) // per_byte]
    pairs, high, more = scratch or [
        torch.empty(2 * packed.numel(), dtype=torch.int16) for _ in range(3)
    ]
    codes = _split(packed, 4, pairs, high)  # int4: the codes; int2: two codes each
    if bits == 2:
        codes = _split(codes, 2, high, more)
    out.copy_(codes[:count]).sub_(1 << (bits - 1))


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


def wire_view(raw: Buffer, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``raw``, without a copy.

    Only ever read: torch warns that a read-only buffer (``bytes``) could be
    written through the tensor, which is why the warning is silenced here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype, offset=offset, count=count)
