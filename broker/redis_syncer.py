"""Syncer side of the Redis Streams transport (docs/transports.md).

Keys, the delivery contract and the connection handling both sides share are in
:mod:`broker.redis_common`. A syncer is one consumer of the group ``syncers`` on
the delta streams of the fragments it owns: it re-reads its own pending entries,
takes over those a dead consumer left (XAUTOCLAIM after ``claim_idle_s``), reads
new ones with XREADGROUP, XACKs what the caller acks and trims the streams below
what any group still needs (:mod:`broker.redis_deltas`). It reads heartbeats from
the learners hash and publishes each new global to its snapshot key and the
globals stream at once.

Connection errors never escape, not even from ``publish``: the newest
unpublished global of each fragment stays queued until redis is back.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, cast

import redis

from broker.errors import ConfigError
from broker.keys import GlobalSigner, GlobalVerifier, RunKeys
from broker.redis_common import (
    FIELD,
    GROUP,
    NOTICES_MAXLEN,
    NOTICES_TTL_S,
    RedisLink,
    check_frame,
    connect,
    delta_stream_key,
    encode_bounded,
    is_transient,
    learners_key,
    notices_key,
    to_str,
)
from broker.redis_deltas import DeltaReader, DeltaTrimmer, Token
from broker.redis_globals import GlobalsPublisher
from broker.transport import Inbound, SyncerTransport, TransportStats
from broker.wire import Delta, GlobalFragment, Heartbeat, Refusal

log = logging.getLogger(__name__)

_HEARTBEAT_READ_INTERVAL_S = 0.25
# For deltas of a learner no heartbeat was read of: sooner, still bounded for a
# sender that never writes one.
_UNHEARD_READ_INTERVAL_S = 0.01


def warn_without_aof(client: redis.Redis, consumer: str) -> None:
    """Acknowledged deltas are only as durable as Redis: without an append-only
    file a Redis restart loses them. Said once, loudly, at start."""
    try:
        # redis-py decodes CONFIG GET replies to text whatever decode_responses says.
        config = {
            to_str(k): to_str(v)
            for k, v in cast(dict[Any, Any], client.config_get("appendonly")).items()
        }
    except Exception as e:  # CONFIG may be renamed or denied by an ACL: no verdict
        log.debug("syncer %s: cannot read redis's appendonly setting: %s", consumer, e)
        return
    if config.get("appendonly", "yes") != "yes":
        log.warning(
            "syncer %s: redis runs without AOF (appendonly no): a redis restart loses "
            "acknowledged deltas; run it with --appendonly yes --appendfsync always",
            consumer,
        )


class RedisSyncerTransport(SyncerTransport):
    """Syncer side: a consumer of group ``syncers`` on the owned fragments' delta
    streams (:class:`~broker.redis_deltas.DeltaReader`, trimmed by
    :class:`~broker.redis_deltas.DeltaTrimmer`); reads the learners' heartbeats
    (:class:`HeartbeatRoster`) and publishes globals to the globals stream and the
    snapshot keys (:class:`GlobalsPublisher`)."""

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
        keys: RunKeys | None = None,
    ) -> None:
        if not fragments or len(set(fragments)) != len(fragments) or min(fragments) < 0:
            raise ConfigError(f"fragments must be distinct non-negative ids, got {fragments}")
        if claim_idle_s <= 0:
            raise ConfigError(f"claim_idle_s must be > 0, got {claim_idle_s}")
        if globals_maxlen < 1:
            raise ConfigError(f"globals_maxlen must be >= 1, got {globals_maxlen}")
        if block_ms < 1:
            raise ConfigError(f"block_ms must be >= 1 (0 would block forever), got {block_ms}")
        if max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        if socket_timeout_s <= 0:
            raise ConfigError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        self.run_id = run_id
        self.consumer = consumer
        self.fragments = list(fragments)
        self.group = group
        self.max_message_bytes = max_message_bytes
        self.claim_idle_s = claim_idle_s
        self.globals_maxlen = globals_maxlen
        self.stats = TransportStats()
        self._max_block_s = min(block_ms / 1000, socket_timeout_s / 2)
        client = connect(url, socket_timeout_s, keys)
        warn_without_aof(client, consumer)
        fragment_of = {delta_stream_key(run_id, p): p for p in fragments}
        self._deltas = DeltaReader(
            client,
            run_id,
            consumer,
            group,
            fragment_of,
            claim_idle_s,
            max_message_bytes,
            self.stats,
        )
        # A transient error may have lost a reply that delivered entries to us.
        self._link = RedisLink(client, f"syncer {consumer}", self._deltas.reset_pending)
        self._trimmer = DeltaTrimmer(client, run_id, consumer, group, self.fragments, self.stats)
        self._roster = HeartbeatRoster(client, run_id, max_message_bytes, self.stats)
        self._publisher = GlobalsPublisher(
            self._link, run_id, consumer, globals_maxlen, max_message_bytes, self.stats,
            GlobalSigner(keys) if keys else None, GlobalVerifier(keys) if keys else None,
        )  # fmt: skip
        try:
            self._deltas.ensure_groups()
        except Exception as e:
            if not is_transient(e):
                raise
            self._link.failed(e)  # receive() creates them once redis is back

    @property
    def connection_errors(self) -> int:
        return self._link.errors

    # -- receiving --------------------------------------------------------------
    def receive(self, timeout_s: float) -> list[Inbound]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        return self._link.retry(deadline, self._receive_once, on_error=self._deltas.lost_group)

    def _receive_once(self, deadline: float) -> list[Inbound]:
        self._deltas.begin()
        self._deltas.ensure_groups()
        self._publisher.publish_queued()
        self._trimmer.acked_in(self._deltas.xack([]))  # the rejected entries of the last call
        self._trimmer.trim_due()
        self._trimmer.count_trimmed_unread()
        items = self._roster.read()
        items += self._deltas.claim_abandoned()
        items += self._deltas.read_own_pending()
        if not items:
            items += self._deltas.read_new(deadline, self._max_block_s)
        # A learner's first deltas can wake this read before any heartbeat of it was
        # read (heartbeats are read before blocking, every 0.25 s): read them again
        # now, so that its pace, not the floor, bounds those deltas' step counts.
        senders = {i.message.learner_id for i in items if isinstance(i.message, Delta)}
        if not self._roster.heard_all(senders):
            items = self._roster.read(_UNHEARD_READ_INTERVAL_S) + items
        self._deltas.hand_out()
        return items

    # -- acknowledging and refusing -------------------------------------------
    def ack(self, items: list[Inbound]) -> None:
        """XACK the deltas among ``items``, then trim the streams if due (also
        when ``items`` is empty)."""
        tokens = [cast(Token, i.token) for i in items if i.token is not None]
        self._deltas.settled(tokens)

        def xack_and_trim() -> None:
            self._trimmer.acked_in(self._deltas.xack(tokens))
            self._trimmer.trim_due()

        # If redis is away they stay pending: our PEL re-read after reconnecting
        # delivers them again, and the caller's de-duplication acks them then.
        self._link.attempt(xack_and_trim)

    def refuse(self, item: Inbound, reason: str) -> None:
        """XACK the entry and tell its learner on its notices stream. If redis is
        away the entry stays pending: it is delivered again and refused again."""
        d = item.message
        if not isinstance(d, Delta) or item.token is None:
            return
        stream, entry_id = cast(Token, item.token)
        self._deltas.settled([(stream, entry_id)])
        refusal = Refusal.of(d, reason)
        notices = notices_key(self.run_id, d.learner_id)
        pipe = self._link.client.pipeline(transaction=True)
        pipe.xadd(notices, {FIELD: encode_bounded(refusal, self.max_message_bytes)},
                  maxlen=NOTICES_MAXLEN, approximate=False)  # fmt: skip
        pipe.expire(notices, NOTICES_TTL_S)
        pipe.xack(stream, self.group, entry_id)
        if self._link.attempt(pipe.execute):
            self._trimmer.acked_in({stream})

    # -- publishing --------------------------------------------------------------
    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        return self._publisher.existing(fragments)

    def publish(self, fragment: GlobalFragment, snapshot: GlobalFragment | None = None) -> None:
        """Write the snapshot key and append to the globals stream, atomically.

        Never raises on connection errors: the newest unpublished global of each
        fragment is kept and written by the next ``publish`` or ``receive`` once
        redis is back (learners see the skipped versions as a gap and resync).
        """
        self._publisher.publish(fragment, snapshot)

    def announce(self, fragment: GlobalFragment) -> None:
        """Write the snapshot key again (a key lost or overwritten in Redis is
        restored) and append the version, without its weights, to the globals
        stream."""
        self._publisher.announce(fragment)

    def close(self) -> None:
        self._publisher.close()
        self._link.close()


class HeartbeatRoster:
    """The learners' heartbeats, read from the learners hash: each one once, when
    it changed."""

    def __init__(
        self, client: redis.Redis, run_id: str, max_message_bytes: int, stats: TransportStats
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._max_message_bytes = max_message_bytes
        self._stats = stats
        self._frames: dict[bytes, bytes] = {}  # learner id -> the frame last read
        self._last_read_at = -math.inf

    def heard_all(self, learner_ids: set[str]) -> bool:
        """Whether a heartbeat of each of ``learner_ids`` was read."""
        return not {i.encode() for i in learner_ids} - self._frames.keys()

    def read(self, interval_s: float = _HEARTBEAT_READ_INTERVAL_S) -> list[Inbound]:
        """Heartbeats that changed since the last read, if it was ``interval_s`` ago."""
        now = time.monotonic()
        if now < self._last_read_at + interval_s:
            return []
        self._last_read_at = now
        frames = cast(dict[bytes, bytes], self._client.hgetall(learners_key(self._run_id)))
        items: list[Inbound] = []
        for learner, frame in frames.items():
            if self._frames.get(learner) == frame:
                continue
            self._frames[learner] = frame
            msg = check_frame(frame, self._max_message_bytes, self._stats)
            if msg is None:
                continue
            if not isinstance(msg, Heartbeat):
                self._stats.rejected["wrong_kind"] += 1
            elif msg.run_id != self._run_id:
                self._stats.rejected["wrong_run"] += 1
            else:
                self._stats.messages_received += 1
                items.append(Inbound(msg))
        return items
