"""Syncer side of the Redis Streams transport (docs/transports.md).

Keys, the delivery contract and the connection handling both sides share are in
:mod:`broker.redis_common`. A syncer is one consumer of the group ``syncers`` on
the delta streams of the fragments it owns: it re-reads its own pending entries,
takes over those a dead consumer left (XAUTOCLAIM after ``claim_idle_s``), reads
new ones with XREADGROUP, XACKs what the caller acks and trims the streams below
what any group still needs. It reads heartbeats from the learners hash and
publishes each new global to its snapshot key and the globals stream at once.

Connection errors never escape, not even from ``publish``: the newest
unpublished global of each fragment stays queued until redis is back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT

from broker.redis_common import (
    FIELD,
    GROUP,
    NOTICES_MAXLEN,
    NOTICES_TTL_S,
    Entries,
    Reconnect,
    check_entry,
    check_frame,
    connect,
    delta_stream_key,
    encode_bounded,
    globals_stream_key,
    is_transient,
    learners_key,
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
from broker.transport import Inbound, SyncerTransport, TransportStats
from broker.wire import Delta, GlobalFragment, Heartbeat, Refusal

log = logging.getLogger(__name__)

_DELTAS_READ_COUNT = 64  # per stream and call
_HEARTBEAT_READ_INTERVAL_S = 0.25
# For deltas of a learner no heartbeat was read of: sooner, still bounded for a
# sender that never writes one.
_UNHEARD_READ_INTERVAL_S = 0.01
_TRIM_INTERVAL_S = 1.0


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
        self._client = connect(url, socket_timeout_s)
        self._reconnect = Reconnect(f"syncer {consumer}")
        self._warn_without_aof()
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
        self._last_heartbeat_read_at = -math.inf
        self._trim_waiting: set[str] = set()
        self._next_trim_at: dict[str, float] = {}
        # (to the stream, to the snapshot key, the version), by fragment
        self._unpublished: dict[int, tuple[bytes, bytes, GlobalFragment]] = {}
        self._next_trimmed_check_at = 0.0
        try:
            self._ensure_groups()
        except Exception as e:
            if not is_transient(e):
                raise
            self._failed(e)  # receive() creates them once redis is back

    def _warn_without_aof(self) -> None:
        """Acknowledged deltas are only as durable as Redis: without an append-only
        file a Redis restart loses them. Said once, loudly, at start."""
        try:
            # redis-py decodes CONFIG GET replies to text whatever decode_responses says.
            config = {
                to_str(k): to_str(v)
                for k, v in cast(dict[Any, Any], self._client.config_get("appendonly")).items()
            }
        except Exception as e:  # CONFIG may be renamed or denied by an ACL: no verdict
            log.debug("syncer %s: cannot read redis's appendonly setting: %s", self.consumer, e)
            return
        if config.get("appendonly", "yes") != "yes":
            log.warning(
                "syncer %s: redis runs without AOF (appendonly no): a redis restart loses "
                "acknowledged deltas; run it with --appendonly yes --appendfsync always",
                self.consumer,
            )

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
        return retry_until(
            self._reconnect, deadline, self._receive_once, self._failed, on_error=self._lost_group
        )

    def _lost_group(self, error: Exception) -> bool:
        """True for NOGROUP: the streams or the group vanished (e.g. redis lost its
        data). The next attempt, which may go at once, recreates them."""
        if not (isinstance(error, redis.ResponseError) and str(error).startswith("NOGROUP")):
            return False
        log.warning("syncer %s: %s; recreating the consumer group", self.consumer, error)
        self._groups_ready = False
        self._reset_pending()
        return True

    def _receive_once(self, deadline: float) -> list[Inbound]:
        self._handing_out = set()
        if not self._groups_ready:
            self._ensure_groups()
        self._publish_queued()
        self._xack([])  # the rejected entries of the last call
        self._trim_due()
        self._count_trimmed_unread()
        items = self._read_heartbeats()
        items += self._claim_abandoned()
        items += self._read_own_pending()
        if not items:
            block_ms = read_block_ms(deadline, self._max_block_s)
            streams: dict[KeyT, StreamIdT] = dict.fromkeys(self._fragment_of, ">")
            reply = cast(
                list[tuple[bytes, Entries]],
                self._client.xreadgroup(
                    self.group,
                    self.consumer,
                    streams,
                    count=_DELTAS_READ_COUNT,
                    block=block_ms,
                ),
            )
            for stream, entries in reply or []:
                items += self._accept_deltas(to_str(stream), entries)
            if not reply and block_ms is None:
                sleep_tail(deadline)
        # A learner's first deltas can wake this read before any heartbeat of it was
        # read (heartbeats are read before blocking, every 0.25 s): read them again
        # now, so that its pace, not the floor, bounds those deltas' step counts.
        unheard = {
            i.message.learner_id.encode() for i in items if isinstance(i.message, Delta)
        } - self._heartbeat_frames.keys()
        if unheard:
            items = self._read_heartbeats(_UNHEARD_READ_INTERVAL_S) + items
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
            list[tuple[bytes, Entries]],
            self._client.xreadgroup(
                self.group,
                self.consumer,
                streams,
                count=_DELTAS_READ_COUNT,
            ),
        )
        items: list[Inbound] = []
        replied = {to_str(stream): entries for stream, entries in reply or []}
        for stream in todo:
            entries = replied.get(stream, [])
            if not entries:
                self._pending_after[stream] = None
                continue
            self._pending_after[stream] = to_str(entries[-1][0])
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
            next_cursor, entries = to_str(reply[0]), reply[1]
            deleted = reply[2] if len(reply) > 2 else []  # redis >= 7 drops them from the PEL
            self.stats.rejected["trimmed"] += len(deleted)
            if any(entry_id is None for entry_id, _ in entries):
                # redis < 7 claims an entry that was trimmed while pending but
                # returns it as nil, without its id: our own PEL re-read finds it.
                self._pending_after[stream] = "0-0"
            # Our own entries that the caller still holds come back too once idle
            # for claim_idle_s; they are not handed out again.
            claimed = [
                (i, f) for i, f in entries if i is not None and not self._held((stream, to_str(i)))
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

    def _accept_deltas(self, stream: str, entries: Entries) -> list[Inbound]:
        items: list[Inbound] = []
        for raw_id, fields in entries:
            token = (stream, to_str(raw_id))
            if self._held(token):
                continue
            if not fields:  # trimmed or deleted while pending
                self.stats.rejected["trimmed"] += 1
                self._rejected_unacked.add(token)
                continue
            msg = check_entry(fields, self.max_message_bytes, self.stats)
            if (
                isinstance(msg, Delta)
                and msg.run_id == self.run_id
                and msg.fragment == self._fragment_of[stream]
            ):
                self.stats.messages_received += 1
                self._handing_out.add(token)
                items.append(Inbound(msg, token))
                continue
            if msg is not None:  # check_frame counted the others
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

    def _read_heartbeats(self, interval_s: float = _HEARTBEAT_READ_INTERVAL_S) -> list[Inbound]:
        """Heartbeats that changed since the last read, if it was ``interval_s`` ago."""
        now = time.monotonic()
        if now < self._last_heartbeat_read_at + interval_s:
            return []
        self._last_heartbeat_read_at = now
        frames = cast(dict[bytes, bytes], self._client.hgetall(learners_key(self.run_id)))
        items: list[Inbound] = []
        for learner, frame in frames.items():
            if self._heartbeat_frames.get(learner) == frame:
                continue
            self._heartbeat_frames[learner] = frame
            msg = check_frame(frame, self.max_message_bytes, self.stats)
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

        def xack_and_trim() -> None:
            self._xack(tokens)
            self._trim_due()

        # If redis is away they stay pending: our PEL re-read after reconnecting
        # delivers them again, and the caller's de-duplication acks them then.
        self._attempt(xack_and_trim)

    def _attempt(self, action: Callable[[], object]) -> bool:
        """Run ``action`` unless we are backing off from redis; True if it ran.
        A transient error starts (or extends) the backoff instead of escaping."""
        if self._reconnect.wait_s():
            return False
        try:
            action()
        except Exception as e:
            if not is_transient(e):
                raise
            self._failed(e)
            return False
        self._reconnect.succeeded()
        return True

    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        frames = self._client.mget([model_key(self.run_id, p) for p in fragments])
        found = {}
        for p, frame in zip(fragments, frames, strict=True):
            msg = check_frame(frame, self.max_message_bytes, self.stats) if frame else None
            if isinstance(msg, GlobalFragment) and msg.run_id == self.run_id and msg.fragment == p:
                found[p] = (msg.epoch, msg.version)
        return found

    def refuse(self, item: Inbound, reason: str) -> None:
        """XACK the entry and tell its learner on its notices stream. If redis is
        away the entry stays pending: it is delivered again and refused again."""
        d = item.message
        if not isinstance(d, Delta) or item.token is None:
            return
        stream, entry_id = cast(tuple[str, str], item.token)
        self._outstanding.discard((stream, entry_id))
        refusal = Refusal.of(d, reason)
        notices = notices_key(self.run_id, d.learner_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.xadd(notices, {FIELD: encode_bounded(refusal, self.max_message_bytes)},
                  maxlen=NOTICES_MAXLEN, approximate=False)  # fmt: skip
        pipe.expire(notices, NOTICES_TTL_S)
        pipe.xack(stream, self.group, entry_id)
        if self._attempt(pipe.execute):
            self._trim_waiting.add(stream)

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

    def _count_trimmed_unread(self) -> None:
        """Take (GETDEL) the counts of delta entries the learners' stream bound
        dropped unread (see ``BOUNDED_XADD``), at most every second: each loss is
        reported once, also when it happened while no syncer ran."""
        now = time.monotonic()
        if now < self._next_trimmed_check_at:
            return
        self._next_trimmed_check_at = now + _TRIM_INTERVAL_S
        pipe = self._client.pipeline(transaction=False)
        for p in self.fragments:
            pipe.getdel(trimmed_key(self.run_id, p))
        for p, raw in zip(self.fragments, pipe.execute(), strict=True):
            lost = int(raw or 0)
            if lost > 0:
                self.stats.rejected["trimmed_unread"] += lost
                log.error(
                    "syncer %s: %d deltas of fragment %d were dropped unread at the delta "
                    "stream's bound (no syncer kept up); raise delta_stream_maxlen",
                    self.consumer,
                    lost,
                    p,
                )

    def _trim_bound(self, groups: list[dict[str, Any]], pending: dict[str, Any]) -> str | None:
        bounds: list[tuple[int, int]] = []
        for g in groups:
            ms, seq = parse_id(g["last-delivered-id"])
            bounds.append((ms, seq + 1))  # everything after the last delivered id is unread
            if to_str(g["name"]) != self.group and g["pending"]:
                return None  # another group's pending entries are unknown to us: keep all
        if pending["pending"]:
            bounds.append(parse_id(pending["min"]))
        if not bounds:
            return None
        ms, seq = min(bounds)
        return f"{ms}-{seq}"

    # -- publishing --------------------------------------------------------------
    def publish(self, fragment: GlobalFragment, snapshot: GlobalFragment | None = None) -> None:
        """Write the snapshot key and append to the globals stream, atomically.

        Never raises on connection errors: the newest unpublished global of each
        fragment is kept and written by the next ``publish`` or ``receive`` once
        redis is back (learners see the skipped versions as a gap and resync).
        """
        if fragment.run_id != self.run_id:
            raise ValueError(f"global of run {fragment.run_id!r} published on run {self.run_id!r}")
        frame = encode_bounded(fragment, self.max_message_bytes)
        whole = frame if snapshot is None else encode_bounded(snapshot, self.max_message_bytes)
        self._unpublished[fragment.fragment] = (frame, whole, fragment)
        self._attempt(self._publish_queued)

    def announce(self, fragment: GlobalFragment) -> None:
        """Write the snapshot key again (a key lost or overwritten in Redis is
        restored) and append the version, without its weights, to the globals
        stream."""
        if fragment.run_id != self.run_id:
            raise ValueError(f"global of run {fragment.run_id!r} announced on run {self.run_id!r}")
        weightless = encode_bounded(fragment.without_weights(), self.max_message_bytes)
        whole = encode_bounded(fragment, self.max_message_bytes)
        self._unpublished[fragment.fragment] = (weightless, whole, fragment)
        self._attempt(self._publish_queued)

    def _publish_queued(self) -> None:
        if not self._unpublished:
            return
        pipe = self._client.pipeline(transaction=True)
        for p, (frame, whole, version) in self._unpublished.items():
            pipe.set(model_key(self.run_id, p), whole)
            weightless = encode_bounded(version.without_weights(), self.max_message_bytes)
            pipe.hset(
                weightless_key(self.run_id, p),
                mapping={"crc": str(version.weights_crc), "frame": weightless},
            )
            pipe.xadd(
                globals_stream_key(self.run_id),
                {FIELD: frame},
                maxlen=self.globals_maxlen,
                approximate=False,
            )
        pipe.execute()
        for frame, whole, _ in self._unpublished.values():
            self.stats.bytes_sent += len(frame) + len(whole)  # XADD and SET
            self.stats.messages_sent += 1
        self._unpublished.clear()

    def close(self) -> None:
        if self._unpublished:
            try:
                self._publish_queued()
            except Exception as e:
                if not is_transient(e):
                    raise
                log.warning(
                    "syncer %s: closing with %d unpublished globals (%s)",
                    self.consumer,
                    len(self._unpublished),
                    e,
                )
        self._client.close()
