"""The run's keys, and who holds which (docs/security.md).

``ddiloco keys --keys DIR`` makes a run's key folder; every file is 0600::

    join.secret        32 random bytes, hex: enrolls a process in the run
                       (learners, evaluators and syncers hold it)
    syncer.curve       the syncers' CURVE secret key, z85          (syncers only)
    syncer.curve.pub   its public key, z85                         (everyone)
    signing.key        the syncers' Ed25519 signing key, hex       (syncers only)
    signing.pub        Ed25519 public keys that sign globals, hex,
                       one per line, the newest last               (everyone)
    revoked            learner ids shut out of the run, one per line
                       (``ddiloco keys revoke ID``; syncers read it)
    tls.ca.crt, tls.ca.key, redis.crt, redis.key
                       the run's CA and the Redis server's certificate, for
                       ``rediss://`` (:mod:`broker.identity.tls`)
    redis.syncer       the syncers' Redis password, hex            (syncers only)
    redis.acl          the Redis users a run starts with: the file Redis loads
                       (``--aclfile``; :mod:`broker.redis.access`)

A learner's identity is its own key pair, made when it starts (kept in its
``state_dir`` when it has one, so a restart is the same learner): it enrolls
with a proof made from the join secret (:func:`enroll_proof`), and the syncer
binds its learner id and slot to that key. Replicas of one service share
their mounts, so identity cannot be a file handed to each of them.

Globals are signed with the one run signing key by every syncer of the run,
and learners check each one before anything is applied
(:mod:`broker.identity.signing`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from zmq.utils import z85

from broker.errors import ConfigError
from broker.files import write_private
from broker.identity.tls import TLS_CA, make_tls

log = logging.getLogger(__name__)

DEFAULT_KEYS_DIR = "keys"  # a run's key folder where none is named
JOIN_SECRET = "join.secret"
CURVE_SECRET = "syncer.curve"
CURVE_PUBLIC = "syncer.curve.pub"
SIGNING_KEY = "signing.key"
SIGNING_PUBLIC = "signing.pub"
REVOKED = "revoked"
REDIS_SYNCER = "redis.syncer"
REDIS_ACL = "redis.acl"
REDIS_SENTINEL = "redis.sentinel"  # the Redis servers' and Sentinels' own password
# What each role needs to start; a missing file is named in the error.
NEEDED = {
    "syncer": (
        JOIN_SECRET,
        CURVE_SECRET,
        CURVE_PUBLIC,
        SIGNING_KEY,
        SIGNING_PUBLIC,
        REDIS_SYNCER,
    ),
    "learner": (JOIN_SECRET, CURVE_PUBLIC, SIGNING_PUBLIC),
    "reader": (JOIN_SECRET, CURVE_PUBLIC, SIGNING_PUBLIC),
}
_PUBLIC_FILES = (CURVE_PUBLIC, SIGNING_PUBLIC, TLS_CA)  # may be readable by others
_ENROLL_DOMAIN = b"ddiloco enroll v1\0"
_MAX_KEY_FILE_BYTES = 64 * 1024


def _read(folder: Path, name: str) -> str:
    path = folder / name
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO) and name not in _PUBLIC_FILES:
            raise ConfigError(
                f"{path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 it"
            )
        with path.open("rb") as f:
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(
            f"no {name} in the run's key folder {folder}: make the keys with "
            f"`ddiloco keys --keys {folder}`, or run with --insecure (no keys: anyone "
            "who reaches the ports can read and steer the run)"
        ) from None
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {_MAX_KEY_FILE_BYTES} bytes, not a key file")
    return data.decode("ascii", errors="replace").strip()


def _hex_bytes(folder: Path, name: str, size: int) -> bytes:
    text = _read(folder, name)
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != size:
        raise ConfigError(f"{folder / name}: expected {2 * size} hex digits")
    return value


def read_secret_hex(folder: Path, name: str) -> str:
    """A 32-byte secret of the folder, as the hex it is kept in."""
    return _hex_bytes(folder, name, 32).hex()


def _curve_key(folder: Path, name: str) -> bytes:
    """A z85 CURVE key; of a list (``syncer.curve.pub`` after a rotation), the
    newest: the last line."""
    lines = [line.strip() for line in _read(folder, name).splitlines() if line.strip()]
    if not lines or any(len(line) != 40 for line in lines):
        raise ConfigError(f"{folder / name}: expected 40-character z85 CURVE keys, one a line")
    return lines[-1].encode()


def _public_keys(folder: Path) -> tuple[Ed25519PublicKey, ...]:
    keys = []
    for line in _read(folder, SIGNING_PUBLIC).splitlines():
        if line.strip():
            try:
                keys.append(Ed25519PublicKey.from_public_bytes(bytes.fromhex(line.strip())))
            except ValueError:
                raise ConfigError(
                    f"{folder / SIGNING_PUBLIC}: {line[:20]!r}... is no key"
                ) from None
    if not keys:
        raise ConfigError(f"{folder / SIGNING_PUBLIC}: lists no key")
    return tuple(keys)


def _raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def make_key_files(folder: str | Path, *, overwrite: bool = False) -> Path:
    """Make a run's key files and TLS certificates (0700, every file 0600): all
    but ``redis.acl`` (:func:`broker.run.key_folder.make_keys` makes the folder
    whole); refuses to replace one unless ``overwrite``: the keys of a running
    run must rotate, not vanish."""
    out = Path(folder)
    if (out / JOIN_SECRET).exists() and not overwrite:
        raise ConfigError(f"{out} holds a run's keys already; rotate them (`ddiloco keys rotate`)")
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    curve_public, curve_secret = zmq.curve_keypair()
    signing = Ed25519PrivateKey.generate()
    write_private(out / JOIN_SECRET, secrets.token_bytes(32).hex() + "\n")
    write_private(out / REDIS_SYNCER, secrets.token_hex(32) + "\n")
    write_private(out / REDIS_SENTINEL, secrets.token_hex(32) + "\n")
    write_private(out / CURVE_SECRET, curve_secret.decode() + "\n")
    write_private(out / CURVE_PUBLIC, curve_public.decode() + "\n")
    write_private(out / SIGNING_KEY, _raw_private(signing).hex() + "\n")
    write_private(out / SIGNING_PUBLIC, _raw_public(signing).hex() + "\n")
    write_private(out / REVOKED, "")
    make_tls(out)
    return out


def rotate_signing_key(folder: str | Path) -> str:
    """A new signing key: its public half is listed beside the old ones first
    (learners that re-read the list accept both), then syncers sign with it.
    Returns the new public key, hex."""
    out = Path(folder)
    old = _read(out, SIGNING_PUBLIC)
    signing = Ed25519PrivateKey.generate()
    new_public = _raw_public(signing).hex()
    write_private(out / SIGNING_PUBLIC, f"{old}\n{new_public}\n")
    write_private(out / SIGNING_KEY, _raw_private(signing).hex() + "\n")
    return new_public


def rotate_curve_key(folder: str | Path) -> str:
    """A new CURVE key pair for the syncers: its public half is listed after the
    old ones first (learners that re-read the list dial the newest), then the
    syncers' secret is replaced (they bind again with it). Returns the new
    public key, z85."""
    out = Path(folder)
    old = _read(out, CURVE_PUBLIC)
    public, secret = zmq.curve_keypair()
    write_private(out / CURVE_PUBLIC, f"{old}\n{public.decode()}\n")
    write_private(out / CURVE_SECRET, secret.decode() + "\n")
    return public.decode()


def revoke(folder: str | Path, learner_id: str) -> None:
    """Add ``learner_id`` to the revoked list the syncers read."""
    out = Path(folder)
    path = out / REVOKED
    listed = path.read_text().split() if path.exists() else []
    if learner_id not in listed:
        write_private(path, "".join(f"{x}\n" for x in [*listed, learner_id]))


def read_revoked(folder: Path) -> frozenset[str]:
    path = folder / REVOKED
    if not path.exists():
        return frozenset()
    return frozenset(_read(folder, REVOKED).split())


# -- roles ------------------------------------------------------------------
@dataclass(frozen=True)
class RunKeys:
    """The key folder as one role sees it: a learner or reader holds the join
    secret and the public keys, a syncer also the secret ones."""

    folder: Path
    role: str
    join_secret: bytes
    curve_public: bytes  # the syncers' CURVE server key, z85
    verify_keys: tuple[Ed25519PublicKey, ...]
    curve_secret: bytes | None = None
    signing_key: Ed25519PrivateKey | None = None
    redis_password: str | None = None  # the syncers' Redis user's

    @classmethod
    def load(cls, folder: str | Path, role: str) -> RunKeys:
        """The keys ``role`` needs from ``folder``; :class:`ConfigError` names what is missing."""
        where = Path(folder).expanduser()
        if role not in NEEDED:
            raise ConfigError(f"role {role!r}: one of {sorted(NEEDED)}")
        if not where.is_dir():
            raise ConfigError(
                f"no run key folder at {where}: make one with `ddiloco keys --keys {where}`, "
                "or run with --insecure (no keys: anyone who reaches the ports can read "
                "and steer the run)"
            )
        # Each file is read once below; a missing one is named by _read.
        syncer = role == "syncer"
        return cls(
            folder=where,
            role=role,
            join_secret=_hex_bytes(where, JOIN_SECRET, 32),
            curve_public=_curve_key(where, CURVE_PUBLIC),
            verify_keys=_public_keys(where),
            curve_secret=_curve_key(where, CURVE_SECRET) if syncer else None,
            signing_key=(
                Ed25519PrivateKey.from_private_bytes(_hex_bytes(where, SIGNING_KEY, 32))
                if syncer
                else None
            ),
            redis_password=_hex_bytes(where, REDIS_SYNCER, 32).hex() if syncer else None,
        )

    def reloaded(self) -> RunKeys:
        """The same role's keys as the folder holds them now (after a rotation)."""
        return RunKeys.load(self.folder, self.role)

    def rotated(self, watch: FileWatch, what: str) -> RunKeys | None:
        """The keys as the folder holds them now if ``watch``'s file was replaced
        since last looked at; None if not, or if they cannot be read (said in
        the log: the process goes on with the keys it has)."""
        if not watch.changed():
            return None
        try:
            return self.reloaded()
        except ConfigError as e:
            log.warning("%s not re-read (%s): going on with the one loaded", what, e)
            return None

    def revoked(self) -> frozenset[str]:
        return read_revoked(self.folder)

    def tls_ca(self) -> Path:
        """The run's CA certificate, which a ``rediss://`` client checks the server by."""
        path = self.folder / TLS_CA
        if not path.is_file():
            raise ConfigError(
                f"no {TLS_CA} in the run's key folder {self.folder}: rediss:// needs the "
                f"run's CA; make the keys again with `ddiloco keys --keys {self.folder} --force`"
            )
        return path


