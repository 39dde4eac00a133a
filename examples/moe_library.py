"""Decoupled DiLoCo on a mixture-of-experts byte language model, two learners.

    python examples/moe_library.py [--steps 60] [--url zmq://127.0.0.1:5555]

Starts a syncer for the model on this machine, trains two learner processes
on the bytes of the Python standard library (each the loop in ``learn``: the
language-model loss plus the router's load-balancing loss), then loads the
global model and prints as JSON its held-out loss before and after and each
layer's share of the held-out tokens per expert.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from typing import Any

import torch

from learner.data import BatchSampler, eval_batches, evaluate, load_corpus
from learner.library import DecoupledDiLoCo, load_global_model, local_syncer
from learner.model import ModelConfig
from learner.moe import AUX_WEIGHT, MoEGPT

# The same for syncer and learners. One learner may finish its few steps before
# the other has joined: rounds of one delta (quorum 1, not the default 2 of 2)
# let it sync.
SETTINGS: dict[str, Any] = dict(fragments=2, sync_every=8, learners=2, quorum=1)
MODEL = ModelConfig(seq_len=64, n_layer=2, n_head=2, d_model=64)
BATCH = 16


def make_model() -> MoEGPT:
    torch.manual_seed(0)  # every process starts from the same weights
    return MoEGPT(MODEL)


def learn(url: str, rank: int, steps: int, keys: str) -> None:
    """The user's own loop; the library adds the ``with`` and ``sync.step``."""
    torch.set_num_threads(1)
    corpus = load_corpus(None, MODEL.vocab_size, MODEL.seq_len)
    # This learner's own shard of the training bytes.
    batches = BatchSampler(corpus.train, MODEL.seq_len, BATCH, rank, num_shards=2, seed=rank)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with DecoupledDiLoCo(model, url, learner_id=f"learner-{rank}", keys=keys, **SETTINGS) as sync:
        for _ in range(sync.start_step, steps):
            x, y = batches.next()
            loss = model(x, y) + AUX_WEIGHT * model.balance_loss()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sync.step(weight=x.numel())  # tokens: the token-step weighting's unit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--url", default="zmq://127.0.0.1:5555")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    held_out = eval_batches(
        load_corpus(None, MODEL.vocab_size, MODEL.seq_len).val, MODEL.seq_len, BATCH, 4
    )
    model = make_model()
    before = evaluate(model, held_out)
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
    model.reset_expert_counts()
    after = evaluate(model, held_out)
    shares = [[round(s, 3) for s in layer] for layer in model.expert_shares().tolist()]
    print(
        json.dumps(
            {"before": before, "after": after, "versions": versions, "expert_shares": shares}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
