"""The syncer's per-fragment checkpoints: a full state every N rounds, and
between them a log of each round's published change.

A fragment's full state (its kept versions, master, momentum and
de-duplication state) lives in one safetensors file, written atomically
(:mod:`broker.files`), so a crash leaves either the old or the new state,
never a mix. Between two full states each round appends one record to the
fragment's log, fsynced before anything of the round leaves: the compact
change it published (about 0.2 bytes per parameter at int2+zstd, where the
full state is 12) and the fragment's small state (de-duplication, token
accounting, quarantine windows). The change and the de-duplication state of
a round are in one record: that is what makes "applied exactly once" hold
across a syncer restart. A record cut short by a crash is one whose round
was never published or acknowledged: it is dropped, and its deltas come
again.

A restart loads the full state and replays the records after it, each
change rebuilding the version exactly as learners built it; the master's
lead over the published version (rounding error not yet published) and the
momentum's last rounds are what a replay does not restore (docs/design.md,
"Exactly once").
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import torch

from broker.files import atomic_write, fsync_dir
from broker.run.tensor_files import load_tensors, save_tensors

# A log record: the body's length and CRC-32, then the body (msgpack).
_RECORD_HEAD = struct.Struct("<II")


def fragment_path(directory: Path, fragment: int) -> Path:
    return directory / f"fragment-{fragment:04d}.safetensors"


def log_path(directory: Path, fragment: int) -> Path:
    return directory / f"fragment-{fragment:04d}.log"


def save_fragment(
    directory: Path, fragment: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> int:
    """Write one fragment's full state atomically, then drop its log (the state
    contains every record of it); returns the bytes written."""
    written = save_tensors(fragment_path(directory, fragment), tensors, meta)
    log = log_path(directory, fragment)
    if log.exists():
        log.unlink()
        fsync_dir(directory)
    return written


def append_change(
    directory: Path, fragment: int, version: int, change: bytes | memoryview, meta: dict[str, Any]
) -> int:
    """Append a round's record to the fragment's log and fsync it: ``change``, the
    published change that made ``version``, and ``meta``, the fragment's small
    state after the round. Returns the bytes written."""
    body = msgpack.packb(
        {"version": version, "change": bytes(change), "meta": meta}, use_bin_type=True
    )
    record = _RECORD_HEAD.pack(len(body), zlib.crc32(body)) + body
    path = log_path(directory, fragment)
    created = not path.exists()
    with open(path, "ab") as f:
        f.write(record)
        f.flush()
        os.fsync(f.fileno())
    if created:
        fsync_dir(directory)
    return len(record)


def read_changes(
    directory: Path, fragment: int, *, cut: bool = False
) -> list[tuple[int, bytes, dict[str, Any]]]:
    """The records of the fragment's log, in order: (version, change, meta). A
    record cut short or damaged (a crash while it was written) ends the log;
    with ``cut`` (the syncer, as it starts) the file is cut back to the
    records before it, so that the records it appends follow them."""
    path = log_path(directory, fragment)
    if not path.exists():
        return []
    data = path.read_bytes()
    records, at = [], 0
    while at + _RECORD_HEAD.size <= len(data):
        length, crc = _RECORD_HEAD.unpack_from(data, at)
        body = data[at + _RECORD_HEAD.size : at + _RECORD_HEAD.size + length]
        if len(body) < length or zlib.crc32(body) != crc:
            break
        record = msgpack.unpackb(body, raw=False)
        records.append((int(record["version"]), record["change"], record["meta"]))
        at += _RECORD_HEAD.size + length
    if cut and at < len(data):
        with open(path, "r+b") as f:
            f.truncate(at)
            os.fsync(f.fileno())
    return records


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