@dataclass(frozen=True)
class Identity:
    """A process's own CURVE key pair (z85): who it is to the syncers."""

    public: bytes
    secret: bytes

    @property
    def key_hex(self) -> str:
        return curve_key_hex(self.public)

    @classmethod
    def new(cls) -> Identity:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def kept_in(cls, path: Path | None) -> Identity:
        """The identity saved at ``path`` (made there, 0600, if missing), so that a
        restarted process is the same learner; a new one when ``path`` is None
        or cannot be written (said in the log: a restart is then a newcomer)."""
        if path is None:
            return cls.new()
        if path.exists():
            secret = _read(path.parent, path.name).encode()
            try:
                public = zmq.curve_public(secret)
            except (zmq.ZMQError, ValueError):
                raise ConfigError(f"{path}: not a CURVE secret key; delete it") from None
            return cls(public, secret)
        identity = cls.new()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, identity.secret.decode() + "\n")
        except OSError as e:
            log.warning("identity not kept (%s): a restart of this process is a newcomer", e)
        return identity


IDENTITY_HOME = "~/.local/state/ddiloco"


def identity_path(run_id: str, name: str) -> Path:
    """Where the process named ``name`` (a learner id, or a slot's holder) keeps
    its identity for run ``run_id``: under its own home, so that a restart (of
    the process, or of its container) is the same learner, and replicas of a
    service, which share their volumes, never share a key."""
    return Path(IDENTITY_HOME).expanduser() / run_id / f"{name}.identity"


