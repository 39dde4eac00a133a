"""The globals of the Redis Streams transport (docs/transports.md): the globals
stream and the snapshot keys, written by a syncer and read by learners.

A syncer's :class:`GlobalsPublisher` writes each new global to its fragment's
snapshot keys (``model``, ``weightless``) and the globals stream in one
transaction. A learner's :class:`GlobalsReader` follows the globals stream,
reading its notices stream (:class:`NoticeReader`) in the same blocking XREAD,
and falls back to the snapshot keys (:class:`SnapshotKeys`) when it has no base,
sees a gap or finds the stream trimmed past its read position. Reads raise
redis's errors: the transports (:mod:`broker.redis_syncer`,
:mod:`broker.redis_learner`) retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT

from broker.keys import GlobalSigner, GlobalVerifier
from broker.redis_common import (
    FIELD,
    SNAPSHOTS_UNLESS_HELD,
    STREAM_FIRST_ID,
    Entries,
    ReadScript,
    RedisLink,
    check_frame,
    encode_bounded,
    entries_within,
    globals_stream_key,
    is_transient,
    model_key,
    notices_key,
    parse_id,
    read_block_ms,
    sleep_tail,
    to_str,
    weightless_key,
)
from broker.transport import TransportStats, candidate_order
from broker.wire import GlobalFragment, Refusal, weights_checksum

log = logging.getLogger(__name__)

_GLOBALS_READ_COUNT = 16  # globals are whole fragments: read few at a time

# The accepted (epoch, version) of a fragment known to have no global yet: any
# global of it is new.
_NOTHING_YET = (-1, -1)

Versions = dict[int, tuple[int, int]]  # accepted (epoch, version) per fragment


class GlobalsPublisher:
    """Writes each new global to its snapshot keys (``model``, ``weightless``) and
    the globals stream in one transaction; keeps the newest unpublished global of
    each fragment while redis is away."""

    def __init__(
        self,
        link: RedisLink,
        run_id: str,
        consumer: str,
        globals_maxlen: int,
        globals_max_bytes: int,
        max_message_bytes: int,
        stats: TransportStats,
        signer: GlobalSigner | None = None,
        verifier: GlobalVerifier | None = None,
    ) -> None:
        self._link = link
        self._run_id = run_id
        self._consumer = consumer
        # With the run's keys: every global written is signed, and the snapshot
        # keys found at start count only when signed (a forged key with a huge
        # version would make the syncer refuse every delta as from the future).
        self._signer = signer
        self._verifier = verifier
        self._globals_maxlen = globals_maxlen
        self._globals_max_bytes = globals_max_bytes
        self._max_message_bytes = max_message_bytes
        self._stats = stats
        # (to the stream, to the snapshot key, the version), by fragment
        self._unpublished: dict[int, tuple[bytes, bytes, GlobalFragment]] = {}

    def existing(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        """(epoch, version) of the snapshot key of each of ``fragments`` that has one."""
        frames = self._link.client.mget([model_key(self._run_id, p) for p in fragments])
        found = {}
        for p, frame in zip(fragments, frames, strict=True):
            msg = check_frame(frame, self._max_message_bytes, self._stats) if frame else None
            if isinstance(msg, GlobalFragment) and msg.run_id == self._run_id and msg.fragment == p:
                if self._verifier is not None and not self._verifier.verify(msg):
                    self._stats.rejected["bad_signature"] += 1
                    log.warning("snapshot key of fragment %d is not signed by the run: ignored", p)
                    continue
                found[p] = (msg.epoch, msg.version)
        return found

    def _encoded(self, fragment: GlobalFragment) -> bytes:
        signed = fragment if self._signer is None else self._signer.sign(fragment)
        return encode_bounded(signed, self._max_message_bytes)

    def publish(self, fragment: GlobalFragment, snapshot: GlobalFragment | None) -> None:
        """Queue ``fragment`` for the stream and ``snapshot`` (or it) for the key;
        write what is queued unless redis is away."""
        if fragment.run_id != self._run_id:
            raise ValueError(f"global of run {fragment.run_id!r} published on run {self._run_id!r}")
        frame = self._encoded(fragment)
        whole = frame if snapshot is None else self._encoded(snapshot)
        self._unpublished[fragment.fragment] = (frame, whole, fragment)
        self._link.attempt(self.publish_queued)

    def announce(self, fragment: GlobalFragment) -> None:
        """As :meth:`publish`, with ``fragment`` without its weights to the stream."""
        if fragment.run_id != self._run_id:
            raise ValueError(f"global of run {fragment.run_id!r} announced on run {self._run_id!r}")
        weightless = self._encoded(fragment.without_weights())
        whole = self._encoded(fragment)
        self._unpublished[fragment.fragment] = (weightless, whole, fragment)
        self._link.attempt(self.publish_queued)

    def publish_queued(self) -> None:
        """Write what is queued; raises redis's errors (and keeps it queued)."""
        if not self._unpublished:
            return
        pipe = self._link.client.pipeline(transaction=True)
        for p, (frame, whole, version) in self._unpublished.items():
            pipe.set(model_key(self._run_id, p), whole)
            weightless = self._encoded(version.without_weights())
            pipe.hset(
                weightless_key(self._run_id, p),
                mapping={"crc": str(version.weights_crc), "frame": weightless},
            )
            pipe.xadd(
                globals_stream_key(self._run_id),
                {FIELD: frame},
                maxlen=entries_within(self._globals_max_bytes, len(frame), self._globals_maxlen),
                approximate=False,
            )
        pipe.execute()
        for frame, whole, _ in self._unpublished.values():
            self._stats.bytes_sent += len(frame) + len(whole)  # XADD and SET
            self._stats.messages_sent += 1
        self._unpublished.clear()

    def close(self) -> None:
        """Write what is queued if redis answers; say what is lost if not."""
        if not self._unpublished:
            return
        try:
            self.publish_queued()
        except Exception as e:
            if not is_transient(e):
                raise
            log.warning(
                "syncer %s: closing with %d unpublished globals (%s)",
                self._consumer,
                len(self._unpublished),
                e,
            )


