"""The outer optimizer against torch.optim.SGD(nesterov=True)."""

from __future__ import annotations

import pytest
import torch

from syncer.outer import momentum_from_change, nesterov_step

torch.set_num_threads(1)


def run_reference(
    w0: torch.Tensor, grads: list[torch.Tensor], lr: float, mu: float
) -> list[torch.Tensor]:
    """Weights after each step of torch's SGD, given the gradients."""
    p = torch.nn.Parameter(w0.clone())
    if mu > 0:
        opt = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=True, dampening=0.0)
    else:
        opt = torch.optim.SGD([p], lr=lr)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


@pytest.mark.parametrize(
    ("lr", "mu"),
    [(0.7, 0.9), (1.0, 0.9), (0.1, 0.5), (0.7, 0.99), (2.0, 0.3), (1.0, 0.0), (0.5, 0.0)],
)
def test_matches_torch_sgd_nesterov(lr: float, mu: float) -> None:
    gen = torch.Generator().manual_seed(int(lr * 100 + mu * 1000))
    w0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(6)]
    expected = run_reference(w0, grads, lr, mu)
    w, buf = w0.clone(), None
    for g, exp in zip(grads, expected, strict=True):
        w, buf = nesterov_step(w, g, buf, lr, mu)
        torch.testing.assert_close(w, exp, rtol=1e-6, atol=1e-6)


def test_by_hand_two_steps() -> None:
    # lr 0.5, mu 0.9, w 1, g 1 then 2:
    # step 1: b = 1, w = 1 - 0.5 * (1 + 0.9) = 0.05
    # step 2: b = 0.9 + 2 = 2.9, w = 0.05 - 0.5 * (2 + 2.61) = -2.255
    w, b = nesterov_step(torch.tensor([1.0]), torch.tensor([1.0]), None, 0.5, 0.9)
    assert w.item() == pytest.approx(0.05) and b.item() == 1.0
    w, b = nesterov_step(w, torch.tensor([2.0]), b, 0.5, 0.9)
    assert w.item() == pytest.approx(-2.255) and b.item() == pytest.approx(2.9)


def test_lr_one_mu_zero_is_plain_averaging() -> None:
    gen = torch.Generator().manual_seed(1)
    global_w = torch.randn(64, generator=gen)
    learners = [torch.randn(64, generator=gen) for _ in range(4)]
    # Outer gradient of each learner g_m = Theta - theta_m, averaged.
    g = torch.stack([global_w - th for th in learners]).mean(0)
    w, _ = nesterov_step(global_w, g, None, lr=1.0, momentum=0.0)
    torch.testing.assert_close(w, torch.stack(learners).mean(0), rtol=1e-6, atol=1e-6)
    # ... on every step, whatever the buffer holds.
    w2, _ = nesterov_step(global_w, g, torch.randn(64, generator=gen), 1.0, 0.0)
    torch.testing.assert_close(w2, w)


def test_inputs_not_mutated() -> None:
    w, g, b = torch.randn(10), torch.randn(10), torch.randn(10)
    w0, g0, b0 = w.clone(), g.clone(), b.clone()
    new_w, new_b = nesterov_step(w, g, b, 0.7, 0.9)
    assert torch.equal(w, w0) and torch.equal(g, g0) and torch.equal(b, b0)
    assert new_w.data_ptr() not in (w.data_ptr(), g.data_ptr(), b.data_ptr())
    assert new_b.data_ptr() not in (w.data_ptr(), g.data_ptr(), b.data_ptr())
    # First step: the new buffer is a copy of the gradient, not the gradient.
    _, first = nesterov_step(w, g, None, 0.7, 0.9)
    first.add_(1.0)
    assert torch.equal(g, g0)


def test_the_momentum_estimated_from_the_last_change_is_the_settled_buffer() -> None:
    """Constant gradients: after the buffer settled, the last change gives it back
    (up to float rounding); steps from the estimate go on as the real buffer's do,
    where a buffer restarted from zero falls behind."""
    lr, mu = 0.7, 0.9
    g = torch.randn(64, generator=torch.Generator().manual_seed(0))
    w, buf = torch.zeros(64), None
    for _ in range(200):
        before = w
        w, buf = nesterov_step(w, g, buf, lr, mu)
    assert buf is not None
    estimate = momentum_from_change(w - before, lr)
    torch.testing.assert_close(estimate, buf, rtol=1e-4, atol=1e-4)
    real, from_estimate, from_zero = (w, buf), (w, estimate), (w, None)
    for _ in range(5):
        real = nesterov_step(real[0], g, real[1], lr, mu)
        from_estimate = nesterov_step(from_estimate[0], g, from_estimate[1], lr, mu)
        from_zero = nesterov_step(from_zero[0], g, from_zero[1], lr, mu)
    torch.testing.assert_close(from_estimate[0], real[0], rtol=1e-4, atol=1e-3)
    assert (from_zero[0] - real[0]).norm() > 10 * (from_estimate[0] - real[0]).norm()


def test_the_momentum_estimate_is_the_buffer_on_average_under_noise() -> None:
    """Noisy gradients around a fixed mean: over many steps the estimate's mean is
    the buffer's (both ``mean / (1 - mu)``), so a restart keeps the step's pace."""
    lr, mu = 0.5, 0.9
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(32, generator=gen)
    w, buf = torch.zeros(32), None
    estimates, buffers = [], []
    for step in range(2000):
        before = w
        w, buf = nesterov_step(w, mean + torch.randn(32, generator=gen), buf, lr, mu)
        if step >= 100:
            estimates.append(momentum_from_change(w - before, lr))
            buffers.append(buf)
    torch.testing.assert_close(
        torch.stack(estimates).mean(0), torch.stack(buffers).mean(0), rtol=0, atol=0.05
    )
    torch.testing.assert_close(torch.stack(buffers).mean(0), mean / (1 - mu), rtol=0, atol=0.5)
