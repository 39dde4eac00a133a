"""Joining a run: fetch every fragment of the current global model, checked
against this learner's plan before anything is applied."""

from __future__ import annotations

import contextlib
import time

import torch

from broker.fragments import FragmentPlan
from broker.transport import LearnerTransport, TransportError
from broker.wire import GlobalFragment, WireError
from learner.fragment_sync import Stamp


def decode_global(g: GlobalFragment, plan: FragmentPlan) -> tuple[int, Stamp, torch.Tensor] | str:
    """(fragment, (epoch, version), weights) of a global that fits ``plan``, else why not."""
    if g.plan_hash != plan.plan_hash:
        return "wrong_plan"
    if g.fragment >= plan.num_fragments or g.numel != plan.fragment_numel(g.fragment):
        return "bad_shape"
    try:
        flat = g.tensor()
    except WireError as e:
        return e.reason
    if not torch.isfinite(flat).all():
        return "non_finite"
    return g.fragment, (g.epoch, g.version), flat


def join_snapshot(
    transport: LearnerTransport, plan: FragmentPlan, timeout_s: float
) -> list[tuple[int, Stamp, torch.Tensor]]:
    """Every fragment of the current global model, for joining or rejoining."""
    deadline = time.monotonic() + timeout_s
    wanted = list(range(plan.num_fragments))
    got: dict[int, GlobalFragment] = {}
    while len(got) < len(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no snapshot of fragments {sorted(set(wanted) - got.keys())} within "
                f"{timeout_s}s: is the syncer running and reachable?"
            )
        # A broker that does not answer yet (starting, restarting): ask again.
        with contextlib.suppress(TransportError):
            got.update(transport.snapshot([p for p in wanted if p not in got], timeout_s=2.0))
        if len(got) < len(wanted):
            time.sleep(0.2)  # the syncer has not published those fragments yet
    arrived = []
    for g in got.values():
        if g.plan_hash != plan.plan_hash:
            raise ValueError(
                f"the syncer's model plan {g.plan_hash} differs from this learner's "
                f"{plan.plan_hash}: use the same model, --fragments and --sync-every "
                "as `ddiloco init`"
            )
        decoded = decode_global(g, plan)
        if isinstance(decoded, str):
            raise ValueError(f"the syncer's snapshot of fragment {g.fragment} is bad: {decoded}")
        transport.accepted(g)
        arrived.append(decoded)
    return arrived
