"""Wire format: one self-checking frame per message.

    magic "DDL1" | header_len u32 | payload_len u32 | header | payload | crc32 u32

All integers little endian. The header is a msgpack map holding the schema
version, the message kind and its metadata; the payload holds raw tensor
bytes (already encoded by a codec). Nothing is pickled. Every size is checked
against a limit before anything is allocated or unpacked, the checksum is
verified before the header is parsed, and every field is type- and
range-checked afterwards. Any failure raises :class:`WireError` with a short
machine-readable ``reason`` that services use as a metrics label.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import msgpack
import torch

from broker.errors import ConfigError  # re-exported: defined in broker.errors
from broker.errors import WireError as WireError
from broker.wire.codecs import Buffer, Codec, CodecError
from broker.wire.fields import FIELD_CHECKS, MAX_LIST_LEN, MAX_RESUME_BYTES

try:
    # ISA-L's CRC-32 is zlib's checksum (same polynomial, same frames), computed
    # with carry-less multiplies: about 3x zlib's speed on a 16 MB fragment,
    # which every frame pays twice (sender and receiver).
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheel
    from zlib import crc32

# 2: globals carry their syncer epoch, deltas their base's; 3: a global may be a
# change, and names the checksum of the weights it makes; 6: globals and acks
# carry their syncer's term; 7: globals carry what a successor resumes from
# (resume, snapshot_signature), learners answer a syncer's Recall
SCHEMA_VERSION = 7
MAGIC = b"DDL1"
_PREFIX = struct.Struct("<4sII")
_CRC = struct.Struct("<I")
FRAME_PREFIX_BYTES = _PREFIX.size + _CRC.size  # what a frame adds to header and payload
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 512 * 1024 * 1024


def weights_checksum(weights: Any) -> int:
    """CRC-32 of a flat fp32 tensor's bytes (what ``GlobalFragment.weights_crc`` holds)."""
    flat = weights.detach().reshape(-1).contiguous()
    if flat.dtype != torch.float32:
        raise ConfigError(f"weights_checksum takes fp32 weights, not {flat.dtype}")
    return int(crc32(flat.numpy().data.cast("B")))


# -- messages ---------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""

    def validate(self) -> None:
        for f in fields(self):
            if f.name != "payload":
                FIELD_CHECKS[f.name](f.name, getattr(self, f.name))


@dataclass(frozen=True)
class _TensorMessage(Message):
    # On the wire the codec travels as its name; in memory it is parsed once,
    # here, and every later size check and decode uses the parsed object.
    codec: Codec = Codec()
    numel: int = 0
    # Sent as given; a decoded message's payload is a read-only view into the
    # received buffer (decoding copies nothing).
    payload: Buffer = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.codec, str):
            try:
                object.__setattr__(self, "codec", Codec.parse(self.codec))
            except CodecError as e:
                raise WireError("bad_codec", str(e)) from None

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise WireError("bad_field", "payload must be bytes")
        codec = self.codec
        expected = codec.quantised_size(self.numel)
        if expected > DEFAULT_MAX_PAYLOAD_BYTES:
            raise WireError("too_large", f"{self.numel} values decode past the payload limit")
        if codec.lossless == "none" and len(self.payload) != expected:
            raise WireError(
                "bad_size", f"{self.codec} payload of {self.numel} values must be {expected} bytes"
            )

    def tensor(self, out: Any = None) -> Any:
        """Decode the payload to a flat fp32 tensor (into ``out`` if given)."""
        try:
            return self.codec.decode(self.payload, self.numel, out)
        except CodecError as e:
            raise WireError("bad_payload", str(e)) from None

    def quantised(self, out: bytearray | None = None) -> Any:
        """The payload's quantised bytes, out of its lossless stage and size-checked
        (:meth:`broker.wire.codecs.Codec.quantised`, into ``out``), for code that reads
        the codes."""
        try:
            return self.codec.quantised(self.payload, self.numel, out)
        except CodecError as e:
            raise WireError("bad_payload", str(e)) from None


@dataclass(frozen=True)
class Delta(_TensorMessage):
    """A learner's pseudo-gradient for one fragment: Theta(base) - theta_local."""

    KIND: ClassVar[str] = "delta"
    run_id: str = ""
    learner_id: str = ""
    incarnation: int = 0  # distinguishes restarts of the same learner id
    seq: int = 0  # per (learner, incarnation), strictly increasing
    fragment: int = 0
    plan_hash: str = ""
    base_epoch: int = 0  # the epoch of the global the delta is based on
    base_version: int = 0
    step: int = 0
    c_steps: int = 0
    c_tokens: int = 0
    sent_at: float = 0.0


