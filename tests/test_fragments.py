"""Fragment plan: balance, determinism, schedule and flattening.

Balance is checked against the LPT bound and a brute-force optimum; the
schedule against hand-computed offsets; flattening against the model's own
parameters.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.errors import ConfigError
from broker.fragments import FragmentPlan, ParamSpec, assign_fragments, param_specs
from learner.model import GPT, ModelConfig

torch.set_num_threads(1)

SMALL = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)


def small_gpt(seed: int = 0, cfg: ModelConfig = SMALL) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def loads(sizes: list[int], owner: list[int], p: int) -> list[int]:
    out = [0] * p
    for s, o in zip(sizes, owner, strict=True):
        out[o] += s
    return out


def brute_force_makespan(sizes: list[int], p: int) -> int:
    """Optimal largest fragment over every assignment (small cases only)."""
    best = sum(sizes)
    for owner in itertools.product(range(p), repeat=len(sizes)):
        best = min(best, max(loads(sizes, list(owner), p)))
    return best


# -- assign_fragments ---------------------------------------------------------
def test_hand_example_lpt() -> None:
    # Largest first to the lightest (ties: lowest index):
    # 7->0, 5->1, 4->2, 3->2 (load 7), 2->1 (load 7), 1->0 (load 8).
    assert assign_fragments([1, 5, 3, 7, 2, 4], 3) == [0, 1, 2, 0, 1, 2]


def test_classic_lpt_worst_case_is_within_4_3_of_optimum() -> None:
    # 3,3 | 2,2 | 2 on top of one: LPT gives 7, the optimum (3+3 | 2+2+2) is 6.
    sizes = [3, 3, 2, 2, 2]
    owner = assign_fragments(sizes, 2)
    assert max(loads(sizes, owner, 2)) == 7
    assert brute_force_makespan(sizes, 2) == 6


def test_ties_broken_by_position() -> None:
    assert assign_fragments([5, 5, 5, 5], 2) == [0, 1, 0, 1]
    assert assign_fragments([5, 5, 5, 5], 2) == assign_fragments([5, 5, 5, 5], 2)


def test_zero_sized_tensors_still_fill_every_fragment() -> None:
    owner = assign_fragments([0, 0, 0], 3)
    assert sorted(owner) == [0, 1, 2]
    owner = assign_fragments([10, 0, 0, 0], 4)
    assert sorted(owner) == [0, 1, 2, 3]


def test_assign_errors() -> None:
    with pytest.raises(ValueError, match="num_fragments"):
        assign_fragments([1, 2], 0)
    with pytest.raises(ValueError, match="at most 2 fragments"):
        assign_fragments([1, 2], 3)


def cap_for_bound(sizes: list[int], p: int) -> list[int]:
    """Clip sizes at the largest T with T <= sum(min(s, T)) / (3 P).

    sum(min(s, T)) - 3 P T is concave in T and >= 0 at T = min(sizes) when
    len(sizes) >= 3 P, so binary search finds the upper end; the result has
    max <= ideal / 3, often with equality, the edge of the bound.
    """
    lo, hi = min(sizes), max(sizes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(s, mid) for s in sizes) >= 3 * p * mid:
            lo = mid
        else:
            hi = mid - 1
    return [min(s, lo) for s in sizes]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_largest_fragment_within_4_3_of_ideal(data: st.DataObject) -> None:
    p = data.draw(st.integers(1, 12))
    n = data.draw(st.integers(3 * p, 3 * p + 60))
    raw = data.draw(st.lists(st.integers(1, 10_000), min_size=n, max_size=n))
    sizes = cap_for_bound(raw, p)
    assert max(sizes) * 3 * p <= sum(sizes)  # the bound's precondition holds
    owner = assign_fragments(sizes, p)
    assert len(owner) == len(sizes)
    assert sorted(set(owner)) == list(range(p))  # every fragment non-empty
    # max load <= 4/3 * total / P, in exact arithmetic.
    assert Fraction(max(loads(sizes, owner, p))) <= Fraction(4, 3) * Fraction(sum(sizes), p)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40), st.data())
def test_every_fragment_non_empty_for_any_sizes(sizes: list[int], data: st.DataObject) -> None:
    p = data.draw(st.integers(1, len(sizes)))
    owner = assign_fragments(sizes, p)
    assert len(owner) == len(sizes)
    assert sorted(set(owner)) == list(range(p))
    assert owner == assign_fragments(list(sizes), p)  # deterministic


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.integers(1, 50), min_size=2, max_size=8),
    st.integers(1, 3),
)
def test_lpt_within_graham_bound_of_brute_force_optimum(sizes: list[int], p: int) -> None:
    if p > len(sizes):
        p = len(sizes)
    owner = assign_fragments(sizes, p)
    assert sorted(set(owner)) == list(range(p))
    opt = brute_force_makespan(sizes, p)
    lpt = max(loads(sizes, owner, p))
    assert opt <= lpt
    # Graham: LPT <= (4/3 - 1/(3P)) OPT <= 4/3 OPT.
    assert Fraction(lpt) <= (Fraction(4, 3) - Fraction(1, 3 * p)) * opt


# -- plan identity ------------------------------------------------------------
def test_param_specs_by_hand() -> None:
    lin = torch.nn.Linear(3, 2)
    specs = param_specs(lin.named_parameters())
    assert specs == [
        ParamSpec("weight", (2, 3), "float32"),
        ParamSpec("bias", (2,), "float32"),
    ]
    assert specs[0].numel == 6 and specs[0].nbytes == 24
    assert ParamSpec("x", (4, 5), "bfloat16").nbytes == 40
    assert ParamSpec("s", (), "float32").numel == 1


def test_plan_is_deterministic_across_model_instances() -> None:
    a = FragmentPlan.for_model(small_gpt(0), 4, 8)
    b = FragmentPlan.for_model(small_gpt(123), 4, 8)  # other values, same shapes
    assert a == b
    assert a.plan_hash == b.plan_hash
    assert len(a.plan_hash) == 16 and int(a.plan_hash, 16) >= 0


def test_plan_from_equal_specs_built_in_shuffled_order() -> None:
    model = small_gpt()
    named = list(model.named_parameters())
    order = {name: i for i, (name, _) in enumerate(named)}
    shuffled = named[:]
    random.Random(7).shuffle(shuffled)
    # Build fresh spec objects by hand, in a shuffled order, then put them in
    # model order: the plan depends only on the (name, shape, dtype) list.
    rebuilt = sorted(
        (ParamSpec(n, tuple(t.shape), "float32") for n, t in shuffled),
        key=lambda s: order[s.name],
    )
    a = FragmentPlan.for_model(model, 4, 8)
    b = FragmentPlan.build(rebuilt, 4, 8)
    assert a == b and a.plan_hash == b.plan_hash


def test_hash_changes_with_p_h_shapes_and_order() -> None:
    model = small_gpt()
    base = FragmentPlan.for_model(model, 4, 8)
    other_p = FragmentPlan.for_model(model, 2, 8)
    other_h = FragmentPlan.for_model(model, 4, 12)
    wider = FragmentPlan.for_model(
        small_gpt(cfg=ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=48)), 4, 8
    )
    specs = list(base.specs)
    specs[0] = ParamSpec(specs[0].name, (specs[0].shape[0] + 1, specs[0].shape[1]), "float32")
    one_shape = FragmentPlan.build(specs, 4, 8)
    bf16 = FragmentPlan.build([ParamSpec(s.name, s.shape, "bfloat16") for s in base.specs], 4, 8)
    reversed_order = FragmentPlan.build(list(reversed(base.specs)), 4, 8)
    hashes = [p.plan_hash for p in (base, other_p, other_h, wider, one_shape, bf16, reversed_order)]
    assert len(set(hashes)) == len(hashes)


def test_every_tensor_in_exactly_one_nonempty_fragment() -> None:
    model = small_gpt()
    names = [n for n, _ in model.named_parameters()]
    for p in (1, 2, 3, 4, 7):
        plan = FragmentPlan.for_model(model, p)
        seen = [s.name for f in range(p) for s in plan.fragment_specs(f)]
        assert sorted(seen) == sorted(names)
        assert len(seen) == len(set(seen))
        for f in range(p):
            assert plan.fragment_specs(f)
        total = sum(t.numel() for t in model.parameters())
        assert sum(plan.fragment_numel(f) for f in range(p)) == total
        assert sum(plan.fragment_nbytes(f) for f in range(p)) == 4 * total


def test_default_model_plan_balance() -> None:
    model = GPT(ModelConfig())
    plan = FragmentPlan.for_model(model, 4, 24)
    sizes = [s.nbytes for s in plan.specs]
    ideal = sum(sizes) / 4
    biggest = max(plan.fragment_nbytes(f) for f in range(4))
    assert max(sizes) <= ideal / 3  # so the LPT bound applies
    assert biggest <= 4 / 3 * ideal


# -- schedule -----------------------------------------------------------------
def make_plan(p: int, h: int) -> FragmentPlan:
    specs = [ParamSpec(f"t{i}", (i + 1,), "float32") for i in range(max(p, 3))]
    return FragmentPlan.build(specs, p, h)


@pytest.mark.parametrize(
    ("p", "h", "offsets"),
    [
        (1, 1, [0]),
        (4, 4, [0, 1, 2, 3]),
        (4, 24, [0, 6, 12, 18]),
        (3, 9, [0, 3, 6]),
        (2, 10, [0, 5]),
    ],
)
def test_offsets_spread_evenly(p: int, h: int, offsets: list[int]) -> None:
    plan = make_plan(p, h)
    assert [plan.offset(f) for f in range(p)] == offsets


@pytest.mark.parametrize(("p", "h"), [(1, 1), (4, 4), (4, 24), (3, 9), (5, 5), (2, 10)])
def test_each_fragment_due_once_per_h_steps(p: int, h: int) -> None:
    plan = make_plan(p, h)
    assert plan.fragments_due(0) == []
    assert plan.fragments_due(-h) == []
    for start in range(1, 3 * h + 1):
        window = [f for t in range(start, start + h) for f in plan.fragments_due(t)]
        assert sorted(window) == list(range(p))
    # Fragment f is due exactly at the t > 0 with t mod H == offset(f).
    for t in range(1, 4 * h):
        assert plan.fragments_due(t) == [f for f in range(p) if t % h == f * h // p]
    # Default H = P.
    specs = [ParamSpec(f"t{i}", (1,), "float32") for i in range(p)]
    assert FragmentPlan.build(specs, p).sync_every == p


def test_plan_errors() -> None:
    specs = [ParamSpec(f"t{i}", (2,), "float32") for i in range(3)]
    with pytest.raises(ValueError, match="multiple"):
        FragmentPlan.build(specs, 2, 3)
    with pytest.raises(ValueError, match="multiple"):
        FragmentPlan.build(specs, 2, 0)
    with pytest.raises(ValueError, match="at most 3 fragments"):
        FragmentPlan.build(specs, 4, 4)
    with pytest.raises(ValueError, match="num_fragments"):
        FragmentPlan.build(specs, 0, 4)
    with pytest.raises(ValueError, match="unique"):
        FragmentPlan.build([*specs, specs[0]], 2, 2)


# -- flatten / unflatten ------------------------------------------------------
def test_flatten_unflatten_round_trip_on_gpt() -> None:
    model = small_gpt()
    params = dict(model.named_parameters())
    plan = FragmentPlan.for_model(model, 3, 6)
    for f in range(3):
        flat = plan.flatten(params, f)
        assert flat.dtype == torch.float32 and flat.ndim == 1
        assert flat.numel() == plan.fragment_numel(f)
        # Flattening order is model order within the fragment.
        expected = torch.cat([params[s.name].detach().reshape(-1) for s in plan.fragment_specs(f)])
        assert torch.equal(flat, expected)
        back = plan.unflatten(flat, f)
        assert list(back) == [s.name for s in plan.fragment_specs(f)]
        for name, t in back.items():
            assert t.shape == params[name].shape
            assert torch.equal(t, params[name].detach())
        # flatten is a copy: changing it leaves the model alone.
        before = params[plan.fragment_specs(f)[0].name].detach().clone()
        flat.add_(1.0)
        assert torch.equal(params[plan.fragment_specs(f)[0].name].detach(), before)


def test_flatten_converts_bf16_to_fp32() -> None:
    params = {"a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "b": torch.ones(2, 2)}
    plan = FragmentPlan.build(param_specs(params.items()), 1)
    flat = plan.flatten(params, 0)
    assert flat.dtype == torch.float32
    assert flat.tolist() == [1.5, -2.0, 1.0, 1.0, 1.0, 1.0]


def test_unflatten_rejects_wrong_size() -> None:
    plan = FragmentPlan.for_model(small_gpt(), 2)
    n = plan.fragment_numel(0)
    with pytest.raises(ValueError, match="fragment 0"):
        plan.unflatten(torch.zeros(n + 1), 0)
    with pytest.raises(ValueError, match="fragment 0"):
        plan.unflatten(torch.zeros(1, n), 0)


def test_a_fragment_too_large_for_one_fp32_message_is_refused() -> None:
    # 600M values (specs only: nothing is allocated) in 4 tensors of 150M: 572 MiB each.
    specs = [ParamSpec(f"w{i}", (150_000_000,), "float32") for i in range(4)]
    with pytest.raises(ConfigError, match=r"fragment 0 holds 150,000,000 values.*at least 5\)"):
        FragmentPlan.build(specs, 4)
    plan = FragmentPlan.build([ParamSpec(f"w{i}", (100_000_000,), "float32") for i in range(6)], 6)
    assert plan.max_message_bytes > 4 * 100_000_000  # 381 MiB in fp32: it fits
    with pytest.raises(ConfigError, match="fragment 0 holds 200,000,000"):
        FragmentPlan.from_json(
            plan.to_json()
            | {
                "fragments": 3,
                "sync_every": 3,
                "params": [[f"w{i}", [100_000_000], "float32", i // 2] for i in range(6)],
            }
        )
