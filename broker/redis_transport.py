"""Redis Streams backend of the transport (DESIGN.md section 3).

Keys of one run (``{run}`` is the run id)::

    ddiloco:{run}:deltas:{p}   stream   learners XADD deltas of fragment p; the syncer
                                        consumer group ``syncers`` reads them
    ddiloco:{run}:globals      stream   syncers XADD every new global (exact MAXLEN)
    ddiloco:{run}:model:{p}    string   the latest global of fragment p, for joiners
    ddiloco:{run}:learners     hash     learner id -> its latest heartbeat frame

Every stream entry holds one :mod:`broker.wire` frame in the field ``m``.

Delivery
--------
* A learner's delta is delivered when Redis replied to its XADD (the server runs
  with AOF ``appendfsync always``, so the reply comes after the fsync). Until
  then it stays queued in the learner and is resent by ``poll``; a resend after
  a lost reply may duplicate an entry, which the syncer de-duplicates by
  (learner, incarnation, seq).
* The syncer reads with XREADGROUP and acks (XACK) only what the caller acks.
  A restarted consumer first re-reads its own pending entries, then new ones.
  Entries left pending by a dead consumer are taken over with XAUTOCLAIM once
  they are idle for ``claim_idle_s``: that must be longer than the longest time
  a live syncer holds a delta before acking it.
* Delta streams are trimmed with XTRIM MINID below the oldest entry that is
  pending or not yet delivered to the group, so trimming never eats an entry
  the syncer still needs. The learner's approximate MAXLEN is only a safety
  bound for a syncer that is down for long; an entry it trims while pending is
  detected (it comes back without fields) and counted as ``trimmed``, but one
  it trims before the group read it is lost unnoticed (redis < 7 keeps no
  record of it): size ``delta_stream_maxlen`` for the longest syncer outage.
* Globals reach learners in version order per fragment. A learner that sees a
  gap, a fragment it has no base for, or the globals stream trimmed past its
  read position fetches the latest-snapshot keys instead.

Connection errors (and other transient server errors: loading, OOM, MISCONF)
never escape: both sides back off exponentially (with jitter), reconnect and
carry on; deltas and globals not yet written stay queued in the process. The
exceptions are ``snapshot``, which raises :class:`TransportError` when it gets
no answer within its timeout, and ``send_delta``, which raises
:class:`Backpressure` when ``max_unacked`` deltas wait. Invalid messages of our
own (wrong run, fragment out of range, frame over ``max_message_bytes``) raise
``ValueError``/``WireError`` at once: they are bugs, not network weather.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.retry import Retry
from redis.typing import KeyT, StreamIdT

from broker.transport import (
    Backpressure,
    Inbound,
    LearnerTransport,
    SyncerTransport,
    TransportError,
    TransportStats,
)
from broker.wire import Delta, GlobalFragment, Heartbeat, Message, WireError, decode, encode

log = logging.getLogger(__name__)

# (entry id, fields) as redis-py returns them; fields are empty for an entry
# that was trimmed or deleted while pending.
_Entries = list[tuple[bytes, dict[bytes, bytes]]]

FIELD = b"m"
GROUP = "syncers"
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0
_GLOBALS_READ_COUNT = 16  # globals are whole fragments: read few at a time
_DELTAS_READ_COUNT = 64  # per stream and call
_HEARTBEAT_READ_INTERVAL_S = 0.25
_TRIM_INTERVAL_S = 1.0
# redis ends a blocking read on its timer tick (every 100 ms at the default
# hz 10), so BLOCK b returns after b to b + 100 ms: block only for what is left
# after one tick, and poll without blocking in the last tick of a wait.
_REDIS_TICK_S = 0.1
_TAIL_POLL_S = 0.02

# Errors after which the same request may succeed later: the server is down,
# restarting, loading its AOF, out of memory, or failing to write its AOF.
_TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ExecAbortError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
)

# The id of the first (or, with ARGV[1] == "last", the last) entry of a stream,
# or false when it is empty, without sending the entry's payload to the client.
_STREAM_END_ID = """
local entries
if ARGV[1] == 'last' then
    entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
