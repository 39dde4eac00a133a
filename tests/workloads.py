"""A user workload for the ``--workload module:factory`` tests: a small regression
model, nothing to do with language, built by a factory as users write theirs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn

from learner.workload import Workload, WorkloadContext

TRUE_MAP = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) / 4


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ TRUE_MAP)


def regression(context: WorkloadContext) -> Workload:
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    held_out = _data(seed=2**31 - 1, n=2048)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = context.start_step
        while True:
            step += 1
            yield _data(seed=context.shard * 1_000_003 + step, n=context.train.batch_size)

    def evaluate(m: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(m(held_out[0]), held_out[1]))

    return Workload(
        model=model,
        batches=batches(),
        loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        weight=lambda b: len(b[0]),
        evaluate=evaluate,
    )
