"""The lossless stage after quantisation: zstd, lz4 or none.

Pure functions of the stage's name. Errors are :class:`CodecError` without the
codec's name; :class:`broker.wire.codecs.Codec` puts its name in front.
"""

from __future__ import annotations

import io
from typing import Literal, cast

import lz4.frame
import zstandard

from broker.errors import CodecError
from broker.wire.packing import Buffer

Lossless = Literal["none", "zstd", "lz4"]
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


def compress(stage: Lossless, raw: Buffer) -> bytes:
    """``raw`` through the lossless ``stage``: what goes on the wire."""
    if stage == "zstd":
        return zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS).compress(raw)
    if stage == "lz4":
        return cast(bytes, lz4.frame.compress(raw))
    return bytes(raw)


def decompress(
    stage: Lossless, data: Buffer, expected: int, out: bytearray | None = None
) -> Buffer:
    """What the lossless ``stage`` made ``data`` of, if it is ``expected`` bytes:
    no more than ``expected + 1`` bytes are ever read out, so the caller sees a
    longer stream by its size (zstd into ``out`` refuses it here). ``out``: a
    buffer of at least ``expected`` bytes that zstd decompresses into (a view of
    it is returned); ``data`` itself when ``stage`` is none."""
    if stage == "none":
        return data
    # Read at most expected + 1 bytes so a decompression bomb cannot
    # allocate more than the message is allowed to hold.
    try:
        if stage == "lz4":
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
        raise CodecError(f"corrupt {stage} stream: {e}") from None
    if longer:
        raise CodecError(f"the stream holds more than {expected} bytes")
    return view[:size]