else
    entries = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
end
if #entries == 0 then return false end
return entries[1][1]
"""


def delta_stream_key(run_id: str, fragment: int) -> str:
    return f"ddiloco:{run_id}:deltas:{fragment}"


def globals_stream_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:globals"


def model_key(run_id: str, fragment: int) -> str:
    return f"ddiloco:{run_id}:model:{fragment}"


def learners_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:learners"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = _text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _block_ms(deadline: float, max_block_s: float) -> int | None:
    """BLOCK argument that returns by ``deadline``; None: read without blocking
    (BLOCK 0 would wait forever)."""
    block_s = min(deadline - time.monotonic() - _REDIS_TICK_S, max_block_s)
    return int(block_s * 1000) if block_s >= 0.001 else None


def _sleep_tail(deadline: float) -> None:
    """After a non-blocking read found nothing: wait a little, client side."""
    time.sleep(min(max(0.0, deadline - time.monotonic()), _TAIL_POLL_S))


def _is_transient(error: Exception) -> bool:
    return isinstance(error, _TRANSIENT_ERRORS) or (
        isinstance(error, redis.ResponseError) and str(error).startswith("MISCONF")
    )


def _connect(url: str, socket_timeout_s: float) -> redis.Redis:
    # One immediate retry replaces a pooled connection that a server restart
    # broke; longer outages are the caller's backoff loop's business.
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=False,
    )


class _Reconnect:
    """Exponential backoff (with jitter) between attempts after transient errors."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._backoff = EqualJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
        self.failures = 0
        self._retry_at = 0.0

    def wait_s(self) -> float:
        """Seconds until the next attempt may go out (0 when it may go now)."""
        return max(0.0, self._retry_at - time.monotonic())

    def failed(self, error: Exception) -> None:
        self.failures += 1
        delay_s = self._backoff.compute(self.failures)
        self._retry_at = time.monotonic() + delay_s
        if self.failures == 1:
            log.warning("%s: redis unavailable (%s); retrying with backoff", self._what, error)
        else:
            log.debug(
                "%s: attempt %d failed (%s); next in %.2fs",
                self._what,
                self.failures,
                error,
                delay_s,
            )

    def succeeded(self) -> None:
        if self.failures:
            log.info(
                "%s: redis reachable again after %d failed attempts", self._what, self.failures
            )
        self.failures = 0
        self._retry_at = 0.0


def _check_frame(frame: Any, max_message_bytes: int, stats: TransportStats) -> Message | None:
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


def _encode_bounded(msg: Message, max_message_bytes: int) -> bytes:
    frame = encode(msg, max_payload_bytes=max_message_bytes)
    if len(frame) > max_message_bytes:
        raise WireError("too_large", f"frame of {len(frame)} > {max_message_bytes} bytes")
    return frame


@dataclass
class _QueuedDelta:
    stream: str
    frame: bytes
    failed_attempts: int = 0


