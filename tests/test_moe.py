"""The mixture-of-experts workload: routing, load balancing, parameter counts, training."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compose.processes import free_port_pair
from learner.config import EvalConfig, TrainConfig, WorkloadConfig
from learner.model import GPT, Block, ModelConfig
from learner.moe import (
    AUX_WEIGHT,
    NUM_EXPERTS,
    TOP_K,
    MoEBlock,
    MoEGPT,
    load_balancing_loss,
)
from learner.workload import WorkloadContext, load_workload
from tests.test_examples import run_example

TINY = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=16)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_active_parameters_per_token_match_the_dense_model() -> None:
    cfg = ModelConfig()  # the default byte GPT's size
    dense_block, layer = Block(cfg), MoEBlock(cfg)
    dense_mlp = _numel(dense_block.fc) + _numel(dense_block.fc_out)
    # TOP_K experts and the bias they share, per token.
    active_experts = TOP_K * _numel(layer.experts[0]) + layer.out_bias.numel()
    assert dense_mlp == active_experts == 131_712
    # The whole model: everything but the experts a token does not use is active.
    idle = (NUM_EXPERTS - TOP_K) * _numel(layer.experts[0]) * cfg.n_layer
    router = _numel(layer.router) * cfg.n_layer
    dense, moe = GPT(cfg), MoEGPT(cfg)
    assert _numel(dense) == 875_264
    assert _numel(moe) == 1_403_648
    assert _numel(moe) - idle == _numel(dense) + router == 877_312


def test_shapes_and_the_expert_shares() -> None:
    model = MoEGPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    assert model(idx).shape == (3, TINY.seq_len, TINY.vocab_size)
    assert model(idx, idx).shape == ()
    assert model.balance_loss().shape == ()
    shares = model.expert_shares()
    assert shares.shape == (TINY.n_layer, NUM_EXPERTS)
    torch.testing.assert_close(shares.sum(dim=1), torch.ones(TINY.n_layer))
    # Two forwards of 3 x 16 tokens, each routed to TOP_K experts per layer.
    assert int(model.moe_blocks()[0].routed.sum()) == 2 * 3 * TINY.seq_len * TOP_K
    model.reset_expert_counts()
    assert model.expert_shares().sum() == 0


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_collapsed() -> None:
    tokens = 64
    uniform = torch.full((tokens, NUM_EXPERTS), 1 / NUM_EXPERTS)
    balanced = torch.full((NUM_EXPERTS,), tokens * TOP_K // NUM_EXPERTS)
    assert load_balancing_loss(uniform, balanced).item() == pytest.approx(1.0)
    # Every token prefers expert 0, then 1: the top two take all the tokens.
    collapsed = torch.tensor([0.97, 0.01, 0.01, 0.01]).expand(tokens, -1)
    onto_two = torch.tensor([tokens, tokens, 0, 0])
    assert load_balancing_loss(collapsed, onto_two).item() == pytest.approx(
        NUM_EXPERTS * (0.97 + 0.01) / 2
    )
    # A model whose routers give every expert the same logit.
    model = MoEGPT(TINY)
    for block in model.moe_blocks():
        torch.nn.init.zeros_(block.router.weight)
    model(torch.randint(0, TINY.vocab_size, (2, TINY.seq_len)))
    assert model.balance_loss().item() == pytest.approx(1.0, abs=1e-6)


def test_the_workload_trains_with_the_balancing_loss() -> None:
    context = WorkloadContext(
        WorkloadConfig(workload="learner.moe:moe_gpt", model=TINY),
        train=TrainConfig(batch_size=8),
        eval=EvalConfig(eval_batches=2, eval_batch_size=8),
    )
    workload = load_workload(context)
    model = workload.model
    assert isinstance(model, MoEGPT)
    assert workload.evaluate is not None
    batch = next(workload.batches)
    loss = workload.loss(model, batch)
    torch.testing.assert_close(loss, model(*batch) + AUX_WEIGHT * model.balance_loss())
    before = workload.evaluate(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):
        workload.loss(model, next(workload.batches)).backward()
        opt.step()
        opt.zero_grad()
    assert workload.evaluate(model) < before - 1.0
    torch.testing.assert_close(model.expert_shares().sum(dim=1), torch.ones(TINY.n_layer))
    # An evaluation's event carries each layer's shares of the held-out tokens,
    # counted from that evaluation alone (training's routing is not in them).
    fields = workload.evaluation(model)
    assert set(fields) == {"loss", "expert_shares"}
    assert int(sum(block.routed.sum() for block in model.moe_blocks())) == (
        TOP_K * 2 * 8 * TINY.seq_len * TINY.n_layer  # 2 batches of 8 sequences
    )
    assert [round(sum(layer), 3) for layer in fields["expert_shares"]] == [1.0] * TINY.n_layer


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_moe_example_learns_over_zeromq() -> None:
    url = f"zmq://127.0.0.1:{free_port_pair()}"
    result: dict[str, Any] = run_example("moe_library.py", "--steps", "24", "--url", url)
    assert result["after"] < result["before"] - 1.5, result
    assert min(result["versions"]) >= 2
    for layer in result["expert_shares"]:
        assert sum(layer) == pytest.approx(1.0, abs=0.01)  # rounded to 3 decimals
