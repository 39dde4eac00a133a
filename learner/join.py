"""Joining a run: fetch every fragment of the current global model, checked
against this learner's plan before anything is applied."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import replace

import torch

from broker.errors import ConfigError, TransportError
from broker.fragments import FragmentPlan
from broker.transport import LearnerTransport
from broker.wire.codecs import apply_change
from broker.wire.messages import GlobalFragment, WireError, weights_checksum
from learner.fragment_sync import Stamp

NO_BASE = "no_base"  # a change from a version this learner does not hold
DIVERGED = "diverged"  # what it decodes to is not the version the syncer names
STALE = "stale"  # a change to a version no newer than the one held


class GlobalDecoder:
    """Globals checked against this learner's plan and decoded to weights.

    Keeps the weights of the version of each fragment it last decoded: a global
    that is a change (:attr:`broker.wire.messages.GlobalFragment.is_change`) is added to
    them (:func:`broker.wire.codecs.apply_change`, the syncer's own rule, so the
    result is bit for bit the syncer's version). A change from any other
    version is refused as ``no_base``, and a global whose weights do not match
    the checksum it names as ``diverged``; either way the fragment's snapshot
    is fetched. A change to a version no newer than the one held is ``stale``
    (a snapshot overtook it) and fetches nothing.
    Callers hand every global they take to :meth:`decode`, in arrival order, and
    mark it accepted on the transport once decoded.

    What it holds answers a syncer that lost its checkpoint (:meth:`held`):
    the version's weights, and the change that made it where it came as one
    (kept encoded: a quarter byte per parameter with the default int2 globals),
    from which the syncer estimates its momentum.
    """

    def __init__(self, plan: FragmentPlan, transport: LearnerTransport | None = None) -> None:
        self.plan = plan
        self.transport = transport
        # Per fragment: the version last decoded, its weights, and its global
        # (a change whole; otherwise without the payload: its signatures and
        # the syncer state it names).
        self._held: dict[int, tuple[Stamp, torch.Tensor, GlobalFragment]] = {}
        if transport is not None:
            transport.answer_recalls(self.held)

    def held(self, fragment: int, weights: bool) -> list[GlobalFragment]:
        """The version of ``fragment`` held, in its held form
        (:meth:`GlobalFragment.held_form`): without its weights (a claim), or
        with them, then preceded by the change that made it if it came as one;
        empty if none is held."""
        held = self._held.get(fragment)
        if held is None:
            return []
        _, flat, g = held
        if not weights:
            return [g.without_weights()]
        return [g, g.held_form(flat)] if g.is_change else [g.held_form(flat)]

    def decode(self, g: GlobalFragment) -> tuple[int, Stamp, torch.Tensor] | str:
        """(fragment, (epoch, version), weights) of a global that fits the plan, else why not."""
        plan = self.plan
        if g.plan_hash != plan.plan_hash:
            return "wrong_plan"
        if g.fragment >= plan.num_fragments or g.numel != plan.fragment_numel(g.fragment):
            return "bad_shape"
        held = self._held.get(g.fragment)
        if g.is_change and held is not None and held[0][0] == g.epoch and g.version <= held[0][1]:
            # Overtaken: a snapshot (on its own connection) brought a newer version
            # first. Nothing is missing, so nothing to fetch.
            return STALE
        if g.is_change and (held is None or held[0] != (g.epoch, g.change_from)):
            if self.transport is not None:
                self.transport.resync(g.fragment)
            return NO_BASE
        try:
            flat = g.tensor()
        except WireError as e:
            return e.reason
        if held is not None and g.is_change:
            flat = apply_change(held[1], flat)
        if not torch.isfinite(flat).all():
            return "non_finite"
        if weights_checksum(flat) != g.weights_crc:
            # Not the version the syncer made: never build on it.
            if self.transport is not None:
                self.transport.resync(g.fragment)
            return DIVERGED
        kept = g if g.is_change else replace(g, payload=b"")
        self._held[g.fragment] = ((g.epoch, g.version), flat, kept)
        return g.fragment, (g.epoch, g.version), flat


def join_snapshot(
    transport: LearnerTransport,
    decoder: GlobalDecoder,
    timeout_s: float,
    held: Mapping[int, torch.Tensor] | None = None,
) -> list[tuple[int, Stamp, torch.Tensor]]:
    """Every fragment of the current global model, for joining or rejoining.
    ``held``: the joiner's own weights by fragment; those that are already the
    current version need not come over the network (see ``LearnerTransport.snapshot``)."""
    plan = decoder.plan
    deadline = time.monotonic() + timeout_s
    wanted = list(range(plan.num_fragments))
    got: dict[int, GlobalFragment] = {}
    while len(got) < len(wanted):
        if time.monotonic() > deadline:
            raise TransportError(
                f"no snapshot of fragments {sorted(set(wanted) - got.keys())} within "
                f"{timeout_s}s: is the syncer running and reachable?"
            )
        # A broker that does not answer yet (starting, restarting): ask again. One
        # call waits for the whole join (the transport retries with backoff): a
        # new call would ask at once for what may still be on a slow link.
        with contextlib.suppress(TransportError):
            remaining_s = max(0.1, deadline - time.monotonic())
            got.update(transport.snapshot([p for p in wanted if p not in got], remaining_s, held))
        if len(got) < len(wanted):
            time.sleep(0.2)  # the syncer has not published those fragments yet
    arrived = []
    for g in got.values():
        if g.plan_hash != plan.plan_hash:
            raise ConfigError(
                f"the syncer's model plan {g.plan_hash} differs from this learner's "
                f"{plan.plan_hash}: use the same model, --fragments and --sync-every "
                "as `ddiloco init`"
            )
        decoded = decoder.decode(g)
        if isinstance(decoded, str):
            raise TransportError(
                f"the syncer's snapshot of fragment {g.fragment} is bad: {decoded}"
            )
        transport.accepted(g)
        arrived.append(decoded)
    return arrived
