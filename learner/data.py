"""Training data: byte-level text that every machine has, split deterministically.

The default corpus is the Python standard library's top-level source files
(about 5 MB of real text, no download). Files are assigned to the held-out
validation split by a hash of their name, so the split is the same on every
learner, the syncer and every run. A user's own data: ``--data FILE`` with
text (read as bytes) or a ``.npy`` array of token ids; its last 10% is held out.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from broker.errors import ConfigError

VAL_PERCENT = 10


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # 1-D token ids: uint8 for bytes (int64 only per batch), else int64
    val: torch.Tensor
    source: str


def _is_validation(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def stdlib_corpus() -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise ConfigError(f"no Python sources under {root}; pass --data FILE")
    train: list[bytes] = []
    val: list[bytes] = []
    for f in files:
        (val if _is_validation(f.name) else train).append(f.read_bytes())
    return Corpus(_bytes_to_ids(b"".join(train)), _bytes_to_ids(b"".join(val)), str(root))


def _bytes_to_ids(data: bytes) -> torch.Tensor:
    # Bytes stay bytes: widening 5 MB to int64 at start took most of a restart's build.
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))


def file_corpus(path: str, vocab_size: int) -> Corpus:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data {path}: no such file")
    if p.suffix == ".npy":
        ids = np.load(p, allow_pickle=False)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"--data {path}: expected a 1-D integer array of token ids")
        tokens = torch.from_numpy(ids.astype(np.int64))
    else:
        tokens = _bytes_to_ids(p.read_bytes())
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ConfigError(f"--data {path}: token ids must lie in [0, {vocab_size})")
    cut = tokens.numel() * (100 - VAL_PERCENT) // 100
    return Corpus(tokens[:cut], tokens[cut:], str(p))


def load_corpus(data: str | None, vocab_size: int, seq_len: int) -> Corpus:
    corpus = stdlib_corpus() if data is None else file_corpus(data, vocab_size)
    for split in ("train", "val"):
        if getattr(corpus, split).numel() < 4 * (seq_len + 1):
            raise ConfigError(
                f"{corpus.source}: the {split} split is too small for seq_len {seq_len}"
            )
    return corpus


class BatchSampler:
    """Random windows from one shard of the training tokens (learner m of M)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        shard: int,
        num_shards: int,
        seed: int,
    ) -> None:
        size = tokens.numel() // num_shards
        self.tokens = tokens[shard * size : (shard + 1) * size]
        if self.tokens.numel() <= seq_len + 1:
            raise ConfigError(f"shard {shard} of {num_shards} is too small for seq_len {seq_len}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=self.gen
        )
        window = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        window = window.long()
        return window[:, :-1], window[:, 1:]


def eval_batches(
    val: torch.Tensor, seq_len: int, batch_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evenly spaced held-out windows, the same for every evaluation."""
    count = batch_size * num_batches
    stride = max(1, (val.numel() - seq_len - 1) // count)
    starts = [i * stride for i in range(count)]
    window = torch.stack([val[s : s + seq_len + 1] for s in starts]).long()
    return [
        (window[i : i + batch_size, :-1], window[i : i + batch_size, 1:])
        for i in range(0, count, batch_size)
    ]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    losses = [float(model(x, y)) for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
