"""A mixture-of-experts byte-level language model: ``--workload learner.moe:moe_gpt``.

The byte GPT of :mod:`learner.model` with each block's MLP replaced by a
router and :data:`NUM_EXPERTS` experts (each an MLP). Every token goes to the
:data:`TOP_K` experts with the largest router logits, weighted by a softmax
over those logits; no token is dropped. Each expert is ``1 / TOP_K`` of the
dense MLP's width, so the experts a token uses hold as many parameters as the
dense model's MLP: the active parameters per token are the dense model's,
plus the router.

Training adds :data:`AUX_WEIGHT` times the Switch Transformer's load-balancing
loss (:func:`load_balancing_loss`, averaged over layers) to the language-model
loss, so that the router spreads tokens over the experts instead of
collapsing onto a few. Evaluation reports the language-model loss alone, as
for the dense model.

For reporting, :meth:`MoEGPT.expert_shares` gives each layer's share of
routed tokens per expert (rows sum to 1) since :meth:`MoEGPT.reset_expert_counts`;
every forward counts, training or evaluation.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from learner.model import GPT, MLP_RATIO, AttentionBlock, ModelConfig
from learner.workload import Workload, WorkloadContext, byte_lm

NUM_EXPERTS = 4
TOP_K = 2  # experts per token
AUX_WEIGHT = 0.01  # the load-balancing loss's weight in the training loss


def load_balancing_loss(router_probs: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_i f_i * P_i``.

    ``router_probs`` (tokens, E) is the router's softmax over all experts;
    ``routed`` (E,) counts the tokens sent to each expert. ``f_i`` is expert
    i's share of the routed tokens and ``P_i`` its mean router probability.
    It is 1 when either is uniform (a balanced router) and grows as both
    concentrate on the same experts, up to E when everything goes to one;
    only ``P`` carries a gradient (``f`` is a count).
    """
    num_experts = router_probs.shape[-1]
    f = routed.to(router_probs.dtype) / routed.sum()
    return num_experts * (f * router_probs.mean(dim=0)).sum()


class Expert(nn.Module):
    """One expert: an MLP whose output bias the layer holds (see :class:`MoEBlock`)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.fc_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc(x)))


class MoEBlock(AttentionBlock):
    routed: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.router = nn.Linear(cfg.d_model, NUM_EXPERTS, bias=False)
        hidden = MLP_RATIO * cfg.d_model // TOP_K
        self.experts = nn.ModuleList(Expert(cfg.d_model, hidden) for _ in range(NUM_EXPERTS))
        # The gates sum to 1, so one bias after mixing is a bias all experts
        # share; one per expert would count TOP_K times per token.
        self.out_bias = nn.Parameter(torch.zeros(cfg.d_model))
        # Tokens routed to each expert since the last reset: local statistics,
        # not part of the model's state.
        self.register_buffer("routed", torch.zeros(NUM_EXPERTS, dtype=torch.long), persistent=False)
        self.balance_loss = torch.zeros(())  # of the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.mixture(self.ln2(x))

    def mixture(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        top_logits, chosen = logits.topk(TOP_K, dim=-1)
        gates = top_logits.softmax(dim=-1)
        routed = torch.bincount(chosen.flatten(), minlength=NUM_EXPERTS)
        self.routed += routed
        self.balance_loss = load_balancing_loss(logits.softmax(dim=-1), routed)
        out = torch.zeros_like(tokens)
        for i, expert in enumerate(self.experts):
            token, slot = (chosen == i).nonzero(as_tuple=True)
            out = out.index_add(0, token, gates[token, slot, None] * expert(tokens[token]))
        return (out + self.out_bias).view_as(x)


class MoEGPT(GPT):
    """``model(idx)`` gives logits and ``model(idx, targets)`` the mean
    cross-entropy, as :class:`~learner.model.GPT`; :meth:`balance_loss` is the
    load-balancing loss of that forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, block=MoEBlock)

    def moe_blocks(self) -> list[MoEBlock]:
        return [cast(MoEBlock, block) for block in self.blocks]

    def balance_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss, averaged over layers (1 when balanced)."""
        return torch.stack([block.balance_loss for block in self.moe_blocks()]).mean()

    def expert_shares(self) -> torch.Tensor:
        """(layers, experts): each layer's share of the tokens routed to each
        expert since the last reset (zeros for a layer that routed none)."""
        routed = torch.stack([block.routed for block in self.moe_blocks()]).float()
        return routed / routed.sum(dim=1, keepdim=True).clamp(min=1)

    def reset_expert_counts(self) -> None:
        for block in self.moe_blocks():
            block.routed.zero_()


def training_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The batch's cross-entropy plus the weighted load-balancing loss."""
    lm_loss = model(*batch)
    return lm_loss + AUX_WEIGHT * cast(MoEGPT, model).balance_loss()


def moe_gpt(context: WorkloadContext) -> Workload:
    """The byte GPT's data and evaluation, with the mixture-of-experts model. Each
    evaluation logs ``expert_shares``: per layer, each expert's share of the
    held-out tokens routed in it."""
    workload = byte_lm(context, MoEGPT(context.config.model), loss=training_loss)
    held_out_loss = workload.evaluate
    assert held_out_loss is not None

    def evaluate(model: nn.Module) -> float:
        cast(MoEGPT, model).reset_expert_counts()  # count this evaluation's tokens only
        return held_out_loss(model)

    def expert_shares(model: nn.Module) -> dict[str, Any]:
        shares = cast(MoEGPT, model).expert_shares().tolist()
        return {"expert_shares": [[round(s, 4) for s in layer] for layer in shares]}

    workload.evaluate = evaluate
    workload.eval_report = expert_shares
    return workload
