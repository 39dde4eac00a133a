"""A learner's reading of the globals on Redis (docs/transports.md).

:class:`GlobalsReader` follows the globals stream, reading the learner's
notices stream (:class:`NoticeReader`) in the same blocking XREAD, and falls
back to the snapshot keys (:class:`~broker.redis.snapshot_keys.SnapshotKeys`)
when it has no base, sees a gap or finds the stream trimmed past its read
position. Reads raise redis's errors: the transport
(:mod:`broker.redis.learner`) retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT

from broker.redis.frames import FIELD, Entries, check_frame, to_str
from broker.redis.names import globals_stream_key, notices_key
from broker.redis.scripts import STREAM_TRIMMED_PAST, ReadScript
from broker.redis.snapshot_keys import GlobalCheck, SnapshotKeys
from broker.transport import TransportStats, candidate_order
from broker.wire.messages import GlobalFragment, Refusal

log = logging.getLogger(__name__)

_GLOBALS_READ_COUNT = 16  # globals are whole fragments: read few at a time

# The accepted (epoch, version) of a fragment known to have no global yet: any
# global of it is new.
_NOTHING_YET = (-1, -1)

Versions = dict[int, tuple[int, int]]  # accepted (epoch, version) per fragment

# redis ends a blocking read on its timer tick (every 100 ms at the default
# hz 10), so BLOCK b returns after b to b + 100 ms: block only for what is left
# after one tick, and poll without blocking in the last tick of a wait.
_REDIS_TICK_S = 0.1
_TAIL_POLL_S = 0.02


def read_block_ms(deadline: float, max_block_s: float) -> int | None:
    """BLOCK argument that returns by ``deadline``; None: read without blocking
    (BLOCK 0 would wait forever)."""
    block_s = min(deadline - time.monotonic() - _REDIS_TICK_S, max_block_s)
    return int(block_s * 1000) if block_s >= 0.001 else None


def sleep_tail(deadline: float) -> None:
    """After a non-blocking read found nothing: wait a little, client side."""
    time.sleep(min(max(0.0, deadline - time.monotonic()), _TAIL_POLL_S))


class NoticeReader:
    """Refusals of this learner's deltas, from its notices stream; those of earlier
    incarnations are skipped."""

    def __init__(
        self,
        run_id: str,
        learner_id: str,
        incarnation: int,
        num_fragments: int,
        max_message_bytes: int,
        stats: TransportStats,
        refused: Callable[[int], None],
    ) -> None:
        self._run_id = run_id
        self._learner_id = learner_id
        self._incarnation = incarnation
        self._num_fragments = num_fragments
        self._max_message_bytes = max_message_bytes
        self._stats = stats
        self._refused = refused  # a delta of this fragment was refused
        self.key = notices_key(run_id, learner_id)
        self.position = "0-0"  # read position in the notices stream

    def read(self, entries: Entries) -> list[int]:
        """Count the refusals among ``entries``; the fragments to resync."""
        resync: list[int] = []
        for entry_id, fields in entries:
            self.position = to_str(entry_id)
            msg = check_frame(fields.get(FIELD), self._max_message_bytes, self._stats)
            if msg is None:
                continue
            if (
                not isinstance(msg, Refusal)
                or msg.run_id != self._run_id
                or msg.learner_id != self._learner_id
            ):
                self._stats.rejected["foreign_refusal"] += 1
                continue
            if msg.incarnation != self._incarnation:
                continue  # an earlier process of ours was refused; nothing to do now
            self._stats.refused[msg.reason] += 1
            log.warning(
                "learner %s: the syncer refused delta %d of fragment %d (%s); resyncing it",
                self._learner_id,
                msg.seq,
                msg.fragment,
                msg.reason,
            )
            if msg.fragment < self._num_fragments and msg.fragment not in resync:
                self._refused(msg.fragment)
                resync.append(msg.fragment)
        return resync


class GlobalsReader:
    """A learner's reader of the globals stream: candidate globals newer than the
    accepted ``versions`` (the transport's, shared), in version order per
    fragment, with snapshots for gaps. Records no version: that waits for
    ``LearnerTransport.accepted``."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        learner_id: str,
        num_fragments: int,
        max_block_s: float,
        stats: TransportStats,
        check: GlobalCheck,
        snapshots: SnapshotKeys,
        notices: NoticeReader | None,
        versions: Versions,
        is_new: Callable[[GlobalFragment], bool],
    ) -> None:
        self._client = client
        self._learner_id = learner_id
        self._num_fragments = num_fragments
        self._max_block_s = max_block_s
        self._stats = stats
        self._check = check
        self._snapshots = snapshots
        self._notices = notices
        self._versions = versions
        self._is_new = is_new
        self._globals = globals_stream_key(run_id)
        self._trimmed_past = ReadScript(client, STREAM_TRIMMED_PAST)
        self._wanted: set[int] = set()  # fragments to fetch the snapshot of (resync)
        # Read position in the globals stream; None until the first snapshot or poll.
        self._position: str | None = None

    def want(self, fragment: int) -> None:
        """Fetch the snapshot of ``fragment`` with the next read."""
        self._wanted.add(fragment)

    def read(self, deadline: float) -> list[GlobalFragment]:
        """New candidates, waiting up to ``deadline`` for globals or notices."""
        if self._position is None:
            return self._resync()
        if self._wanted:
            wanted = sorted(self._wanted)
            found = self._fetch_snapshots(wanted)
            self._wanted.difference_update(wanted)  # once fetched: an error reads again
            if found:
                return found
        block_ms = read_block_ms(deadline, self._max_block_s)
        streams: dict[KeyT, StreamIdT] = {self._globals: self._position}
        if self._notices is not None:  # a learner's: a reader sends nothing to refuse
            streams[self._notices.key] = self._notices.position
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
        resync = (
            self._notices.read(replied.get(self._notices.key, []))
            if self._notices is not None
            else []
        )
        entries = replied.get(self._globals, [])
        if not entries:
            return self._fetch_snapshots(resync)
        # New entries arrived. Trimming drops the oldest entries first, so if the
        # entry at our position is gone, entries we never read may have been
        # trimmed: fall back to the snapshot keys.
        if self._trimmed_past(keys=[self._globals], args=[self._position]):
            log.info(
                "learner %s: globals stream trimmed past %s; resyncing from snapshots",
                self._learner_id,
                self._position,
            )
            self._stats.bytes_received += sum(len(f.get(FIELD, b"")) for _, f in entries)
            return self._resync()
        return self._accept(entries, resync)

    def _accept(self, entries: Entries, fetch: list[int]) -> list[GlobalFragment]:
        """The next versions among ``entries``; snapshots for gaps and for the
        fragments in ``fetch``. Moves the read position only once nothing can fail
        any more, so that a connection error reads the same entries again."""
        found: list[GlobalFragment] = []
        seen = dict(self._versions)  # this batch's newest candidates, for gaps
        for _, fields in entries:
            msg = self._check(fields.get(FIELD))
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
        found = self._snapshots.latest(fragments)
        return [g for _, g in sorted(found.items()) if self._is_new(g)]

    def load(
        self, fragments: list[int], held: Mapping[int, Any] | None = None
    ) -> dict[int, GlobalFragment]:
        """The snapshots of ``fragments`` (:meth:`SnapshotKeys.load`), whatever
        version was accepted before.

        Moves the read position to the stream's last id read with them when there
        was none or when every fragment was loaded: nothing published after the
        read is skipped, and entries before it carry versions the snapshot
        already covers.
        """
        found, last_id = self._snapshots.load(fragments, held or {})
        if self._position is None or set(fragments) >= set(range(self._num_fragments)):
            self._position = to_str(last_id) if last_id is not None else "0-0"
        for p in fragments:
            self._versions.setdefault(p, _NOTHING_YET)
        return found

    def _resync(self) -> list[GlobalFragment]:
        snapshots = self.load(list(range(self._num_fragments)))
        return [g for _, g in sorted(snapshots.items()) if self._is_new(g)]
