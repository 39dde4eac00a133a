"""A syncer's trimming of the delta streams on Redis (docs/transports.md):
:class:`DeltaTrimmer` trims the streams below what any group still needs and
reports the entries the learners' stream bound dropped unread
(:data:`~broker.redis.scripts.BOUNDED_XADD`). It raises redis's errors: the
transport (:mod:`broker.redis.syncer`) retries.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from broker.redis.frames import parse_id, to_str
from broker.redis.names import trimmed_key
from broker.transport import TransportStats

log = logging.getLogger(__name__)

_TRIM_INTERVAL_S = 1.0


class DeltaTrimmer:
    """Trims the delta streams acked into, and takes the counts of entries the
    learners' stream bound dropped unread (``BOUNDED_XADD``)."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        consumer: str,
        group: str,
        streams: dict[str, tuple[int, str]],
        stats: TransportStats,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._consumer = consumer
        self._group = group
        self._streams = streams  # the reader's: stream -> (fragment, learner id)
        self._stats = stats
        self._waiting: set[str] = set()
        self._next_trim_at: dict[str, float] = {}
        self._next_trimmed_check_at = 0.0

    def acked_in(self, streams: set[str]) -> None:
        """Entries of ``streams`` were acked: trim them when next due."""
        self._waiting.update(streams)

    def trim_due(self) -> None:
        """XTRIM MINID each acked-into stream (at most every second) below every
        entry that some group still has pending or has not delivered yet."""
        now = time.monotonic()
        due = [s for s in self._waiting if now >= self._next_trim_at.get(s, 0.0)]
        if not due:
            return
        # One atomic view of the groups: an entry below the bound is delivered
        # and acked by every group, and nothing can make it pending again.
        pipe = self._client.pipeline(transaction=True)
        for stream in due:
            pipe.xinfo_groups(stream)
            pipe.xpending(stream, self._group)
        replies = pipe.execute(raise_on_error=False)
        trims = self._client.pipeline(transaction=False)
        for i, stream in enumerate(due):
            groups, pending = replies[2 * i], replies[2 * i + 1]
            if isinstance(groups, Exception) or isinstance(pending, Exception):
                # The stream or group vanished; the next read recreates them.
                log.warning(
                    "syncer %s: %s not trimmed (its stream or group is gone; the next read "
                    "makes them again, and the next ack into it trims it): %s / %s",
                    self._consumer, stream, groups, pending,
                )  # fmt: skip
                continue
            bound = self._trim_bound(groups, pending)
            if bound is not None:
                trims.xtrim(stream, minid=bound, approximate=False)
        trims.execute()
        for stream in due:
            self._waiting.discard(stream)
            self._next_trim_at[stream] = now + _TRIM_INTERVAL_S

    def _trim_bound(self, groups: list[dict[str, Any]], pending: dict[str, Any]) -> str | None:
        bounds: list[tuple[int, int]] = []
        for g in groups:
            ms, seq = parse_id(g["last-delivered-id"])
            bounds.append((ms, seq + 1))  # everything after the last delivered id is unread
            if to_str(g["name"]) != self._group and g["pending"]:
                return None  # another group's pending entries are unknown to us: keep all
        if pending["pending"]:
            bounds.append(parse_id(pending["min"]))
        if not bounds:
            return None
        ms, seq = min(bounds)
        return f"{ms}-{seq}"

    def count_trimmed_unread(self) -> None:
        """Take (GETDEL) the counts of delta entries the learners' stream bound
        dropped unread (see ``BOUNDED_XADD``), at most every second: each loss is
        reported once, also when it happened while no syncer ran."""
        now = time.monotonic()
        if now < self._next_trimmed_check_at:
            return
        self._next_trimmed_check_at = now + _TRIM_INTERVAL_S
        owners = list(self._streams.values())
        if not owners:
            return
        pipe = self._client.pipeline(transaction=False)
        for p, learner in owners:
            pipe.getdel(trimmed_key(self._run_id, p, learner))
        for (p, learner), raw in zip(owners, pipe.execute(), strict=True):
            try:
                lost = int(raw or 0)
            except ValueError:  # not a count: a learner wrote it (its own key)
                log.warning(
                    "syncer %s: %s holds %.40r, not a count of deltas dropped unread (its "
                    "learner wrote it): taken and not counted",
                    self._consumer, trimmed_key(self._run_id, p, learner), raw,
                )  # fmt: skip
                lost = 0
            if lost > 0:
                self._stats.rejected["trimmed_unread"] += lost
                log.error(
                    "syncer %s: %d deltas of learner %s, fragment %d were dropped unread at "
                    "the delta stream's bound (no syncer kept up); raise delta_stream_maxlen",
                    self._consumer,
                    lost,
                    learner,
                    p,
                )
