"""The compiled close (syncer/kernels.py) against the torch close it replaces.

With int2 globals merged by the mean, a FragmentState closes rounds in one
compiled pass over packed int2 deltas. Each round here is closed twice from
the same state: by the compiled close, and by the torch one (a state loaded
from the compiled one's checkpoint, with the compiled close turned off). The
published bytes must be exactly the codec's encoding of the compiled master's
change, the version exactly what a learner decodes from them, and the master
and momentum the torch close's up to float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from broker.run.settings import RunSettings
from broker.wire.codecs import Codec, apply_change
from broker.wire.messages import Delta, weights_checksum
from syncer import kernels
from syncer.aggregation import l2_norm
from syncer.buffers import DeltaBuffers, PackedRows
from syncer.config import OuterConfig
from syncer.fragment_state import (
    ACCEPTED,
    FragmentState,
    PackedDelta,
    RoundOverflow,
    RoundResult,
)
from syncer.merge import CompiledMerge, TorchMerge
from syncer.trust import ReportLimits
from tests.syncer_settings import syncer_settings

torch.set_num_threads(1)

INT2 = Codec.parse("int2+zstd")
T0 = 1_000.0
LIMITS = ReportLimits(step_floor=64, max_tokens_per_step=10_000, max_clock_skew_s=60.0)
# Lengths around blocks (64 values) and tiles (4096): partial bytes, blocks and tiles.
LENGTHS = [1, 7, 63, 64, 65, 4096, 2 * 4096 + 100 + 5]


def params(**over: Any) -> tuple[OuterConfig, RunSettings]:
    values: dict[str, Any] = dict(
        quorum=3,
        grace_gamma=0.5,
        overlap=2,
        staleness=3,
        outer_lr=0.7,
        outer_momentum=0.9,
        aggregation="mean",
        codec=INT2,
        limits=LIMITS,
        weight_clip=3.0,
        quarantine_factor=10.0,
        quarantine_window=16,
        quarantine_action="clip",
    )
    values.update(over)
    return syncer_settings(**values)


def sent(
    learner: str, seq: int, base: int, values: torch.Tensor, codec: Codec = INT2, tokens: int = 400
) -> Delta:
    return Delta(
        run_id="r",
        learner_id=learner,
        incarnation=0,
        seq=seq,
        fragment=0,
        base_version=base,
        c_tokens=tokens,
        c_steps=4,
        numel=values.numel(),
        step=4 * seq,
        codec=codec,
        payload=codec.encode(values),
    )


def torch_twin(state: FragmentState) -> FragmentState:
    """A state with ``state``'s checkpoint (copied) whose rounds close in torch."""
    twin = FragmentState(0, state.weights.clone(), state.outer, state.run, published_s=T0)
    tensors, meta = state.state()
    twin.load({k: v.clone() for k, v in tensors.items()}, meta)
    # The torch close, as for every other codec.
    twin.buffers = DeltaBuffers(twin.numel, twin.codec, packed=False)
    twin.merge = TorchMerge(twin.outer, twin.codec, twin.versions)
    return twin


def offer_both(states: list[FragmentState], deltas: list[Delta], wall_s: float) -> None:
    for state in states:
        for d in deltas:
            assert (
                state.offer(d, state.decode(d), None, 0.0, wall_s=wall_s, step_s=None) == ACCEPTED
            )


def close_both(
    compiled: FragmentState, twin: FragmentState, wall_s: float, learners: int = 0
) -> RoundResult:
    """Close the round in both; check the compiled one against the codec and the twin."""
    previous = compiled.weights.clone()
    result = compiled.close(wall_s, learners)
    expected = twin.close(wall_s, learners)
    assert (result.included, result.clipped, result.refused) == (
        expected.included,
        expected.clipped,
        expected.refused,
    )
    publication = compiled.publication
    assert publication.is_change and publication.codec == INT2
    # Exactly the codec's encoding of the compiled master's change ...
    assert publication.payload == INT2.encode(compiled.master - previous, fit_scales=True)
    # ... and the version is what every learner builds from it, bit for bit.
    rebuilt = apply_change(previous, INT2.decode(publication.payload, previous.numel()))
    assert torch.equal(rebuilt.view(torch.int32), compiled.weights.view(torch.int32))
    assert publication.weights_crc == weights_checksum(compiled.weights)
    # The master and momentum: the torch close's, up to float32 rounding.
    torch.testing.assert_close(compiled.master, twin.master, rtol=2e-6, atol=1e-7)
    assert compiled.momentum is not None and twin.momentum is not None
    torch.testing.assert_close(compiled.momentum, twin.momentum, rtol=2e-5, atol=1e-7)
    return result


