"""Frames on a ZeroMQ socket: how our sockets are made, how a message is sent
as frames, and how one is received within a bound of parts and bytes and
decoded.

Deltas and globals travel as three-part messages, the parts of
:func:`broker.wire.messages.encode_parts` (prefix and header, payload, checksum), so a
fragment is sent from the caller's buffer and received into one without a
copy; everything else is one frame. Under CURVE the payload goes in 1 MiB
frames, joined again on receipt (see ``CURVE_FRAME_BYTES``). Every message is
received frame by frame within a bound of parts and bytes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from broker.errors import WireError
from broker.transport import TransportStats
from broker.wire import messages as wire

log = logging.getLogger(__name__)
GLOBALS_TOPIC = b"g"
_FRAME_OVERHEAD = 64 * 1024 + 16  # header limit + prefix + checksum
# Parts at least this big are sent zero-copy (libzmq reads the bytes object
# itself); below it a copy is cheaper than the bookkeeping.
_ZERO_COPY_BYTES = 64 * 1024
# Under CURVE, libzmq encrypts each frame into fresh buffers of its size and
# copies it twice more: a 16 MiB payload misses the CPU caches at every step.
# Sent in frames of this size it stays in them (loopback, 16 MiB deltas: 0.6
# GB/s as one frame, 0.85 GB/s as 1 MiB frames; benchmarks/README.md).
CURVE_FRAME_BYTES = 2**20
# A message as sent: one whole frame, or the three parts of wire.encode_parts.
Parts = tuple[bytes, ...]
# A request that could not go out (no connection yet: a transport just made,
# or a syncer restarting) is tried again this soon, without backing off: the
# backoff is for requests that went out, whose answers are whole fragments.
UNSENT_RETRY_S = 0.02


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, max_message_bytes: int
) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # ZMTP heartbeats: notice a silently dead peer (and reconnect) within seconds.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    # A peer that sends more than this is disconnected by ZeroMQ before the
    # bytes reach us, so one bad client cannot make us allocate without bound.
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + _FRAME_OVERHEAD)
    return sock


@contextmanager
def destroyed_on_error(
    ctx: zmq.Context[zmq.Socket[bytes]], first: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Destroy the context if building the sockets raises (after ``first``,
    which stops threads that hold sockets of it): nobody holds the half-built
    transport to close it, and a context left to the garbage collector can
    hang the collecting thread in zmq_ctx_term (its sockets' weak references
    are cleared first, so nothing closes them)."""
    try:
        yield
    except BaseException:
        first()
        ctx.destroy(linger=0)
        raise


def send_parts(sock: zmq.Socket[bytes], parts: Parts, flags: int = 0) -> None:
    """Send ``parts`` as one message without blocking (under CURVE, large parts
    in frames of ``CURVE_FRAME_BYTES``). Raises ``zmq.Again`` only before
    anything is queued: once its first part is, a message is whole."""
    frames: list[bytes | memoryview] = list(parts)
    if sock.get(zmq.MECHANISM) == zmq.CURVE:
        frames = []
        for part in parts:
            view = memoryview(part)
            frames.extend(
                view[i : i + CURVE_FRAME_BYTES] for i in range(0, len(view), CURVE_FRAME_BYTES)
            )
            if not view:
                frames.append(part)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        more = zmq.SNDMORE if i < last else 0
        sock.send(frame, flags | zmq.NOBLOCK | more, copy=len(frame) < _ZERO_COPY_BYTES)


def max_parts(max_message_bytes: int) -> int:
    """Frames of one message at most: an envelope (identity or topic), prefix
    and header, the payload in CURVE frames, checksum."""
    return 3 + max(1, math.ceil(max_message_bytes / CURVE_FRAME_BYTES))


def receive_frames(
    sock: zmq.Socket[bytes], max_message_bytes: int, stats: TransportStats
) -> list[zmq.Frame] | None:
    """The next message's frames (``zmq.Again`` when none is there), read one
    by one: one with more frames or bytes than any message of ours is read to
    its end and dropped, counted ``too_large``, so a peer that sends endless
    parts (each within MAXMSGSIZE) never makes us hold them all."""
    first = sock.recv(zmq.NOBLOCK, copy=False)
    frames: list[zmq.Frame] | None = [first]
    total = len(first)
    most_parts, max_bytes = max_parts(max_message_bytes), max_message_bytes + _FRAME_OVERHEAD
    more = first.more
    while more:
        frame = sock.recv(copy=False)  # the rest of a message is there with its first part
        more = frame.more
        total += len(frame)
        if frames is None:
            continue
        if len(frames) >= most_parts or total > max_bytes:
            frames = None
            stats.rejected["too_large"] += 1
            log.warning("rejected a message of over %d parts or %d bytes", most_parts, max_bytes)
        else:
            frames.append(frame)
    return frames


def decode_frames(
    frames: list[zmq.Frame], max_message_bytes: int, stats: TransportStats
) -> wire.Message | None:
    """The message of one frame or of the parts of ``wire.encode_parts``, its
    payload in one frame or in several (CURVE), joined."""
    stats.bytes_received += sum(len(f) for f in frames)
    stats.messages_received += 1
    try:
        if len(frames) == 1:
            return wire.decode(frames[0].buffer, max_payload_bytes=max_message_bytes)
        if len(frames) >= 3:
            payload = (
                frames[1].buffer if len(frames) == 3 else b"".join(f.buffer for f in frames[1:-1])
            )
            return wire.decode_parts(
                frames[0].buffer, payload, frames[-1].buffer, max_payload_bytes=max_message_bytes
            )
        raise WireError("bad_envelope", f"{len(frames)} parts")
    except WireError as e:
        stats.rejected[e.reason] += 1
        log.warning("rejected frame: %s", e)
        return None