class RedisLearnerTransport(LearnerTransport):
    """Learner side: XADD deltas, HSET heartbeats, XREAD globals, GET snapshots."""

    def __init__(
        self,
        url: str,
        run_id: str,
        learner_id: str,
        num_fragments: int,
        *,
        max_message_bytes: int = 256 * 2**20,
        max_unacked: int = 64,
        delta_stream_maxlen: int = 10_000,
        socket_timeout_s: float = 5.0,
    ) -> None:
        if num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
        if max_unacked < 1:
            raise ValueError(f"max_unacked must be >= 1, got {max_unacked}")
        if delta_stream_maxlen < 1:
            raise ValueError(f"delta_stream_maxlen must be >= 1, got {delta_stream_maxlen}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        self.run_id = run_id
        self.learner_id = learner_id
        self.num_fragments = num_fragments
        self.max_message_bytes = max_message_bytes
        self.max_unacked = max_unacked
        self.delta_stream_maxlen = delta_stream_maxlen
        self.stats = TransportStats()
        self.connection_errors = 0
        self.heartbeats_dropped = 0
        # A blocking read must end well before the socket timeout.
        self._max_block_s = socket_timeout_s / 2
        self._client = _connect(url, socket_timeout_s)
        self._stream_end_id = self._client.register_script(_STREAM_END_ID)
        self._reconnect = _Reconnect(f"learner {learner_id}")
        self._queue: deque[_QueuedDelta] = deque()
        self._globals = globals_stream_key(run_id)
        # Read position in the globals stream; None until the first snapshot or poll.
        self._position: str | None = None
        # Latest version per fragment; -1: known not to exist yet; missing: no base.
        self._versions: dict[int, int] = {}

    # -- deltas and heartbeats ----------------------------------------------
    def send_delta(self, delta: Delta) -> None:
        if delta.run_id != self.run_id:
            raise ValueError(f"delta of run {delta.run_id!r} sent on run {self.run_id!r}")
        if not 0 <= delta.fragment < self.num_fragments:
            raise ValueError(f"fragment {delta.fragment} outside [0, {self.num_fragments})")
        if len(self._queue) >= self.max_unacked:
            self._send_queued()
            if len(self._queue) >= self.max_unacked:
                raise Backpressure(f"{len(self._queue)} deltas wait for redis")
        frame = _encode_bounded(delta, self.max_message_bytes)
        self._queue.append(_QueuedDelta(delta_stream_key(self.run_id, delta.fragment), frame))
        self._send_queued()

    def _send_queued(self) -> None:
        """XADD queued deltas in order until the queue is empty or redis fails."""
        while self._queue and not self._reconnect.wait_s():
            item = self._queue[0]
            try:
                self._client.xadd(
                    item.stream,
                    {FIELD: item.frame},
                    maxlen=self.delta_stream_maxlen,
                    approximate=True,
                )
            except Exception as e:
                if not _is_transient(e):
                    raise
                item.failed_attempts += 1
                self._failed(e)
                return
            self._reconnect.succeeded()
            self._queue.popleft()
            self.stats.bytes_sent += len(item.frame)
            self.stats.messages_sent += 1
            if item.failed_attempts:
                self.stats.resent += 1

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        if heartbeat.run_id != self.run_id or heartbeat.learner_id != self.learner_id:
            raise ValueError("heartbeat of another run or learner")
        frame = _encode_bounded(heartbeat, self.max_message_bytes)
        if self._reconnect.wait_s():
            self.heartbeats_dropped += 1
            return
        try:
            self._client.hset(learners_key(self.run_id), self.learner_id, frame)
        except Exception as e:
            if not _is_transient(e):
                raise
            self.heartbeats_dropped += 1
            self._failed(e)
            return
        self._reconnect.succeeded()
        self.stats.bytes_sent += len(frame)
        self.stats.messages_sent += 1

    @property
    def unacked(self) -> int:
        return len(self._queue)

    def _failed(self, error: Exception) -> None:
        self.connection_errors += 1
        self._reconnect.failed(error)

    # -- globals --------------------------------------------------------------
    def poll(self, timeout_s: float) -> list[GlobalFragment]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if not self._reconnect.wait_s():
                self._send_queued()
            if not self._reconnect.wait_s():
                try:
                    found = self._read_globals(deadline)
                except Exception as e:
                    if not _is_transient(e):
                        raise
                    self._failed(e)
                else:
                    self._reconnect.succeeded()
                    if found or time.monotonic() >= deadline:
                        return found
                    continue
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return []
            time.sleep(min(remaining_s, self._reconnect.wait_s()))

    def _read_globals(self, deadline: float) -> list[GlobalFragment]:
        if self._position is None:
            return self._resync()
        block_ms = _block_ms(deadline, self._max_block_s)
        streams: dict[KeyT, StreamIdT] = {self._globals: self._position}
        reply = cast(
            list[tuple[bytes, _Entries]],
            self._client.xread(
                streams,
                count=_GLOBALS_READ_COUNT,
                block=block_ms,
            ),
        )
        if not reply:
            if block_ms is None:
                _sleep_tail(deadline)
            return []
        entries = reply[0][1]
        # New entries arrived. Trimming drops the oldest entries first, so if the
        # stream's first entry is now newer than our position, entries we never
        # read may have been trimmed: fall back to the snapshot keys.
        first_id = self._stream_end_id(keys=[self._globals], args=["first"])
        if first_id is not None and _parse_id(first_id) > _parse_id(self._position):
            log.info(
                "learner %s: globals stream trimmed past %s; resyncing from snapshots",
                self.learner_id,
                self._position,
            )
            self.stats.bytes_received += sum(len(f.get(FIELD, b"")) for _, f in entries)
            return self._resync()
        return self._accept_globals(entries)

    def _accept_globals(self, entries: _Entries) -> list[GlobalFragment]:
        """The next versions among ``entries``; snapshots for gaps. Moves the read
        position and the versions only once nothing can fail any more, so that a
        connection error reads the same entries again."""
        found: list[GlobalFragment] = []
        versions = dict(self._versions)
        fetch: list[int] = []  # fragments with a gap or no base: take their snapshot
        for _, fields in entries:
            msg = self._check_global(fields.get(FIELD))
            if msg is None or msg.fragment in fetch:
                continue
            known = versions.get(msg.fragment)
            if known is not None and msg.version <= known:
                continue
            if known is not None and msg.version == known + 1:
                versions[msg.fragment] = msg.version
                found.append(msg)
            else:
                fetch.append(msg.fragment)
        if fetch:
            frames = self._client.mget([model_key(self.run_id, p) for p in fetch])
            for p, g in self._get_models(fetch, frames).items():
                if g.version > versions.get(p, -1):
                    versions[p] = g.version
                    found.append(g)
        self._versions = versions
        self._position = _text(entries[-1][0])
        return found

    def _check_global(self, frame: Any) -> GlobalFragment | None:
        msg = _check_frame(frame, self.max_message_bytes, self.stats)
        if msg is None:
            return None
        if not isinstance(msg, GlobalFragment):
            self.stats.rejected["wrong_kind"] += 1
        elif msg.run_id != self.run_id:
            self.stats.rejected["wrong_run"] += 1
        elif msg.fragment >= self.num_fragments:
            self.stats.rejected["wrong_fragment"] += 1
        else:
            self.stats.messages_received += 1
            return msg
        return None

    def _advance(self, msg: GlobalFragment) -> bool:
        """Record ``msg``'s version; True if it is newer than what we had."""
        known = self._versions.get(msg.fragment)
        if known is not None and msg.version <= known:
            return False
        self._versions[msg.fragment] = msg.version
        return True

    def _get_models(self, fragments: list[int], frames: list[Any]) -> dict[int, GlobalFragment]:
        found: dict[int, GlobalFragment] = {}
        for p, frame in zip(fragments, frames, strict=True):
            if frame is None:
                continue
            msg = self._check_global(frame)
            if msg is None:
                continue
            if msg.fragment != p:
                self.stats.rejected["wrong_fragment"] += 1
                continue
            found[p] = msg
        return found

    def _load_snapshots(self, fragments: list[int]) -> dict[int, GlobalFragment]:
        """Read the snapshot keys and the globals stream's last id atomically.

        Moves the read position to that id when there was none or when every
        fragment was loaded: nothing published after the read is skipped, and
        entries before it carry versions the snapshot already covers.
        """
        pipe = self._client.pipeline(transaction=True)
        self._stream_end_id(keys=[self._globals], args=["last"], client=pipe)
        pipe.mget([model_key(self.run_id, p) for p in fragments])
        last_id, frames = pipe.execute()
        found = self._get_models(fragments, frames)
        if self._position is None or set(fragments) >= set(range(self.num_fragments)):
            self._position = _text(last_id) if last_id is not None else "0-0"
        for p in fragments:
            self._versions.setdefault(p, -1)
        return found

    def _resync(self) -> list[GlobalFragment]:
        snapshots = self._load_snapshots(list(range(self.num_fragments)))
        return [g for _, g in sorted(snapshots.items()) if self._advance(g)]

    def snapshot(self, fragments: list[int], timeout_s: float) -> dict[int, GlobalFragment]:
        bad = [p for p in fragments if not 0 <= p < self.num_fragments]
        if bad:
            raise ValueError(f"fragments {bad} outside [0, {self.num_fragments})")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            time.sleep(min(max(0.0, deadline - time.monotonic()), self._reconnect.wait_s()))
            try:
                found = self._load_snapshots(list(fragments))
            except Exception as e:
                if not _is_transient(e):
                    raise
                self._failed(e)
                if time.monotonic() >= deadline:
                    raise TransportError(f"no snapshot within {timeout_s}s: {e}") from e
                continue
            self._reconnect.succeeded()
            for g in found.values():
                self._advance(g)
            return found

    def close(self) -> None:
        if self._queue:
            log.warning(
                "learner %s: closing with %d undelivered deltas", self.learner_id, len(self._queue)
            )
        self._client.close()


class RedisSyncerTransport(SyncerTransport):
    """Syncer side: a consumer of group ``syncers`` on the owned fragments' delta
    streams; publishes globals to the globals stream and the snapshot keys."""

    def __init__(
        self,
        url: str,
        run_id: str,
        consumer: str,
        fragments: list[int],
        *,
        group: str = GROUP,
        max_message_bytes: int = 256 * 2**20,
        claim_idle_s: float = 30.0,
        globals_maxlen: int = 1000,
        block_ms: int = 200,
        socket_timeout_s: float = 5.0,
    ) -> None:
        if not fragments or len(set(fragments)) != len(fragments) or min(fragments) < 0:
            raise ValueError(f"fragments must be distinct non-negative ids, got {fragments}")
        if claim_idle_s <= 0:
            raise ValueError(f"claim_idle_s must be > 0, got {claim_idle_s}")
        if globals_maxlen < 1:
            raise ValueError(f"globals_maxlen must be >= 1, got {globals_maxlen}")
        if block_ms < 1:
            raise ValueError(f"block_ms must be >= 1 (0 would block forever), got {block_ms}")
        if max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        self.run_id = run_id
        self.consumer = consumer
        self.fragments = list(fragments)
        self.group = group
        self.max_message_bytes = max_message_bytes
        self.claim_idle_s = claim_idle_s
        self.globals_maxlen = globals_maxlen
        self.stats = TransportStats()
        self.connection_errors = 0
        self._max_block_s = min(block_ms / 1000, socket_timeout_s / 2)
        self._client = _connect(url, socket_timeout_s)
        self._reconnect = _Reconnect(f"syncer {consumer}")
        self._fragment_of = {delta_stream_key(run_id, p): p for p in fragments}
        self._groups_ready = False
        # Own pending entries still to re-read, per stream: the id to read after,
        # None once done. Reset after every transient error: a reply lost on the
        # way may have left entries delivered to us that we never saw.
        self._pending_after: dict[str, str | None] = {}
        self._reset_pending()
        # Handed to the caller and not acked yet: never hand them out twice.
        self._outstanding: set[tuple[str, str]] = set()
        # Accepted during the current receive(); outstanding once it returns them
        # (if it fails instead, the PEL re-read delivers them again).
        self._handing_out: set[tuple[str, str]] = set()
        # Rejected entries to XACK with the next receive() or ack().
        self._rejected_unacked: set[tuple[str, str]] = set()
        self._claim_interval_s = min(max(claim_idle_s / 2, 0.1), 5.0)
        self._claim_cursor: dict[str, str] = {}
        self._next_claim_at = 0.0
        self._heartbeat_frames: dict[bytes, bytes] = {}
        self._next_heartbeat_read_at = 0.0
        self._trim_waiting: set[str] = set()
        self._next_trim_at: dict[str, float] = {}
        self._unpublished: dict[int, bytes] = {}
        try:
            self._ensure_groups()
        except Exception as e:
            if not _is_transient(e):
                raise
            self._failed(e)  # receive() creates them once redis is back

    def _ensure_groups(self) -> None:
        for stream in self._fragment_of:
            try:
                self._client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self._groups_ready = True

    def _reset_pending(self) -> None:
        self._pending_after = dict.fromkeys(self._fragment_of, "0-0")

    def _failed(self, error: Exception) -> None:
        self.connection_errors += 1
        self._reset_pending()
        self._reconnect.failed(error)

    # -- receiving --------------------------------------------------------------
    def receive(self, timeout_s: float) -> list[Inbound]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            if not self._reconnect.wait_s():
                try:
                    items = self._receive_once(deadline)
                except Exception as e:
                    if isinstance(e, redis.ResponseError) and str(e).startswith("NOGROUP"):
                        # The streams or the group vanished (e.g. redis lost its data).
                        log.warning(
                            "syncer %s: %s; recreating the consumer group", self.consumer, e
                        )
                        self._groups_ready = False
                        self._reset_pending()
                    elif _is_transient(e):
                        self._failed(e)
                    else:
                        raise
                else:
                    self._reconnect.succeeded()
                    if items or time.monotonic() >= deadline:
                        return items
                    continue
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return []
            time.sleep(min(remaining_s, self._reconnect.wait_s()))

    def _receive_once(self, deadline: float) -> list[Inbound]:
        self._handing_out = set()
        if not self._groups_ready:
            self._ensure_groups()
        self._publish_queued()
        self._xack([])  # the rejected entries of the last call
        self._trim_due()
        items = self._read_heartbeats()
        items += self._claim_abandoned()
        items += self._read_own_pending()
        if not items:
            block_ms = _block_ms(deadline, self._max_block_s)
            streams: dict[KeyT, StreamIdT] = dict.fromkeys(self._fragment_of, ">")
            reply = cast(
                list[tuple[bytes, _Entries]],
                self._client.xreadgroup(
                    self.group,
                    self.consumer,
                    streams,
                    count=_DELTAS_READ_COUNT,
                    block=block_ms,
                ),
            )
            for stream, entries in reply or []:
                items += self._accept_deltas(_text(stream), entries)
            if not reply and block_ms is None:
                _sleep_tail(deadline)
        self._outstanding |= self._handing_out
        return items

    def _read_own_pending(self) -> list[Inbound]:
        """Entries delivered to this consumer name and never acked (by an earlier
        process of the same name, or before a lost reply), oldest first."""
        todo = {s: after for s, after in self._pending_after.items() if after is not None}
        if not todo:
            return []
        streams: dict[KeyT, StreamIdT] = {s: after for s, after in todo.items()}
        reply = cast(
            list[tuple[bytes, _Entries]],
            self._client.xreadgroup(
                self.group,
                self.consumer,
                streams,
                count=_DELTAS_READ_COUNT,
            ),
        )
        items: list[Inbound] = []
        replied = {_text(stream): entries for stream, entries in reply or []}
        for stream in todo:
            entries = replied.get(stream, [])
            if not entries:
                self._pending_after[stream] = None
                continue
            self._pending_after[stream] = _text(entries[-1][0])
            items += self._accept_deltas(stream, entries)
        return items

    def _claim_abandoned(self) -> list[Inbound]:
        """XAUTOCLAIM entries idle for ``claim_idle_s`` (left by dead consumers),
        one page per stream and call until every stream's scan is complete."""
        if time.monotonic() < self._next_claim_at:
            return []
        items: list[Inbound] = []
        for stream in self._fragment_of:
            cursor = self._claim_cursor.get(stream, "0-0")
            if cursor == "done":
                continue
            reply = cast(
                list[Any],
                self._client.xautoclaim(
                    stream,
                    self.group,
                    self.consumer,
                    int(self.claim_idle_s * 1000),
                    start_id=cursor,
                    count=_DELTAS_READ_COUNT,
                ),
            )
            next_cursor, entries = _text(reply[0]), reply[1]
            deleted = reply[2] if len(reply) > 2 else []  # redis >= 7 drops them from the PEL
            self.stats.rejected["trimmed"] += len(deleted)
            if any(entry_id is None for entry_id, _ in entries):
                # redis < 7 claims an entry that was trimmed while pending but
                # returns it as nil, without its id: our own PEL re-read finds it.
                self._pending_after[stream] = "0-0"
            # Our own entries that the caller still holds come back too once idle
            # for claim_idle_s; they are not handed out again.
            claimed = [
                (i, f) for i, f in entries if i is not None and not self._held((stream, _text(i)))
            ]
            if claimed:
                log.info(
                    "syncer %s: claimed %d abandoned entries of %s",
                    self.consumer,
                    len(claimed),
                    stream,
                )
            items += self._accept_deltas(stream, claimed)
            self._claim_cursor[stream] = "done" if next_cursor == "0-0" else next_cursor
        if all(self._claim_cursor.get(s) == "done" for s in self._fragment_of):
            self._claim_cursor.clear()
            self._next_claim_at = time.monotonic() + self._claim_interval_s
        return items

    def _held(self, token: tuple[str, str]) -> bool:
        return token in self._outstanding or token in self._handing_out

    def _accept_deltas(self, stream: str, entries: _Entries) -> list[Inbound]:
        items: list[Inbound] = []
        for raw_id, fields in entries:
            token = (stream, _text(raw_id))
            if self._held(token):
                continue
            if not fields:  # trimmed or deleted while pending
                self.stats.rejected["trimmed"] += 1
                self._rejected_unacked.add(token)
                continue
            msg = _check_frame(fields.get(FIELD), self.max_message_bytes, self.stats)
            if (
                isinstance(msg, Delta)
                and msg.run_id == self.run_id
                and msg.fragment == self._fragment_of[stream]
            ):
                self.stats.messages_received += 1
                self._handing_out.add(token)
                items.append(Inbound(msg, token))
                continue
            if msg is not None:  # _check_frame counted the others
                reason = (
                    "wrong_kind"
                    if not isinstance(msg, Delta)
                    else "wrong_run"
                    if msg.run_id != self.run_id
                    else "wrong_fragment"
                )
                self.stats.rejected[reason] += 1
            self._rejected_unacked.add(token)  # it can never become valid: ack it
        return items

    def _read_heartbeats(self) -> list[Inbound]:
        """Heartbeats that changed since the last read, at most every 0.25 s."""
        now = time.monotonic()
        if now < self._next_heartbeat_read_at:
            return []
        self._next_heartbeat_read_at = now + _HEARTBEAT_READ_INTERVAL_S
        frames = cast(dict[bytes, bytes], self._client.hgetall(learners_key(self.run_id)))
        items: list[Inbound] = []
        for learner, frame in frames.items():
            if self._heartbeat_frames.get(learner) == frame:
                continue
            self._heartbeat_frames[learner] = frame
            msg = _check_frame(frame, self.max_message_bytes, self.stats)
            if msg is None:
                continue
            if not isinstance(msg, Heartbeat):
                self.stats.rejected["wrong_kind"] += 1
            elif msg.run_id != self.run_id:
                self.stats.rejected["wrong_run"] += 1
            else:
                self.stats.messages_received += 1
                items.append(Inbound(msg))
        return items

    # -- acknowledging and trimming ------------------------------------------
    def ack(self, items: list[Inbound]) -> None:
        """XACK the deltas among ``items``, then trim the streams if due (also
        when ``items`` is empty)."""
        tokens = [cast(tuple[str, str], i.token) for i in items if i.token is not None]
        self._outstanding.difference_update(tokens)
        if self._reconnect.wait_s():
            # Left pending: our PEL re-read after reconnecting delivers them again,
            # and the caller's de-duplication acks them then.
            return
        try:
            self._xack(tokens)
            self._trim_due()
        except Exception as e:
            if not _is_transient(e):
                raise
            self._failed(e)
        else:
            self._reconnect.succeeded()

    def _xack(self, tokens: list[tuple[str, str]]) -> None:
        """XACK ``tokens`` and the rejected entries waiting for it."""
        rejected = list(self._rejected_unacked)
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in tokens + rejected:
            by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return
        pipe = self._client.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.group, *ids)
        pipe.execute()
        self._rejected_unacked.difference_update(rejected)
        self._trim_waiting.update(by_stream)

    def _trim_due(self) -> None:
        """XTRIM MINID each acked-into stream (at most every second) below every
        entry that some group still has pending or has not delivered yet."""
        now = time.monotonic()
        due = [s for s in self._trim_waiting if now >= self._next_trim_at.get(s, 0.0)]
        if not due:
            return
        # One atomic view of the groups: an entry below the bound is delivered
        # and acked by every group, and nothing can make it pending again.
        pipe = self._client.pipeline(transaction=True)
        for stream in due:
            pipe.xinfo_groups(stream)
            pipe.xpending(stream, self.group)
        replies = pipe.execute(raise_on_error=False)
        trims = self._client.pipeline(transaction=False)
        for i, stream in enumerate(due):
            groups, pending = replies[2 * i], replies[2 * i + 1]
            if isinstance(groups, Exception) or isinstance(pending, Exception):
                # The stream or group vanished; the next read recreates them.
                log.debug(
                    "syncer %s: not trimming %s: %s / %s", self.consumer, stream, groups, pending
                )
                continue
            bound = self._trim_bound(groups, pending)
            if bound is not None:
                trims.xtrim(stream, minid=bound, approximate=False)
        trims.execute()
        for stream in due:
            self._trim_waiting.discard(stream)
            self._next_trim_at[stream] = now + _TRIM_INTERVAL_S

    def _trim_bound(self, groups: list[dict[str, Any]], pending: dict[str, Any]) -> str | None:
        bounds: list[tuple[int, int]] = []
        for g in groups:
            ms, seq = _parse_id(g["last-delivered-id"])
            bounds.append((ms, seq + 1))  # everything after the last delivered id is unread
            if _text(g["name"]) != self.group and g["pending"]:
                return None  # another group's pending entries are unknown to us: keep all
        if pending["pending"]:
            bounds.append(_parse_id(pending["min"]))
        if not bounds:
            return None
        ms, seq = min(bounds)
        return f"{ms}-{seq}"

    # -- publishing --------------------------------------------------------------
    def publish(self, fragment: GlobalFragment) -> None:
        """Write the snapshot key and append to the globals stream, atomically.

        Never raises on connection errors: the newest unpublished global of each
        fragment is kept and written by the next ``publish`` or ``receive`` once
        redis is back (learners see the skipped versions as a gap and resync).
        """
        if fragment.run_id != self.run_id:
            raise ValueError(f"global of run {fragment.run_id!r} published on run {self.run_id!r}")
        self._unpublished[fragment.fragment] = _encode_bounded(fragment, self.max_message_bytes)
        if self._reconnect.wait_s():
            return
        try:
            self._publish_queued()
        except Exception as e:
            if not _is_transient(e):
                raise
            self._failed(e)
        else:
            self._reconnect.succeeded()

    def _publish_queued(self) -> None:
        if not self._unpublished:
            return
        pipe = self._client.pipeline(transaction=True)
        for p, frame in self._unpublished.items():
            pipe.set(model_key(self.run_id, p), frame)
            pipe.xadd(
                globals_stream_key(self.run_id),
                {FIELD: frame},
                maxlen=self.globals_maxlen,
                approximate=False,
            )
        pipe.execute()
        for frame in self._unpublished.values():
            self.stats.bytes_sent += 2 * len(frame)  # the frame travels twice: SET and XADD
            self.stats.messages_sent += 1
        self._unpublished.clear()

    def close(self) -> None:
        if self._unpublished:
            try:
                self._publish_queued()
            except Exception as e:
                if not _is_transient(e):
                    raise
                log.warning(
                    "syncer %s: closing with %d unpublished globals (%s)",
                    self.consumer,
                    len(self._unpublished),
                    e,
                )
        self._client.close()
