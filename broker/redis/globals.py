"""The globals of the Redis Streams transport (docs/transports.md): the globals
stream and the snapshot keys, written by a syncer and read by learners.

A syncer's :class:`GlobalsPublisher` writes each new global to the globals
stream and its fragment's snapshot keys in one transaction: the ``weightless``
hash every time, the fragment's fp32 weights (``model``) only every
``snapshot_every`` versions, and in between the change to its ``changes``
list, so that a round writes the compact change, not the weights, to the
append-only file. A learner's :class:`GlobalsReader` follows the globals stream,
reading its notices stream (:class:`NoticeReader`) in the same blocking XREAD,
and falls back to the snapshot keys (:class:`SnapshotKeys`) when it has no base,
sees a gap or finds the stream trimmed past its read position. Reads raise
redis's errors: the transports (:mod:`broker.redis.syncer`,
:mod:`broker.redis.learner`) retry.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
from redis.typing import KeyT, StreamIdT

from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.redis.common import (
    FIELD,
    SNAPSHOTS_UNLESS_HELD,
    STREAM_TRIMMED_PAST,
    Entries,
    ReadScript,
    RedisLink,
    changes_key,
    check_frame,
    encode_bounded,
    entries_within,
    globals_stream_key,
    is_transient,
    model_key,
    notices_key,
    read_block_ms,
    resume_key,
    sleep_tail,
    to_str,
    weightless_key,
)
from broker.redis.shards import Fence, execute, transaction
from broker.transport import TransportStats, candidate_order
from broker.wire.codecs import apply_change
from broker.wire.messages import GlobalFragment, Refusal, WireError, weights_checksum

log = logging.getLogger(__name__)

_GLOBALS_READ_COUNT = 16  # globals are whole fragments: read few at a time

# The accepted (epoch, version) of a fragment known to have no global yet: any
# global of it is new.
_NOTHING_YET = (-1, -1)

Versions = dict[int, tuple[int, int]]  # accepted (epoch, version) per fragment


# How often a syncer checks that Redis still holds each fragment's snapshot keys
# as it wrote them: a fragment that does not move is restored within this.
SNAPSHOT_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class _Written:
    """What a publisher wrote last of a fragment."""

    version: tuple[int, int]  # (epoch, version)
    listed: int  # changes listed since its weights were written
    crc: int  # the version's weights checksum, as the weightless hash holds it


@dataclass
class _Queued:
    """A fragment's newest global not yet written, and what goes with it."""

    frame: bytes  # to the stream
    version: GlobalFragment
    whole: GlobalFragment | None  # the version with its weights (None: ``version`` is)
    resume: bytes  # the publisher's state that goes with it (empty: none)


