"""Learner side of the Redis Streams transport (docs/transports.md).

Keys, the delivery contract and the connection handling both sides share are in
:mod:`broker.redis_common`. A learner XADDs its deltas to the delta stream of
their fragment, HSETs its heartbeat into the learners hash, XREADs the globals
stream and GETs the snapshot keys when it has no base or sees a gap. Learner
slots are leased in the leases hash by one script, on the server's clock.

Connection errors never escape, with two exceptions: ``snapshot`` and ``lease``
raise :class:`TransportError` when they get no answer within their timeout, and
``send_delta`` raises :class:`Backpressure` when ``max_unacked`` deltas wait.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from redis.typing import KeyT, StreamIdT

from broker.redis_common import (
    BOUNDED_XADD,
    FIELD,
    GROUP,
    LEASE_SLOT,
    PART_FIELDS,
    SNAPSHOTS_UNLESS_HELD,
    STREAM_END_ID,
    Entries,
    Reconnect,
    check_frame,
    connect,
    delta_stream_key,
    encode_bounded,
    encode_parts_bounded,
    globals_stream_key,
    is_transient,
    learners_key,
    leases_key,
    model_key,
    notices_key,
    parse_id,
    read_block_ms,
    retry_until,
    sleep_tail,
    to_str,
    trimmed_key,
    weightless_key,
)
from broker.transport import (
    MAX_LEARNER_SLOTS,
    Backpressure,
    LearnerTransport,
    TransportError,
    candidate_order,
    lease_request_ok,
)
from broker.wire import Delta, GlobalFragment, Heartbeat, Refusal, weights_checksum

log = logging.getLogger(__name__)

_GLOBALS_READ_COUNT = 16  # globals are whole fragments: read few at a time


# The accepted (epoch, version) of a fragment known to have no global yet: any
# global of it is new.
_NOTHING_YET = (-1, -1)


@dataclass
class _QueuedDelta:
    stream: str
    trimmed_key: str
    parts: tuple[bytes, bytes, bytes]  # wire.encode_parts: the payload is the caller's
    failed_attempts: int = 0


class RedisLearnerTransport(LearnerTransport):
    """Learner side: XADD deltas, HSET heartbeats, XREAD globals, GET snapshots."""

    def __init__(
        self,
        url: str,
        run_id: str,
        learner_id: str,
        incarnation: int,
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
        self.incarnation = incarnation
        self.num_fragments = num_fragments
        self.max_message_bytes = max_message_bytes
        self.max_unacked = max_unacked
        self.delta_stream_maxlen = delta_stream_maxlen
        super().__init__()
        self.connection_errors = 0
        self.heartbeats_dropped = 0
        # A blocking read must end well before the socket timeout.
        self._max_block_s = socket_timeout_s / 2
        self._client = connect(url, socket_timeout_s)
        self._stream_end_id = self._client.register_script(STREAM_END_ID)
        self._snapshots_unless_held = self._client.register_script(SNAPSHOTS_UNLESS_HELD)
        self._lease_slot = self._client.register_script(LEASE_SLOT)
        self._bounded_xadd = self._client.register_script(BOUNDED_XADD)
        self._reconnect = Reconnect(f"learner {learner_id}")
        self._queue: deque[_QueuedDelta] = deque()
        self._globals = globals_stream_key(run_id)
        self._wanted: set[int] = set()  # fragments to fetch the snapshot of (resync)
        # Read position in the globals stream; None until the first snapshot or poll.
        self._position: str | None = None
        # Refusals of our deltas, read with the globals; old incarnations' are skipped.
        self._notices = notices_key(run_id, learner_id)
        self._notices_position = "0-0"
        self.trimmed_unread = 0  # deltas of ours (or others') the stream bound dropped unread

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
        self._queue.append(
            _QueuedDelta(
                delta_stream_key(self.run_id, delta.fragment),
                trimmed_key(self.run_id, delta.fragment),
                encode_parts_bounded(delta, self.max_message_bytes),
            )
        )
        self._send_queued()

    def _send_queued(self) -> None:
        """XADD queued deltas in order until the queue is empty or redis fails."""
        while self._queue and not self._reconnect.wait_s():
            item = self._queue[0]
            try:
                lost = int(
                    self._bounded_xadd(
                        keys=[item.stream, item.trimmed_key],
                        args=[self.delta_stream_maxlen, GROUP, *self._entry(item.parts)],
                    )
                )
            except Exception as e:
                if not is_transient(e):
                    raise
                item.failed_attempts += 1
                self._failed(e)
                return
            self._reconnect.succeeded()
            self._queue.popleft()
            if lost:
                self.trimmed_unread += lost
                log.error(
                    "learner %s: %s is at its bound of %d entries with the syncer behind: "
                    "dropped %d unread deltas (raise delta_stream_maxlen or restart the syncer)",
                    self.learner_id,
                    item.stream,
                    self.delta_stream_maxlen,
                    lost,
                )
            self.stats.bytes_sent += sum(len(part) for part in item.parts)
            self.stats.messages_sent += 1
            if item.failed_attempts:
                self.stats.resent += 1

    @staticmethod
    def _entry(parts: tuple[bytes, bytes, bytes]) -> list[bytes]:
        """A delta entry's fields and values, as XADD takes them."""
        return [v for pair in zip(PART_FIELDS, parts, strict=True) for v in pair]

    def send_heartbeat(self, heartbeat: Heartbeat) -> None:
        if heartbeat.run_id != self.run_id or heartbeat.learner_id != self.learner_id:
            raise ValueError("heartbeat of another run or learner")
        frame = encode_bounded(heartbeat, self.max_message_bytes)
        if self._reconnect.wait_s():
            self.heartbeats_dropped += 1
            return
        try:
            self._client.hset(learners_key(self.run_id), self.learner_id, frame)
        except Exception as e:
            if not is_transient(e):
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
        # Queued deltas go out ahead of every read: poll() is what resends them.
        return retry_until(
            self._reconnect, deadline, self._read_globals, self._failed, before=self._send_queued
        )

    def resync(self, fragment: int) -> None:
        if 0 <= fragment < self.num_fragments:
            self._wanted.add(fragment)

    def _read_globals(self, deadline: float) -> list[GlobalFragment]:
        if self._position is None:
            return self._resync()
        if self._wanted:
            wanted = sorted(self._wanted)
            found = self._fetch_snapshots(wanted)
            self._wanted.difference_update(wanted)  # once fetched: an error reads again
            if found:
                return found
        block_ms = read_block_ms(deadline, self._max_block_s)
        streams: dict[KeyT, StreamIdT] = {
            self._globals: self._position,
            self._notices: self._notices_position,
        }
        reply = cast(
            list[tuple[bytes, Entries]],
            self._client.xread(
                streams,
                count=_GLOBALS_READ_COUNT,
                block=block_ms,
            ),
        )
        if not reply:
            if block_ms is None:
                sleep_tail(deadline)
            return []
        replied = {to_str(stream): entries for stream, entries in reply}
        resync = self._read_notices(replied.get(self._notices, []))
        entries = replied.get(self._globals, [])
        if not entries:
            return self._fetch_snapshots(resync)
        # New entries arrived. Trimming drops the oldest entries first, so if the
        # stream's first entry is now newer than our position, entries we never
        # read may have been trimmed: fall back to the snapshot keys.
        first_id = self._stream_end_id(keys=[self._globals], args=["first"])
        if first_id is not None and parse_id(first_id) > parse_id(self._position):
            log.info(
                "learner %s: globals stream trimmed past %s; resyncing from snapshots",
                self.learner_id,
                self._position,
            )
            self.stats.bytes_received += sum(len(f.get(FIELD, b"")) for _, f in entries)
            return self._resync()
        return self._accept_globals(entries, resync)

    def _read_notices(self, entries: Entries) -> list[int]:
        """Count the refusals among ``entries``; the fragments to resync."""
        resync: list[int] = []
        for entry_id, fields in entries:
            self._notices_position = to_str(entry_id)
            msg = check_frame(fields.get(FIELD), self.max_message_bytes, self.stats)
            if msg is None:
                continue
            if (
                not isinstance(msg, Refusal)
                or msg.run_id != self.run_id
                or msg.learner_id != self.learner_id
            ):
                self.stats.rejected["foreign_refusal"] += 1
                continue
            if msg.incarnation != self.incarnation:
                continue  # an earlier process of ours was refused; nothing to do now
            self.stats.refused[msg.reason] += 1
            log.warning(
                "learner %s: the syncer refused delta %d of fragment %d (%s); resyncing it",
                self.learner_id,
                msg.seq,
                msg.fragment,
                msg.reason,
            )
            if msg.fragment < self.num_fragments and msg.fragment not in resync:
                self._refused(msg.fragment)
                resync.append(msg.fragment)
        return resync

    def _accept_globals(self, entries: Entries, fetch: list[int]) -> list[GlobalFragment]:
        """The next versions among ``entries``; snapshots for gaps and for the
        fragments in ``fetch``. Moves the read position only once nothing can fail
        any more, so that a connection error reads the same entries again. Records
        no version: that waits for :meth:`accepted`."""
        found: list[GlobalFragment] = []
        seen = dict(self._versions)  # this batch's newest candidates, for gaps
        for _, fields in entries:
            msg = self._check_global(fields.get(FIELD))
            if msg is None or msg.fragment in fetch:
                continue
            known = seen.get(msg.fragment)
            if msg.is_weightless:  # an announcement: fetch the version unless held
                if known is None or msg.epoch != known[0] or msg.version > known[1]:
                    fetch.append(msg.fragment)
                continue
            if known is None:
                fetch.append(msg.fragment)  # no base: take the snapshot
            elif msg.epoch != known[0] or msg.version == known[1] + 1:
                # The next version, or a restarted syncer's new lineage.
                seen[msg.fragment] = (msg.epoch, msg.version)
                found.append(msg)
            elif msg.version > known[1]:
                fetch.append(msg.fragment)  # a gap: the snapshot is the latest
        found += self._fetch_snapshots(fetch)
        self._position = to_str(entries[-1][0])
        return sorted(found, key=candidate_order)

    def _fetch_snapshots(self, fragments: list[int]) -> list[GlobalFragment]:
        if not fragments:
            return []
        frames = self._client.mget([model_key(self.run_id, p) for p in fragments])
        return [
            g for _, g in sorted(self._get_models(fragments, frames).items()) if self._is_new(g)
        ]

    def _check_global(self, frame: Any) -> GlobalFragment | None:
        msg = check_frame(frame, self.max_message_bytes, self.stats)
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

    def _load_snapshots(
        self, fragments: list[int], held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        """Read the snapshot keys and the globals stream's last id atomically;
        a fragment whose current weights are ``held`` is read without them.

        Moves the read position to that id when there was none or when every
        fragment was loaded: nothing published after the read is skipped, and
        entries before it carry versions the snapshot already covers.
        """
        held = held or {}
        pipe = self._client.pipeline(transaction=True)
        self._stream_end_id(keys=[self._globals], args=["last"], client=pipe)
        if held:
            self._snapshots_unless_held(
                keys=[model_key(self.run_id, p) for p in fragments]
                + [weightless_key(self.run_id, p) for p in fragments],
                args=[str(weights_checksum(held[p])) if p in held else "" for p in fragments],
                client=pipe,
            )
        else:
            pipe.mget([model_key(self.run_id, p) for p in fragments])
        last_id, frames = pipe.execute()
        found = self._get_models(fragments, frames)
        for p, g in list(found.items()):
            if g.is_weightless:
                if p in held:
                    found[p] = g.with_weights(held[p])
                else:
                    del found[p]
                    self.stats.rejected["weightless"] += 1
        if self._position is None or set(fragments) >= set(range(self.num_fragments)):
            self._position = to_str(last_id) if last_id is not None else "0-0"
        for p in fragments:
            self._versions.setdefault(p, _NOTHING_YET)
        return found

    def _resync(self) -> list[GlobalFragment]:
        snapshots = self._load_snapshots(list(range(self.num_fragments)))
        return [g for _, g in sorted(snapshots.items()) if self._is_new(g)]

    def snapshot(
        self, fragments: list[int], timeout_s: float, held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        bad = [p for p in fragments if not 0 <= p < self.num_fragments]
        if bad:
            raise ValueError(f"fragments {bad} outside [0, {self.num_fragments})")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            time.sleep(min(max(0.0, deadline - time.monotonic()), self._reconnect.wait_s()))
            try:
                found = self._load_snapshots(list(fragments), held)
            except Exception as e:
                if not is_transient(e):
                    raise
                self._failed(e)
                if time.monotonic() >= deadline:
                    raise TransportError(f"no snapshot within {timeout_s}s: {e}") from e
                continue
            self._reconnect.succeeded()
            return found

    # -- learner slots ----------------------------------------------------------
    def lease(self, holder: str, ttl_s: float, timeout_s: float, held_slot: int = -1) -> int:
        if not lease_request_ok(ttl_s, held_slot):
            raise ValueError(f"lease of slot {held_slot} for {ttl_s}s: out of bounds")
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            time.sleep(min(max(0.0, deadline - time.monotonic()), self._reconnect.wait_s()))
            try:
                slot = self._lease_slot(
                    keys=[leases_key(self.run_id)],
                    args=[holder, max(1, int(ttl_s * 1000)), held_slot, MAX_LEARNER_SLOTS],
                )
            except Exception as e:
                if not is_transient(e):
                    raise
                self._failed(e)
                if time.monotonic() >= deadline:
                    raise TransportError(f"no learner slot within {timeout_s}s: {e}") from e
                continue
            self._reconnect.succeeded()
            if slot < 0:
                raise TransportError(f"all {MAX_LEARNER_SLOTS} learner slots are held")
            return int(slot)

    def close(self) -> None:
        if self._queue:
            log.warning(
                "learner %s: closing with %d undelivered deltas", self.learner_id, len(self._queue)
            )
        self._client.close()
