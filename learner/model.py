"""A small byte-level GPT that trains on a CPU in minutes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from broker.errors import ConfigError

MLP_RATIO = 4  # a block's feed-forward is this many times d_model wide


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"model {name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )


class AttentionBlock(nn.Module):
    """Causal self-attention on a pre-norm residual, and the norm before the
    feed-forward half that subclasses add: dense (:class:`Block`) or a mixture
    of experts (:mod:`learner.moe`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(AttentionBlock):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.fc = nn.Linear(cfg.d_model, MLP_RATIO * cfg.d_model)
        self.fc_out = nn.Linear(MLP_RATIO * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """``block`` builds each layer: the dense :class:`Block`, or another
    :class:`AttentionBlock` (the mixture of experts' in :mod:`learner.moe`)."""

    def __init__(
        self, cfg: ModelConfig, block: Callable[[ModelConfig], AttentionBlock] = Block
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2: scale residual projections by depth so the stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or the mean cross-entropy when targets are given."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
