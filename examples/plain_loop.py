"""Decoupled DiLoCo in a plain PyTorch loop: a small regression model, two learners.

    python examples/plain_loop.py [--steps 300] [--url zmq://127.0.0.1:5555]

Starts a syncer for the model on this machine, trains two learner processes
(each the dozen-line loop in ``learn``), then loads the global model and
prints its held-out loss before and after as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile

import torch
import torch.nn as nn

from learner.library import DecoupledDiLoCo, load_global_model, local_syncer

# The same for syncer and learners. This toy trains its steps faster than a
# round trip to the syncer, and one learner may finish before the other has
# joined: rounds of one delta (quorum 1, not the default 2 of 2) let it sync.
SETTINGS = dict(fragments=2, sync_every=8, learners=2, quorum=1)
TRUE_MAP = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) / 4


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every process starts from the same weights
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def data(seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ TRUE_MAP)


def learn(url: str, rank: int, steps: int, keys: str) -> None:
    """The user's own loop; the library adds the ``with`` and ``sync.step``."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with DecoupledDiLoCo(model, url, learner_id=f"learner-{rank}", keys=keys, **SETTINGS) as sync:
        for step in range(sync.start_step, steps):
            x, y = data(seed=1000 * rank + step)  # this learner's own shard
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sync.step(weight=len(x))  # never blocks


def held_out_loss(model: nn.Module) -> float:
    with torch.no_grad():
        x, y = data(seed=-1 % 2**31, n=2048)
        return float(nn.functional.mse_loss(model(x), y))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--url", default="zmq://127.0.0.1:5555")
    args = ap.parse_args(argv)
    model = make_model()
    before = held_out_loss(model)
    with (
        tempfile.TemporaryDirectory() as workdir,
        # The run's keys are made in the work folder; learners enroll with them.
        local_syncer(model, args.url, workdir, keys=f"{workdir}/keys", **SETTINGS),
    ):
        ctx = mp.get_context("spawn")
        learners = [
            ctx.Process(target=learn, args=(args.url, r, args.steps, f"{workdir}/keys"))
            for r in range(2)
        ]
        for p in learners:
            p.start()
        for p in learners:
            p.join()
        if any(p.exitcode for p in learners):
            print("a learner failed", file=sys.stderr)
            return 1
        versions = load_global_model(model, args.url, keys=f"{workdir}/keys", **SETTINGS)
    result = {"before": before, "after": held_out_loss(model), "versions": versions}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
