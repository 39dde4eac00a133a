"""Signed globals: every syncer of a run signs each global it publishes with the
run's one signing key, and learners check each one before anything is applied
(docs/security.md). Rotation adds a key to ``signing.pub`` first, then
replaces ``signing.key``: learners accept every key listed."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import fields, replace

import msgpack
from cryptography.exceptions import InvalidSignature

from broker.errors import ConfigError
from broker.identity.keys import SIGNING_KEY, FileWatch, RunKeys
from broker.wire.messages import GlobalFragment

log = logging.getLogger(__name__)

_DIGEST_DOMAIN = b"ddiloco global v1\0"
# snapshot_signature is a signature of its own (of the version's held form),
# which no change to it can forge: it is not signed again.
_SIGNED_FIELDS = tuple(
    f.name
    for f in fields(GlobalFragment)
    if f.name not in ("payload", "signature", "snapshot_signature")
)


def signing_digest(g: GlobalFragment) -> bytes:
    """SHA-256 over every field of ``g`` but its two signatures, and the
    payload's SHA-256: what the signature covers."""
    values = [g.codec.name if name == "codec" else getattr(g, name) for name in _SIGNED_FIELDS]
    head = msgpack.packb(values, use_bin_type=True)
    payload = hashlib.sha256(g.payload).digest()
    return hashlib.sha256(_DIGEST_DOMAIN + head + payload).digest()


class GlobalSigner:
    """Signs every global a syncer publishes with the run's signing key. A
    rotated key (``ddiloco keys rotate``) is taken up without a restart: the
    key file is looked at (a stat) at most every ``recheck_s``."""

    def __init__(self, keys: RunKeys, recheck_s: float = 1.0) -> None:
        if keys.signing_key is None:
            raise ConfigError(f"{keys.folder}: a syncer needs {SIGNING_KEY}")
        self._keys = keys
        self.watch = FileWatch(keys.folder / SIGNING_KEY, recheck_s)

    def sign(self, g: GlobalFragment) -> GlobalFragment:
        self._take_up_rotation()
        assert self._keys.signing_key is not None
        return replace(g, signature=self._keys.signing_key.sign(signing_digest(g)).hex())

    def _take_up_rotation(self) -> None:
        keys = self._keys.rotated(self.watch, "signing key")
        if keys is not None:
            self._keys = keys
            log.warning("signing with the rotated key in %s", keys.folder)


class GlobalVerifier:
    """Checks globals against the keys in ``signing.pub``. The list is read again
    (at most every ``reread_s``) when a signature fails: a rotation adds the new
    key to the list before any syncer signs with it."""

    def __init__(self, keys: RunKeys, reread_s: float = 5.0) -> None:
        self._keys = keys
        self._reread_s = reread_s
        self._last_read = 0.0

    def verify(self, g: GlobalFragment) -> bool:
        if not g.signature:
            return False
        digest = signing_digest(g)
        signature = bytes.fromhex(g.signature)
        if self._any_key(digest, signature):
            return True
        now = time.monotonic()
        if now - self._last_read >= self._reread_s:
            self._last_read = now
            try:
                self._keys = self._keys.reloaded()
            except ConfigError as e:
                log.warning("signing keys not re-read: %s", e)
                return False
            return self._any_key(digest, signature)
        return False

    def _any_key(self, digest: bytes, signature: bytes) -> bool:
        for key in reversed(self._keys.verify_keys):  # the newest first
            try:
                key.verify(signature, digest)
            except InvalidSignature:
                continue
            return True
        return False
