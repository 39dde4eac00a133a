"""The kept versions (syncer/versions.py): the current one as fp32, the older
ones as the changes published after them, against versions recorded whole."""

from __future__ import annotations

import gc

import pytest
import torch

from broker.wire.codecs import Codec
from syncer.aggregation import StaleDelta
from syncer.versions import Versions, canonical

N = 70_000  # not a whole number of blocks


def published(codec: str, depth: int, versions: int) -> tuple[Versions, dict[int, torch.Tensor]]:
    """``versions`` versions of a master moving by outer steps of about 1e-3,
    kept at ``depth``, and every one of them recorded whole."""
    c = Codec.parse(codec)
    gen = torch.Generator().manual_seed(0)
    master = 0.02 * torch.randn(N, generator=gen)
    first, publication = canonical(c, master)
    kept = Versions(depth, first, publication, 0, 0.0)
    record = {0: first.clone()}
    for v in range(1, versions):
        master = master + 1e-3 * torch.randn(N, generator=gen)
        version, publication = canonical(c, master, kept.current)
        kept.push(version, publication, float(v))
        record[v] = version.clone()
    return kept, record


@pytest.mark.parametrize("codec", ["int2+zstd", "int8", "fp32"])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_the_last_depth_versions_are_kept_and_no_older(codec: str, depth: int) -> None:
    kept, record = published(codec, depth, 9)
    assert kept.kept == list(range(9 - depth, 9))
    assert torch.equal(kept.current, record[8])
    for old in range(0, 9 - depth):
        with pytest.raises(StaleDelta) as info:
            kept.shift(old)
        assert info.value.reason == "stale"
    with pytest.raises(StaleDelta) as info:
        kept.shift(9)
    assert info.value.reason == "future_version"
    assert kept.shift(8) == (None, 0.0)


@pytest.mark.parametrize("codec", ["int2+zstd", "int8", "fp32"])
def test_shifts_are_the_published_versions_difference_within_a_rounding(codec: str) -> None:
    """docs/design.md, rule 1: the sum of the changes differs from the difference
    of the versions learners hold by less than one fp32 rounding of the
    largest weight (measured: 0.33 of one at int2, 29 versions at S = 4)."""
    kept, record = published(codec, 4, 30)
    eps = torch.finfo(torch.float32).eps
    for base in kept.kept[:-1]:
        shift, magnitude = kept.shift(base)
        assert shift is not None
        exact = record[kept.version].double() - record[base].double()
        error = (shift.double() - exact).abs().max().item()
        assert error <= eps * record[kept.version].abs().max().item()
        assert magnitude == shift.abs().max().item()
        assert kept.shift_bound(base) >= magnitude


def test_older_versions_cost_their_compact_changes_not_fp32_copies() -> None:
    """At int2+zstd, S = 4 keeps one fp32 version and three changes of under
    0.3 bytes per parameter each; fp32 globals keep four fp32 versions."""
    kept, _ = published("int2+zstd", 4, 9)
    tensors = kept.tensors()
    whole = [name for name, t in tensors.items() if t.numel() == N and t.dtype == torch.float32]
    assert whole == ["version.8"]
    changes = {name: t.numel() for name, t in tensors.items() if name.startswith("change.")}
    assert sorted(changes) == ["change.6", "change.7", "change.8"]
    assert all(size < 0.3 * N for size in changes.values())
    weights, _ = published("fp32", 4, 9)
    assert sorted(weights.tensors()) == [f"version.{v}" for v in range(5, 9)]


@pytest.mark.parametrize("codec", ["int2+zstd", "fp32"])
def test_a_checkpoint_restores_every_kept_version(codec: str) -> None:
    kept, record = published(codec, 4, 7)
    fresh = Versions(4, torch.zeros(N), canonical(Codec.parse(codec), torch.zeros(N))[1], 0, 0.0)
    fresh.load(
        {k: t.clone() for k, t in kept.tensors().items()},
        kept.published_at,
        {int(v): m for v, m in kept.magnitudes().items()},
        Codec.parse(codec),
    )
    assert fresh.kept == kept.kept and torch.equal(fresh.current, record[6])
    assert not fresh.publication.is_change  # the current one goes out whole after a restart
    for base in kept.kept[:-1]:
        assert torch.equal(fresh.shift(base)[0], kept.shift(base)[0])  # type: ignore[arg-type]
        assert fresh.shift_bound(base) == kept.shift_bound(base)


def test_the_current_version_is_written_over_only_when_nothing_views_it() -> None:
    """A transport may still serve the current version's bytes as a snapshot:
    the next version then goes into new memory."""
    kept, _ = published("int2+zstd", 4, 3)
    assert kept.writable()
    snapshot = kept.snapshot
    assert not kept.writable()
    del snapshot
    gc.collect()
    assert kept.writable()
    held = kept.current  # another name for it: someone else's tensor
    assert not kept.writable()
    del held
    assert kept.writable()
