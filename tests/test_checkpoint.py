"""Atomic checkpoint files: round trips, checked with safetensors' own reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from broker.files import atomic_write
from syncer.checkpoint import (
    append_change,
    fragment_path,
    load_fragment,
    load_manifest,
    log_path,
    read_changes,
    save_fragment,
    save_manifest,
)

torch.set_num_threads(1)


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "version.3": torch.randn(17, generator=g),
        "version.4": torch.randn(17, generator=g),
        "momentum": torch.randn(17, generator=g),
        "payload": torch.randint(0, 256, (40,), generator=g, dtype=torch.uint8),
        "matrix": torch.randn(3, 5, generator=g).t(),  # not contiguous
        "halves": torch.randn(6, generator=g).to(torch.bfloat16),
        "counts": torch.arange(5, dtype=torch.int64),
    }


META = {
    "fragment": 2,
    "version": 4,
    "applied": {"learner-0": [1, 7], "learner-1": [0, 12]},
    "note": "ünïcode ok",
}


def test_fragment_round_trip(tmp_path: Path) -> None:
    tensors = sample_tensors()
    written = save_fragment(tmp_path, 2, tensors, META)
    path = fragment_path(tmp_path, 2)
    assert path == tmp_path / "fragment-0002.safetensors"
    assert written == path.stat().st_size > 0

    loaded = load_fragment(tmp_path, 2)
    assert loaded is not None
    got, meta = loaded
    assert meta == META
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_file_is_plain_safetensors(tmp_path: Path) -> None:
    """Read back with the safetensors library alone: no pickles, metadata as JSON."""
    tensors = sample_tensors()
    save_fragment(tmp_path, 0, tensors, META)
    with safe_open(str(fragment_path(tmp_path, 0)), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert torch.equal(f.get_tensor("momentum"), tensors["momentum"])
        metadata = f.metadata()
    assert json.loads(metadata["ddiloco"]) == META


def test_save_replaces_the_previous_state(tmp_path: Path) -> None:
    save_fragment(tmp_path, 1, {"version.0": torch.zeros(4)}, {"version": 0})
    save_fragment(tmp_path, 1, {"version.1": torch.ones(4)}, {"version": 1})
    loaded = load_fragment(tmp_path, 1)
    assert loaded is not None
    got, meta = loaded
    assert meta == {"version": 1}
    assert list(got) == ["version.1"] and torch.equal(got["version.1"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fragment-0001.safetensors"]


def test_load_of_a_missing_fragment_is_none(tmp_path: Path) -> None:
    assert load_fragment(tmp_path, 0) is None
    assert load_fragment(tmp_path / "does-not-exist", 3) is None
    save_fragment(tmp_path, 0, {"x": torch.zeros(1)}, {})
    assert load_fragment(tmp_path, 1) is None


def test_atomic_write_creates_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "dir" / "state.bin"
    atomic_write(target, b"first")
    assert target.read_bytes() == b"first"
    atomic_write(target, b"second, longer")
    assert target.read_bytes() == b"second, longer"
    atomic_write(target, b"")
    assert target.read_bytes() == b""
    assert [p.name for p in target.parent.iterdir()] == ["state.bin"]


def test_failed_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    atomic_write(target, b"good")
    with pytest.raises(TypeError):
        atomic_write(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_manifest_round_trip(tmp_path: Path) -> None:
    assert load_manifest(tmp_path) is None
    manifest = {
        "run_id": "r1",
        "plan_hash": "0123456789abcdef",
        "fragments": 4,
        "sync_every": 24,
        "model": {"d_model": 128, "n_layer": 4},
    }
    save_manifest(tmp_path, manifest)
    assert load_manifest(tmp_path) == manifest
    # It is plain JSON on disk.
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    save_manifest(tmp_path, {"run_id": "r2"})
    assert load_manifest(tmp_path) == {"run_id": "r2"}
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_log_records_come_back_in_order(tmp_path: Path) -> None:
    for v in (5, 6, 7):
        append_change(tmp_path, 3, v, bytes([v]) * 100, {"version": v, "applied": {"a": [0, v]}})
    records = read_changes(tmp_path, 3)
    assert [(v, change, meta["applied"]) for v, change, meta in records] == [
        (v, bytes([v]) * 100, {"a": [0, v]}) for v in (5, 6, 7)
    ]
    assert read_changes(tmp_path, 4) == []


@pytest.mark.parametrize("cut", [1, 7, 50])
def test_a_record_cut_short_ends_the_log_and_is_cut_off(tmp_path: Path, cut: int) -> None:
    """A crash while a record was written: the records before it stand, it is
    dropped (its round was never published), and the next record follows them."""
    append_change(tmp_path, 0, 1, b"one", {})
    append_change(tmp_path, 0, 2, b"two" * 30, {})
    path = log_path(tmp_path, 0)
    path.write_bytes(path.read_bytes()[:-cut])
    assert [v for v, _, _ in read_changes(tmp_path, 0)] == [1]
    assert [v for v, _, _ in read_changes(tmp_path, 0, cut=True)] == [1]
    append_change(tmp_path, 0, 2, b"again", {})
    assert [(v, c) for v, c, _ in read_changes(tmp_path, 0)] == [(1, b"one"), (2, b"again")]


def test_a_damaged_record_ends_the_log(tmp_path: Path) -> None:
    append_change(tmp_path, 0, 1, b"one", {})
    append_change(tmp_path, 0, 2, b"two", {})
    data = bytearray(log_path(tmp_path, 0).read_bytes())
    data[-2] ^= 0xFF  # in the second record's body: its CRC no longer matches
    log_path(tmp_path, 0).write_bytes(bytes(data))
    assert [v for v, _, _ in read_changes(tmp_path, 0)] == [1]


def test_a_full_state_drops_the_log(tmp_path: Path) -> None:
    append_change(tmp_path, 2, 1, b"one", {})
    save_fragment(tmp_path, 2, {"version.1": torch.ones(4)}, {"version": 1})
    assert not log_path(tmp_path, 2).exists() and read_changes(tmp_path, 2) == []