@dataclass(frozen=True)
class GlobalFragment(_TensorMessage):
    """The syncer's new global weights of one fragment."""

    KIND: ClassVar[str] = "global"
    run_id: str = ""
    fragment: int = 0
    plan_hash: str = ""
    # A syncer that starts without its checkpoint starts a new epoch: versions
    # restart at 0 and compare only within an epoch, so it can never lock
    # learners out with versions below the ones they hold.
    epoch: int = 0
    version: int = 0
    sent_at: float = 0.0
    # -1: the payload is the fragment's weights (a snapshot). Otherwise the
    # version it is the change from, always version - 1 of the same epoch: the
    # receiver adds it to the weights of that version it holds
    # (:func:`broker.wire.codecs.apply_change`), and one that does not hold them
    # fetches a snapshot.
    change_from: int = -1
    # CRC-32 of the fp32 bytes of this version's weights (weights_checksum): a
    # receiver whose rebuilt version differs notices, and fetches the snapshot.
    weights_crc: int = 0
    # The term its syncer holds the fragment's shard under (0: no lease). A
    # learner refuses a global or an ack of a lower term than one it took: a
    # syncer that woke after another took its shard over is heard no more.
    term: int = 0
    # Over ZeroMQ: the syncer's state for this version (msgpack, opaque to
    # learners), which a learner hands back to a syncer that lost its
    # checkpoint (Recall). Empty over Redis, which keeps it beside the snapshot.
    resume: bytes = b""
    # The signature of this version's :meth:`held_form` (not signed again: it
    # is a signature on its own). Empty: unsigned.
    snapshot_signature: str = ""
    # The syncers' Ed25519 signature (hex) of everything above and the payload
    # (broker.identity.signing.signing_digest); learners with the run's keys check it
    # before anything is applied. Empty: unsigned (a run without keys).
    signature: str = ""

    def validate(self) -> None:
        super().validate()
        if self.change_from != -1 and self.change_from != self.version - 1:
            raise WireError("bad_field", "change_from must be -1 or version - 1")

    @property
    def is_change(self) -> bool:
        return self.change_from >= 0

    @property
    def is_weightless(self) -> bool:
        """A snapshot answer without its weights: the asker said it holds them
        (``SnapshotRequest.held_crcs``)."""
        return self.numel == 0 and not self.is_change

    def without_weights(self) -> GlobalFragment:
        """This version's answer to a learner that holds its weights."""
        return replace(self, codec=Codec(), numel=0, payload=b"", change_from=-1, signature="")

    def with_weights(self, weights: torch.Tensor) -> GlobalFragment:
        """A weightless answer completed with the weights the learner holds: the
        learner checks them against ``weights_crc`` like any snapshot."""
        flat = weights.detach().reshape(-1).to(torch.float32)
        return replace(self, codec=Codec(), numel=flat.numel(), payload=Codec().encode(flat))

    def held_form(self, weights: torch.Tensor) -> GlobalFragment:
        """This version as the fp32 ``weights`` it names, signed by
        ``snapshot_signature``: the one form a syncer signs for every version
        (whatever went out for it), so that a learner holding any of its
        globals and the weights can hand them to a successor that checks them."""
        held = replace(self, change_from=-1, signature=self.snapshot_signature)
        return held.with_weights(weights)


@dataclass(frozen=True)
class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    run_id: str = ""
    learner_id: str = ""
    incarnation: int = 0
    step: int = 0
    tokens: int = 0
    step_time_s: float = 0.0
    sent_at: float = 0.0


@dataclass(frozen=True)
class Ack(Message):
    """Syncer -> learner: these delta sequence numbers are durably handled."""

    KIND: ClassVar[str] = "ack"
    run_id: str = ""
    learner_id: str = ""
    incarnation: int = 0
    seqs: list[int] = field(default_factory=list)
    term: int = 0  # as GlobalFragment.term


@dataclass(frozen=True)
class SnapshotRequest(Message):
    """Learner -> syncer: send the latest global of these fragments (empty: all).

    ``held_crcs``, if given, lists per fragment asked for the CRC-32 of the
    weights the learner already holds (``weights_checksum``): a fragment whose
    latest version has that checksum is answered with its global less the
    weights (``numel`` 0), and the learner uses its own (Redis keeps these
    answers in ``weightless`` keys). A learner that starts
    from the run's initial model so joins without downloading it.
    """

    KIND: ClassVar[str] = "snapshot_request"
    run_id: str = ""
    learner_id: str = ""
    fragments: list[int] = field(default_factory=list)
    held_crcs: list[int] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        if self.held_crcs and len(self.held_crcs) != len(self.fragments):
            raise WireError("bad_field", "held_crcs must be empty or one per fragment")


