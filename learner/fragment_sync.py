"""A learner's per-fragment bookkeeping, with no I/O: pure over tensors and numbers.

For each fragment: the global it started from (``base`` and ``base_version``)
and the progress made since (``c_steps``, ``c_tokens``), which is what a delta
reports. Globals are applied at step boundaries only. A global that would
erase much progress not sent yet is flushed first (the syncer rebases it onto
the new version, so a round that closed without this learner loses nothing);
with ``keep_unsent`` the rest (the overlap steps since the last send) is kept
on top of the global, and the next delta carries it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from broker.fragments import FragmentPlan

Stamp = tuple[int, int]  # (syncer epoch, version) of a global


class FragmentSync:
    def __init__(
        self,
        plan: FragmentPlan,
        overlap: int,
        flush_before_overwrite: bool,
        keep_unsent: bool,
    ) -> None:
        self.plan = plan
        self.overlap = overlap
        self.flush_before_overwrite = flush_before_overwrite
        self.keep_unsent = keep_unsent
        # Per fragment: the weights up to which progress has been sent (the
        # base, if nothing was sent since), and the steps and tokens since.
        self.sent_point: dict[int, torch.Tensor] = {}
        self.unsent_steps = [0] * plan.num_fragments
        self.unsent_tokens = [0] * plan.num_fragments
        self.base: dict[int, torch.Tensor] = {}  # the global each fragment started from
        self.base_version: dict[int, int] = {}
        self.base_epoch: dict[int, int] = {}  # the syncer lineage base_version belongs to
        self.c_steps = [0] * plan.num_fragments
        self.c_tokens = [0] * plan.num_fragments
        self.last_sent_step: dict[int, int] = {}

    def trained(self, tokens: int) -> None:
        """One inner step on ``tokens`` tokens moved every fragment."""
        for p in range(self.plan.num_fragments):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens
            self.unsent_steps[p] += 1
            self.unsent_tokens[p] += tokens

    def has_progress(self, p: int) -> bool:
        return self.c_steps[p] > 0 and p in self.base

    def delta(self, p: int, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The pseudo-gradient Theta_p(base) - theta_p, flat fp32 on the CPU."""
        return self.base[p] - self.plan.flatten(params, p)

    def send(self, p: int, step: int, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The delta to send now; the progress in it counts as sent. None when the
        fragment's weights are not all finite (its training blew up): nothing
        is sent, and the caller puts it back on its base (:meth:`restore`)."""
        weights = self.plan.flatten(params, p)
        if not bool(torch.isfinite(weights).all()):
            return None
        self.last_sent_step[p] = step
        self.sent_point[p] = weights
        self.unsent_steps[p] = self.unsent_tokens[p] = 0
        return self.base[p] - weights

    def versions(self) -> list[int]:
        """Each fragment's base version (-1: none yet), for progress reports."""
        return [self.base_version.get(p, -1) for p in range(self.plan.num_fragments)]

    def is_newer(self, p: int, stamp: Stamp) -> bool:
        """Whether a global stamped (epoch, version) moves fragment ``p`` forward. A
        global of another epoch always does: the syncer started a new lineage
        (its versions restart at 0), and holding on to the old one would lock
        this learner out of the run."""
        epoch, version = stamp
        if p in self.base_epoch and epoch != self.base_epoch[p]:
            return True
        return version > self.base_version.get(p, -1)

    def must_flush(self, p: int, step: int) -> bool:
        """Whether applying a new global of ``p`` now would erase progress worth sending.

        Progress sent in the last ``2 * overlap`` steps is still on its way into
        a round; more than that, unsent, would be lost by the overwrite.
        """
        unsent = min(self.c_steps[p], step - self.last_sent_step.get(p, -(10**9)))
        return self.flush_before_overwrite and unsent > 2 * self.overlap

    def apply(
        self,
        p: int,
        stamp: Stamp,
        flat: torch.Tensor,
        params: Mapping[str, torch.Tensor],
        mix_alpha: float = 0.0,
    ) -> bool:
        """Overwrite (or mix into) the fragment's parameters; it becomes the new base.
        False when the fragment's own weights were not all finite: then the
        global is taken as it is (no progress kept on top, no mixing)."""
        carried_steps = carried_tokens = 0
        landed = flat
        local = None
        if mix_alpha or (self.keep_unsent and p in self.sent_point):
            local = self.plan.flatten(params, p)
        finite = local is None or bool(torch.isfinite(local).all())
        if not finite:
            mix_alpha = 0.0
        elif local is not None and self.keep_unsent and p in self.sent_point:
            # The global lands under the progress not sent yet, which the next
            # delta (measured from the global) then carries to the syncer.
            landed = flat + (local - self.sent_point[p])
            carried_steps, carried_tokens = self.unsent_steps[p], self.unsent_tokens[p]
        with torch.no_grad():
            for name, tensor in self.plan.unflatten(landed, p).items():
                param = params[name]
                if mix_alpha:
                    param.mul_(mix_alpha).add_(tensor.to(param.dtype), alpha=1 - mix_alpha)
                else:
                    param.copy_(tensor)
        self.base[p] = flat.clone()
        self.base_epoch[p], self.base_version[p] = stamp
        self.sent_point[p] = self.base[p]
        self.c_steps[p] = self.unsent_steps[p] = carried_steps
        self.c_tokens[p] = self.unsent_tokens[p] = carried_tokens
        return finite

    def restore(self, p: int, params: Mapping[str, torch.Tensor]) -> None:
        """Put fragment ``p`` back on its base, the last good global it took; the
        progress since is dropped."""
        with torch.no_grad():
            for name, tensor in self.plan.unflatten(self.base[p], p).items():
                params[name].copy_(tensor)
        self.sent_point[p] = self.base[p]
        self.c_steps[p] = self.unsent_steps[p] = 0
        self.c_tokens[p] = self.unsent_tokens[p] = 0
