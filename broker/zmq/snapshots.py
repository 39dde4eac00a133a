"""A learner's globals: candidates held until the learner takes them, and a gap
turned into a snapshot request.

Globals are full fragment weights (or a change from the version before), so
PUB's drops are harmless as long as they are noticed: versions are
per-fragment sequence numbers, and a gap triggers a snapshot request for that
fragment over the DEALER, asked again with backoff until an answer comes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import zmq

from broker.fragments import owner_shard
from broker.transport import TransportStats, candidate_order
from broker.wire import messages as wire
from broker.wire.messages import GlobalFragment, SnapshotRequest
from broker.zmq.frames import UNSENT_RETRY_S

# Globals held per fragment between two polls. Most are changes, each from the
# version before it: all of a run of them are needed to follow the chain (a
# learner busy between two polls, e.g. joining, may find a dozen).
_CANDIDATES_PER_FRAGMENT = 64
RESYNC_FIRST_RETRY_S = 0.5  # then doubling: whole fragments must not pile up on a slow link
_RESYNC_MAX_RETRY_S = 8.0


class SnapshotRequests:
    """Snapshot requests to the fragments' owners, asked again with backoff until
    an answer comes: the syncer may drop a request (rate limit, full queue) and
    PUB may drop the newest version, after which no later message would reveal
    the gap."""

    def __init__(
        self,
        dealers: list[zmq.Socket[bytes]],
        run_id: str,
        learner_id: str,
        stats: TransportStats,
    ) -> None:
        self._dealers = dealers
        self._run_id = run_id
        self._learner_id = learner_id
        self._stats = stats
        # Fragments to resync: (when to ask again, the retry interval after that).
        self.awaiting: dict[int, tuple[float, float]] = {}
        # While snapshot() runs: the checksums of the weights the caller holds.
        self.held_crcs: dict[int, int] = {}

    def request(self, fragments: list[int]) -> bool:
        """Ask the owners of ``fragments`` for them; False if a request could not
        go out (its syncer is not connected, or its queue is full)."""
        sent = True
        by_owner: dict[int, list[int]] = defaultdict(list)
        for p in fragments:
            by_owner[owner_shard(p, len(self._dealers))].append(p)
        for owner, owned in by_owner.items():
            held = [self.held_crcs[p] for p in owned if p in self.held_crcs]
            req = SnapshotRequest(
                run_id=self._run_id,
                learner_id=self._learner_id,
                fragments=owned,
                held_crcs=held if len(held) == len(owned) else [],
            )
            frame = wire.encode(req)
            try:
                self._dealers[owner].send(frame, zmq.NOBLOCK)
            except zmq.Again:
                sent = False
                continue
            self._stats.bytes_sent += len(frame)
        return sent

    def resync(self, fragment: int) -> None:
        """Ask for the fragment's latest global until :meth:`answered`."""
        if fragment not in self.awaiting:
            self.awaiting[fragment] = (0.0, RESYNC_FIRST_RETRY_S)

    def answered(self, fragment: int) -> None:
        self.awaiting.pop(fragment, None)

    def retry_due(self) -> None:
        now = time.monotonic()
        for p, (due, retry_s) in list(self.awaiting.items()):
            if now < due:
                continue
            if self.request([p]):
                self.awaiting[p] = (now + retry_s, min(2 * retry_s, _RESYNC_MAX_RETRY_S))
            else:
                self.awaiting[p] = (now + UNSENT_RETRY_S, retry_s)


class Candidates:
    """Globals received and not yet handed to the learner, oldest first per
    fragment; a skipped version (a gap) asks ``resync`` for the latest."""

    def __init__(
        self,
        run_id: str,
        num_fragments: int,
        stats: TransportStats,
        versions: dict[int, tuple[int, int]],
        is_new: Callable[[GlobalFragment], bool],
        resync: Callable[[int], None],
    ) -> None:
        self._run_id = run_id
        self._num_fragments = num_fragments
        self._stats = stats
        self._versions = versions  # the accepted ones: the transport's, shared
        self._is_new = is_new
        self._resync = resync
        self.gaps = 0
        self._ready: dict[int, list[GlobalFragment]] = {}

    def _ours(self, g: GlobalFragment) -> bool:
        if g.run_id != self._run_id or g.fragment >= self._num_fragments:
            self._stats.rejected["wrong_run" if g.run_id != self._run_id else "bad_fragment"] += 1
            return False
        return True

    def offer(self, g: GlobalFragment) -> None:
        """A global with weights or a change, broadcast or answering a request."""
        if not self._ours(g) or not self._is_new(g):
            return
        known = self._versions.get(g.fragment)
        ready = self._ready.setdefault(g.fragment, [])
        if (
            known is not None
            and g.epoch == known[0]
            and g.version > 1 + max([known[1]] + [r.version for r in ready if r.epoch == g.epoch])
        ):
            # Missed at least one version (PUB dropped it, or we were away):
            # ask for the latest. Weights are offered too (a change the learner
            # cannot apply, it drops).
            self.gaps += 1
            self._resync(g.fragment)
        # A global of another epoch is a restarted syncer's new lineage: offered
        # as is, whatever its version (its versions start again at 0). Nothing is
        # recorded until the learner has validated it (accepted()); every
        # candidate is offered, so a bad one cannot hide a good one.
        ready.append(g)
        if len(ready) > _CANDIDATES_PER_FRAGMENT:
            # The changes kept no longer reach back to what the learner holds.
            del ready[:-_CANDIDATES_PER_FRAGMENT]
            self._resync(g.fragment)

    def announced(self, g: GlobalFragment) -> None:
        """A version announced without weights: fetch it unless it is held."""
        if self._ours(g) and self._is_new(g):
            self._resync(g.fragment)

    def take_all(self) -> list[GlobalFragment]:
        ready = sorted((g for queued in self._ready.values() for g in queued), key=candidate_order)
        self._ready.clear()
        return ready

    def take_weights(self, fragments: set[int]) -> dict[int, GlobalFragment]:
        """The newest candidate with weights of each of ``fragments`` that has one,
        for a joiner: a change (broadcast meanwhile) needs a base the joiner does
        not have yet. Later changes stay for :meth:`take_all`."""
        got: dict[int, GlobalFragment] = {}
        for p in fragments & self._ready.keys():
            whole = [g for g in self._ready[p] if not g.is_change]
            if whole:
                got[p] = max(whole, key=candidate_order)
                self._ready[p] = [
                    g for g in self._ready[p]
                    if g.is_change and candidate_order(g) > candidate_order(got[p])
                ]  # fmt: skip
        return got
