"""Outer optimizer: SGD with Nesterov momentum, one state per fragment."""

from __future__ import annotations

import torch


def nesterov_step(
    weights: torch.Tensor,
    grad: torch.Tensor,
    momentum_buf: torch.Tensor | None,
    lr: float,
    momentum: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step, returning new (weights, momentum buffer); inputs are not modified.

    Same arithmetic as ``torch.optim.SGD(nesterov=True, dampening=0)``:
    ``b = mu*b + g`` (``b = g`` on the first step), ``w -= lr * (g + mu*b)``.
    With lr = 1 and mu = 0 this is plain averaging of the learners' weights.
    """
    buf = grad.clone() if momentum_buf is None else momentum_buf.mul(momentum).add_(grad)
    update = grad.add(buf, alpha=momentum)
    return weights.sub(update, alpha=lr), buf
