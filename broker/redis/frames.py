"""What a stream entry of the Redis Streams transport holds, and the checks
every frame read from Redis passes: each is size-bounded and decoded by
:mod:`broker.wire.messages`, and a bad one is counted by reason
(:class:`~broker.transport.TransportStats`) and dropped. Frames written are
bounded too (:func:`encode_bounded`)."""

from __future__ import annotations

from typing import Any

from broker.transport import TransportStats
from broker.wire.messages import Message, WireError, decode, decode_parts, encode, encode_parts

# (entry id, fields) as redis-py returns them; fields are empty for an entry
# that was trimmed or deleted while pending.
Entries = list[tuple[bytes, dict[bytes, bytes]]]

FIELD = b"m"
PART_FIELDS = (b"h", b"p", b"c")  # a frame in parts: prefix and header, payload, checksum


def to_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = to_str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def entries_within(max_bytes: int, entry_bytes: int, most: int) -> int:
    """A stream's MAXLEN that holds its entries of about ``entry_bytes`` to
    ``max_bytes``: at most ``most`` entries and at least one."""
    return max(1, min(most, max_bytes // max(1, entry_bytes)))


def check_frame(frame: Any, max_message_bytes: int, stats: TransportStats) -> Message | None:
    """Decode one stream/hash value, or count why it is rejected and return None."""
    if not isinstance(frame, bytes):
        stats.rejected["bad_entry"] += 1
        return None
    stats.bytes_received += len(frame)
    if len(frame) > max_message_bytes:
        stats.rejected["too_large"] += 1
        return None
    try:
        return decode(frame, max_payload_bytes=max_message_bytes)
    except WireError as e:
        stats.rejected[e.reason] += 1
        return None


def check_entry(
    fields: dict[bytes, bytes], max_message_bytes: int, stats: TransportStats
) -> Message | None:
    """Decode a stream entry (a frame in ``m``, or its parts in ``h``, ``p``,
    ``c``), or count why it is rejected and return None."""
    if fields.keys() != set(PART_FIELDS):
        frame = fields.get(FIELD) if len(fields) == 1 else None
        return check_frame(frame, max_message_bytes, stats)
    start, payload, crc = (fields[name] for name in PART_FIELDS)
    if not all(isinstance(part, bytes) for part in (start, payload, crc)):
        stats.rejected["bad_entry"] += 1
        return None
    size = len(start) + len(payload) + len(crc)
    stats.bytes_received += size
    if size > max_message_bytes:
        stats.rejected["too_large"] += 1
        return None
    try:
        return decode_parts(start, payload, crc, max_payload_bytes=max_message_bytes)
    except WireError as e:
        stats.rejected[e.reason] += 1
        return None


def encode_parts_bounded(msg: Message, max_message_bytes: int) -> tuple[bytes, bytes, bytes]:
    parts = encode_parts(msg, max_payload_bytes=max_message_bytes)
    size = sum(len(part) for part in parts)
    if size > max_message_bytes:
        raise WireError("too_large", f"frame of {size} > {max_message_bytes} bytes")
    return parts


def encode_bounded(msg: Message, max_message_bytes: int) -> bytes:
    frame = encode(msg, max_payload_bytes=max_message_bytes)
    if len(frame) > max_message_bytes:
        raise WireError("too_large", f"frame of {len(frame)} > {max_message_bytes} bytes")
    return frame