def curve_key_hex(z85_key: bytes | str) -> str:
    """A z85 CURVE key (as ZeroMQ's ZAP names it) in the hex of an
    :class:`~broker.wire.messages.Enroll`."""
    raw = z85_key.encode() if isinstance(z85_key, str) else z85_key
    return z85.decode(raw).hex()


def enroll_proof(join_secret: bytes, run_id: str, key_hex: str, role: str) -> str:
    """HMAC-SHA256 of run, key and role under the join secret, hex."""
    message = _ENROLL_DOMAIN + f"{run_id}\0{key_hex}\0{role}".encode()
    return hmac.new(join_secret, message, hashlib.sha256).hexdigest()


def proof_ok(join_secret: bytes, run_id: str, key_hex: str, role: str, proof: str) -> bool:
    return hmac.compare_digest(enroll_proof(join_secret, run_id, key_hex, role), proof)


class FileWatch:
    """Whether a key file was replaced since last looked at (its mtime and
    inode), looked at (a stat) at most every ``every_s``: how a running process
    takes up a rotation (``ddiloco keys rotate``, ``rotate-curve``)."""

    def __init__(self, path: Path, every_s: float = 1.0) -> None:
        self._path = path
        self.every_s = every_s
        self._checked = time.monotonic()
        self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[int, int]:
        st = self._path.stat()
        return st.st_mtime_ns, st.st_ino

    def changed(self) -> bool:
        now = time.monotonic()
        if now - self._checked < self.every_s:
            return False
        self._checked = now
        try:
            stamp = self._file_stamp()
        except OSError as e:
            log.warning("%s not looked at (%s)", self._path, e)
            return False
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True