@pytest.mark.parametrize("numel", LENGTHS)
def test_compiled_rounds_publish_the_codecs_bytes_and_follow_the_torch_close(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    weights = torch.randn(numel, generator=gen)
    weights[::3] = -0.0  # a zero change on -0.0 is +0.0 for a learner: 0 x scale is +0.0
    state = FragmentState(0, weights, *params(), published_s=T0)
    assert isinstance(state.merge, CompiledMerge)
    for r in range(4):  # the first round starts the momentum, the later ones use it
        twin = torch_twin(state)
        deltas = [
            sent(name, r + 1, state.version, 1e-2 * torch.randn(numel, generator=gen))
            for name in "abc"
        ]
        offer_both([state, twin], deltas, T0 + 10.0 * (r + 1))
        assert all(isinstance(c.delta, PackedDelta) for c in state.admission.pending.values())
        result = close_both(state, twin, T0 + 10.0 * (r + 1) + 1.0)
        assert result.included == 3 and state.version == r + 1


def test_compiled_round_with_other_codecs_older_bases_a_clip_and_a_share() -> None:
    """Deltas that are not packed (int8), deltas on an older version (their shift),
    a delta clipped by the quarantine, and a round of fewer than the learners."""
    numel = 4096 + 333
    gen = torch.Generator().manual_seed(1)
    state = FragmentState(0, torch.randn(numel, generator=gen), *params(quorum=2), published_s=T0)
    # Two rounds, so that version 1 is behind and the norms have a history.
    for r in range(2):
        twin = torch_twin(state)
        deltas = [
            sent(name, r + 1, state.version, 1e-2 * torch.randn(numel, generator=gen))
            for name in "ab"
        ]
        offer_both([state, twin], deltas, T0 + 10.0 * (r + 1))
        close_both(state, twin, T0 + 10.0 * (r + 1) + 1.0)
    twin = torch_twin(state)
    deltas = [
        sent("a", 3, 2, 1e-2 * torch.randn(numel, generator=gen)),
        sent("b", 3, 1, 1e-2 * torch.randn(numel, generator=gen)),  # a version behind
        sent("c", 1, 2, 1e-2 * torch.randn(numel, generator=gen), Codec.parse("int8")),
        sent("d", 1, 1, 1e-2 * torch.randn(numel, generator=gen), Codec.parse("int8")),
        sent("e", 1, 2, 5.0 * torch.randn(numel, generator=gen)),  # 500x: clipped
    ]
    offer_both([state, twin], deltas, T0 + 40.0)
    kinds = {c.learner: type(c.delta).__name__ for c in state.admission.pending.values()}
    assert kinds == {"a": "PackedDelta", "b": "PackedDelta", "c": "Tensor", "d": "Tensor",
                     "e": "PackedDelta"}  # fmt: skip
    result = close_both(state, twin, T0 + 41.0, learners=8)  # 5 of 8: a share of the step
    assert result.included == 5 and [key[0] for key in result.clipped] == ["e"]


def test_a_packed_delta_has_the_norm_and_magnitude_of_its_values() -> None:
    """Also when the payload's last byte holds nonzero codes past the end: nothing
    decodes them, so nothing counts them."""
    for numel in LENGTHS:
        values = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        d = sent("a", 1, 0, values, Codec.parse("int2"))
        raw = bytearray(d.payload)
        if numel % 4:
            raw[-1] |= 0xFF << (2 * (numel % 4)) & 0xFF  # code 1 in every unused field
        d = replace(d, payload=bytes(raw))
        decoded = d.tensor()
        state = FragmentState(0, torch.zeros(numel), *params(quorum=1), published_s=T0)
        packed = state.decode(d)
        assert isinstance(packed, PackedDelta)
        assert math.isclose(packed.norm, float(decoded.double().norm()), rel_tol=1e-12)
        assert math.isclose(packed.norm, l2_norm(decoded), rel_tol=1e-6)
        assert packed.magnitude == float(decoded.abs().max())


def test_a_packed_delta_with_a_scale_that_is_not_finite_is_refused() -> None:
    numel = 200
    state = FragmentState(0, torch.zeros(numel), *params(quorum=1), published_s=T0)
    d = sent("a", 1, 0, torch.full((numel,), 0.01), Codec.parse("int2"))
    for bits in (0x7F80, 0xFF80, 0x7FC0):  # +inf, -inf and NaN as bf16
        raw = bytearray(d.payload)
        raw[2:4] = bits.to_bytes(2, "little")  # block 1's scale
        bad = replace(d, payload=bytes(raw))
        packed = state.decode(bad)
        assert isinstance(packed, PackedDelta) and math.isinf(packed.magnitude)
        assert state.offer(bad, packed, None, 0.0, wall_s=T0 + 10.0, step_s=None) == "non_finite"


def test_an_overflowing_compiled_step_publishes_nothing_and_keeps_the_state() -> None:
    numel = 100
    state = FragmentState(0, torch.full((numel,), 3e38), *params(quorum=1), published_s=T0)
    before = state.master.clone(), state.weights.clone(), state.version
    # Finite, and below the admission bar, but the step (0.7 x 1.9 x 1e38 more) overflows.
    d = sent("a", 1, 0, torch.full((numel,), -1e38), Codec.parse("int2"))
    assert state.offer(d, state.decode(d), "ref", 0.0, wall_s=T0 + 10.0, step_s=None) == ACCEPTED
    with pytest.raises(RoundOverflow) as raised:
        state.close(T0 + 11.0)
    assert raised.value.refs == ["ref"]
    assert torch.equal(state.master, before[0]) and torch.equal(state.weights, before[1])
    assert state.version == before[2] and state.momentum is None
    # The next round closes as usual.
    d = sent("a", 2, 0, torch.full((numel,), 1e36), Codec.parse("int2"))
    assert state.offer(d, state.decode(d), "ref", 0.0, wall_s=T0 + 20.0, step_s=None) == ACCEPTED
    assert state.close(T0 + 21.0).published and state.version == 1


def test_memory_is_written_over_only_when_nothing_holds_it() -> None:
    """The compiled close writes each new version into the memory of one no longer
    kept, unless something still holds that one: a caller's reference, or a view
    of its bytes (a snapshot being sent). It steps the master and momentum in
    place when their bounds rule out an overflow (the overflow test below is
    the other case: the state is kept)."""
    numel = 4096
    gen = torch.Generator().manual_seed(2)
    state = FragmentState(0, torch.randn(numel, generator=gen), *params(quorum=1), published_s=T0)

    def round_(r: int) -> None:
        d = sent("a", r, state.version, 1e-2 * torch.randn(numel, generator=gen))
        assert state.offer(d, state.decode(d), None, 0.0, wall_s=T0 + r, step_s=None) == ACCEPTED
        state.close(T0 + r + 0.5)

    addresses = set()
    for r in range(1, 13):
        round_(r)
        addresses.add(state.weights.data_ptr())
        if r == 3:  # 9 rounds before the last: an odd count, unlike two buffers taking turns
            assert state.momentum is not None
            stepped = (state.master.data_ptr(), state.momentum.data_ptr())
    # 3 kept versions and a spare go round: 12 rounds, not 12 new tensors.
    assert len(addresses) <= 5
    # Far from overflowing, the master and momentum are stepped in place (from
    # the second round: the first version is the first master).
    assert state.momentum is not None
    assert (state.master.data_ptr(), state.momentum.data_ptr()) == stepped

    held = state.weights  # a caller's reference
    held_copy = held.clone()
    round_(13)
    viewed = state.snapshot.payload  # a view of another version's bytes
    viewed_copy = bytes(viewed)
    for r in range(14, 30):
        round_(r)
    assert torch.equal(held, held_copy)
    assert bytes(viewed) == viewed_copy


def test_bf16_rounding_matches_torch() -> None:
    values = torch.tensor(
        [0.0, -0.0, 1.0, 1.00390625, 1.005859375, 1.0078125, 3.4e38, 1e-40, -2.5e-3],
        dtype=torch.float32,
    )
    specials = torch.tensor([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF])
    values = torch.cat(
        [
            values,
            specials.to(torch.int32).view(torch.float32),  # inf, -inf and NaNs
            torch.randn(1000, generator=torch.Generator().manual_seed(3)),
        ]
    )
    expected = values.to(torch.bfloat16).float().view(torch.int32).numpy().view(np.uint32)
    for x, want in zip(values.view(torch.int32).numpy().view(np.uint32), expected, strict=True):
        got = kernels._bf16_bits(np.uint32(x))
        nan = (want & 0x7FFFFFFF) > 0x7F800000
        assert got == want or (nan and (got & 0x7FFFFFFF) > 0x7F800000), hex(x)


def test_unpack_and_pack_are_the_payload_layout() -> None:
    for numel in LENGTHS:
        codec = Codec.parse("int2")
        raw = np.frombuffer(codec.encode(torch.randn(numel)), dtype=np.uint8)
        scales, codes = kernels.new_rows(2, numel)
        kernels.unpack_int2(raw, numel, scales[1], codes[1])
        assert scales.shape[1] % kernels.TILE_BLOCKS == 0 and codes.shape[1] == scales.shape[1] * 16
        assert np.array_equal(kernels.pack_int2(scales[1], codes[1], numel), raw)
        assert not scales[0].any() and (codes[0] == 0xAA).all()


def test_rows_of_packed_deltas_come_back_when_their_deltas_go() -> None:
    """Packed deltas live in rows that the close reads in place: a row is taken
    until its last delta (a clipped one shares it) is dropped, then reused, so
    rounds after rounds need no new memory."""
    numel = 300
    gen = torch.Generator().manual_seed(4)
    state = FragmentState(0, torch.randn(numel, generator=gen), *params(quorum=3), published_s=T0)
    assert state.buffers.rows is not None
    for r in range(1, 21):
        deltas = [
            sent(name, r, state.version, 1e-2 * torch.randn(numel, generator=gen)) for name in "abc"
        ]
        offer_both([state], deltas, T0 + r)
        state.close(T0 + r + 0.5)
    assert len(state.buffers.rows.scales) == 4  # the first 4 rows: never more than 3 at once
    held = state.decode(sent("a", 21, state.version, torch.randn(numel, generator=gen)))
    assert isinstance(held, PackedDelta)
    taken = {held.row.index}
    for _ in range(8):  # decoded and dropped at once: rows come back, never the held one
        again = state.decode(sent("b", 21, state.version, torch.randn(numel, generator=gen)))
        assert isinstance(again, PackedDelta) and again.row.index not in taken
    codes = state.buffers.rows.codes[held.row.index].copy()
    del again
    assert np.array_equal(state.buffers.rows.codes[held.row.index], codes)


@pytest.mark.parametrize("compiled", [True, False])
def test_gradients_are_taken_against_the_master_as_the_design_says(compiled: bool) -> None:
    """docs/design.md, rule 1, written independently here in float64: with int2
    globals the outer gradient of a delta on base b is master - (Theta(b) -
    Delta): the learner's weights rebuilt from the published version it holds,
    the gradient taken against the fp32 master (which leads the current
    version by the rounding error still to publish). lr 1 and no momentum: the
    master moves by exactly the merged gradient."""
    numel = 4096 + 100
    state = FragmentState(
        0, torch.randn(numel, generator=torch.Generator().manual_seed(3)),
        *params(quorum=1, outer_lr=1.0, outer_momentum=0.0), published_s=T0,
    )  # fmt: skip
    if not compiled:
        state = torch_twin(state)
    assert isinstance(state.merge, CompiledMerge) is compiled
    gen = torch.Generator().manual_seed(4)
    theta = {}  # each version as published, as learners hold it
    for seq in range(1, 4):  # a few rounds, so that the master leads the version
        # int8 deltas: changes that ternary codes cannot publish exactly.
        values = 1e-2 * torch.randn(numel, generator=gen)
        offer_both([state], [sent("a", seq, state.version, values, Codec.parse("int8"))], T0 + seq)
        state.close(T0 + seq, 1)
        theta[state.version] = state.weights.double().clone()
    lead = (state.master.double() - state.weights.double()).abs().max().item()
    assert lead > 1e-3  # int2 globals: the master is ahead of what was published
    # Two deltas of two learners: one on the current version, one a version behind.
    current, behind = state.version, state.version - 1
    master = state.master.double().clone()
    d_now = sent("b", 1, current, 1e-2 * torch.randn(numel, generator=gen))
    d_old = sent("c", 1, behind, 1e-2 * torch.randn(numel, generator=gen))
    offer_both([state], [d_now, d_old], T0 + 10)
    state.close(T0 + 10, 2)
    deltas = {
        v: d.codec.decode(d.payload, numel).double() for v, d in ((current, d_now), (behind, d_old))
    }
    # Equal token-step weights: the merged gradient is the mean of the two.
    g = [master - (theta[v] - deltas[v]) for v in (current, behind)]
    expected = master - (g[0] + g[1]) / 2
    torch.testing.assert_close(state.master.double(), expected, rtol=0, atol=1e-5)


def test_fragments_sharing_their_rows_close_as_with_rows_of_their_own() -> None:
    """A syncer's fragments share one pool of packed rows: a row that held a
    larger fragment's delta, and then a smaller one's, must close the smaller
    fragment bit for bit as a row of its own would (its last tile's padding is
    zero again)."""
    big, small = 3 * 4096 + 5, 4096 + 100 + 7
    gen = torch.Generator().manual_seed(11)
    shared = PackedRows(big, INT2)
    large = FragmentState(
        0, torch.randn(big, generator=gen), *params(quorum=1), published_s=T0, rows=shared
    )
    weights = torch.randn(small, generator=gen)
    pooled = FragmentState(1, weights.clone(), *params(quorum=1), published_s=T0, rows=shared)
    alone = FragmentState(1, weights.clone(), *params(quorum=1), published_s=T0)
    for seq in range(1, 4):
        # The large fragment's deltas fill the shared rows with nonzero codes everywhere.
        offer_both(
            [large],
            [sent(f"l{m}", seq, large.version, torch.randn(big, generator=gen)) for m in range(2)],
            T0 + seq,
        )
        large.close(T0 + seq, 2)
        on = [pooled.version, max(pooled.version - 1, 0)]  # one behind: the kept changes too
        deltas = [
            sent(f"s{m}", seq, on[m], 1e-2 * torch.randn(small, generator=gen)) for m in range(2)
        ]
        offer_both([pooled, alone], deltas, T0 + seq)
        pooled.close(T0 + seq, 2)
        alone.close(T0 + seq, 2)
        assert pooled.publication.payload == alone.publication.payload
        assert torch.equal(pooled.master, alone.master)


def test_rows_come_back_after_the_pool_grew() -> None:
    """Rows taken before the pool grew come back to it when their deltas go:
    the pool stays the size of the most deltas held at once."""
    rows = PackedRows(1000, INT2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        held = [rows.pack(sent("a", 1, 0, torch.randn(1000, generator=gen))) for _ in range(9)]
        assert rows.in_use == 9
        del held
        assert rows.in_use == 0
    assert rows.rows == 12  # 4 rows at a time: never past what 9 deltas need
