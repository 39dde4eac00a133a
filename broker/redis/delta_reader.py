"""A syncer's reading of the delta streams on Redis (docs/transports.md).

:class:`DeltaReader` is one consumer of the group on the delta streams of the
fragments a syncer owns, one per learner it follows (the roster's): it re-reads
its own pending entries, takes over those a dead consumer left (XAUTOCLAIM after
``claim_idle_s``; at once, the first time it scans a stream, while it holds
the shard's term: whoever read them before is fenced), reads new ones with
XREADGROUP and XACKs what the caller
acks; :class:`DeltaBell` wakes it when a learner wrote. Learners write the
streams (:mod:`broker.redis.delta_queue`); the syncer trims them
(:mod:`broker.redis.delta_trimmer`). These parts raise redis's errors: the
transport (:mod:`broker.redis.syncer`) retries.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, cast

import redis

from broker.redis.frames import Entries, check_entry, to_str
from broker.redis.names import delta_stream_key
from broker.redis.scripts import CLAIM_BOUNDED, READ_BOUNDED
from broker.redis.shards import Fence, execute, transaction
from broker.transport import Inbound, TransportStats
from broker.wire.messages import Delta

log = logging.getLogger(__name__)

_DELTAS_READ_COUNT = 64  # per stream and call
# Streams claimed from per round trip. What they hand over is what a dead
# consumer had read and not acknowledged (its rounds in flight), not a backlog.
_CLAIM_BATCH = 16
# Bytes one read returns at most (one entry at least): 250M parameters over
# 24 fragments and 16 learners made 384 streams of 1.8 MB deltas, and a read of
# what had piled up outlasted the socket's timeout, failed, and was tried
# again, so that the syncer applied 3 deltas in 167 s.
READ_BUDGET_BYTES = 64 * 2**20
_EVENTS = "notify-keyspace-events"
_BELL_FALLBACK_S = 0.02

Token = tuple[str, str]  # (stream, entry id): what a delta's Inbound carries to ack it


def _entries(raw: list[Any]) -> Entries:
    """Stream entries as a script returns them ([id, [field, value, ...]], the
    fields nil for an entry deleted while pending) as redis-py's reads do."""
    out: Entries = []
    for entry_id, fields in raw:
        flat = fields or []
        out.append((entry_id, dict(zip(flat[::2], flat[1::2], strict=True))))
    return out


class DeltaBell:
    """Wakes a syncer waiting for deltas: Redis's keyspace notification of an
    XADD to one of the run's delta streams carries the key's name only, never
    the entry, so waiting reads nothing a learner wrote. Without them (a Redis
    whose CONFIG is denied) the syncer looks again every ``_BELL_FALLBACK_S``."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        self._client = client
        db = client.connection_pool.connection_kwargs.get("db", 0)
        self._pattern = f"__keyspace@{db}__:ddiloco:{run_id}:deltas:*"
        self._pubsub: Any = None
        self._unavailable = False

    def _subscribe(self) -> None:
        try:
            # redis-py decodes CONFIG GET replies to text whatever decode_responses says.
            flags = str(cast(dict[str, str], self._client.config_get(_EVENTS)).get(_EVENTS, ""))
            wanted = "".join(sorted(set(flags) | ({"K"} if "A" in flags else {"K", "t"})))
            if wanted != "".join(sorted(flags)):
                self._client.config_set(_EVENTS, wanted)
        except redis.ResponseError as e:  # CONFIG denied or renamed: poll instead
            log.warning("no keyspace notifications (%s): polling for deltas", e)
            self._unavailable = True
            return
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        pubsub.psubscribe(self._pattern)
        self._pubsub = pubsub

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an XADD to a delta stream (or, without
        notifications, a short while); whether to read again."""
        if self._pubsub is None and not self._unavailable:
            self._subscribe()
        if self._pubsub is None:
            time.sleep(min(timeout_s, _BELL_FALLBACK_S))
            return True
        try:
            rang = self._pubsub.get_message(timeout=timeout_s) is not None
            while self._pubsub.get_message(timeout=0) is not None:
                pass  # one read takes what all of them announced
        except Exception:
            self.close()  # subscribed again with the next wait
            raise
        return rang

    def close(self) -> None:
        if self._pubsub is not None:
            pubsub, self._pubsub = self._pubsub, None
            with contextlib.suppress(redis.RedisError):
                pubsub.close()


