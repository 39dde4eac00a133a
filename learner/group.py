"""A learner that is itself a torch.distributed group (torchrun): rank 0 speaks for it.

The ranks all-reduce gradients every step, so they hold identical weights;
rank 0 alone talks to the broker and broadcasts the globals it receives, so
every rank applies the same globals at the same step boundary.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from broker.fragments import FragmentPlan
from learner.fragment_sync import Stamp


class TorchrunGroup:
    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share_globals(
        self, arrived: list[tuple[int, Stamp, torch.Tensor]], plan: FragmentPlan
    ) -> list[tuple[int, Stamp, torch.Tensor]]:
        """(fragment, (epoch, version), weights) that every rank applies this step."""
        if self.world == 1:
            return arrived
        header = torch.full((plan.num_fragments, 2), -1, dtype=torch.int64)
        if self.leader:
            for p, (epoch, version), _ in arrived:
                header[p, 0], header[p, 1] = epoch, version
        dist.broadcast(header, 0)
        by_fragment = {p: flat for p, _, flat in arrived}
        out = []
        for p in range(plan.num_fragments):
            if header[p, 1] < 0:
                continue
            flat = by_fragment[p] if self.leader else torch.empty(plan.fragment_numel(p))
            dist.broadcast(flat, 0)
            out.append((p, (int(header[p, 0]), int(header[p, 1])), flat))
        return out

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank: decisions every rank must take together."""
        if self.world == 1:
            return flag
        any_set = torch.tensor([int(flag)])
        dist.all_reduce(any_set, op=dist.ReduceOp.MAX)
        return bool(any_set.item())

    def allreduce_grads(self, model: torch.nn.Module) -> None:
        if self.world == 1:
            return
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= self.world

    def consistent(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds bit-identical weights (they must, always)."""
        if self.world == 1:
            return True
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        return bool(torch.equal(lo, hi))

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            # Tear down together: a rank that destroys its group while a peer's
            # gloo threads still talk to it can abort ("terminate called ...").
            dist.barrier()
            dist.destroy_process_group()
