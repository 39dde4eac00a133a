"""Who talks to a run's Redis with the run's keys (docs/security.md): the users'
names and how each password is derived. What each user may do is
:mod:`broker.redis.access`.
"""

from __future__ import annotations

import hashlib
import hmac

SYNCER_USER = "ddiloco-syncer"
JOIN_USER = "ddiloco-join"
# The Redis servers' and Sentinels' own user: replicas sync from the primary as
# it, and Sentinels monitor, reconfigure and talk to each other as it.
SENTINEL_USER = "ddiloco-sentinel"
_JOIN_DOMAIN = b"ddiloco redis join v1\0"
_MEMBER_DOMAIN = b"ddiloco redis member v1\0"


def join_password(join_secret: bytes) -> str:
    """The ``ddiloco-join`` user's password: every holder of the join secret has it."""
    return hmac.new(join_secret, _JOIN_DOMAIN, hashlib.sha256).hexdigest()


def member_password(identity_secret: bytes) -> str:
    """A member's password, from its own identity's secret key."""
    return hmac.new(identity_secret, _MEMBER_DOMAIN, hashlib.sha256).hexdigest()


def password_digest(password: str) -> str:
    """SHA-256 of a password, hex: what Redis keeps of it, and a member's key."""
    return hashlib.sha256(password.encode()).hexdigest()


def member_user(run_id: str, key: str) -> str:
    return f"ddiloco:{run_id}:k:{key[:32]}"
