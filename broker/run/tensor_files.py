"""Tensor files (the initial model, checkpoints): safetensors, only tensors and a
JSON header, so loading one never executes code; written atomically
(:func:`broker.files.atomic_write`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from broker.files import atomic_write

META_KEY = "ddiloco"  # the safetensors metadata entry that holds our JSON
# safetensors' names of the dtypes written here.
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
    """Write tensors and JSON metadata atomically as a safetensors file; returns
    the bytes written. Each tensor goes to the file straight from its own
    memory: a checkpoint costs no second copy of the state (safetensors' own
    ``save`` builds the whole file in memory first)."""
    flat = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    header: dict[str, Any] = {"__metadata__": {META_KEY: json.dumps(meta)}}
    offset = 0
    for name, t in flat.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    parts: list[bytes | memoryview] = [len(encoded).to_bytes(8, "little"), encoded]
    parts += [t.reshape(-1).view(torch.uint8).numpy().data for t in flat.values() if t.numel()]
    atomic_write(path, parts)
    return 8 + len(encoded) + offset


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and JSON metadata written by :func:`save_tensors` (read through a
    memory map: one copy of the tensors in memory, not two)."""
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    meta = json.loads(metadata.get(META_KEY, "{}"))
    return load_file(path), meta
