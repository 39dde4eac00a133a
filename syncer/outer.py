"""Outer optimizer: SGD with Nesterov momentum, one state per fragment."""

from __future__ import annotations

import torch


def nesterov_step(
    weights: torch.Tensor,
    grad: torch.Tensor,
    momentum_buf: torch.Tensor | None,
    lr: float,
    momentum: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step, returning new (weights, momentum buffer); inputs are not modified.

    Same arithmetic as ``torch.optim.SGD(nesterov=True, dampening=0)``:
    ``b = mu*b + g`` (``b = g`` on the first step), ``w -= lr * (g + mu*b)``.
    With lr = 1 and mu = 0 this is plain averaging of the learners' weights.

    ``out``: (weights, momentum buffer) to write the results into, none of them
    an input: a caller stepping round after round reuses memory already paged in.
    """
    new_weights, new_buf = out if out is not None else (torch.empty_like(weights), None)
    if momentum_buf is None:
        buf = grad.clone() if new_buf is None else new_buf.copy_(grad)
    else:
        buf = torch.mul(momentum_buf, momentum, out=new_buf).add_(grad)
    # The update goes where the new weights will be, then they replace it.
    update = torch.add(grad, buf, alpha=momentum, out=new_weights)
    return torch.sub(weights, update, alpha=lr, out=new_weights), buf


def momentum_from_change(change: torch.Tensor, lr: float) -> torch.Tensor:
    """The momentum buffer estimated from the last published change
    ``w_t - w_(t-1)`` alone, for a syncer whose checkpoint (and buffer) was lost.

    The last step made ``w_t - w_(t-1) = -lr * (g + mu*b)``, and its buffer is
    ``b = mu*b' + g``. Where the buffer has settled (``b' = b``, after some
    1 / (1 - mu) rounds), ``g = (1 - mu) * b`` and so ``g + mu*b = b``: the
    buffer is the last update, ``-(w_t - w_(t-1)) / lr``, exact for constant
    gradients, and on average for noisy ones. Restarting from it rather than
    from zero keeps the outer step's pace (from zero the next step is 1.9 g
    where the settled one is 10 g at mu = 0.9, for about ten rounds). With a
    lossy global codec the change carries its rounding error too.
    """
    return change.to(torch.float32).mul(-1.0 / lr)
