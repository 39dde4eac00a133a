"""Syncer side of the Redis Streams transport (docs/transports.md).

The delivery contract is in :mod:`broker.redis`, the keys in
:mod:`broker.redis.names` and the connection handling both sides share in
:mod:`broker.redis.link`. A syncer is one consumer of the group ``syncers`` on
the delta streams of the fragments it owns, one stream per fragment and
learner of the roster: it re-reads its own pending entries, takes over those
a dead consumer left (XAUTOCLAIM after ``claim_idle_s``), reads new ones with
XREADGROUP and XACKs what the caller acks (:mod:`broker.redis.delta_reader`),
and trims the streams below what any group still needs
(:mod:`broker.redis.delta_trimmer`). It reads the roster's heartbeat keys, each
in bounded form, and publishes each new global to its snapshot keys and the
globals stream at once (its weights every ``snapshot_every`` versions,
:mod:`broker.redis.globals_publisher`). The syncer that owns fragment 0 also
admits learners (:mod:`broker.redis.admission`).

Connection errors never escape, not even from ``publish``: the newest
unpublished global of each fragment stays queued until redis is back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, cast

import redis

from broker.checks import check_positive
from broker.errors import ConfigError
from broker.identity.keys import RunKeys
from broker.identity.members import MAX_MEMBERS
from broker.identity.signing import GlobalSigner, GlobalVerifier
from broker.redis.access import lock_down_if_open
from broker.redis.admission import Admission
from broker.redis.delta_reader import DeltaReader, Token
from broker.redis.delta_trimmer import DeltaTrimmer
from broker.redis.frames import FIELD, check_frame, encode_bounded, to_str
from broker.redis.globals_publisher import GlobalsPublisher
from broker.redis.link import RedisLink, connect
from broker.redis.names import (
    NOTICES_MAXLEN,
    NOTICES_TTL_S,
    changes_key,
    heartbeat_key,
    notices_key,
    resume_key,
    roster_key,
)
from broker.redis.options import RedisOptions
from broker.redis.shards import Fence, execute, transaction
from broker.redis.snapshot_keys import GlobalCheck, SnapshotKeys
from broker.redis.users import SYNCER_USER
from broker.transport import (
    MAX_LEARNER_SLOTS,
    Inbound,
    ResumePoint,
    SyncerTransport,
    TransportStats,
)
from broker.wire.messages import Delta, GlobalFragment, Heartbeat, Refusal

log = logging.getLogger(__name__)

_HEARTBEAT_READ_INTERVAL_S = 0.25
_ROSTER_READ_INTERVAL_S = 1.0
# A heartbeat frame is a few hundred bytes: more is read of none.
MAX_HEARTBEAT_BYTES = 4096
# A joiner reads a fragment's weights and up to this many changes less one
# (about 0.2 bytes per parameter each at int2): what it downloads stays near
# the weights' 4 bytes per parameter.


def warn_unless_durable(client: redis.Redis, consumer: str) -> None:
    """Acknowledged deltas are only as durable as Redis: without an append-only
    file a Redis restart loses them, and so does a default user that may not
    write (Redis 7.0 replays the file's transactions as that user and drops
    what it may not run: :data:`broker.redis.access.DEFAULT_USER_RULES`).
    Said once, loudly, at start."""
    try:
        # redis-py decodes CONFIG GET replies to text whatever decode_responses says.
        config = {
            to_str(k): to_str(v)
            for k, v in cast(dict[Any, Any], client.config_get("appendonly")).items()
        }
        replayed = to_str(
            client.execute_command("ACL", "DRYRUN", "default", "XADD", "k", "*", "f", "v")
        )
    except redis.RedisError as e:  # CONFIG or ACL renamed or denied, or not up: no verdict
        log.warning(
            "syncer %s: not checked whether redis keeps what it acknowledges (that it runs "
            "with AOF, and that its default user may replay it): CONFIG GET appendonly or "
            "ACL DRYRUN failed (%s)",
            consumer, e,
        )  # fmt: skip
        return
    if config.get("appendonly", "yes") != "yes":
        log.warning(
            "syncer %s: redis runs without AOF (appendonly no): a redis restart loses "
            "acknowledged deltas; run it with --appendonly yes --appendfsync always",
            consumer,
        )
    elif replayed != "OK":
        log.error(
            "syncer %s: redis's default user may not write (%s): at a restart redis drops "
            "every transaction and script of its append-only file, and with them acknowledged "
            "deltas and published globals; write its users again (`ddiloco keys acl`) and "
            "restart redis with --aclfile KEYS/redis.acl",
            consumer, replayed,
        )  # fmt: skip


REDIS_DEFAULT_BULK_BYTES = 512 * 2**20  # redis's proto-max-bulk-len unless configured


def check_value_limit(client: redis.Redis, max_message_bytes: int) -> None:
    """Fail at start when the run's largest message (its largest fragment in
    fp32: a snapshot key's value) is over the largest value this Redis takes
    (``proto-max-bulk-len``; its default when CONFIG is denied or Redis is
    not up yet, said in a warning), rather than on the first publish of that
    snapshot."""
    try:
        reply = cast(dict[Any, Any], client.config_get("proto-max-bulk-len"))
        limit = int(to_str(next(iter(reply.values()))))
    except Exception as e:  # denied by an ACL, renamed, or not up: its default
        limit = REDIS_DEFAULT_BULK_BYTES
        log.warning(
            "redis's largest value (proto-max-bulk-len) not read (%s): assuming redis's "
            "default proto-max-bulk-len of %d MiB; a server configured lower refuses a "
            "snapshot of this run's largest message (%.1f MiB) only when it is published",
            str(e) or type(e).__name__, limit // 2**20, max_message_bytes / 2**20,
        )  # fmt: skip
    if max_message_bytes > limit:
        raise ConfigError(
            f"this run's largest message is {max_message_bytes / 2**20:,.1f} MiB (its largest "
            f"fragment in fp32, as a snapshot); this redis takes values of at most "
            f"{limit / 2**20:,.1f} MiB (proto-max-bulk-len): cut the model into more "
            "fragments (--fragments) or raise proto-max-bulk-len"
        )


def _check_syncer_user(client: redis.Redis, url: str) -> None:
    """Fail at start, saying why, when Redis knows the syncers' user by another
    password (it holds another key folder's users); a Redis not up yet is
    waited for, as always."""
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise ConfigError(
            f"redis at {url.split('@')[-1]} refused the syncers' user ({e}): it holds "
            "another run's users; start it with --aclfile KEYS/redis.acl of this run's keys "
            "(one Redis serves the runs of one key folder)"
        ) from None
    except redis.RedisError as e:  # not up yet: the syncer's connection waits for it
        log.warning(
            "redis at %s: not checked whether it knows the syncers' user by this run's "
            "password (%s); the syncer's connection waits for redis",
            url.split("@")[-1], e,
        )  # fmt: skip


class RedisSyncerTransport(SyncerTransport):
    """Syncer side: a consumer of group ``syncers`` on the owned fragments' delta
    streams (:class:`~broker.redis.delta_reader.DeltaReader`, trimmed by
    :class:`~broker.redis.delta_trimmer.DeltaTrimmer`); reads the learners' heartbeats
    (:class:`HeartbeatRoster`) and publishes globals to the globals stream and the
    snapshot keys (:class:`GlobalsPublisher`)."""

    def __init__(
        self,
        url: str,
        run_id: str,
        consumer: str,
        fragments: list[int],
        *,
        options: RedisOptions = RedisOptions(),
        num_fragments: int | None = None,
        # With keys: a learner id stays bound to its key until the key is silent this long.
        identity_hold_s: float,
        keys: RunKeys | None = None,
        roster_cap: int = MAX_LEARNER_SLOTS,
        fence: Fence | None = None,
    ) -> None:
        if not fragments or len(set(fragments)) != len(fragments) or min(fragments) < 0:
            raise ConfigError(f"fragments must be distinct non-negative ids, got {fragments}")
        check_positive("identity_hold_s", identity_hold_s)
        group, max_message_bytes = options.group, options.max_message_bytes
        claim_idle_s, socket_timeout_s = options.claim_idle_s, options.socket_timeout_s
        if num_fragments is None:
            num_fragments = max(fragments) + 1
        if num_fragments <= max(fragments):
            raise ConfigError(f"num_fragments {num_fragments} but fragment {max(fragments)}")
        self.run_id = run_id
        self.consumer = consumer
        self.fragments = list(fragments)
        self.options = options
        self.group = group
        self.max_message_bytes = max_message_bytes
        self.claim_idle_s = claim_idle_s
        self.stats = TransportStats()
        self._max_block_s = min(options.block_ms / 1000, socket_timeout_s / 2)
        user = None
        if keys is not None and keys.redis_password is not None:
            user = (SYNCER_USER, keys.redis_password)
            lock_down_if_open(url, socket_timeout_s, keys)
        client = connect(url, socket_timeout_s, keys, user)
        if user is not None:
            _check_syncer_user(client, url)
        warn_unless_durable(client, consumer)
        check_value_limit(client, max_message_bytes)
        self._deltas = DeltaReader(
            client,
            run_id,
            consumer,
            group,
            self.fragments,
            claim_idle_s,
            max_message_bytes,
            self.stats,
            fence,
        )
        # A transient error may have lost a reply that delivered entries to us.
        self._link = RedisLink(
            client, f"syncer {consumer}", lambda _: self._deltas.reset_pending(), stats=self.stats
        )
        self._trimmer = DeltaTrimmer(
            client, run_id, consumer, group, self._deltas.streams, self.stats
        )
        self._admission = (
            Admission(client, run_id, num_fragments, keys, identity_hold_s, roster_cap, self.stats)
            if 0 in fragments
            else None
        )
        self._learners = RosterReader(client, run_id, self._admission)
        self._roster = HeartbeatRoster(client, run_id, max_message_bytes, self.stats)
        verifier = GlobalVerifier(keys) if keys else None
        self._snapshots = SnapshotKeys(
            client, run_id,
            GlobalCheck(run_id, num_fragments, max_message_bytes, self.stats, verifier),
        )  # fmt: skip
        self._socket_timeout_s = socket_timeout_s
        self._publisher = GlobalsPublisher(
            self._link, run_id, consumer, options.globals_maxlen, options.globals_max_bytes,
            max_message_bytes,
            self.stats,
            GlobalSigner(keys) if keys else None, verifier, options.snapshot_every, fence,
        )  # fmt: skip
        self._fence = fence
        # Where redis is away, receive() creates them once it is back.
        self._link.call(self._deltas.ensure_groups)

    @property
    def connection_errors(self) -> int:
        return self._link.errors

    @property
    def learners(self) -> list[str]:
        """The admitted learner ids whose streams this syncer reads."""
        return self._learners.ids

    # -- receiving --------------------------------------------------------------
    def receive(self, timeout_s: float) -> list[Inbound]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        return self._link.retry(deadline, self._receive_once, on_error=self._deltas.lost_group)

    def _receive_once(self, deadline: float) -> list[Inbound]:
        self._deltas.begin()
        if self._admission is not None:
            self._admission.step()
        self._deltas.follow(self._learners.read())
        self._deltas.ensure_groups()
        self._publisher.publish_queued()
        self._trimmer.acked_in(self._deltas.xack([]))  # the rejected entries of the last call
        self._trimmer.trim_due()
        self._trimmer.count_trimmed_unread()
        items = self._heartbeats()
        items += self._deltas.claim_abandoned()
        items += self._deltas.read_own_pending()
        # New entries: waiting for them only when nothing else came.
        items += self._deltas.read_new(0.0 if items else deadline, self._max_block_s)
        self._deltas.hand_out()
        return items

    def _heartbeats(self) -> list[Inbound]:
        items = self._roster.read(self._learners.ids, _HEARTBEAT_READ_INTERVAL_S)
        if self._admission is not None:
            self._admission.heard([cast(Heartbeat, i.message).learner_id for i in items])
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

        def notify_and_ack() -> None:
            pipe = transaction(self._link.client, self._fence)
            pipe.xadd(notices, {FIELD: encode_bounded(refusal, self.max_message_bytes)},
                      maxlen=NOTICES_MAXLEN, approximate=False)  # fmt: skip
            pipe.expire(notices, NOTICES_TTL_S)
            pipe.xack(stream, self.group, entry_id)
            execute(pipe, self._fence)

        if self._link.attempt(notify_and_ack):
            self._trimmer.acked_in({stream})

    # -- publishing --------------------------------------------------------------
    def existing_globals(self, fragments: list[int]) -> dict[int, tuple[int, int]]:
        return self._publisher.existing(fragments)

    def lost_snapshots(self) -> list[int]:
        """Checked at most every second (:meth:`GlobalsPublisher.lost`); none
        while redis is away."""
        lost: list[int] = []
        self._link.attempt(lambda: lost.extend(self._publisher.lost()))
        return lost

    def resume_points(
        self, fragments: list[int], held: Mapping[int, Any] | None = None, wait_s: float = 0.0
    ) -> dict[int, ResumePoint]:
        """Read from the snapshot keys (signatures checked with the run's keys)
        and the resume keys; raises :class:`TransportError` when redis does not
        answer within the socket timeout."""

        def read() -> dict[int, ResumePoint]:
            latest = self._snapshots.load(fragments, held or {})[0]
            pipe = self._link.client.pipeline(transaction=False)
            pipe.mget([resume_key(self.run_id, p) for p in fragments])
            for p in fragments:
                pipe.llen(changes_key(self.run_id, p))
            replies = pipe.execute()
            states = cast(list[bytes | None], replies[0])
            found = {}
            for p, state, listed in zip(fragments, states, replies[1:], strict=True):
                if p in latest and state:
                    found[p] = ResumePoint(latest[p], state, self._snapshots.last_changes.get(p))
                    # This shard's syncer (under its lease) writes nothing else:
                    # its next change follows what Redis holds.
                    self._publisher.follow(latest[p], int(listed))
            return found

        return self._link.call_within(self._socket_timeout_s, read, "resume points")

    def serves(self, fragment: int, epoch: int, version: int) -> bool:
        return self._publisher.holds(fragment, (epoch, version))

    def publish(
        self, fragment: GlobalFragment, snapshot: GlobalFragment | None = None, resume: bytes = b""
    ) -> None:
        """Write the snapshot key and append to the globals stream, atomically.

        Never raises on connection errors: the newest unpublished global of each
        fragment is kept and written by the next ``publish`` or ``receive`` once
        redis is back (learners see the skipped versions as a gap and resync).
        """
        self._publisher.publish(fragment, snapshot, resume)

    def announce(self, fragment: GlobalFragment, resume: bytes = b"") -> None:
        """Write the snapshot key again (a key lost or overwritten in Redis is
        restored) and append the version, without its weights, to the globals
        stream."""
        self._publisher.announce(fragment, resume)

    def close(self) -> None:
        self._publisher.close()
        self._deltas.close()
        self._link.close()


class RosterReader:
    """The admitted learner ids: the roster hash (only syncers write it), read
    at most every second, and at once those this syncer admitted itself."""

    def __init__(self, client: redis.Redis, run_id: str, admission: Admission | None) -> None:
        self._client = client
        self._run_id = run_id
        self._admission = admission
        self._listed: list[str] = []
        self.ids: list[str] = []
        self._read_at = -math.inf

    def read(self) -> list[str]:
        now = time.monotonic()
        if now - self._read_at >= _ROSTER_READ_INTERVAL_S:
            self._read_at = now
            key = roster_key(self._run_id)
            if int(cast(int, self._client.hlen(key))) > MAX_MEMBERS:
                log.error("%s holds more than %d learners: not read", key, MAX_MEMBERS)
            else:
                listed = cast(dict[bytes, bytes], self._client.hgetall(key))
                self._listed = [to_str(k) for k in listed]
        own = list(self._admission.roster) if self._admission is not None else []
        self.ids = list(dict.fromkeys(own + self._listed))
        return self.ids


class HeartbeatRoster:
    """The learners' heartbeats, one key each: every one read in bounded form
    (at most :data:`MAX_HEARTBEAT_BYTES`), and handed out once, when it changed."""

    def __init__(
        self, client: redis.Redis, run_id: str, max_message_bytes: int, stats: TransportStats
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._max_bytes = min(max_message_bytes, MAX_HEARTBEAT_BYTES)
        self._stats = stats
        self._frames: dict[str, bytes] = {}  # learner id -> the frame last read
        self._last_read_at = -math.inf

    def read(self, learner_ids: list[str], interval_s: float) -> list[Inbound]:
        """Heartbeats of ``learner_ids`` that changed since the last read, if it
        was ``interval_s`` ago."""
        now = time.monotonic()
        if now < self._last_read_at + interval_s or not learner_ids:
            return []
        self._last_read_at = now
        pipe = self._client.pipeline(transaction=False)
        for learner in learner_ids:
            # One byte past the bound: a longer value is seen to be too long.
            pipe.getrange(heartbeat_key(self._run_id, learner), 0, self._max_bytes)
        items: list[Inbound] = []
        for learner, frame in zip(learner_ids, pipe.execute(), strict=True):
            if not frame or self._frames.get(learner) == frame:
                continue
            self._frames[learner] = frame
            if len(frame) > self._max_bytes:
                self._stats.rejected["too_large"] += 1
                continue
            msg = check_frame(frame, self._max_bytes, self._stats)
            if msg is None:
                continue
            if not isinstance(msg, Heartbeat):
                self._stats.rejected["wrong_kind"] += 1
            elif msg.run_id != self._run_id:
                self._stats.rejected["wrong_run"] += 1
            elif msg.learner_id != learner:
                self._stats.rejected["wrong_learner"] += 1
            else:
                self._stats.messages_received += 1
                items.append(Inbound(msg))
        return items
