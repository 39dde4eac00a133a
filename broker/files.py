"""Files that both sides of the broker write: atomic replace, private files, events.

A crash must leave either the old file or the new one, never a mix: write to
a temporary name in the same folder, fsync, rename, fsync the folder. Tensor
files are in :mod:`broker.run.tensor_files`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Replace ``path`` with ``data``, or with its parts one after the other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in [data] if isinstance(data, bytes) else data:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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


class EventLog:
    """One JSON object per line, each with a wall-clock time and fixed fields.

    Each line is one ``write`` to a file opened for appending, so processes
    sharing a file (the shards of a syncer service) never cut into each
    other's lines, however long."""

    def __init__(self, path: str | None, **fixed: Any) -> None:
        self.fixed = fixed
        self._fd: int | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, kind: str, **fields: Any) -> None:
        self.write_at(time.time(), kind, **fields)

    def write_at(self, at: float, kind: str, **fields: Any) -> None:
        """An event that happened at wall-clock time ``at``, written now."""
        if self._fd is not None:
            line = json.dumps({"t": at, "event": kind, **self.fixed, **fields}) + "\n"
            os.write(self._fd, line.encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
