"""Redis Streams backend of the transport (docs/transports.md): what both sides share.

The learner side is :mod:`broker.redis.learner`, the syncer side
:mod:`broker.redis.syncer`; both are built of the parts that write and read the
delta streams (:mod:`broker.redis.deltas`) and the globals
(:mod:`broker.redis.globals`). This module holds the keys, the frame checks, the
connection handling (:class:`RedisLink`) and the one retry loop both sides wait in.

Keys of one run (``{run}`` is the run id, ``{l}`` a learner id, ``{p}`` a fragment)::

    ddiloco:{run}:deltas:{p}:{l}  stream   learner l XADDs its deltas of fragment p;
                                           the syncer consumer group ``syncers``
                                           reads them
    ddiloco:{run}:trimmed:{p}:{l} integer  entries of that stream trimmed unread
    ddiloco:{run}:heartbeat:{l}   string   learner l's latest heartbeat frame
    ddiloco:{run}:notices:{l}     stream   refusals of learner l's deltas (short
                                           MAXLEN, expires when unused)
    ddiloco:{run}:requests        stream   enrollments and lease requests, read
                                           (and deleted) by the admitting syncer
    ddiloco:{run}:grant:{k}       string   the admitting syncer's answer to key k's
                                           last lease request
    ddiloco:{run}:roster          hash     admitted learner id -> its key: the
                                           learners whose streams syncers read
    ddiloco:{run}:globals         stream   syncers XADD every new global (exact MAXLEN)
    ddiloco:{run}:model:{p}       string   a recent global of fragment p with its
                                           weights, for joiners (written every
                                           snapshot_every versions)
    ddiloco:{run}:changes:{p}     list     the changes published since, in order:
                                           with the model key, the latest version
    ddiloco:{run}:weightless:{p}  hash     the latest version's weights checksum and
                                           its frame without weights
    ddiloco:{run}:shard:{s}       string   the holder of syncer shard s's lease
                                           (:mod:`broker.redis.shards`)

A learner writes only keys named after itself; with the run's keys each
enrolled key is a Redis ACL user that may write only those
(:mod:`broker.redis.access`).

Every stream entry holds one :mod:`broker.wire.messages` frame: deltas in the three
fields ``h``, ``p``, ``c`` (the parts of :func:`broker.wire.messages.encode_parts`, so a
learner sends its payload without copying it into a frame first), everything
else whole in the field ``m``. A reader takes either form.

Delivery
--------
* A learner's delta is delivered when Redis replied to its XADD (the server runs
  with AOF ``appendfsync always``, so the reply comes after the fsync). Until
  then it stays queued in the learner and is resent by ``poll``; a resend after
  a lost reply may duplicate an entry, which the syncer de-duplicates by
  (learner, incarnation, seq).
* The syncer reads with XREADGROUP and acks (XACK) only what the caller acks.
  A restarted consumer first re-reads its own pending entries, then new ones.
  Entries left pending by a dead consumer are taken over with XAUTOCLAIM once
  they are idle for ``claim_idle_s``: that must be longer than the longest time
  a live syncer holds a delta before acking it.
* Delta streams are trimmed with XTRIM MINID below the oldest entry that is
  pending or not yet delivered to the group, so trimming never eats an entry
  the syncer still needs. The learner's ``delta_stream_maxlen`` is a hard bound
  for a syncer that is down for long: its XADD (one script, :data:`BOUNDED_XADD`)
  first drops what the group is done with, and only then the oldest entries the
  syncer never acked, which it counts in ``trimmed:{p}``. The learner logs
  every such loss, and the syncer reports the count (``transport_trimmed_unread``)
  and logs it loudly. Size ``delta_stream_maxlen`` (a URL option) for the
  longest syncer outage you want to survive without loss.
* A delta the syncer refuses is XACKed and answered on the learner's notices
  stream, which the learner reads in the same blocking XREAD as the globals.
* Globals reach learners in version order per fragment. A learner that sees a
  gap, a fragment it has no base for, or the globals stream trimmed past its
  read position fetches the latest-snapshot keys instead.

Connection errors (and other transient server errors: loading, OOM, MISCONF)
never escape: both sides back off exponentially (with jitter), reconnect and
carry on; deltas and globals not yet written stay queued in the process. The
few exceptions are documented with each side. Invalid messages of our own
(wrong run, fragment out of range, frame over ``max_message_bytes``) raise
``ValueError``/``WireError`` at once: they are bugs, not network weather.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.retry import Retry

from broker.transport import TransportError, TransportStats
from broker.wire.messages import Message, WireError, decode, decode_parts, encode, encode_parts

if TYPE_CHECKING:
    from broker.identity.keys import RunKeys

log = logging.getLogger(__name__)

# (entry id, fields) as redis-py returns them; fields are empty for an entry
# that was trimmed or deleted while pending.
Entries = list[tuple[bytes, dict[bytes, bytes]]]

FIELD = b"m"
PART_FIELDS = (b"h", b"p", b"c")  # a frame in parts: prefix and header, payload, checksum
GROUP = "syncers"
_BACKOFF_BASE_S = 0.05
_BACKOFF_CAP_S = 2.0
# redis ends a blocking read on its timer tick (every 100 ms at the default
# hz 10), so BLOCK b returns after b to b + 100 ms: block only for what is left
# after one tick, and poll without blocking in the last tick of a wait.
_REDIS_TICK_S = 0.1
_TAIL_POLL_S = 0.02

# Errors after which the same request may succeed later: the server is down,
# restarting, loading its AOF, out of memory, or failing to write its AOF.
# With the run's keys also a refused user or command (AUTH, NOPERM): a learner
# whose ACL user the syncer has not made, or widened to its learner id, yet; it
# enrolls again and waits (broker.redis.learner).
_TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.exceptions.NoPermissionError,
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ExecAbortError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
)

# Redis refused our user or a command: not admitted (yet), not network weather.
_REFUSED = (redis.AuthenticationError, redis.exceptions.NoPermissionError)

# Whether stream KEYS[1] lost entries past the id ARGV[1] that a reader read
# last ('0-0': none yet) to trimming, which drops the oldest entries first: 1 if
# that entry is gone (or, for '0-0', if the stream holds any), else 0. Only the
# reader's own last entry is looked at: the stream's first one is often a
# fragment's whole fp32 weights, which Lua would copy on every check (at 100M
# parameters 16 MB a call, most of Redis's time under 16 learners).
STREAM_TRIMMED_PAST = """#!lua flags=no-writes
if ARGV[1] == '0-0' then
  return #redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1) > 0 and 1 or 0
