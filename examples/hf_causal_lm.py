"""A Hugging Face causal LM in the user's own loop, synced by DecoupledDiLoCo.

    HF_HUB_OFFLINE=1 python examples/hf_causal_lm.py [--steps 120] [--url redis://...]

A GPT-2 style model built from a config (no download; its input embedding and
output head are one tied tensor, which is sent once) learns the bytes of the
Python standard library. Two learner processes train it through the library;
a syncer runs on this machine. Prints the global model's held-out loss before
and after as JSON. Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from learner.library import DecoupledDiLoCo, load_global_model, local_syncer

SETTINGS = dict(fragments=4, sync_every=8, learners=2)  # the same for syncer and learners
SEQ_LEN, BATCH = 64, 16


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every process starts from the same weights
    config = GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) bytes of the standard library's top-level modules."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)
    cut = len(data) * 9 // 10
    return data[:cut].long(), data[cut:].long()


def batch(tokens: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(tokens) - SEQ_LEN, (BATCH,), generator=gen)
    return torch.stack([tokens[s : s + SEQ_LEN] for s in starts.tolist()])


def learn(url: str, rank: int, steps: int, keys: str) -> None:
    """The user's own loop; the library adds the ``with`` and ``sync.step``."""
    torch.set_num_threads(1)
    train, _ = corpus()
    shard = train[rank * len(train) // 2 : (rank + 1) * len(train) // 2]
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    with DecoupledDiLoCo(model, url, learner_id=f"learner-{rank}", keys=keys, **SETTINGS) as sync:
        for _ in range(sync.start_step, steps):
            ids = batch(shard, gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            sync.step(weight=ids.numel())  # tokens: the token-step weighting's unit


def held_out_loss(model: GPT2LMHeadModel) -> float:
    _, held_out = corpus()
    ids = batch(held_out, torch.Generator().manual_seed(12345))
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
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
    tied = model.lm_head.weight is model.transformer.wte.weight
    result = {"before": before, "after": held_out_loss(model), "versions": versions, "tied": tied}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
