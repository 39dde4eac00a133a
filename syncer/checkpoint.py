"""Atomic per-fragment checkpoints: safetensors plus a JSON manifest.

Each fragment's state (its kept versions, momentum, published bytes and
de-duplication state) lives in one file, written to a temporary name, fsynced
and renamed, so a crash leaves either the old or the new state, never a mix.
Weights, momentum and de-duplication state change together in one rename:
that is what makes "applied exactly once" hold across a syncer restart.
Loading never executes code (safetensors holds only tensors and strings).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

META_KEY = "ddiloco"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def fragment_path(directory: Path, fragment: int) -> Path:
    return directory / f"fragment-{fragment:04d}.safetensors"


def save_fragment(
    directory: Path, fragment: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> int:
    """Write one fragment's state atomically; returns the bytes written."""
    data = st_save(
        {k: v.contiguous() for k, v in tensors.items()}, metadata={META_KEY: json.dumps(meta)}
    )
    atomic_write(fragment_path(directory, fragment), data)
    return len(data)


def load_fragment(
    directory: Path, fragment: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    path = fragment_path(directory, fragment)
    if not path.exists():
        return None
    data = path.read_bytes()
    tensors = st_load(data)
    # safetensors keeps metadata in its JSON header: read it without torch.load.
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"][META_KEY])
    return tensors, meta


def save_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write(directory / "manifest.json", json.dumps(manifest, indent=2).encode())


def load_manifest(directory: Path) -> dict[str, Any] | None:
    path = directory / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None
