"""The snapshot keys of the globals on Redis, as learners and syncers read them
(docs/transports.md): :class:`GlobalCheck` decodes a global of the run and
counts why a frame is none, :class:`SnapshotKeys` reads the latest global of
each fragment from its snapshot keys (written by
:mod:`broker.redis.globals_publisher`). Reads raise redis's errors: the
transports (:mod:`broker.redis.syncer`, :mod:`broker.redis.learner`) retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from broker.identity.signing import GlobalVerifier
from broker.redis.frames import check_frame
from broker.redis.names import changes_key, globals_stream_key, model_key, weightless_key
from broker.redis.scripts import SNAPSHOTS_UNLESS_HELD, ReadScript
from broker.transport import TransportStats
from broker.wire.codecs import apply_change
from broker.wire.messages import GlobalFragment, WireError, weights_checksum


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
        # Per fragment, the change that made the latest version the last load
        # read, where it read changes (not when the snapshot key holds that
        # version's weights itself): a successor's momentum estimate.
        self.last_changes: dict[int, GlobalFragment] = {}

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
        for p in fragments:
            self.last_changes.pop(p, None)
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
        if latest.is_change:
            self.last_changes[snapshot.fragment] = latest
        return latest.without_weights().with_weights(weights)
