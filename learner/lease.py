"""A learner slot for a learner that does not name itself (``--learner-id auto``).

Containers of one scaled service are alike: none knows which learner it is.
Each asks the broker for a slot, the lowest one nobody holds, and becomes
``learner-<slot>`` training data shard ``slot mod num_shards``. The lease is
held under the container's host name (its id, under docker compose and
swarm), which survives a restart of the container, so a restarted learner
gets its slot back and resumes its own progress; one that is gone for longer
than the lease lets a newcomer take its slot. The same mechanism serves both
transports (:meth:`broker.transport.LearnerTransport.lease`): Redis holds the
leases, or the first ZeroMQ syncer does.

A :class:`SlotLease` renews the lease from a thread with its own connection,
so the learner's comm thread never waits on it. Should the slot ever be lost
(the learner was cut off for longer than the lease and another took the slot),
``on_lost`` runs: the CLI learner then stops, and its restart takes a free slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from broker.connect import connect_learner
from broker.errors import TransportError
from broker.identity.keys import Identity
from broker.run.settings import GONE_AFTER_HEARTBEATS, RunSettings
from broker.transport import LearnerTransport
from broker.transport import learner_id_of as learner_id_of

log = logging.getLogger(__name__)

AUTO_ID = "auto"  # the learner id that asks for a slot


def shard_of(slot: int, num_shards: int) -> int:
    """Slots beyond the number of shards share shards, round robin."""
    return slot % num_shards


class SlotLease:
    """Take a slot for ``holder`` and keep it renewed until :meth:`close`."""

    def __init__(
        self,
        run: RunSettings,
        holder: str,
        identity: Identity | None,
        on_lost: Callable[[], None],
        ttl_s: float | None = None,
    ) -> None:
        self.holder = holder
        self.ttl_s = ttl_s if ttl_s is not None else run.gone_after_s
        self.on_lost = on_lost
        self.slot = -1
        self.renewals = 0
        self.failed_renewals = 0
        self._transport: LearnerTransport = connect_learner(
            run.url,
            run_id=run.run_id,
            learner_id=holder,
            incarnation=time.time_ns(),
            num_fragments=run.fragments,
            syncer_shards=run.syncer_shards,
            keys=run.run_keys("learner"),
            identity=identity,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for a slot (the broker may not be up yet), then
        start renewing it; :class:`TransportError` when none came."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                self.slot = self._transport.lease(
                    self.holder, self.ttl_s, timeout_s=max(0.1, min(5.0, remaining))
                )
                break
            except TransportError as e:
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"no learner slot within {timeout_s}s: is the broker up? ({e})"
                    ) from e
                log.info("waiting for a learner slot: %s", e)
        log.info("holder %s holds learner slot %d", self.holder, self.slot)
        self._thread = threading.Thread(target=self._renew, name="ddiloco-lease", daemon=True)
        self._thread.start()
        return self.slot

    def _renew(self) -> None:
        interval_s = self.ttl_s / GONE_AFTER_HEARTBEATS
        while not self._stop.wait(interval_s):
            try:
                slot = self._transport.lease(
                    self.holder, self.ttl_s, timeout_s=interval_s, held_slot=self.slot
                )
            except TransportError as e:
                # The broker is away: keep training; the lease holds for a while,
                # and nobody new can take the slot while the broker is down.
                self.failed_renewals += 1
                log.warning("could not renew learner slot %d: %s", self.slot, e)
                continue
            self.renewals += 1
            if slot != self.slot:
                log.error(
                    "learner slot %d was lost (its lease ran out and another learner took "
                    "it); %s now holds slot %d: stopping",
                    self.slot,
                    self.holder,
                    slot,
                )
                self._stop.set()
                self.on_lost()
                return

    def close(self) -> None:
        """Stop renewing (the lease runs out by itself) and close the connection."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._transport.close()
