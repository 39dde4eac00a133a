"""A syncer's writing of the globals on Redis (docs/transports.md).

:class:`GlobalsPublisher` writes each new global to the globals stream and its
fragment's snapshot keys in one transaction: the ``weightless`` hash every
time, the fragment's fp32 weights (``model``) only every ``snapshot_every``
versions, and in between the change to its ``changes`` list, so that a round
writes the compact change, not the weights, to the append-only file. Learners
read them (:mod:`broker.redis.globals_reader`, :mod:`broker.redis.snapshot_keys`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import cast

from broker.errors import ConfigError
from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.redis.frames import FIELD, check_frame, encode_bounded, entries_within
from broker.redis.link import Failed, RedisLink, transient_call
from broker.redis.names import (
    changes_key,
    globals_stream_key,
    model_key,
    resume_key,
    weightless_key,
)
from broker.redis.shards import Fence, execute, transaction
from broker.transport import TransportStats
from broker.wire.messages import GlobalFragment

log = logging.getLogger(__name__)

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

    def follow(self, latest: GlobalFragment, listed: int) -> None:
        """Redis holds ``latest`` as its fragment's newest version, its weights
        and then ``listed`` changes (read at start): the next change goes to the
        list after them, as if this process had written them, not the weights
        again (a syncer that took a 250M-parameter shard over wrote 1 GB before
        its first round)."""
        crc = latest.weights_crc
        self._written[latest.fragment] = _Written((latest.epoch, latest.version), listed, crc)

    def holds(self, fragment: int, version: tuple[int, int]) -> bool:
        """Whether ``version`` (epoch, version) is the fragment's newest in Redis as
        this process wrote or read it last, and nothing newer is queued."""
        written = self._written.get(fragment)
        return (
            fragment not in self._unpublished
            and written is not None
            and (written.version == version)
        )

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
            raise ConfigError(
                f"global of run {fragment.run_id!r} published on run {self._run_id!r}"
            )
        if fragment.is_change and snapshot is None:
            raise ConfigError(f"a change of fragment {fragment.fragment} published without weights")
        self._check_resume(resume)
        self._queue(_Queued(self._encoded(fragment), fragment, snapshot, resume))

    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        """As :meth:`publish`, with ``fragment`` without its weights to the stream
        (and its weights to the model key)."""
        if fragment.run_id != self._run_id:
            raise ConfigError(
                f"global of run {fragment.run_id!r} announced on run {self._run_id!r}"
            )
        self._check_resume(resume)
        weightless = self._encoded(fragment.without_weights())
        self._queue(_Queued(weightless, fragment.without_weights(), fragment, resume))

    def _check_resume(self, resume: bytes) -> None:
        if len(resume) > self._max_message_bytes:
            raise ConfigError(
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
        failed = transient_call(self.publish_queued)
        if isinstance(failed, Failed):
            log.warning(
                "syncer %s: closing with %d unpublished globals (%s)",
                self._consumer,
                len(self._unpublished),
                failed.error,
            )