@dataclass(frozen=True)
class GlobalCheck:
    """Decodes a global of one of the run's fragments, or counts why a frame is
    none (and returns None)."""

    run_id: str
    num_fragments: int
    max_message_bytes: int
    stats: TransportStats
    verifier: GlobalVerifier | None = None  # with the run's keys: signatures checked

    def __call__(self, frame: Any) -> GlobalFragment | None:
        msg = check_frame(frame, self.max_message_bytes, self.stats)
        if msg is None:
            return None
        if not isinstance(msg, GlobalFragment):
            self.stats.rejected["wrong_kind"] += 1
        elif msg.run_id != self.run_id:
            self.stats.rejected["wrong_run"] += 1
        elif msg.fragment >= self.num_fragments:
            self.stats.rejected["wrong_fragment"] += 1
        elif self.verifier is not None and not self.verifier.verify(msg):
            self.stats.rejected["bad_signature"] += 1
        else:
            self.stats.messages_received += 1
            return msg
        return None


class SnapshotKeys:
    """The latest global of each fragment, read from its snapshot keys."""

    def __init__(self, client: redis.Redis, run_id: str, check: GlobalCheck) -> None:
        self._client = client
        self._run_id = run_id
        self._check = check
        self._snapshots_unless_held = ReadScript(client, SNAPSHOTS_UNLESS_HELD)

    def latest(self, fragments: list[int]) -> dict[int, GlobalFragment]:
        """The latest global of each of ``fragments`` that has one (with weights)."""
        if not fragments:
            return {}
        frames = self._client.mget([model_key(self._run_id, p) for p in fragments])
        return self._models(fragments, frames)

    def load(
        self, fragments: list[int], held: Mapping[int, Any]
    ) -> tuple[dict[int, GlobalFragment], bytes | None]:
        """The latest global of each of ``fragments`` that has one, and the globals
        stream's last id (None: empty), read atomically. A fragment whose current
        weights are ``held`` is read without them and completed from ``held``."""
        reply = self._snapshots_unless_held(
            keys=[globals_stream_key(self._run_id)]
            + [model_key(self._run_id, p) for p in fragments]
            + [weightless_key(self._run_id, p) for p in fragments],
            args=[str(weights_checksum(held[p])) if p in held else "" for p in fragments],
        )
        last_id, frames = reply[0] or None, reply[1:]
        found = self._models(fragments, frames)
        for p, g in list(found.items()):
            if g.is_weightless:
                if p in held:
                    found[p] = g.with_weights(held[p])
                else:
                    del found[p]
                    self._check.stats.rejected["weightless"] += 1
        return found, last_id

    def _models(self, fragments: list[int], frames: list[Any]) -> dict[int, GlobalFragment]:
        found: dict[int, GlobalFragment] = {}
        for p, frame in zip(fragments, frames, strict=True):
            if frame is None:
                continue
            msg = self._check(frame)
            if msg is None:
                continue
            if msg.fragment != p:
                self._check.stats.rejected["wrong_fragment"] += 1
                continue
            found[p] = msg
        return found


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
        self._stream_first_id = ReadScript(client, STREAM_FIRST_ID)
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
        # stream's first entry is now newer than our position, entries we never
        # read may have been trimmed: fall back to the snapshot keys.
        first_id = self._stream_first_id(keys=[self._globals], args=[])
        if first_id is not None and parse_id(first_id) > parse_id(self._position):
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
