"""A syncer's shard index, leased from Redis (``--shard auto``).

The replicas of a scaled syncer service are alike: none knows which shard it
is. Each takes the lowest shard index nobody holds, as a key with a time to
live (:func:`~broker.redis_common.shard_key`), under its host name and
process id. In a container that is the container's id and 1, which survive a
restart of the container, so a restarted syncer gets its own shard back at
once, with its checkpoint folder and its consumer's pending deltas; anywhere
else, a restarted syncer takes a shard once its old lease ran out. A replica
that finds every index held waits as a standby and takes the first one that
frees.

A thread renews the lease with its own connection, so a long round never
lets it run out. Should it ever be lost (Redis out of reach for longer than
the lease, or another holder took the index), :attr:`ShardLease.lost` is set
and the syncer stops at once: two syncers serving one fragment would publish
two lineages of it.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from broker.errors import TransportError
from broker.redis_common import is_transient, shard_key, to_str

log = logging.getLogger(__name__)

# Take index KEYS[1] for holder ARGV[1] for ARGV[2] ms when nobody else holds
# it: 1 if held now (taken or renewed), 0 if another holder has it.
_TAKE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class ShardLease:
    """Take a shard index for ``holder`` and keep it renewed until :meth:`close`."""

    def __init__(
        self, client: redis.Redis, run_id: str, shards: int, holder: str, ttl_s: float
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._client = client
        self._run_id = run_id
        self.shards = shards
        self.holder = holder
        self.ttl_s = ttl_s
        self.shard = -1
        self.lost = threading.Event()
        self._take = client.register_script(_TAKE)
        self._release = client.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _try(self, shard: int) -> bool:
        key = shard_key(self._run_id, shard)
        return bool(self._take(keys=[key], args=[self.holder, int(self.ttl_s * 1000)]))

    def take(self, timeout_s: float | None = None) -> int:
        """The lowest free index (or the one this holder already has), waiting
        as a standby while all are held, up to ``timeout_s`` (None: for ever);
        then renewed from a thread."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        said = False
        while True:
            try:
                # Our own index first: after a restart it is still held by us.
                order = sorted(range(self.shards), key=lambda s: not self._holds(s))
                for s in order:
                    if self._try(s):
                        self.shard = s
                        self._thread = threading.Thread(
                            target=self._renew, name="ddiloco-shard-lease", daemon=True
                        )
                        self._thread.start()
                        return s
                if not said:
                    log.warning(
                        "all %d shard(s) of run %s are held by live syncers: %s waits as a "
                        "standby and takes the first that frees",
                        self.shards, self._run_id, self.holder,
                    )  # fmt: skip
                    said = True
            except redis.RedisError as e:
                if not is_transient(e):
                    raise TransportError(f"shard lease: {e}") from e
                log.warning("shard lease: redis is out of reach (%s); trying again", e)
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportError(
                    f"no free shard of {self.shards} within {timeout_s:.0f}s: every index is "
                    "held by a live syncer (start at most DDILOCO_SHARDS syncers)"
                )
            time.sleep(min(1.0, self.ttl_s / 4))

    def _holds(self, shard: int) -> bool:
        held = self._client.get(shard_key(self._run_id, shard))
        return held is not None and to_str(held) == self.holder

    def _renew(self) -> None:
        last_renewed = time.monotonic()
        while not self._stop.wait(self.ttl_s / 4):
            try:
                if not self._try(self.shard):
                    self._lose("another syncer holds it now")
                    return
                last_renewed = time.monotonic()
            except redis.RedisError as e:
                if not is_transient(e) or time.monotonic() - last_renewed > self.ttl_s:
                    # Out of reach longer than the lease: another may have it by now.
                    self._lose(f"not renewed for {time.monotonic() - last_renewed:.0f}s ({e})")
                    return

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
                log.debug("shard lease not released: %s", e)
        self._client.close()