class DeltaReader:
    """Consumer ``consumer`` of ``group`` on the delta streams of ``fragments``
    of each learner it follows; hands each entry out once until it is acked."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        consumer: str,
        group: str,
        fragments: list[int],
        claim_idle_s: float,
        max_message_bytes: int,
        stats: TransportStats,
        fence: Fence | None = None,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._consumer = consumer
        self._group = group
        self._fragments = fragments
        self.fence = fence  # the shard's term: no ack once another syncer holds it
        # Stream key -> (fragment, learner id), for every learner followed.
        self.streams: dict[str, tuple[int, str]] = {}
        self._followed: set[str] = set()
        self._grouped: set[str] = set()  # streams whose group was made
        self._claim_idle_s = claim_idle_s
        self._max_message_bytes = max_message_bytes
        self._stats = stats
        # Own pending entries still to re-read, per stream: the id to read after,
        # None once done. Reset after every transient error: a reply lost on the
        # way may have left entries delivered to us that we never saw.
        self._pending_after: dict[str, str | None] = {}
        self.reset_pending()
        self._held_back: set[str] = set()  # streams the last read held entries back of
        # Handed to the caller and not acked yet: never hand them out twice.
        self._outstanding: set[Token] = set()
        # Accepted during the current read; outstanding once the transport returns
        # them (if it fails instead, the PEL re-read delivers them again).
        self._handing_out: set[Token] = set()
        # Rejected entries to XACK with the next receive() or ack().
        self._rejected_unacked: set[Token] = set()
        self._claim_interval_s = min(max(claim_idle_s / 2, 0.1), 5.0)
        self._read_script = client.register_script(READ_BOUNDED)
        self._claim_script = client.register_script(CLAIM_BOUNDED)
        self._bell = DeltaBell(client, run_id)
        self._claim_cursor: dict[str, str] = {}
        self._next_claim_at = 0.0
        # Streams scanned once since they were followed: under a term (fence),
        # the first scan takes every pending entry, not only the idle ones.
        self._swept: set[str] = set()

    def follow(self, learner_ids: list[str]) -> None:
        """Read the streams of ``learner_ids`` too (their pending entries first)."""
        for learner in learner_ids:
            if learner in self._followed:
                continue
            self._followed.add(learner)
            for p in self._fragments:
                stream = delta_stream_key(self._run_id, p, learner)
                self.streams[stream] = (p, learner)
                self._pending_after[stream] = "0-0"
                if self.fence is not None:
                    self._next_claim_at = 0.0  # its predecessor's entries, at once

    def ensure_groups(self) -> None:
        """Create the group on every stream (and the streams) not done yet."""
        for stream in self.streams.keys() - self._grouped:
            try:
                self._client.xgroup_create(stream, self._group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            self._grouped.add(stream)

    def reset_pending(self) -> None:
        """Re-read our own pending entries from the start with the next read."""
        self._pending_after = dict.fromkeys(self.streams, "0-0")

    def lost_group(self, error: Exception) -> bool:
        """True for NOGROUP: the streams or the group vanished (e.g. redis lost its
        data). The next attempt, which may go at once, recreates them."""
        if not (isinstance(error, redis.ResponseError) and str(error).startswith("NOGROUP")):
            return False
        log.warning("syncer %s: %s; recreating the consumer group", self._consumer, error)
        self._grouped.clear()
        self.reset_pending()
        return True

    def begin(self) -> None:
        """Start a read: what an attempt that failed accepted is not held."""
        self._handing_out = set()

    def hand_out(self) -> None:
        """The read's deltas are the caller's now: not handed out again until acked."""
        self._outstanding |= self._handing_out

    def read_new(self, deadline: float, max_block_s: float) -> list[Inbound]:
        """Entries never delivered to the group, waiting up to ``deadline`` (for
        the bell: an XADD to a delta stream) when there are none yet."""
        if not self.streams:  # nobody to read yet: wait as a read would
            time.sleep(min(max(0.0, deadline - time.monotonic()), max_block_s))
            return []
        items = self._read_bounded(dict.fromkeys(self.streams, ">"))[1]
        wait_s = min(deadline - time.monotonic(), max_block_s)
        if items or wait_s <= 0:
            return items
        if self._bell.wait(wait_s):
            items = self._read_bounded(dict.fromkeys(self.streams, ">"))[1]
        return items

    def read_own_pending(self) -> list[Inbound]:
        """Entries delivered to this consumer name and never acked (by an earlier
        process of the same name, or before a lost reply), oldest first."""
        todo = {s: after for s, after in self._pending_after.items() if after is not None}
        if not todo:
            return []
        last_read, items = self._read_bounded(todo)
        for stream, after in todo.items():
            if stream not in self._held_back:
                self._pending_after[stream] = last_read.get(stream)  # None: none left
            else:
                self._pending_after[stream] = last_read.get(stream, after)
        return items

    def _read_bounded(self, streams: dict[str, str]) -> tuple[dict[str, str], list[Inbound]]:
        """XREADGROUP from ``streams`` (stream -> the id to read after, or ">"),
        no entry larger than ``max_message_bytes`` leaving Redis (READ_BOUNDED
        acks, deletes and counts those) and at most READ_BUDGET_BYTES in all:
        the last id read per stream that had entries, and the deltas among them.
        Entries held back for the budget are pending for this consumer; their
        streams are read again from there (:meth:`read_own_pending`)."""
        reply = cast(
            list[Any],
            self._read_script(
                keys=list(streams),
                args=[self._group, self._consumer, _DELTAS_READ_COUNT, self._max_message_bytes,
                      READ_BUDGET_BYTES, *streams.values()],
            ),
        )  # fmt: skip
        self._count_dropped(int(reply[0]))
        last_read: dict[str, str] = {}
        items: list[Inbound] = []
        self._held_back = set()
        for raw_stream, raw_entries, last, held in reply[1]:
            stream = to_str(raw_stream)
            if last:
                last_read[stream] = to_str(last)
            if held:
                self._held_back.add(stream)
                if self._pending_after.get(stream) is None:
                    self._pending_after[stream] = last_read.get(stream, "0-0")
            items += self._accept(stream, _entries(raw_entries))
        return last_read, items

    def _count_dropped(self, dropped: int) -> None:
        if dropped:
            self._stats.rejected["too_large"] += dropped
            log.warning(
                "syncer %s: dropped %d delta entries larger than %d bytes unread",
                self._consumer, dropped, self._max_message_bytes,
            )  # fmt: skip

    def claim_abandoned(self) -> list[Inbound]:
        """XAUTOCLAIM entries idle for ``claim_idle_s`` (left by dead consumers),
        one page per stream and call until every stream's scan is complete; no
        entry larger than the bound leaves Redis (CLAIM_BOUNDED)."""
        if time.monotonic() < self._next_claim_at:
            return []
        items: list[Inbound] = []
        due = [s for s in self.streams if self._claim_cursor.get(s, "0-0") != "done"]
        # Pipelined, a batch of streams per round trip: a syncer that takes over
        # scans every stream of its shard at once (384 at 24 fragments and 16
        # learners took 5 s one call at a time, every round waiting).
        for start in range(0, len(due), _CLAIM_BATCH):
            batch = due[start : start + _CLAIM_BATCH]
            pipe = self._client.pipeline(transaction=False)
            for stream in batch:
                # A predecessor under an older term (another host's syncer: another
                # consumer name) can ack nothing more: its entries are ours now.
                at_once = self.fence is not None and stream not in self._swept
                idle_ms = 0 if at_once else int(self._claim_idle_s * 1000)
                self._claim_script(
                    keys=[stream],
                    args=[self._group, self._consumer, _DELTAS_READ_COUNT, idle_ms,
                          self._claim_cursor.get(stream, "0-0"), self._max_message_bytes],
                    client=pipe,
                )  # fmt: skip
            for stream, reply in zip(batch, cast(list[Any], pipe.execute()), strict=True):
                items += self._claimed(stream, reply)
        if all(self._claim_cursor.get(s) == "done" for s in self.streams):
            self._claim_cursor.clear()
            self._next_claim_at = time.monotonic() + self._claim_interval_s
        return items

    def _claimed(self, stream: str, reply: list[Any]) -> list[Inbound]:
        """What one stream's claim (CLAIM_BOUNDED) handed over, its cursor moved on."""
        self._count_dropped(int(reply[0]))
        next_cursor, entries, deleted = to_str(reply[1]), _entries(reply[2]), reply[3]
        self._stats.rejected["trimmed"] += len(deleted)  # dropped from the PEL by redis
        # Our own entries that the caller still holds come back too once idle
        # for claim_idle_s; they are not handed out again.
        claimed = [(i, f) for i, f in entries if not self._held((stream, to_str(i)))]
        if claimed:
            log.info(
                "syncer %s: claimed %d abandoned entries of %s",
                self._consumer, len(claimed), stream,
            )  # fmt: skip
        self._claim_cursor[stream] = "done" if next_cursor == "0-0" else next_cursor
        if next_cursor == "0-0":
            self._swept.add(stream)
        return self._accept(stream, claimed)

    def _held(self, token: Token) -> bool:
        return token in self._outstanding or token in self._handing_out

    def _accept(self, stream: str, entries: Entries) -> list[Inbound]:
        items: list[Inbound] = []
        for raw_id, fields in entries:
            token = (stream, to_str(raw_id))
            if self._held(token):
                continue
            if not fields:  # trimmed or deleted while pending
                self._stats.rejected["trimmed"] += 1
                self._rejected_unacked.add(token)
                continue
            msg = check_entry(fields, self._max_message_bytes, self._stats)
            fragment, learner = self.streams[stream]
            if (
                isinstance(msg, Delta)
                and msg.run_id == self._run_id
                and msg.fragment == fragment
                and msg.learner_id == learner
            ):
                self._stats.messages_received += 1
                self._handing_out.add(token)
                items.append(Inbound(msg, token))
                continue
            if msg is not None:  # check_frame counted the others
                reason = (
                    "wrong_kind"
                    if not isinstance(msg, Delta)
                    else "wrong_run"
                    if msg.run_id != self._run_id
                    else "wrong_fragment"
                    if msg.fragment != fragment
                    else "wrong_learner"
                )
                self._stats.rejected[reason] += 1
            self._rejected_unacked.add(token)  # it can never become valid: ack it
        return items

    def close(self) -> None:
        self._bell.close()

    def settled(self, tokens: list[Token]) -> None:
        """The caller is done with ``tokens`` (acked or refused them)."""
        self._outstanding.difference_update(tokens)

    def xack(self, tokens: list[Token]) -> set[str]:
        """XACK ``tokens`` and the rejected entries waiting for it; the streams acked in."""
        rejected = list(self._rejected_unacked)
        by_stream: dict[str, list[str]] = {}
        for stream, entry_id in tokens + rejected:
            by_stream.setdefault(stream, []).append(entry_id)
        if not by_stream:
            return set()
        pipe = transaction(self._client, self.fence)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self._group, *ids)
        execute(pipe, self.fence)
        self._rejected_unacked.difference_update(rejected)
        return set(by_stream)
