"""Atomic per-fragment checkpoints of the syncer: safetensors plus a JSON manifest.

Each fragment's state (its kept versions, momentum, published bytes and
de-duplication state) lives in one file, written atomically
(:mod:`broker.files`), so a crash leaves either the old or the new state,
never a mix. Weights, momentum and de-duplication state change together in one
rename: that is what makes "applied exactly once" hold across a syncer restart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from broker.files import atomic_write, load_tensors, save_tensors


def fragment_path(directory: Path, fragment: int) -> Path:
    return directory / f"fragment-{fragment:04d}.safetensors"


def save_fragment(
    directory: Path, fragment: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> int:
    """Write one fragment's state atomically; returns the bytes written."""
    return save_tensors(fragment_path(directory, fragment), tensors, meta)


def load_fragment(
    directory: Path, fragment: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    path = fragment_path(directory, fragment)
    if not path.exists():
        return None
    return load_tensors(path)


def save_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write(directory / "manifest.json", json.dumps(manifest, indent=2).encode())


def load_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None
