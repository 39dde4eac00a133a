"""The learner's communication thread: the only code that touches the transport.

The training loop never waits on the network. It hands deltas and heartbeats
to this thread through bounded queues and picks up arrived globals at step
boundaries. Encoding (quantisation, compression) happens here too, off the
training thread; with error feedback, what a codec dropped from one delta is
added to the next delta of the same fragment instead of being lost. Globals are
validated here too, before the transport records their version: a malformed
global can neither reach the weights nor hide the real ones that follow.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from broker.errors import ConfigError
from broker.transport import Backpressure, LearnerTransport, candidate_order
from broker.wire.codecs import Codec
from broker.wire.messages import Delta, GlobalFragment, Heartbeat
from learner.fragment_sync import Stamp
from learner.join import STALE

log = logging.getLogger(__name__)

# A validated global: (fragment, (epoch, version), flat fp32 weights).
Decoded = tuple[int, Stamp, torch.Tensor]


@dataclass
class OutgoingDelta:
    """What the training thread hands over: the raw fp32 delta and its metadata."""

    delta: torch.Tensor
    meta: Delta  # every field but codec, numel and payload


class DeltaEncoder:
    """Encodes deltas with a codec; with error feedback, what the codec dropped from
    one delta of a fragment is added to the next delta of that fragment, so
    quantisation error is delayed, never lost."""

    def __init__(self, codec: Codec, error_feedback: bool) -> None:
        self.codec = codec
        self.error_feedback = error_feedback and codec.quant != "fp32"
        self._residual: dict[int, torch.Tensor] = {}

    def encode(self, item: OutgoingDelta) -> Delta:
        p = item.meta.fragment
        delta = item.delta
        if self.error_feedback and p in self._residual:
            delta = delta + self._residual[p]
        payload = self.codec.encode(delta)
        if self.error_feedback:
            self._residual[p] = delta - self.codec.decode(payload, delta.numel())
        return replace(item.meta, codec=self.codec, numel=delta.numel(), payload=payload)


class CommThread(threading.Thread):
    """``check`` validates a global against the learner's plan: the decoded global,
    or why it is refused. ``max_queued_bytes`` bounds the raw deltas waiting to be
    encoded and the encoded ones waiting for transport room, together."""

    def __init__(
        self,
        transport: LearnerTransport,
        encoder: DeltaEncoder,
        check: Callable[[GlobalFragment], Decoded | str],
        max_queued_bytes: int,
    ) -> None:
        super().__init__(name="ddiloco-comm", daemon=True)
        if max_queued_bytes < 1:  # computed by the caller, never a user's value: a bug
            raise ConfigError(f"max_queued_bytes must be >= 1, got {max_queued_bytes}")
        self.transport = transport
        self.encoder = encoder
        self.check = check
        self.max_queued_bytes = max_queued_bytes
        self._outbox: queue.Queue[OutgoingDelta] = queue.Queue()
        self._backlog: deque[Delta] = deque()  # encoded, waiting for transport room
        self._queued_bytes = 0  # raw bytes of what is in the outbox and the backlog
        self._heartbeat: Heartbeat | None = None
        self._lock = threading.Lock()
        self._arrived: dict[int, Decoded] = {}
        # Fragments whose next global is taken whatever its version (the syncer
        # refused a delta of theirs), and those of them that arrived.
        self._force_next: set[int] = set()
        self._forced: set[int] = set()
        self._stopping = threading.Event()
        self._polls = 0  # polls handled so far, counted under _polled
        self._polled = threading.Condition()
        self.dropped = 0
        self.globals_rejected: Counter[str] = Counter()
        self._encoding = 0
        self.error: BaseException | None = None

    # -- called from the training thread -----------------------------------
    def send_delta(self, item: OutgoingDelta) -> None:
        size = _raw_bytes(item.delta)
        with self._lock:
            full = self._queued_bytes + size > self.max_queued_bytes
            if not full:
                self._queued_bytes += size
        if full:
            # The network is far behind; dropping the new delta is better than
            # stalling training or growing without bound. Its fragment's next
            # delta is measured from the same base, so it carries this progress.
            self.dropped += 1
            log.warning("outbox full: dropped delta of fragment %d", item.meta.fragment)
            return
        self._outbox.put_nowait(item)

    def heartbeat(self, hb: Heartbeat) -> None:
        with self._lock:
            self._heartbeat = hb

    def take_globals(self) -> tuple[list[Decoded], set[int]]:
        """The globals that arrived (the newest valid one per fragment), and the
        fragments among them to apply whatever their version."""
        with self._lock:
            arrived = sorted(self._arrived.values(), key=lambda g: g[0])
            forced, self._forced = self._forced, set()
            self._arrived.clear()
        return arrived, forced

    def wait_for_arrivals(self, timeout_s: float) -> None:
        """Return once what arrived before this call has been decoded and is ready
        for :meth:`take_globals` (or after ``timeout_s``). A learner's first step
        waits so: what arrived while it was busy starting (building, joining,
        collecting its heap) is applied before its first delta is measured from
        an old base, which the syncer would refuse as stale."""
        with self._polled:
            # The poll under way may have begun before this call: wait for the next.
            target = self._polls + 2
            self._polled.wait_for(lambda: self._polls >= target or not self.is_alive(), timeout_s)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    @property
    def pending(self) -> int:
        # _encoding covers the moment a delta is neither queued nor handed over.
        return self._outbox.qsize() + self._encoding + len(self._backlog) + self.transport.unacked

    def stop(self, flush_timeout_s: float) -> bool:
        """Deliver what is queued (up to the timeout), then stop. True if all was delivered."""
        deadline = time.monotonic() + flush_timeout_s
        while self.pending and time.monotonic() < deadline and self.is_alive():
            time.sleep(0.02)
        delivered = self.pending == 0
        self._stopping.set()
        self.join(timeout=5)
        return delivered

    # -- the thread ----------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._pump()
        except BaseException as e:  # surfaced to the training loop
            self.error = e
            log.exception("comm thread failed")

    def _pump(self) -> None:
        while True:
            self._encoding = 1  # set before taking, so pending never reads 0 in between
            try:
                self._backlog.append(self.encoder.encode(self._outbox.get_nowait()))
            except queue.Empty:
                break
            finally:
                self._encoding = 0
        while self._backlog:
            try:
                self.transport.send_delta(self._backlog[0])
            except Backpressure:
                break
            sent = self._backlog.popleft()
            with self._lock:
                self._queued_bytes -= 4 * sent.numel
        with self._lock:
            hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            self.transport.send_heartbeat(hb)
        arrived = self.transport.poll(0.01)
        self._force_next |= self.transport.refused_fragments()
        # Whole weights in this batch (a snapshot) supersede every change up to
        # their version: those are skipped, and the weights go first, so a change
        # that arrived beside a newer snapshot never asks for another one.
        newest: dict[int, tuple[int, int]] = {}
        for g in arrived:
            if not g.is_change:
                newest[g.fragment] = max(
                    newest.get(g.fragment, (g.epoch, -1)), (g.epoch, g.version)
                )
        for g in sorted(arrived, key=lambda g: (*candidate_order(g), g.is_change)):
            if g.is_change and g.fragment in newest and (g.epoch, g.version) <= newest[g.fragment]:
                continue
            decoded = self.check(g)
            if decoded == STALE:
                continue
            if isinstance(decoded, str):
                self.globals_rejected[decoded] += 1
                log.warning("refused global %d v%d: %s", g.fragment, g.version, decoded)
                continue
            self.transport.accepted(g)
            with self._lock:
                self._arrived[g.fragment] = decoded
                if g.fragment in self._force_next:
                    self._force_next.discard(g.fragment)
                    self._forced.add(g.fragment)
        with self._polled:
            self._polls += 1
            self._polled.notify_all()


def _raw_bytes(delta: torch.Tensor) -> int:
    return 4 * delta.numel()  # flat fp32, as the training thread hands it over