@dataclass(frozen=True)
class Recall(Message):
    """Syncer -> learner: a syncer that lost its checkpoint asks what the learner
    holds of ``fragments``. The learner answers each one it holds with its
    :meth:`GlobalFragment.held_form`: without the weights (``numel`` 0: its
    claim), or with them where ``weights`` is set; the syncer checks the
    signature and the weights before it resumes from them."""

    KIND: ClassVar[str] = "recall"
    run_id: str = ""
    fragments: list[int] = field(default_factory=list)
    weights: bool = False


@dataclass(frozen=True)
class Refusal(Message):
    """Syncer -> learner: this delta was refused (and will not be asked for again);
    resync the fragment. Never a silent acknowledgement: a learner whose deltas are
    all refused (a syncer that lost its state, a base the syncer never published)
    learns it at once instead of reporting success while the run learns nothing."""

    KIND: ClassVar[str] = "refusal"
    run_id: str = ""
    learner_id: str = ""
    incarnation: int = 0
    seq: int = 0
    fragment: int = 0
    reason: str = "refused"

    @classmethod
    def of(cls, delta: Delta, reason: str) -> Refusal:
        """The refusal of ``delta``, addressed to its sender."""
        return cls(
            run_id=delta.run_id,
            learner_id=delta.learner_id,
            incarnation=delta.incarnation,
            seq=delta.seq,
            fragment=delta.fragment,
            reason=reason,
        )


@dataclass(frozen=True)
class Enroll(Message):
    """Learner -> syncer: admit ``key`` (the learner's own public key; over ZeroMQ
    the CURVE key the message comes on) to the run in ``role``. ``proof`` is
    HMAC-SHA256 of the run id, key and role under the run's join secret
    (:func:`broker.identity.keys.enroll_proof`): only a holder of the secret can make one,
    and it is good for that key alone."""

    KIND: ClassVar[str] = "enroll"
    run_id: str = ""
    key: str = ""
    role: str = "learner"
    proof: str = ""
    # Over Redis, the learner id the key will send as ("" for none yet: a slot
    # learner leases one); over ZeroMQ an id is bound by the first message.
    claims: str = ""


@dataclass(frozen=True)
class LeaseRequest(Message):
    """Learner -> the first syncer: take or renew a learner slot for ``holder``
    for ``ttl_s`` (see ``LearnerTransport.lease``); ``held_slot`` is the slot
    it believes it holds (-1: none)."""

    KIND: ClassVar[str] = "lease_request"
    run_id: str = ""
    holder: str = ""
    held_slot: int = -1
    ttl_s: float = 0.0
    # Over Redis, the enrolled key that asks (its ACL user reads the grant);
    # over ZeroMQ the key of the connection.
    owner_key: str = ""


@dataclass(frozen=True)
class LeaseGrant(Message):
    """Syncer -> learner: ``holder`` holds ``slot`` now."""

    KIND: ClassVar[str] = "lease_grant"
    run_id: str = ""
    holder: str = ""
    slot: int = 0


KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Delta,
        GlobalFragment,
        Heartbeat,
        Ack,
        SnapshotRequest,
        Recall,
        Refusal,
        Enroll,
        LeaseRequest,
        LeaseGrant,
    )
}
# The header fields of each kind: every field but the payload.
_FIELD_NAMES = {cls: frozenset(f.name for f in fields(cls)) - {"payload"} for cls in KINDS.values()}


