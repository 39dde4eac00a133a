"""A syncer's shard, leased from Redis, and the term that fences its writes.

Every Redis syncer serves its shard under a lease: a key with a time to live
(:func:`~broker.redis.names.shard_key`) naming its holder. With ``--shard
auto`` it takes the lowest index nobody holds, under its host name and
process id; in a container that is the container's id and 1, which survive a
restart of the container, so a restarted syncer gets its own shard back at
once, with its checkpoint folder and its consumer's pending deltas. With a
fixed index it takes that one, under its host name and checkpoint folder
(which its lock keeps to one live process per host). A syncer that finds its
shard held waits as a standby, taking nothing, and takes it once the lease
runs out: on any host, since a syncer without a checkpoint rebuilds from the
state Redis keeps (``syncer.recovery.rebuild_from_broker``).

Each new tenure of a shard's lease (a holder that did not hold it already)
adds one to the shard's term (:func:`~broker.redis.names.term_key`), which
never goes down. The holder's writes that publish or acknowledge run in a
transaction that watches the term (:class:`Fence`): once another syncer took
the shard, the old holder's writes are refused and counted, and it stops,
even when it wakes from a freeze (SIGSTOP, a VM paused) before it learns that
its lease ran out.

A thread renews the lease with its own connection, so a long round never
lets it run out. Before each write that leaves the process (a checkpoint, a
publish, an ack), the syncer calls :meth:`ShardLease.confirm`: it returns at
once while a renewal less than a lease ago said the shard is this holder's,
and otherwise asks the store first. A syncer that wakes from a freeze past its
lease so learns that another took its shard before it writes anything; over
ZeroMQ, where no store stands between a syncer and the learners, that is the
fence (with the term each global and ack carries, which learners check).
A holder whose lease ran out while nobody took the index (it was frozen, or
Redis was out of its reach) takes it back under the same term. Should it be
lost (another holder took the index, or held it meanwhile),
:attr:`ShardLease.lost` is set and the syncer stops at once.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.client import Pipeline

from broker.errors import ConfigError, Fenced, TransportError
from broker.redis.frames import to_str
from broker.redis.link import Failed, Outage, transient_call
from broker.redis.names import shard_key, term_key

log = logging.getLogger(__name__)

# Take index KEYS[1] (term KEYS[2]) for holder ARGV[1] for ARGV[2] ms when
# nobody else holds it; ARGV[3]: the term the holder holds it under (0: none
# yet). Returns the term it is held under now, or 0 if another holder has it.
# A new tenure gets a new term; a holder whose lease ran out while nobody took
# the index (frozen, or Redis out of its reach) keeps its term: no other
# syncer wrote under a later one.
_TAKE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
local term = tonumber(redis.call('GET', KEYS[2]) or '0')
if not holder and (ARGV[3] == '0' or term ~= tonumber(ARGV[3])) then
  term = redis.call('INCR', KEYS[2])
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return term
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Fence:
    """A shard's term as its holder took it: :meth:`transaction` opens a
    transaction that Redis runs only while the term is still that one."""

    def __init__(self, run_id: str, shard: int, term: int) -> None:
        self.key = term_key(run_id, shard)
        self.shard = shard
        self.term = term
        self.refused = 0  # writes refused because another syncer holds the shard

    def transaction(self, client: redis.Redis) -> Pipeline:
        """A MULTI pipeline that watches the term; raises :class:`Fenced` if the
        term moved on already. Run it with :meth:`execute`."""
        self._client = client  # to read the term again after a failed EXEC
        pipe = client.pipeline(transaction=True)
        try:
            pipe.watch(self.key)
            held = pipe.get(self.key)
        except redis.WatchError:
            # redis-py's word for a connection error (a timeout: Redis frozen)
            # while it watches: nothing is written yet, and it is retried.
            pipe.reset()
            raise redis.ConnectionError("connection lost while watching the term") from None
        if held is None or int(held) != self.term:
            pipe.reset()
            self._refuse(held)
        pipe.multi()
        return pipe

    def execute(self, pipe: Pipeline) -> list[object]:
        """Run ``pipe``; :class:`Fenced` if the term moved on meanwhile (nothing written)."""
        try:
            return list(pipe.execute())
        except redis.WatchError:
            # redis-py also raises WatchError when the connection drops during a
            # watched transaction (Redis restarting, frozen): only a term that
            # moved on is a refusal; else it is a connection error, retried.
            held = self._client.get(self.key)
            if held is not None and int(held) == self.term:
                raise redis.ConnectionError("connection lost during a fenced write") from None
            self._refuse(held)
            raise  # unreachable: _refuse raises

    def _refuse(self, held: bytes | str | None) -> None:
        self.refused += 1
        now = "none" if held is None else to_str(held)
        raise Fenced(
            f"shard {self.shard} is held under term {now}, not this syncer's {self.term}: "
            "another syncer took it over; this one writes nothing more"
        )


def transaction(client: redis.Redis, fence: Fence | None) -> Pipeline:
    """A MULTI pipeline, fenced when the syncer holds its shard under a term."""
    return fence.transaction(client) if fence is not None else client.pipeline(transaction=True)


def execute(pipe: Pipeline, fence: Fence | None) -> list[object]:
    """Run a pipeline of :func:`transaction`."""
    return fence.execute(pipe) if fence is not None else list(pipe.execute())


class ShardLease:
    """Take a shard index for ``holder`` and keep it renewed until :meth:`close`."""

    def __init__(
        self, client: redis.Redis, run_id: str, shards: int, holder: str, ttl_s: float
    ) -> None:
        if shards < 1:
            raise ConfigError(f"shards must be >= 1, got {shards}")
        if ttl_s <= 0:
            raise ConfigError(f"ttl_s must be > 0, got {ttl_s}")
        self._client = client
        self._run_id = run_id
        self.shards = shards
        self.holder = holder
        self.ttl_s = ttl_s
        self.shard = -1
        self.term = 0  # the tenure it is held under, once taken
        self.lost = threading.Event()
        self.refused = 0  # writes confirm() refused: another syncer holds the shard
        # monotonic time until which the last renewal vouches for the lease: it
        # was asked for at that time less ttl_s, so it ran out no earlier.
        self._confirmed_until = 0.0
        self._asking = threading.Lock()  # the renewing thread and confirm()
        self._take = client.register_script(_TAKE)
        self._release = client.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _try(self, shard: int) -> int:
        """The term ``shard`` is held under for this holder now, or 0 (another's)."""
        keys = [shard_key(self._run_id, shard), term_key(self._run_id, shard)]
        args: list[str | int] = [
            self.holder,
            int(self.ttl_s * 1000),
            self.term if shard == self.shard else 0,
        ]
        with self._asking:
            asked = time.monotonic()
            term = int(self._take(keys=keys, args=args))
            if term and (shard != self.shard or term == self.term):
                self._confirmed_until = asked + self.ttl_s
            return term

    def fence(self) -> Fence:
        """The fence of the shard taken, at its term."""
        return Fence(self._run_id, self.shard, self.term)

    def take(self, timeout_s: float | None = None, only: int | None = None) -> int:
        """The lowest free index (or the one this holder already has), or just
        ``only``, waiting as a standby while it is held (all are), up to
        ``timeout_s`` (None: for ever); then renewed from a thread."""
        if only is not None and not 0 <= only < self.shards:
            raise ConfigError(f"shard {only} of {self.shards}: use an index in [0, {self.shards})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        said = False
        while True:
            try:
                taken = transient_call(lambda: self._take_free(only))
            except redis.RedisError as e:
                raise TransportError(f"shard lease: {e}") from e
            if isinstance(taken, Failed):
                log.warning("shard lease: redis is out of reach (%s); trying again", taken.error)
            elif taken is not None:
                self._thread = threading.Thread(
                    target=self._renew, name="ddiloco-shard-lease", daemon=True
                )
                self._thread.start()
                return taken
            elif not said:
                log.warning(
                    "%s of run %s held by a live syncer: %s waits as a standby and takes "
                    "it once its lease runs out",
                    f"shard {only} is" if only is not None else f"all {self.shards} shards are",
                    self._run_id, self.holder,
                )  # fmt: skip
                said = True
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportError(
                    f"no free shard of {self.shards} within {timeout_s:.0f}s: every index is "
                    "held by a live syncer (start at most DDILOCO_SHARDS syncers)"
                )
            time.sleep(min(1.0, self.ttl_s / 4))

    def _take_free(self, only: int | None) -> int | None:
        """Take the lowest free index (our own first: after a restart it is still
        held by us), or just ``only``; the index taken, or None (all held)."""
        order = (
            [only]
            if only is not None
            else sorted(range(self.shards), key=lambda s: not self._holds(s))
        )
        for s in order:
            if term := self._try(s):
                self.shard, self.term = s, term
                return s
        return None

    def _holds(self, shard: int) -> bool:
        held = self._client.get(shard_key(self._run_id, shard))
        return held is not None and to_str(held) == self.holder

    def _renew(self) -> None:
        """Renew until closed. While Redis is out of reach nobody can take the
        index (the lease is Redis's), so the holder keeps trying: once back,
        its term says whether another syncer held the shard meanwhile."""
        outage = Outage(
            f"renewing the lease of shard {self.shard}",
            f"tried again every {self.ttl_s / 4:.1f}s (nobody else can take it meanwhile)",
        )
        while not self._stop.wait(self.ttl_s / 4):
            try:
                term = transient_call(lambda: self._try(self.shard))
            except redis.RedisError as e:
                self._lose(f"not renewed: {e}")
                return
            if isinstance(term, Failed):  # redis out of reach
                outage.failed(term.error)
                continue
            outage.ended()
            if self._lost_to(term):
                return

    def confirm(self) -> None:
        """Return once the shard is known to be this holder's now: at once while
        the last renewal vouches for it, else after asking the store (waiting
        while it is out of reach: nobody can take the shard meanwhile without
        it). Raises :class:`Fenced`, and counts a refused write, once another
        syncer holds or held the shard."""
        said = False
        while not self.lost.is_set():
            if time.monotonic() < self._confirmed_until:
                return
            try:
                term = transient_call(lambda: self._try(self.shard))
            except redis.RedisError as e:
                self._lose(f"not confirmed: {e}")
                break
            if isinstance(term, Failed):
                if not said:
                    log.warning(
                        "shard %d: its lease is not confirmed (%s): nothing is written "
                        "until it is", self.shard, term.error,
                    )  # fmt: skip
                    said = True
                time.sleep(min(1.0, self.ttl_s / 4))
            else:
                self._lost_to(term)
        self.refused += 1
        raise Fenced(
            f"shard {self.shard}'s lease is lost (term {self.term}): another syncer took "
            "it over; this one writes nothing more"
        )

    def _lost_to(self, term: int) -> bool:
        """Whether the store's answer ``term`` (0: another holds the index) says
        the shard is lost; if so, it is marked lost."""
        if term == self.term:
            return False
        self._lose(
            "another syncer holds it now"
            if not term
            else f"another syncer held it meanwhile (term {term})"
        )
        return True

    def _lose(self, why: str) -> None:
        log.error("lease of shard %d lost: %s", self.shard, why)
        self.lost.set()

    def close(self) -> None:
        """Stop renewing and free the index for a standby (unless lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.shard >= 0 and not self.lost.is_set():
            try:
                self._release(keys=[shard_key(self._run_id, self.shard)], args=[self.holder])
            except redis.RedisError as e:  # it runs out by itself
                log.warning(
                    "lease of shard %d not released (%s): a standby takes it once it runs "
                    "out, within %.1fs", self.shard, e, self.ttl_s,
                )  # fmt: skip
        self._client.close()
