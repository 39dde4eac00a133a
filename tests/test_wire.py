"""Wire frames: round trips, hand-built frames, and hostile input.

Frames are built by hand from the documented layout
``"DDL1" | u32 header_len | u32 payload_len | header | payload | crc32`` (little
endian, crc over everything before it), independently of ``wire.encode``.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.wire import messages as wire
from broker.wire.codecs import Codec
from broker.wire.fields import MAX_LIST_LEN
from broker.wire.messages import (
    Ack,
    Delta,
    Enroll,
    GlobalFragment,
    Heartbeat,
    Message,
    Refusal,
    SnapshotRequest,
    WireError,
)

torch.set_num_threads(1)

HASH = "0123456789abcdef"
VALUES = torch.linspace(-1.0, 1.0, 37)


def frame(header: Any, payload: bytes = b"", magic: bytes = b"DDL1") -> bytes:
    """A frame with a valid checksum around any msgpack-able header."""
    head = msgpack.packb(header, use_bin_type=True)
    body = magic + struct.pack("<II", len(head), len(payload)) + head + payload
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def raw_frame(head: bytes, payload: bytes = b"") -> bytes:
    body = b"DDL1" + struct.pack("<II", len(head), len(payload)) + head + payload
    return body + struct.pack("<I", zlib.crc32(body))


def header_of(msg: Message) -> tuple[dict[str, Any], bytes]:
    h: dict[str, Any] = {"v": wire.SCHEMA_VERSION, "k": msg.KIND}
    payload = b""
    for f in dataclasses.fields(msg):
        if f.name == "payload":
            payload = bytes(msg.payload)  # type: ignore[attr-defined]
        elif f.name == "codec":
            h[f.name] = str(msg.codec)  # type: ignore[attr-defined]  # its name on the wire
        else:
            h[f.name] = getattr(msg, f.name)
    return h, payload


def delta(codec: str = "int4+zstd", **kw: Any) -> Delta:
    c = Codec.parse(codec)
    base: dict[str, Any] = dict(
        codec=codec,
        numel=VALUES.numel(),
        payload=c.encode(VALUES),
        run_id="run-1",
        learner_id="learner-3",
        incarnation=2,
        seq=17,
        fragment=1,
        plan_hash=HASH,
        base_version=5,
        step=120,
        c_steps=24,
        c_tokens=49152,
        sent_at=1712345678.25,
    )
    base.update(kw)
    return Delta(**base)


def messages() -> list[Message]:
    return [
        delta(),
        delta("fp32"),
        delta("int8@128"),
        delta("bf16+lz4"),
        GlobalFragment(
            codec="fp32",
            numel=VALUES.numel(),
            payload=Codec().encode(VALUES),
            run_id="r",
            fragment=3,
            plan_hash=HASH,
            version=9,
            sent_at=0.0,
        ),
        GlobalFragment(
            codec="fp32",
            numel=0,
            payload=b"",
            run_id="r",
            fragment=0,
            plan_hash=HASH,
            version=0,
            sent_at=2,
        ),
        Heartbeat(
            run_id="r",
            learner_id="a.b:c_d-e",
            incarnation=0,
            step=3,
            tokens=999,
            step_time_s=0.125,
            sent_at=10.5,
        ),
        Ack(run_id="r", learner_id="l", incarnation=1, seqs=[1, 2, 3, 2**63 - 1]),
        Ack(run_id="r", learner_id="l", incarnation=1, seqs=[]),
        SnapshotRequest(run_id="r", learner_id="l", fragments=[0, 2]),
        SnapshotRequest(run_id="r", learner_id="l", fragments=[]),
        Refusal(run_id="r", learner_id="l", incarnation=1, seq=4, fragment=1, reason="stale"),
        GlobalFragment(
            codec="int8",
            numel=VALUES.numel(),
            payload=Codec("int8").encode(VALUES),
            run_id="r",
            fragment=1,
            plan_hash=HASH,
            version=7,
            change_from=6,
        ),
        SnapshotRequest(run_id="r", learner_id="l", fragments=[0, 2], held_crcs=[7, 2**32 - 1]),
        Enroll(run_id="r", key="ab" * 32, role="reader", proof="cd" * 32),
    ]


def valid_frames() -> list[bytes]:
    return [wire.encode(m) for m in messages()]


def reason(data: bytes, **kw: Any) -> str:
    with pytest.raises(WireError) as info:
        wire.decode(data, **kw)
    return info.value.reason


# -- round trips ---------------------------------------------------------------
@pytest.mark.parametrize("msg", messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = wire.encode(msg)
    # The frame is exactly the documented layout.
    header, payload = header_of(msg)
    assert data == frame(header, payload)
    back = wire.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert wire.decode(bytearray(data)) == msg
    assert wire.decode(memoryview(data)) == msg


@pytest.mark.parametrize("msg", messages(), ids=lambda m: type(m).__name__)
def test_parts_round_trip(msg: Message) -> None:
    """The three parts make the frame, and decode as it does."""
    parts = wire.encode_parts(msg)
    assert b"".join(parts) == wire.encode(msg)
    assert wire.decode_parts(*parts) == msg
    assert wire.decode_parts(*(memoryview(p) for p in parts)) == msg


def test_decoded_payload_is_a_read_only_view_of_the_frame() -> None:
    data = wire.encode(delta("fp32"))
    back = wire.decode(data)
    assert isinstance(back, Delta) and isinstance(back.payload, memoryview)
    assert back.payload.readonly and back.payload.obj is data


def test_parts_that_do_not_match_the_prefix_are_rejected() -> None:
    start, payload, crc = wire.encode_parts(delta("fp32"))

    def parts_reason(*parts: bytes, **kw: Any) -> str:
        with pytest.raises(WireError) as info:
            wire.decode_parts(*parts, **kw)
        return info.value.reason

    assert parts_reason(start, payload[:-1], crc) == "bad_split"
    assert parts_reason(start, payload, crc + b"x") == "bad_split"
    assert parts_reason(start + payload[:1], payload[1:], crc) == "bad_split"
    assert parts_reason(start[:5], payload, crc) == "truncated"
    assert parts_reason(b"XDL1" + start[4:], payload, crc) == "bad_magic"
    assert parts_reason(start, payload[:-1] + bytes([payload[-1] ^ 1]), crc) == "bad_checksum"
    assert parts_reason(start, payload, bytes(4)) == "bad_checksum"
    assert parts_reason(*wire.encode_parts(delta("fp32")), max_payload_bytes=10) == "too_large"


def test_tensor_decodes_to_values() -> None:
    for codec, tol in (
        ("fp32", 0.0),
        ("bf16+lz4", 2**-8),
        ("int8@128", 1 / 254),
        ("int4+zstd", 1 / 14 + 1e-6),
    ):
        back = wire.decode(wire.encode(delta(codec)))
        assert isinstance(back, Delta)
        t = back.tensor()
        assert t.shape == VALUES.shape
        assert float((t - VALUES).abs().max()) <= tol


def test_tensor_with_corrupt_lossless_payload_is_bad_payload() -> None:
    msg = delta("int8+zstd", payload=b"not a zstd frame at all")
    back = wire.decode(wire.encode(msg))
    with pytest.raises(WireError) as info:
        back.tensor()  # type: ignore[attr-defined]
    assert info.value.reason == "bad_payload"


# -- framing errors -------------------------------------------------------------
def test_framing_errors() -> None:
    good = wire.encode(messages()[6])
    assert reason(b"") == "truncated"
    assert reason(good[:15]) == "truncated"
    assert reason(good[:-1]) == "truncated"
    assert reason(good + b"\0") == "trailing_bytes"
    assert reason(b"DDL2" + good[4:]) == "bad_magic"
    flipped = bytearray(good)
    flipped[20] ^= 0x01
    assert reason(bytes(flipped)) == "bad_checksum"
    assert reason(good[:-4] + bytes(4 * [good[-1] ^ 0xFF])) == "bad_checksum"


@pytest.mark.parametrize(
    ("head_len", "payload_len", "kw"),
    [
        (wire.MAX_HEADER_BYTES + 1, 0, {}),
        (2**32 - 1, 0, {}),
        (10, 2**32 - 1, {}),
        (10, 1001, {"max_payload_bytes": 1000}),
    ],
)
def test_oversized_lengths_rejected_before_reading(
    head_len: int, payload_len: int, kw: dict[str, int]
) -> None:
    # Only 20 bytes are present: the lengths alone must decide.
    data = b"DDL1" + struct.pack("<II", head_len, payload_len) + bytes(8)
    assert reason(data, **kw) == "too_large"


def test_encode_rejects_oversized_payload() -> None:
    msg = delta("fp32")
    with pytest.raises(WireError) as info:
        wire.encode(msg, max_payload_bytes=10)
    assert info.value.reason == "too_large"
    assert reason(wire.encode(msg), max_payload_bytes=10) == "too_large"


def test_numel_that_decodes_past_the_limit() -> None:
    # A zstd payload is small on the wire but numel says what it decodes to.
    h, p = header_of(delta("int8+zstd"))
    h["numel"] = 10**6
    assert reason(frame(h, p), max_payload_bytes=10**5) == "too_large"
    h["numel"] = 2**62
    assert reason(frame(h, p)) == "too_large"


def test_a_global_is_a_change_only_from_the_version_before_it() -> None:
    good = GlobalFragment(
        codec="int8", numel=4, payload=Codec("int8").encode(torch.ones(4)), run_id="r",
        fragment=0, plan_hash=HASH, version=5, change_from=4,
    )  # fmt: skip
    assert good.is_change and wire.decode(wire.encode(good)) == good
    h, p = header_of(good)
    for change_from in (3, 5, -2, 2**63, "4", 4.0, None):
        assert reason(frame({**h, "change_from": change_from}, p)) == "bad_field", change_from
    assert not dataclasses.replace(good, change_from=-1).is_change
    for crc in (-1, 2**63, "0", None):
        assert reason(frame({**h, "weights_crc": crc}, p)) == "bad_field", crc


def test_weights_checksum_is_the_crc_of_the_fp32_bytes() -> None:
    x = torch.linspace(-1, 1, 1000)
    assert wire.weights_checksum(x) == zlib.crc32(x.numpy().tobytes())
    with pytest.raises(ValueError, match="fp32"):
        wire.weights_checksum(x.double())


# -- header errors -------------------------------------------------------------
def test_schema_and_kind_errors() -> None:
    h, p = header_of(delta())
    # 4: before enrollment over Redis; 5: before terms; 6: before recalls
    for v in (0, 1, 2, 3, 4, 5, 6, 8, -1, "7", None, True, 7.0, [7]):
        assert reason(frame({**h, "v": v}, p)) == "bad_schema_version", v
    no_v = {k: x for k, x in h.items() if k != "v"}
    assert reason(frame(no_v, p)) == "bad_schema_version"
    for k in ("deltas", "", None, 3, ["delta"], {"k": 1}, "Delta"):
        assert reason(frame({**h, "k": k}, p)) == "unknown_kind", k
    assert reason(frame([1, "delta"])) == "bad_header"
    assert reason(frame(7)) == "bad_header"
    assert reason(raw_frame(b"\xc1")) == "bad_header"  # reserved msgpack byte
    assert reason(raw_frame(msgpack.packb(h) + b"\x00", p)) == "bad_header"  # extra data
    assert reason(raw_frame(msgpack.packb(h)[:-3], p)) == "bad_header"  # cut short


def test_missing_and_extra_fields() -> None:
    h, p = header_of(delta())
    for name in [k for k in h if k not in ("v", "k")]:
        missing = {k: x for k, x in h.items() if k != name}
        assert reason(frame(missing, p)) == "bad_header", name
    assert reason(frame({**h, "extra": 1}, p)) == "bad_header"
    assert reason(frame({**h, "payload": b""}, p)) == "bad_header"
    ah, _ = header_of(messages()[7])
    assert reason(frame(ah, b"xyz")) == "bad_header"  # an ack carries no payload
    assert reason(frame({**ah, 1: 2})) == "bad_header"  # int key


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("incarnation", True),
        ("seq", False),
        ("numel", True),
        ("seq", -1),
        ("step", -5),
        ("fragment", 1.0),
        ("c_tokens", "12"),
        ("base_version", None),
        ("sent_at", float("nan")),
        ("sent_at", float("inf")),
        ("sent_at", -0.5),
        ("sent_at", True),
        ("sent_at", "now"),
        ("run_id", ""),
        ("run_id", "a b"),
        ("run_id", "x" * 65),
        ("learner_id", "é"),
        ("learner_id", 7),
        ("learner_id", "l/1"),
        ("plan_hash", "0123456789ABCDEF"),
        ("plan_hash", "0123456789abcde"),
        ("plan_hash", "0123456789abcdef0"),
        ("plan_hash", "0123456789abcdeg"),
        ("plan_hash", 12345),
    ],
)
def test_bad_delta_fields(field: str, value: Any) -> None:
    h, p = header_of(delta())
    assert reason(frame({**h, field: value}, p)) == "bad_field"


@pytest.mark.parametrize(
    ("msg_index", "field", "value"),
    [
        (6, "step_time_s", float("nan")),
        (6, "tokens", -1),
        (7, "seqs", [1, -1]),
        (7, "seqs", [1, True]),
        (7, "seqs", "1,2"),
        (7, "seqs", [[1]]),
        (7, "seqs", list(range(MAX_LIST_LEN + 1))),
        (9, "fragments", [0.5]),
        (9, "fragments", {"0": 1}),
        (9, "held_crcs", [1]),  # one checksum per fragment asked for, or none
        (9, "held_crcs", [1, -1]),
        (9, "held_crcs", [1, 2, 3]),
        (4, "version", 2**63),
    ],
)
def test_bad_fields_of_other_kinds(msg_index: int, field: str, value: Any) -> None:
    h, p = header_of(messages()[msg_index])
    assert reason(frame({**h, field: value}, p)) in ("bad_field", "bad_header")
    if field != "seqs" or not isinstance(value, list) or len(value) <= MAX_LIST_LEN:
        assert reason(frame({**h, field: value}, p)) == "bad_field"


def test_bad_codec_and_payload_size() -> None:
    h, p = header_of(delta("fp32"))
    for codec in ("int3", "fp32+gzip", "int8@7", 5, None):
        assert reason(frame({**h, "codec": codec}, p)) == "bad_codec", codec
    assert reason(frame(h, p[:-1])) == "bad_size"
    assert reason(frame(h, p + b"\0\0\0\0")) == "bad_size"
    assert reason(frame({**h, "numel": h["numel"] + 1}, p)) == "bad_size"
    # fp32 payload labelled as int8: 37 values need 4 + 37 bytes, not 148.
    assert reason(frame({**h, "codec": "int8"}, p)) == "bad_size"
    # int4 of 37 values: 4 * ceil(37/64) + ceil(37/2) = 4 + 19 bytes.
    assert reason(frame({**h, "codec": "int4"}, bytes(22))) == "bad_size"
    assert isinstance(wire.decode(frame({**h, "codec": "int4"}, bytes(23))), Delta)


def test_an_unknown_codec_name_is_refused_when_the_message_is_built() -> None:
    with pytest.raises(WireError) as info:
        dataclasses.replace(delta(), codec="nope")
    assert info.value.reason == "bad_codec"


def test_encode_validates() -> None:
    cases = [
        (delta(seq=-1), "bad_field"),
        (delta(run_id=""), "bad_field"),
        (delta(plan_hash="x"), "bad_field"),
        (delta(codec="fp32", payload=b"123"), "bad_size"),
        (delta(sent_at=float("nan")), "bad_field"),
        (Ack(run_id="r", learner_id="l", incarnation=0, seqs=[True]), "bad_field"),
    ]
    for bad, why in cases:
        with pytest.raises(WireError) as info:
            wire.encode(bad)
        assert info.value.reason == why


# -- hostile input (property tests) ----------------------------------------------
def assert_decodes_or_wire_error(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except WireError as e:
        assert isinstance(e.reason, str) and e.reason
        return
    msg.validate()
    assert type(msg) in wire.KINDS.values()


PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    assert_decodes_or_wire_error(data)
    assert_decodes_or_wire_error(b"DDL1" + data)


def test_every_truncation_of_every_small_frame() -> None:
    for data in valid_frames():
        for n in range(len(data)):
            assert reason(data[:n]) == "truncated"


@PROPS
@given(st.data())
def test_single_byte_mutations(data: st.DataObject) -> None:
    frames = valid_frames()
    good = data.draw(st.sampled_from(frames))
    i = data.draw(st.integers(0, len(good) - 1))
    b = data.draw(st.integers(0, 255).filter(lambda x: x != good[i]))
    mutated = bytearray(good)
    mutated[i] = b
    with pytest.raises(WireError):  # crc32 catches every single-byte error
        wire.decode(bytes(mutated))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=8)
    | st.sampled_from(["delta", "ack", "fp32", "int4+zstd", HASH, "r", 1, 0]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@PROPS
@given(
    st.dictionaries(
        st.sampled_from(["v", "k", "run_id", "learner_id", "seq", "seqs", "codec", "numel"])
        | st.text(max_size=6),
        msgpack_values,
        max_size=8,
    ),
    st.binary(max_size=40),
)
def test_valid_checksum_random_header(header: dict[str, Any], payload: bytes) -> None:
    assert_decodes_or_wire_error(frame(header, payload))
    assert_decodes_or_wire_error(frame({**header, "v": wire.SCHEMA_VERSION}, payload))


@PROPS
@given(msgpack_values)
def test_valid_checksum_non_map_header(header: Any) -> None:
    assert_decodes_or_wire_error(frame(header))


@PROPS
@given(st.data())
def test_valid_checksum_mutated_header_field(data: st.DataObject) -> None:
    msg = data.draw(st.sampled_from(messages()))
    h, p = header_of(msg)
    name = data.draw(st.sampled_from(sorted(h)))
    value = data.draw(msgpack_values)
    mutated = {**h, name: value}
    assert_decodes_or_wire_error(frame(mutated, p))
    # Dropping the field or adding a random one.
    assert_decodes_or_wire_error(frame({k: x for k, x in h.items() if k != name}, p))
    extra = data.draw(st.text(max_size=8))
    assert_decodes_or_wire_error(frame({**h, extra: value}, p))


@PROPS
@given(st.data())
def test_valid_checksum_mutated_header_bytes(data: st.DataObject) -> None:
    msg = data.draw(st.sampled_from(messages()))
    h, p = header_of(msg)
    head = bytearray(msgpack.packb(h, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(head) - 1))
        head[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(head)))
    assert_decodes_or_wire_error(raw_frame(bytes(head), p))
    assert_decodes_or_wire_error(raw_frame(bytes(head[:cut]), p))


def test_a_refusal_reason_is_a_short_name() -> None:
    good = Refusal(run_id="r", learner_id="l", incarnation=1, seq=4, fragment=1, reason="stale")
    assert wire.decode(wire.encode(good)) == good
    h, _ = header_of(good)
    for bad in ("", "x" * 33, "Stale", "a b", 3, None):
        assert reason(frame({**h, "reason": bad})) == "bad_field", bad


def test_enroll_and_signature_fields_are_checked() -> None:
    enroll = messages()[-1]
    h, p = header_of(enroll)
    for name, bad in (("key", "AB" * 32), ("key", "ab"), ("proof", 7), ("role", "admin")):
        assert reason(frame({**h, name: bad}, p)) == "bad_field", (name, bad)
    g, gp = header_of(next(m for m in messages() if isinstance(m, GlobalFragment)))
    for bad in ("ab", "g" * 128, 5, "AB" * 64):
        assert reason(frame({**g, "signature": bad}, gp)) == "bad_field", bad
