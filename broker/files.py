"""Files that both sides of the broker write: atomic replace, safetensors, events.

A crash must leave either the old file or the new one, never a mix: write to
a temporary name in the same folder, fsync, rename, fsync the folder. Tensor
files are safetensors (only tensors and a JSON header), so loading one never
executes code.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

META_KEY = "ddiloco"  # the safetensors metadata entry that holds our JSON


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


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to a file of ``mode`` (0600: never readable by others, not
    even briefly) atomically: for keys and secrets."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)  # whatever the umask took away
    os.replace(tmp, path)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
    """Write tensors and JSON metadata atomically; returns the bytes written."""
    data = st_save(
        {k: v.contiguous() for k, v in tensors.items()}, metadata={META_KEY: json.dumps(meta)}
    )
    atomic_write(path, data)
    return len(data)


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON metadata written by :func:`save_tensors`."""
    data = path.read_bytes()
    tensors = st_load(data)
    # safetensors keeps metadata in its JSON header: read it without torch.load.
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    meta = json.loads(header.get("__metadata__", {}).get(META_KEY, "{}"))
    return tensors, meta


class EventLog:
    """One JSON object per line, each with a wall-clock time and fixed fields."""

    def __init__(self, path: str | None, **fixed: Any) -> None:
        self.fixed = fixed
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())

    def write(self, kind: str, **fields: Any) -> None:
        self.write_at(time.time(), kind, **fields)

    def write_at(self, at: float, kind: str, **fields: Any) -> None:
        """An event that happened at wall-clock time ``at``, written now."""
        if self._file is not None:
            self._file.write(json.dumps({"t": at, "event": kind, **self.fixed, **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