class GlobalsPublisher:
    """Writes each new global to the globals stream and its snapshot keys in one
    transaction (see the module); keeps the newest unpublished global of each
    fragment while redis is away."""

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
        snapshot_every: int = 1,
        fence: Fence | None = None,
    ) -> None:
        self._link = link
        self._fence = fence  # the shard's term: no write once another syncer holds it
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
        self._snapshot_every = snapshot_every
        self._unpublished: dict[int, _Queued] = {}
        # Per fragment, what this process wrote last. Nothing before it wrote the
        # weights: a restarted syncer may publish a version the list already holds.
        self._written: dict[int, _Written] = {}
        self._checked_at = -math.inf  # when the snapshot keys were last checked

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

    def publish(
        self, fragment: GlobalFragment, snapshot: GlobalFragment | None, resume: bytes = b""
    ) -> None:
        """Queue ``fragment`` for the stream and, as the snapshot, ``snapshot``
        (the same version with its weights; None: ``fragment`` is) or, between
        snapshots, ``fragment`` for the fragment's changes list, with ``resume``
        (the syncer's state of that version) for its resume key; write what is
        queued unless redis is away."""
        if fragment.run_id != self._run_id:
            raise ValueError(f"global of run {fragment.run_id!r} published on run {self._run_id!r}")
        if fragment.is_change and snapshot is None:
            raise ValueError(f"a change of fragment {fragment.fragment} published without weights")
        self._check_resume(resume)
        self._queue(_Queued(self._encoded(fragment), fragment, snapshot, resume))

    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        """As :meth:`publish`, with ``fragment`` without its weights to the stream
        (and its weights to the model key)."""
        if fragment.run_id != self._run_id:
            raise ValueError(f"global of run {fragment.run_id!r} announced on run {self._run_id!r}")
        self._check_resume(resume)
        weightless = self._encoded(fragment.without_weights())
        self._queue(_Queued(weightless, fragment.without_weights(), fragment, resume))

    def _check_resume(self, resume: bytes) -> None:
        if len(resume) > self._max_message_bytes:
            raise ValueError(
                f"resume state of {len(resume):,} bytes: over max_message_bytes "
                f"{self._max_message_bytes:,}"
            )

    def _queue(self, queued: _Queued) -> None:
        self._unpublished[queued.version.fragment] = queued
        self._link.attempt(self.publish_queued)

    def _writes_weights(self, p: int, queued: _Queued) -> bool:
        """Whether ``queued`` goes to the model key with its weights: when due, and
        whenever it is not a change that follows the list (a whole version or an
        announcement, the first since this process started, a change replaced in
        the queue before Redis got it, a version never handed over, a list that
        Redis lost)."""
        version, written = queued.version, self._written.get(p)
        if written is None or not version.is_change:
            return True
        follows = (version.epoch, version.change_from) == written.version
        return not follows or written.listed + 1 >= self._snapshot_every

    def publish_queued(self) -> None:
        """Write what is queued; raises redis's errors (and keeps it queued).

        A change goes to the changes list in the same transaction that reads
        what the fragment's keys held before it: where that is not what this
        process wrote last (Redis restarted and lost it, or failed over to a
        replica that never had it), the list no longer follows the weights,
        and the version is written again at once, whole."""
        for _ in range(2):  # the second pass writes weights only
            if not self._unpublished:
                return
            for p in self._write_queued():
                self._written.pop(p)  # its next write is whole

    def _write_queued(self) -> list[int]:
        """One transaction of what is queued; the fragments whose change went to a
        list Redis did not hold as written (left queued)."""
        pipe = transaction(self._link.client, self._fence)
        written: dict[int, bool] = {}  # per fragment: whether its weights went to the model key
        sent = 0
        for p, queued in self._unpublished.items():
            frame, version = queued.frame, queued.version
            written[p] = self._writes_weights(p, queued)
            if written[p]:
                whole = frame if queued.whole is None else self._encoded(queued.whole)
                pipe.set(model_key(self._run_id, p), whole)
                pipe.delete(changes_key(self._run_id, p))
                sent += len(whole)
            else:
                # What the list follows, as Redis holds it now (checked below).
                pipe.exists(model_key(self._run_id, p))
                pipe.hget(weightless_key(self._run_id, p), "crc")
                pipe.rpush(changes_key(self._run_id, p), frame)
                sent += len(frame)
            if queued.resume:  # same transaction: a successor finds the two together
                pipe.set(resume_key(self._run_id, p), queued.resume)
                sent += len(queued.resume)
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
            sent += len(frame) + len(weightless)
        replies = iter(execute(pipe, self._fence))
        lost: list[int] = []
        for p, weights in written.items():
            if weights:
                next(replies), next(replies)  # SET, DEL
            else:
                model_kept, crc = next(replies), next(replies)
                next(replies)  # RPUSH
                if not self._held_as_written(p, model_kept, crc):
                    lost.append(p)
            if self._unpublished[p].resume:
                next(replies)  # SET
            next(replies), next(replies)  # HSET, XADD
        for p, weights in written.items():
            version = self._unpublished[p].version
            listed = 0 if weights else self._written[p].listed + 1
            self._written[p] = _Written(
                (version.epoch, version.version), listed, version.weights_crc
            )
            if p not in lost:
                del self._unpublished[p]
        self._count_lost(lost)
        self._stats.bytes_sent += sent
        self._stats.messages_sent += len(written)
        return lost

    def lost(self) -> list[int]:
        """Fragments whose snapshot keys Redis no longer holds as this process
        wrote them last (a restart or failover lost them), checked at most every
        :data:`SNAPSHOT_CHECK_INTERVAL_S`: their next publish must be whole.
        Raises redis's errors."""
        now = time.monotonic()
        if now < self._checked_at + SNAPSHOT_CHECK_INTERVAL_S or not self._written:
            return []
        self._checked_at = now
        checked = [p for p in self._written if p not in self._unpublished]
        pipe = self._link.client.pipeline(transaction=True)
        for p in checked:
            pipe.exists(model_key(self._run_id, p))
            pipe.hget(weightless_key(self._run_id, p), "crc")
        replies = pipe.execute()
        lost = []
        for p, model_kept, crc in zip(checked, replies[::2], replies[1::2], strict=True):
            if not self._held_as_written(p, model_kept, crc):
                lost.append(p)
                del self._written[p]
        self._count_lost(lost)
        return lost

    def _held_as_written(self, p: int, model_kept: object, crc: object) -> bool:
        """Whether Redis holds fragment p's keys as this process wrote them last:
        its model key (EXISTS) and its latest version's checksum (HGET)."""
        held_crc = None if crc is None else int(cast(bytes, crc))
        return bool(model_kept) and held_crc == self._written[p].crc

    def _count_lost(self, lost: list[int]) -> None:
        if lost:
            self._stats.snapshots_lost += len(lost)
            log.warning(
                "syncer %s: redis no longer holds the snapshot keys of fragment(s) %s as "
                "written (a restart or failover lost them): writing them again, whole",
                self._consumer, lost,
            )  # fmt: skip

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
    """The latest global of each fragment, read from its snapshot keys: the
    weights of a recent version and the changes published since, applied here
    (:func:`broker.wire.codecs.apply_change`, bit for bit as a learner following
    the stream applies them, and checked against the checksum the latest one
    names)."""

    def __init__(self, client: redis.Redis, run_id: str, check: GlobalCheck) -> None:
        self._client = client
        self._run_id = run_id
        self._check = check
        self._snapshots_unless_held = ReadScript(client, SNAPSHOTS_UNLESS_HELD)

    def latest(self, fragments: list[int]) -> dict[int, GlobalFragment]:
        """The latest global of each of ``fragments`` that has one (with weights)."""
        return self.load(fragments, {})[0] if fragments else {}

    def load(
        self, fragments: list[int], held: Mapping[int, Any]
    ) -> tuple[dict[int, GlobalFragment], bytes | None]:
        """The latest global of each of ``fragments`` that has one, and the globals
        stream's last id (None: empty), read atomically. A fragment whose current
        weights are ``held`` is read without them and completed from ``held``."""
        reply = self._snapshots_unless_held(
            keys=[globals_stream_key(self._run_id)]
            + [model_key(self._run_id, p) for p in fragments]
            + [weightless_key(self._run_id, p) for p in fragments]
            + [changes_key(self._run_id, p) for p in fragments],
            args=[str(weights_checksum(held[p])) if p in held else "" for p in fragments],
        )
        last_id, answers = reply[0] or None, reply[1:]
        found: dict[int, GlobalFragment] = {}
        for p, (frame, changes) in zip(fragments, answers, strict=True):
            g = self._global(p, frame)
            if g is None:
                continue
            if g.is_weightless:
                if p not in held:
                    self._check.stats.rejected["weightless"] += 1
                    continue
                g = g.with_weights(held[p])
            elif changes:
                g = self._brought_up_to_date(g, changes)
            if g is not None:
                found[p] = g
        return found, last_id

    def _global(self, p: int, frame: Any) -> GlobalFragment | None:
        msg = self._check(frame) if frame is not None else None
        if msg is not None and msg.fragment != p:
            self._check.stats.rejected["wrong_fragment"] += 1
            return None
        return msg

    def _brought_up_to_date(
        self, snapshot: GlobalFragment, frames: list[Any]
    ) -> GlobalFragment | None:
        """``snapshot`` with the changes ``frames`` applied in order: the latest
        version, whole; None (counted) when they do not follow from it."""
        latest = snapshot
        try:
            weights = snapshot.tensor()
            for frame in frames:
                change = self._global(snapshot.fragment, frame)
                if change is None:
                    return None
                if (change.epoch, change.change_from) != (latest.epoch, latest.version):
                    self._check.stats.rejected["broken_changes"] += 1
                    return None
                weights = apply_change(weights, change.tensor())
                latest = change
        except WireError as e:
            self._check.stats.rejected[e.reason] += 1
            return None
        if weights_checksum(weights) != latest.weights_crc:
            self._check.stats.rejected["diverged"] += 1
            return None
        return latest.without_weights().with_weights(weights)


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
