"""The checks of a wire message's fields, by field name: each raises
:class:`~broker.errors.WireError` with a short reason (a metrics label)."""

from __future__ import annotations

import math
import re
from typing import Any

from broker.errors import WireError
from broker.wire.codecs import Codec

MAX_ID_LEN = 64
MAX_LIST_LEN = 4096
# GlobalFragment.resume: a syncer's small state with about 40 bytes per learner
# (docs/design.md, takeover), within the 64 kB header.
MAX_RESUME_BYTES = 32 * 1024
_U63 = 2**63 - 1
_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_HASH_RE = re.compile(r"^[0-9a-f]{16}$")
_REASON_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_SIGNATURE_RE = re.compile(r"^([0-9a-f]{128})?$")  # Ed25519, hex; empty: unsigned
_KEY_RE = re.compile(r"^[0-9a-f]{64}$")  # a 32-byte public key or digest, hex
ROLES = ("learner", "reader")


# -- field checks -----------------------------------------------------------
def _check_id(name: str, v: Any) -> None:
    if not isinstance(v, str) or not _ID_RE.match(v):
        raise WireError("bad_field", f"{name} must be 1-64 chars of [A-Za-z0-9._:-]")


def _check_uint(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _U63:
        raise WireError("bad_field", f"{name} must be an integer in [0, 2^63)")


def _check_time(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise WireError("bad_field", f"{name} must be a finite non-negative number")


def _check_slot(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < 2**31:
        raise WireError("bad_field", f"{name} must be an integer in [-1, 2^31)")


def _check_version_or_none(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v <= _U63:
        raise WireError("bad_field", f"{name} must be -1 or an integer in [0, 2^63)")


def _check_hash(name: str, v: Any) -> None:
    if not isinstance(v, str) or not _HASH_RE.match(v):
        raise WireError("bad_field", f"{name} must be 16 lowercase hex digits")


def _check_uint_list(name: str, v: Any) -> None:
    if not isinstance(v, list) or len(v) > MAX_LIST_LEN:
        raise WireError("bad_field", f"{name} must be a list of at most {MAX_LIST_LEN} integers")
    for x in v:
        _check_uint(name, x)


def _check_reason(name: str, v: Any) -> None:
    if not isinstance(v, str) or not _REASON_RE.match(v):
        raise WireError("bad_field", f"{name} must be 1-32 chars of [a-z0-9_]")


def _check_signature(name: str, v: Any) -> None:
    if not isinstance(v, str) or not _SIGNATURE_RE.match(v):
        raise WireError("bad_field", f"{name} must be 128 hex digits or empty")


def _check_resume(name: str, v: Any) -> None:
    if not isinstance(v, bytes) or len(v) > MAX_RESUME_BYTES:
        raise WireError("bad_field", f"{name} must be at most {MAX_RESUME_BYTES} bytes")


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise WireError("bad_field", f"{name} must be true or false")


def _check_key(name: str, v: Any) -> None:
    if not isinstance(v, str) or not _KEY_RE.match(v):
        raise WireError("bad_field", f"{name} must be 64 hex digits")


def _check_id_or_empty(name: str, v: Any) -> None:
    if v != "":
        _check_id(name, v)


def _check_key_or_empty(name: str, v: Any) -> None:
    if v != "":
        _check_key(name, v)


def _check_role(name: str, v: Any) -> None:
    if v not in ROLES:
        raise WireError("bad_field", f"{name} must be one of {ROLES}")


def _check_codec(name: str, v: Any) -> None:
    if not isinstance(v, Codec):  # __post_init__ parsed the name; this is a wrong type
        raise WireError("bad_codec", f"{name} must be a codec")


FIELD_CHECKS = {
    "run_id": _check_id,
    "learner_id": _check_id,
    "incarnation": _check_uint,
    "seq": _check_uint,
    "fragment": _check_uint,
    "plan_hash": _check_hash,
    "base_version": _check_uint,
    "base_epoch": _check_uint,
    "epoch": _check_uint,
    "version": _check_uint,
    "term": _check_uint,
    "change_from": _check_version_or_none,
    "weights_crc": _check_uint,
    "step": _check_uint,
    "c_steps": _check_uint,
    "c_tokens": _check_uint,
    "tokens": _check_uint,
    "numel": _check_uint,
    "sent_at": _check_time,
    "step_time_s": _check_time,
    "codec": _check_codec,
    "seqs": _check_uint_list,
    "reason": _check_reason,
    "fragments": _check_uint_list,
    "held_crcs": _check_uint_list,
    "holder": _check_id,
    "held_slot": _check_slot,
    "slot": _check_uint,
    "ttl_s": _check_time,
    "signature": _check_signature,
    "snapshot_signature": _check_signature,
    "resume": _check_resume,
    "weights": _check_bool,
    "key": _check_key,
    "proof": _check_key_or_empty,  # empty: a run without keys
    "role": _check_role,
    "claims": _check_id_or_empty,
    "owner_key": _check_key_or_empty,
}