# -- encode / decode --------------------------------------------------------
def encode_parts(
    msg: Message, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> tuple[bytes, bytes, bytes]:
    """One frame in three parts whose concatenation is the frame: prefix and
    header, payload, checksum. The payload is not copied (a ``bytes`` payload is
    the caller's object), so a transport that can send parts (ZeroMQ's
    multipart messages) sends a whole fragment without copying it, and the
    checksum runs over it once, continued from the header's."""
    msg.validate()
    header: dict[str, Any] = {"v": SCHEMA_VERSION, "k": msg.KIND}
    payload = b""
    for f in fields(msg):
        if f.name == "payload":
            payload = bytes(getattr(msg, "payload"))  # noqa: B009 (only tensor messages have it)
        elif f.name == "codec":
            header["codec"] = getattr(msg, "codec").name  # noqa: B009
        else:
            header[f.name] = getattr(msg, f.name)
    head = msgpack.packb(header, use_bin_type=True)
    if len(head) > MAX_HEADER_BYTES:
        raise WireError("too_large", f"header of {len(head)} bytes")
    if len(payload) > max_payload_bytes:
        raise WireError("too_large", f"payload of {len(payload)} > {max_payload_bytes} bytes")
    start = _PREFIX.pack(MAGIC, len(head), len(payload)) + head
    crc = crc32(payload, crc32(start))
    return start, payload, _CRC.pack(crc)


def encode(msg: Message, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> bytes:
    """One frame, in one buffer (the payload is copied once, by the join)."""
    return b"".join(encode_parts(msg, max_payload_bytes))


def decode(
    data: bytes | bytearray | memoryview, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> Message:
    """Decode and validate one frame, or raise :class:`WireError`. A tensor
    message's payload is a read-only view into ``data``, not a copy."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + _CRC.size:
        raise WireError("truncated", f"{len(view)} bytes")
    head_len, payload_len = _check_prefix(view, max_payload_bytes)
    total = _PREFIX.size + head_len + payload_len + _CRC.size
    if len(view) != total:
        raise WireError(
            "truncated" if len(view) < total else "trailing_bytes", f"{len(view)} != {total}"
        )
    payload_at = _PREFIX.size + head_len
    return _decode_checked(
        view[:payload_at], view[payload_at : total - _CRC.size], view[total - _CRC.size :],
        max_payload_bytes,
    )  # fmt: skip


def decode_parts(
    start: bytes | memoryview,
    payload: bytes | memoryview,
    crc: bytes | memoryview,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> Message:
    """Decode a frame received as the three parts of :func:`encode_parts`; each
    part must be exactly what the prefix says, else :class:`WireError`
    (``bad_split``). The payload is a read-only view into ``payload``."""
    start_view = memoryview(start).cast("B")
    if len(start_view) < _PREFIX.size:
        raise WireError("truncated", f"{len(start_view)} bytes")
    head_len, payload_len = _check_prefix(start_view, max_payload_bytes)
    payload_view = memoryview(payload).cast("B")
    crc_view = memoryview(crc).cast("B")
    if (len(start_view), len(payload_view), len(crc_view)) != (
        _PREFIX.size + head_len, payload_len, _CRC.size
    ):  # fmt: skip
        raise WireError("bad_split", "parts do not match the frame's lengths")
    return _decode_checked(start_view, payload_view, crc_view, max_payload_bytes)


def _check_prefix(view: memoryview, max_payload_bytes: int) -> tuple[int, int]:
    """Header and payload lengths of the frame that starts ``view``, once checked."""
    magic, head_len, payload_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError("bad_magic")
    if head_len > MAX_HEADER_BYTES:
        raise WireError("too_large", f"header of {head_len} bytes")
    if payload_len > max_payload_bytes:
        raise WireError("too_large", f"payload of {payload_len} > {max_payload_bytes} bytes")
    return head_len, payload_len


def _decode_checked(
    start: memoryview, payload: memoryview, crc_bytes: memoryview, max_payload_bytes: int
) -> Message:
    """The message of a frame whose prefix and lengths were checked: the checksum
    first, then the header, then every field."""
    (crc,) = _CRC.unpack_from(crc_bytes, 0)
    if crc32(payload, crc32(start)) != crc:
        raise WireError("bad_checksum")
    try:
        header = msgpack.unpackb(
            start[_PREFIX.size :],
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_RESUME_BYTES,  # GlobalFragment.resume, the one bytes field
            max_array_len=MAX_LIST_LEN,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError("bad_header", f"{type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "header is not a map")
    version = header.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:  # not True, not 1.0
        raise WireError("bad_schema_version", repr(version)[:32])
    kind = header.get("k")
    cls = KINDS.get(kind) if isinstance(kind, str) else None  # a list or map is unhashable
    if cls is None:
        raise WireError("unknown_kind", repr(header.get("k"))[:32])
    names = _FIELD_NAMES[cls]
    if set(header) - {"v", "k"} != names:
        raise WireError("bad_header", f"{cls.KIND} fields do not match the schema")
    kwargs = {n: header[n] for n in names}
    if issubclass(cls, _TensorMessage):
        kwargs["payload"] = payload.toreadonly()
    elif len(payload):
        raise WireError("bad_header", f"{cls.KIND} carries no payload")
    try:
        msg = cls(**kwargs)
    except WireError:
        raise
    except Exception as e:  # a codec name that is not a string, say
        raise WireError("bad_codec", f"{type(e).__name__}: {e}") from None
    msg.validate()
    if isinstance(msg, _TensorMessage):
        decoded = msg.codec.quantised_size(msg.numel)
        if decoded > max_payload_bytes:
            raise WireError(
                "too_large", f"payload decodes to {decoded} > {max_payload_bytes} bytes"
            )
    return msg
