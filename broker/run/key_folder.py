"""A run's key folder, whole: the key files and certificates
(:mod:`broker.identity.keys`, :mod:`broker.identity.tls`) and the Redis users
the server starts with (:mod:`broker.redis.access`): one folder serves a run
over either transport."""

from __future__ import annotations

from pathlib import Path

from broker.identity.keys import make_key_files
from broker.redis.access import write_acl_file


def make_keys(folder: str | Path, *, overwrite: bool = False) -> Path:
    """Make a run's key folder (0700, every file 0600 but the public ones and
    ``redis.acl``); refuses to replace one unless ``overwrite``: the keys of a
    running run must rotate, not vanish."""
    out = make_key_files(folder, overwrite=overwrite)
    write_acl_file(out)
    return out