end
return #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 and 1 or 0
"""

# The id of the last entry of the globals stream KEYS[1] (false: empty), and
# per fragment, read at once: its snapshot and the changes published since
# ({model, {change, ...}}: together the latest version), or, when the reader
# holds the latest version's weights, that global without them and no changes
# (SnapshotRequest.held_crcs). KEYS[2..]: n model keys, the n weightless keys,
# then the n changes keys; ARGV: per fragment, the checksum the reader holds
# in decimal, or '' for none.
SNAPSHOTS_UNLESS_HELD = """#!lua flags=no-writes
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local out = {false}
if #last > 0 then out[1] = last[1][1] end
local n = (#KEYS - 1) / 3
for i = 1, n do
    local answer = false
    if ARGV[i] ~= '' then
        local held = redis.call('HMGET', KEYS[1 + n + i], 'crc', 'frame')
        if held[1] == ARGV[i] then answer = {held[2], {}} end
    end
    if not answer then
        answer = {redis.call('GET', KEYS[1 + i]), redis.call('LRANGE', KEYS[1 + 2 * n + i], 0, -1)}
    end
    out[1 + i] = answer
end
return out
"""

# Take up to ARGV[1] entries of stream KEYS[1] and delete them: each whose one
# field ``m`` is at most ARGV[2] bytes is returned, the others only counted, so
# no entry larger than the bound ever leaves the server. Returns
# {dropped, {id1, m1, id2, m2, ...}}.
TAKE_BOUNDED = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', tonumber(ARGV[1]))
local limit, taken, dropped = tonumber(ARGV[2]), {}, 0
for _, entry in ipairs(entries) do
    redis.call('XDEL', KEYS[1], entry[1])
    local f = entry[2]
    if #f == 2 and f[1] == 'm' and #f[2] <= limit then
        taken[#taken + 1] = entry[1]
        taken[#taken + 1] = f[2]
    else
        dropped = dropped + 1
    end
end
return {dropped, taken}
"""

# XREADGROUP GROUP ARGV[1] ARGV[2] COUNT ARGV[3] STREAMS KEYS ARGV[6..] (no
# BLOCK), where every entry whose values hold more than ARGV[4] bytes in all is
# acked and deleted here, counted, and never returned: no entry larger than the
# bound leaves the server. Entries past ARGV[5] bytes in all (after the first)
# are held back: delivered to the consumer but not returned, they are read
# again as its pending entries, so that no reply outgrows what the socket
# moves within its timeout. Returns {dropped, {{stream, kept entries, the last
# id returned or dropped before any held back, whether some were held back},
# ...}}.
READ_BOUNDED = """
local group, consumer, limit = ARGV[1], ARGV[2], tonumber(ARGV[4])
local budget, total, over = tonumber(ARGV[5]), 0, false
local args = {'XREADGROUP', 'GROUP', group, consumer, 'COUNT', ARGV[3], 'STREAMS'}
for i = 1, #KEYS do args[#args + 1] = KEYS[i] end
for i = 6, #ARGV do args[#args + 1] = ARGV[i] end
local reply = redis.call(unpack(args))
local dropped, out = 0, {}
if not reply then return {0, out} end
for _, stream in ipairs(reply) do
    local kept, last, held = {}, false, 0
    for _, entry in ipairs(stream[2]) do
        local size = 0
        if entry[2] then
            for i = 2, #entry[2], 2 do size = size + #entry[2][i] end
        end
        if size > limit then
            redis.call('XACK', stream[1], group, entry[1])
            redis.call('XDEL', stream[1], entry[1])
            dropped = dropped + 1
            if held == 0 then last = entry[1] end
        elseif held == 1 or (total > 0 and total + size > budget) then
            held = 1
        else
            total = total + size
            kept[#kept + 1] = entry
            last = entry[1]
        end
    end
    out[#out + 1] = {stream[1], kept, last, held}
end
return {dropped, out}
"""

# XAUTOCLAIM KEYS[1] ARGV[1] ARGV[2] ARGV[4] ARGV[5] COUNT ARGV[3] (group,
# consumer, count, min idle ms, start), with READ_BOUNDED's bound ARGV[6].
# Returns {dropped, next cursor, claimed entries, ids deleted while pending}.
CLAIM_BOUNDED = """
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[4], ARGV[5],
                         'COUNT', ARGV[3])
local limit, dropped, kept = tonumber(ARGV[6]), 0, {}
for _, entry in ipairs(reply[2]) do
    local size = 0
    if entry[2] then
        for i = 2, #entry[2], 2 do size = size + #entry[2][i] end
    end
    if size > limit then
        redis.call('XACK', KEYS[1], ARGV[1], entry[1])
        redis.call('XDEL', KEYS[1], entry[1])
        dropped = dropped + 1
    else
        kept[#kept + 1] = entry
    end
end
return {dropped, reply[1], kept, reply[3] or {}}
"""

# XADD the field-value pairs ARGV[3..] to delta stream KEYS[1], keeping it at
# most ARGV[1] entries long. Entries group ARGV[2] is done with (delivered and
# acked) go first; if that is not enough, the oldest others are dropped and
# counted in KEYS[2]. Returns how many unread or unacked entries were dropped.
BOUNDED_XADD = """
local maxlen = tonumber(ARGV[1])
local lost = 0
if redis.call('XLEN', KEYS[1]) >= maxlen then
    local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
    if ok then
        for _, g in ipairs(groups) do
            local info = {}
            for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
            if info['name'] == ARGV[2] then
                local bound = info['last-delivered-id']
                if info['pending'] > 0 then
                    bound = redis.call('XPENDING', KEYS[1], ARGV[2])[2]
                end
                redis.call('XTRIM', KEYS[1], 'MINID', bound)
            end
        end
    end
    local len = redis.call('XLEN', KEYS[1])
    if len >= maxlen then
        lost = len - maxlen + 1
        redis.call('XTRIM', KEYS[1], 'MAXLEN', maxlen - 1)
        redis.call('INCRBY', KEYS[2], lost)
    end
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return lost
"""

NOTICES_MAXLEN = 100  # refusals kept per learner: a learner reads them within a poll
NOTICES_TTL_S = 3600  # a notices stream nobody writes to for an hour goes away

T = TypeVar("T")


def delta_stream_key(run_id: str, fragment: int, learner_id: str) -> str:
    return f"ddiloco:{run_id}:deltas:{fragment}:{learner_id}"


def trimmed_key(run_id: str, fragment: int, learner_id: str) -> str:
    return f"ddiloco:{run_id}:trimmed:{fragment}:{learner_id}"


def heartbeat_key(run_id: str, learner_id: str) -> str:
    return f"ddiloco:{run_id}:heartbeat:{learner_id}"


def notices_key(run_id: str, learner_id: str) -> str:
    return f"ddiloco:{run_id}:notices:{learner_id}"


def requests_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:requests"


def grant_key(run_id: str, key: str) -> str:
    return f"ddiloco:{run_id}:grant:{key[:32]}"


def roster_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:roster"


def globals_stream_key(run_id: str) -> str:
    return f"ddiloco:{run_id}:globals"


def model_key(run_id: str, fragment: int) -> str:
    return f"ddiloco:{run_id}:model:{fragment}"


def shard_key(run_id: str, shard: int) -> str:
    return f"ddiloco:{run_id}:shard:{shard}"


def term_key(run_id: str, shard: int) -> str:
    """The shard's term: one more at every new tenure of its lease, never less."""
    return f"ddiloco:{run_id}:term:{shard}"


def changes_key(run_id: str, fragment: int) -> str:
    return f"ddiloco:{run_id}:changes:{fragment}"


def resume_key(run_id: str, fragment: int) -> str:
    """The syncer's state that goes with the fragment's latest snapshot (no
    member may read it): what a syncer that lost its checkpoint resumes from."""
    return f"ddiloco:{run_id}:resume:{fragment}"


def weightless_key(run_id: str, fragment: int) -> str:
    """Hash: ``crc``, the latest version's weights checksum, and ``frame``, its
    global without the weights, for joiners that hold them."""
    return f"ddiloco:{run_id}:weightless:{fragment}"


def to_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = to_str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def read_block_ms(deadline: float, max_block_s: float) -> int | None:
    """BLOCK argument that returns by ``deadline``; None: read without blocking
    (BLOCK 0 would wait forever)."""
    block_s = min(deadline - time.monotonic() - _REDIS_TICK_S, max_block_s)
    return int(block_s * 1000) if block_s >= 0.001 else None


def sleep_tail(deadline: float) -> None:
    """After a non-blocking read found nothing: wait a little, client side."""
    time.sleep(min(max(0.0, deadline - time.monotonic()), _TAIL_POLL_S))


def entries_within(max_bytes: int, entry_bytes: int, most: int) -> int:
    """A stream's MAXLEN that holds its entries of about ``entry_bytes`` to
    ``max_bytes``: at most ``most`` entries and at least one."""
    return max(1, min(most, max_bytes // max(1, entry_bytes)))


def is_transient(error: Exception) -> bool:
    return isinstance(error, _TRANSIENT_ERRORS) or (
        isinstance(error, redis.ResponseError) and str(error).startswith("MISCONF")
    )


def connect(
    url: str,
    socket_timeout_s: float,
    keys: RunKeys | None = None,
    user: tuple[str, str] | None = None,
) -> redis.Redis:
    """A client for ``url``, as ``user`` (name, password) when given. With the
    run's keys, a ``rediss://`` server must hold a certificate of the run's CA
    for the host dialled; a plain ``redis://`` URL to another host is said to
    be in the clear."""
    parts = urlsplit(url)
    options: dict[str, Any] = {}
    if user is not None:
        options["username"], options["password"] = user
    if keys is not None and parts.scheme == "rediss":
        options |= {"ssl_ca_certs": str(keys.tls_ca()), "ssl_cert_reqs": "required",
               "ssl_check_hostname": True}  # fmt: skip
    elif keys is not None and parts.scheme == "redis" and not _loopback(parts.hostname):
        log.warning(
            "%s: redis in the clear, readable on the way; use rediss:// (the run's keys "
            "hold its CA)", parts.hostname,
        )  # fmt: skip
    # One immediate retry replaces a pooled connection that a server restart
    # broke; longer outages are the caller's backoff loop's business.
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=False,
        **options,
    )


def _loopback(host: str | None) -> bool:
    if host in (None, "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Reconnect:
    """Exponential backoff (with jitter) between attempts after transient errors."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._backoff = EqualJitterBackoff(cap=_BACKOFF_CAP_S, base=_BACKOFF_BASE_S)
        self.failures = 0
        self._retry_at = 0.0

    def wait_s(self) -> float:
        """Seconds until the next attempt may go out (0 when it may go now)."""
        return max(0.0, self._retry_at - time.monotonic())

    def failed(self, error: Exception) -> None:
        self.failures += 1
        delay_s = self._backoff.compute(self.failures)
        self._retry_at = time.monotonic() + delay_s
        if self.failures == 1 and isinstance(error, redis.exceptions.OutOfMemoryError):
            log.error(
                "%s: redis is out of memory (its maxmemory, nothing evicted): nothing is "
                "dropped, everything waits queued here while it retries with backoff; "
                "raise redis's maxmemory, or see why the syncer does not keep up (%s)",
                self._what,
                error,
            )
        elif self.failures == 1 and isinstance(error, _REFUSED):
            log.info("%s: not admitted by redis yet (%s); retrying", self._what, error)
        elif self.failures == 1:
            log.warning("%s: redis unavailable (%s); retrying with backoff", self._what, error)
        else:
            log.debug(
                "%s: attempt %d failed (%s); next in %.2fs",
                self._what,
                self.failures,
                error,
                delay_s,
            )

    def succeeded(self) -> None:
        if self.failures:
            log.info(
                "%s: redis reachable again after %d failed attempts", self._what, self.failures
            )
        self.failures = 0
        self._retry_at = 0.0


class RedisLink:
    """One redis client, the backoff after its transient errors, and their count
    (``errors``). ``on_failure`` runs after each transient error, with it: for
    state that a reply lost on the way may have made stale, or to enroll again."""

    def __init__(
        self,
        client: redis.Redis,
        what: str,
        on_failure: Callable[[Exception], None] | None = None,
        stats: TransportStats | None = None,
    ) -> None:
        self.client = client
        self.reconnect = Reconnect(what)
        self.errors = 0
        self._on_failure = on_failure
        self._stats = stats  # counts out-of-memory replies

    def backing_off(self) -> bool:
        """Whether the next request must wait for the backoff."""
        return self.reconnect.wait_s() > 0

    def failed(self, error: Exception) -> None:
        self.errors += 1
        if self._stats is not None and isinstance(error, redis.exceptions.OutOfMemoryError):
            self._stats.out_of_memory += 1
        if self._on_failure is not None:
            self._on_failure(error)
        self.reconnect.failed(error)

    def succeeded(self) -> None:
        self.reconnect.succeeded()

    def attempt(self, action: Callable[[], object]) -> bool:
        """Run ``action`` unless we are backing off from redis; True if it ran.
        A transient error starts (or extends) the backoff instead of escaping."""
        if self.backing_off():
            return False
        try:
            action()
        except Exception as e:
            if not is_transient(e):
                raise
            self.failed(e)
            return False
        self.succeeded()
        return True

    def retry(
        self,
        deadline: float,
        attempt: Callable[[float], list[T]],
        *,
        before: Callable[[], None] | None = None,
        on_error: Callable[[Exception], bool] | None = None,
    ) -> list[T]:
        """:func:`retry_until` on this link."""
        return retry_until(
            self.reconnect, deadline, attempt, self.failed, before=before, on_error=on_error
        )

    def call_within(self, timeout_s: float, action: Callable[[], T], what: str) -> T:
        """``action()``, tried again after transient errors (with backoff) until it
        answers; raises :class:`TransportError` ("no {what} within ...") when the
        last try that failed ended after ``timeout_s``."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            time.sleep(min(max(0.0, deadline - time.monotonic()), self.reconnect.wait_s()))
            try:
                answer = action()
            except Exception as e:
                if not is_transient(e):
                    raise
                self.failed(e)
                if time.monotonic() >= deadline:
                    raise TransportError(f"no {what} within {timeout_s}s: {e}") from e
                continue
            self.succeeded()
            return answer

    def close(self) -> None:
        self.client.close()


def retry_until(
    reconnect: Reconnect,
    deadline: float,
    attempt: Callable[[float], list[T]],
    failed: Callable[[Exception], None],
    *,
    before: Callable[[], None] | None = None,
    on_error: Callable[[Exception], bool] | None = None,
) -> list[T]:
    """Call ``attempt(deadline)`` whenever ``reconnect`` allows until it finds
    something or ``deadline`` passes; what it found, or [] at the deadline.

    A transient error goes to ``failed`` (which must record it with
    ``reconnect.failed``), and the next attempt waits for the backoff. Any
    error goes to ``on_error`` first: True means it handled it, and the loop
    goes on without recording a failure or a success. Other errors propagate.
    ``before`` runs ahead of each attempt the backoff allows; it handles its own
    errors, and when it started a backoff the attempt waits for that too.
    """
    while True:
        if before is not None and not reconnect.wait_s():
            before()
        if not reconnect.wait_s():
            try:
                found = attempt(deadline)
            except Exception as e:
                if on_error is not None and on_error(e):
                    pass
                elif is_transient(e):
                    failed(e)
                else:
                    raise
            else:
                reconnect.succeeded()
                if found or time.monotonic() >= deadline:
                    return found
                # A read came back empty before the deadline: read again at once.
                continue
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return []
        time.sleep(min(remaining_s, reconnect.wait_s()))


class ReadScript:
    """A Lua script that only reads, run with EVALSHA_RO: a member may run it on
    keys it may read but not write. Loaded on first use (or again after a Redis
    restart) where the client may load scripts; a member's syncer loads them."""

    def __init__(self, client: redis.Redis, text: str) -> None:
        self._client = client
        self._text = text
        self._sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, keys: list[str], args: list[str]) -> Any:
        try:
            return self._client.evalsha_ro(self._sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self._client.script_load(self._text)  # NOPERM for a member: retried later
            return self._client.evalsha_ro(self._sha, len(keys), *keys, *args)


def check_frame(frame: Any, max_message_bytes: int, stats: TransportStats) -> Message | None:
    """Decode one stream/hash value, or count why it is rejected and return None."""
    if not isinstance(frame, bytes):
        stats.rejected["bad_entry"] += 1
        return None
    stats.bytes_received += len(frame)
    if len(frame) > max_message_bytes:
        stats.rejected["too_large"] += 1
        return None
    try:
        return decode(frame, max_payload_bytes=max_message_bytes)
    except WireError as e:
        stats.rejected[e.reason] += 1
        return None


def check_entry(
    fields: dict[bytes, bytes], max_message_bytes: int, stats: TransportStats
) -> Message | None:
    """Decode a stream entry (a frame in ``m``, or its parts in ``h``, ``p``,
    ``c``), or count why it is rejected and return None."""
    if fields.keys() != set(PART_FIELDS):
        frame = fields.get(FIELD) if len(fields) == 1 else None
        return check_frame(frame, max_message_bytes, stats)
    start, payload, crc = (fields[name] for name in PART_FIELDS)
    if not all(isinstance(part, bytes) for part in (start, payload, crc)):
        stats.rejected["bad_entry"] += 1
        return None
    size = len(start) + len(payload) + len(crc)
    stats.bytes_received += size
    if size > max_message_bytes:
        stats.rejected["too_large"] += 1
        return None
    try:
        return decode_parts(start, payload, crc, max_payload_bytes=max_message_bytes)
    except WireError as e:
        stats.rejected[e.reason] += 1
        return None


def encode_parts_bounded(msg: Message, max_message_bytes: int) -> tuple[bytes, bytes, bytes]:
    parts = encode_parts(msg, max_payload_bytes=max_message_bytes)
    size = sum(len(part) for part in parts)
    if size > max_message_bytes:
        raise WireError("too_large", f"frame of {size} > {max_message_bytes} bytes")
    return parts


def encode_bounded(msg: Message, max_message_bytes: int) -> bytes:
    frame = encode(msg, max_payload_bytes=max_message_bytes)
    if len(frame) > max_message_bytes:
        raise WireError("too_large", f"frame of {len(frame)} > {max_message_bytes} bytes")
    return frame
