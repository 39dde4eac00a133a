"""Codecs: exactness, error bounds, byte layout, sizes and bad input.

Quantised values are checked against a numpy re-implementation of blockwise
absmax and against the analytic bounds absmax/(2 qmax); bf16 against a
bit-level round-to-nearest-even in numpy; sizes against hand formulas.
"""

from __future__ import annotations

import struct
import tracemalloc

import lz4.frame
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.wire.codecs import LOSSLESS, QUANTS, Codec, CodecError

torch.set_num_threads(1)

LENGTHS = [1, 2, 7, 63, 64, 65, 127, 1001, 4097]


def gaussian(n: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))


def block_absmax(x: np.ndarray, block: int) -> np.ndarray:
    """Per-element absmax of the element's block."""
    n = x.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = np.abs(x)
    return np.repeat(padded.reshape(blocks, block).max(axis=1), block)[:n]


def wire_scale(scale: np.ndarray, qmax: int) -> np.ndarray:
    """Scales as they travel: fp32, and bf16 for int2 (qmax 1)."""
    return numpy_bf16(scale) if qmax == 1 else scale


def numpy_blockwise(x: np.ndarray, block: int, qmax: int) -> np.ndarray:
    """Independent reference: scale = absmax/qmax, codes = round half even."""
    amax = block_absmax(x, block)
    scale = wire_scale((amax / np.float32(qmax)).astype(np.float32), qmax)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    codes = np.clip(np.round(x / safe), -qmax, qmax).astype(np.float32)
    return codes * scale


def numpy_bf16(x: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16 (nearest, ties to even) by bit manipulation."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


# -- exactness and error bounds -----------------------------------------------
@pytest.mark.parametrize("lossless", LOSSLESS)
@pytest.mark.parametrize("n", [0, *LENGTHS])
def test_fp32_round_trip_is_bitwise_exact(n: int, lossless: str) -> None:
    x = gaussian(n, seed=n)
    if n >= 4:
        x[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40])
    c = Codec("fp32", lossless)  # type: ignore[arg-type]
    y = c.decode(c.encode(x), n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert np.array_equal(y.numpy().view(np.uint32), x.numpy().view(np.uint32))


@pytest.mark.parametrize("n", LENGTHS)
def test_bf16_matches_numpy_rounding_and_bound(n: int) -> None:
    x = gaussian(n, seed=n, scale=10.0)
    c = Codec("bf16")
    y = c.decode(c.encode(x), n).numpy()
    assert np.array_equal(y, numpy_bf16(x.numpy()))
    xs = x.numpy()
    assert np.all(np.abs(y - xs) <= 2.0**-8 * np.abs(xs))


@pytest.mark.parametrize("block", [8, 64, 128])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("quant", "qmax"), [("int8", 127), ("int4", 7), ("int2", 1)])
def test_blockwise_error_bound_and_numpy_reference(
    quant: str, qmax: int, n: int, block: int
) -> None:
    x = gaussian(n, seed=1000 + n, scale=3.0)
    c = Codec(quant, "none", block)  # type: ignore[arg-type]
    y = c.decode(c.encode(x), n).numpy()
    xs = x.numpy()
    amax = block_absmax(xs, block)
    bound = amax / (2 * qmax) * (1 + (2**-8 if quant == "int2" else 1e-5)) + 1e-12
    assert np.all(np.abs(y - xs) <= bound)
    assert np.array_equal(y, numpy_blockwise(xs, block, qmax))


@pytest.mark.parametrize("n", [3 * 65536 + 5, 65536 * 2])
@pytest.mark.parametrize(("quant", "qmax"), [("int8", 127), ("int4", 7), ("int2", 1)])
def test_decode_past_a_chunk_matches_the_numpy_reference(quant: str, qmax: int, n: int) -> None:
    """Decoding goes chunk by chunk: chunk edges and the partial last block."""
    x = gaussian(n, seed=n, scale=0.01)
    c = Codec(quant, "none", 64)  # type: ignore[arg-type]
    expected = numpy_blockwise(x.numpy(), 64, qmax)
    assert np.array_equal(c.decode(c.encode(x), n).numpy(), expected)


@pytest.mark.parametrize(
    "spec", ["fp32", "bf16", "int8", "int4", "int2", "int4+zstd", "int8@8", "int2@8"]
)
def test_decode_into_a_buffer(spec: str) -> None:
    """``out``: the same values, written into the given tensor, which is returned."""
    n = 1001
    c = Codec.parse(spec)
    payload = c.encode(gaussian(n, seed=3))
    out = torch.full((n,), float("nan"))
    assert c.decode(memoryview(payload), n, out) is out
    assert torch.equal(out, c.decode(payload, n))
    for bad in (torch.empty(n + 1), torch.empty(n, dtype=torch.float64), torch.empty(2 * n)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            c.decode(payload, n, bad)


@pytest.mark.parametrize("quant", ["int8", "int4", "int2"])
def test_zeros_and_constant_blocks(quant: str) -> None:
    c = Codec(quant, "none", 8)  # type: ignore[arg-type]
    zeros = torch.zeros(21)
    assert torch.equal(c.decode(c.encode(zeros), 21), zeros)
    x = torch.cat([torch.full((8,), 3.3), torch.zeros(8), torch.full((8,), -0.25), torch.ones(3)])
    y = c.decode(c.encode(x), x.numel())
    assert torch.equal(y[8:16], torch.zeros(8))  # a zero block stays exactly zero
    rtol = 2**-8 if quant == "int2" else 1e-6  # int2's scales are bf16
    torch.testing.assert_close(y, x, rtol=rtol, atol=0.0)


def test_int4_layout_by_hand() -> None:
    # block 8, one block: scale = 7 / 7 = 1; codes 7, -7, 0, round(3.5) = 4 (even);
    # stored q + 8 = 15, 1, 8, 12, low nibble first: 0x1F, 0xC8.
    c = Codec("int4", "none", 8)
    raw = c.encode(torch.tensor([7.0, -7.0, 0.0, 3.5]))
    assert raw == struct.pack("<f", 1.0) + bytes([0x1F, 0xC8])
    assert c.decode(raw, 4).tolist() == [7.0, -7.0, 0.0, 4.0]
    # Odd length: the last byte's high nibble is the padding code 8 (zero).
    raw = c.encode(torch.tensor([-14.0, 2.0, 4.0]))
    # scale 2; codes -7, 1, 2 -> 1, 9, 10 -> 0x91, 0x8A.
    assert raw == struct.pack("<f", 2.0) + bytes([0x91, 0x8A])


def test_int8_layout_by_hand() -> None:
    # scale = 127 / 127 = 1; codes 127, round(-63.5) = -64 (even), 1.
    c = Codec("int8", "none", 8)
    raw = c.encode(torch.tensor([127.0, -63.5, 1.0]))
    assert raw == struct.pack("<f", 1.0) + bytes([0x7F, 0xC0, 0x01])
    assert c.decode(raw, 3).tolist() == [127.0, -64.0, 1.0]
    # Two blocks: one scale per block, scales before all codes.
    x = torch.tensor([2.54] + [0.0] * 7 + [-1.27])
    raw = c.encode(x)
    assert raw[:8] == struct.pack("<ff", np.float32(2.54) / np.float32(127), 0.01)
    assert raw[8:] == bytes([127] + [0] * 7 + [0x81])


# -- sizes --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "block", "sizes"),
    [
        # n: fp32, bf16, int8 = 4*ceil(n/b) + n, int4 = 4*ceil(n/b) + ceil(n/2),
        # int2 = 2*ceil(n/b) + ceil(n/4) (bf16 scales)
        (0, 64, (0, 0, 0, 0, 0)),
        (1, 64, (4, 2, 5, 5, 3)),
        (64, 64, (256, 128, 68, 36, 18)),
        (65, 64, (260, 130, 73, 41, 21)),
        (1001, 64, (4004, 2002, 1065, 565, 283)),
        (1001, 128, (4004, 2002, 1033, 533, 267)),
        (4097, 8, (16388, 8194, 6149, 4101, 2051)),
    ],
)
def test_exact_sizes(n: int, block: int, sizes: tuple[int, ...]) -> None:
    x = gaussian(n, seed=n)
    for quant, expected in zip(QUANTS, sizes, strict=True):
        c = Codec(quant, "none", block)
        assert c.quantised_size(n) == expected
        assert len(c.encode(x)) == expected


def test_int4_is_about_a_seventh_of_fp32() -> None:
    n = 64 * 1000
    x = gaussian(n)
    ratio = len(Codec("int4").encode(x)) / len(Codec("fp32").encode(x))
    assert ratio == pytest.approx(9 / 64)  # 1/2 byte + 4/64 byte per value, vs 4 bytes
    assert abs(ratio - 1 / 7) < 0.005


# -- lossless stages ----------------------------------------------------------
@pytest.mark.parametrize("lossless", ["zstd", "lz4"])
@pytest.mark.parametrize("quant", QUANTS)
def test_lossless_stage_round_trip(quant: str, lossless: str) -> None:
    x = gaussian(3001, seed=5)
    plain = Codec(quant, "none")  # type: ignore[arg-type]
    packed = Codec(quant, lossless)  # type: ignore[arg-type]
    data = packed.encode(x)
    assert torch.equal(packed.decode(data, 3001), plain.decode(plain.encode(x), 3001))
    # The stage is a real zstd / lz4 frame of the quantised bytes.
    if lossless == "zstd":
        assert zstandard.ZstdDecompressor().decompress(data) == plain.encode(x)
    else:
        assert lz4.frame.decompress(data) == plain.encode(x)


@pytest.mark.parametrize("lossless", ["zstd", "lz4"])
def test_large_round_trip_through_lossless(lossless: str) -> None:
    x = gaussian(1_000_003, seed=9)
    c = Codec("fp32", lossless)  # type: ignore[arg-type]
    assert torch.equal(c.decode(c.encode(x), x.numel()), x)


def test_zstd_compresses_zeros() -> None:
    c = Codec("fp32", "zstd")
    data = c.encode(torch.zeros(100_000))
    assert len(data) < 400_000 // 100
    assert torch.equal(c.decode(data, 100_000), torch.zeros(100_000))


# -- parse / name -------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "codec", "name"),
    [
        ("fp32", Codec("fp32", "none", 64), "fp32"),
        ("bf16+lz4", Codec("bf16", "lz4", 64), "bf16+lz4"),
        ("int4+zstd", Codec("int4", "zstd", 64), "int4+zstd"),
        ("int8@128", Codec("int8", "none", 128), "int8@128"),
        ("int8@64", Codec("int8", "none", 64), "int8"),
        ("int4+lz4@8", Codec("int4", "lz4", 8), "int4+lz4@8"),
        ("int4+top0.03", Codec("int4", density=0.03), "int4+top0.03"),
        ("int4+top0.03@4096", Codec("int4", "none", 4096, 0.03), "int4+top0.03"),
        ("int8+top0.1+zstd@512", Codec("int8", "zstd", 512, 0.1), "int8+top0.1+zstd@512"),
        ("int8+top1", Codec("int8"), "int8"),
    ],
)
def test_parse_and_name(spec: str, codec: Codec, name: str) -> None:
    assert Codec.parse(spec) == codec
    assert codec.name == name
    assert Codec.parse(name) == codec


def test_parse_name_round_trip_for_all() -> None:
    for quant in QUANTS:
        for lossless in LOSSLESS:
            blocks = [8, 64, 128, 4096] if quant.startswith("int") else [64]
            for block in blocks:
                c = Codec(quant, lossless, block)
                assert Codec.parse(c.name) == c


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "int3",
        "fp16",
        "INT8",
        "int8+gzip",
        "int8+zstd+lz4",
        "int8@abc",
        "int8@7",
        "int8@6",
        "int8@63",
        "int8@5000",
        "int8@-64",
        "int8@1e3",
        "int4+top0",
        "int4+top1.5",
        "int4+top-0.1",
        "int4+topx",
        "int4+top",
        "int4+topnan",
        "fp32+top0.1",
        "bf16+top0.1",
        "int4+zstd+top0.1",
        "int4+top0.1+zstd+lz4",
        "x" * 33,
        None,
        8,
        b"int8",
    ],
)
def test_bad_specs_raise(spec: object) -> None:
    with pytest.raises(CodecError):
        Codec.parse(spec)  # type: ignore[arg-type]


def test_bad_constructor_args_raise() -> None:
    for kwargs in (
        {"quant": "int3"},
        {"lossless": "brotli"},
        {"block_size": 4},
        {"block_size": 8192},
        {"block_size": 65},
    ):
        with pytest.raises(CodecError):
            Codec(**kwargs)  # type: ignore[arg-type]
    assert issubclass(CodecError, ValueError)


# -- bad bytes ----------------------------------------------------------------
@pytest.mark.parametrize("quant", QUANTS)
def test_wrong_size_raises(quant: str) -> None:
    c = Codec(quant)  # type: ignore[arg-type]
    data = c.encode(gaussian(101))
    for bad in (data[:-1], data + b"\0", b"", data + data):
        with pytest.raises(CodecError):
            c.decode(bad, 101)
    with pytest.raises(CodecError):
        c.decode(data, {"int4": 98, "int2": 96}.get(quant, 100))


@pytest.mark.parametrize("lossless", ["zstd", "lz4"])
def test_corrupt_lossless_raises(lossless: str) -> None:
    c = Codec("int8", lossless)  # type: ignore[arg-type]
    data = c.encode(gaussian(500))
    for bad in (b"garbage bytes that are no frame", data[: len(data) // 2], data[:5], b""):
        with pytest.raises(CodecError):
            c.decode(bad, 500)
    with pytest.raises(CodecError):  # the right frame for the wrong size
        c.decode(data, 499)


def _zstd_bomb(total: int, one_shot: bool) -> bytes:
    if one_shot:  # declares its content size in the frame header
        return zstandard.ZstdCompressor().compress(bytes(total))
    cobj = zstandard.ZstdCompressor().compressobj()
    chunk = bytes(1 << 20)
    out = [cobj.compress(chunk) for _ in range(total >> 20)]
    return b"".join(out) + cobj.flush()


def _lz4_bomb(total: int) -> bytes:
    comp = lz4.frame.LZ4FrameCompressor()
    chunk = bytes(1 << 20)
    parts = [comp.begin()] + [comp.compress(chunk) for _ in range(total >> 20)]
    return b"".join(parts) + comp.flush()


@pytest.mark.parametrize("kind", ["zstd-stream", "zstd-one-shot", "lz4"])
def test_decompression_bomb_raises_without_allocating(kind: str) -> None:
    total = 64 << 20
    if kind == "lz4":
        bomb, c = _lz4_bomb(total), Codec("fp32", "lz4")
    else:
        bomb, c = _zstd_bomb(total, kind == "zstd-one-shot"), Codec("fp32", "zstd")
    assert len(bomb) < total // 100
    tracemalloc.start()
    try:
        with pytest.raises(CodecError):
            c.decode(bomb, 1000)  # expects 4000 bytes, the stream holds 64 MiB
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@pytest.mark.parametrize("kind", ["zstd-stream", "zstd-one-shot"])
def test_quantised_into_a_buffer_checks_sizes_and_bombs(kind: str) -> None:
    """Decompressing into a caller's buffer: the same bytes, and the same refusals
    of a payload too short, too long or a bomb, with nothing allocated."""
    c = Codec.parse("int2+zstd")
    numel = 1000
    out = bytearray(c.quantised_size(numel) + 64)
    payload = c.encode(gaussian(numel))
    assert bytes(c.quantised(payload, numel, out)) == bytes(c.quantised(payload, numel))
    raw = bytes(c.quantised(payload, numel))
    for wrong in (raw[:-1], raw + b"\0"):
        with pytest.raises(CodecError):
            c.quantised(zstandard.ZstdCompressor().compress(wrong), numel, out)
    bomb = _zstd_bomb(64 << 20, kind == "zstd-one-shot")
    tracemalloc.start()
    try:
        with pytest.raises(CodecError):
            c.quantised(bomb, numel, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(
        [f"{q}+{lo}" if lo != "none" else q for q in QUANTS for lo in LOSSLESS]
        + ["int8+top0.25@8", "int4+top0.25@8", "int2+top0.25@8", "int4+top0.5+zstd@16"]
    ),
    st.binary(max_size=600),
    st.integers(0, 300),
)
def test_random_bytes_decode_or_raise_codec_error(spec: str, data: bytes, numel: int) -> None:
    c = Codec.parse(spec)
    try:
        y = c.decode(data, numel)
    except CodecError:
        return
    assert y.dtype == torch.float32 and y.shape == (numel,)


# -- sparse (top-k) -------------------------------------------------------------
def numpy_sparse(x: np.ndarray, block: int, density: float, qmax: int) -> np.ndarray:
    """Independent reference: per block the ceil(density * length) largest
    magnitudes, quantised by the largest of them; every other value zero."""
    y = np.zeros_like(x)
    for start in range(0, x.size, block):
        piece = x[start : start + block]
        k = max(1, int(np.ceil(density * piece.size)))
        keep = np.argsort(-np.abs(piece), kind="stable")[:k]
        scale = wire_scale(np.float32(np.abs(piece[keep]).max() / np.float32(qmax)), qmax)
        safe = scale if scale > 0 else np.float32(1.0)
        y[start + keep] = np.clip(np.round(piece[keep] / safe), -qmax, qmax) * scale
    return y


@pytest.mark.parametrize("quant,qmax", [("int8", 127), ("int4", 7), ("int2", 1)])
@pytest.mark.parametrize("n", [1, 7, 64, 65, 1001, 4096, 9000])
@pytest.mark.parametrize("block,density", [(64, 0.25), (4096, 0.03), (8, 0.1)])
def test_sparse_keeps_the_largest_of_each_block(
    quant: str, qmax: int, n: int, block: int, density: float
) -> None:
    c = Codec(quant, "none", block, density)  # type: ignore[arg-type]
    x = gaussian(n, seed=n)
    data = c.encode(x)
    assert len(data) == c.quantised_size(n)
    y = c.decode(data, n).numpy()
    assert np.allclose(y, numpy_sparse(x.numpy(), block, density, qmax), rtol=0, atol=1e-6)
    assert np.count_nonzero(y) <= c.kept(n)


def test_sparse_layout_by_hand() -> None:
    c = Codec("int8", "none", 8, 0.25)  # two of each block of 8
    x = torch.tensor([0.0, 4.0, 0, 0, -2.0, 0, 1.0, 0, 0, 0, 3.0])  # a block of 8 and one of 3
    data = c.encode(x)
    scales = struct.unpack("<2f", data[:8])
    indices = struct.unpack("<3H", data[8:14])  # 2 of the first block, 1 of the last
    codes = struct.unpack("<3b", data[14:])
    assert scales == pytest.approx((4 / 127, 3 / 127))
    assert indices == (1, 4, 2)
    assert codes == (127, -64, 127)
    y = c.decode(data, 11)
    assert y.tolist() == pytest.approx([0, 4, 0, 0, -64 * 4 / 127, 0, 0, 0, 0, 0, 3])
    assert c.quantised_size(11) == len(data) == 8 + 6 + 3
    assert Codec("int4", "none", 8, 0.25).quantised_size(11) == 8 + 6 + 2


def test_int2_layout_by_hand() -> None:
    c = Codec("int2", "none", 8)
    x = torch.tensor([4.0, -4.0, 0.5, 3.0, 0, 0, -2.5, 1.0, 2.0])  # a block of 8 and one of 1
    data = c.encode(x)
    assert data[:4] == struct.pack("<2H", 0x4080, 0x4000)  # bf16 scales 4.0 and 2.0
    # q + 2, four per byte, lowest bits first: (3, 1, 2, 3) (2, 2, 1, 2) | (3, pad 2 x 3)
    assert data[4:] == bytes([3 | 1 << 2 | 2 << 4 | 3 << 6, 2 | 2 << 2 | 1 << 4 | 2 << 6,
                              3 | 2 << 2 | 2 << 4 | 2 << 6])  # fmt: skip
    assert c.decode(data, 9).tolist() == [4, -4, 0, 4, 0, 0, -4, 0, 2]


@pytest.mark.parametrize("spec", ["int2", "int4", "int8", "int2+top0.25@64"])
def test_fitted_scales_keep_the_codes_and_are_least_squares(spec: str) -> None:
    x = gaussian(64 * 500 + 7, seed=5)
    c = Codec.parse(spec)
    plain, fitted = c.encode(x), c.encode(x, fit_scales=True)
    assert len(fitted) == len(plain) == c.quantised_size(x.numel())
    y_plain, y = c.decode(plain, x.numel()), c.decode(fitted, x.numel())
    assert torch.equal(torch.sign(y), torch.sign(y_plain))  # the same codes' signs and zeros
    error = float(((y - x) ** 2).sum())
    assert error < float(((y_plain - x) ** 2).sum())
    # No other scale for these codes is closer (bf16/fp32 rounding aside).
    for factor in (0.98, 1.02):
        assert error < float(((y * factor - x) ** 2).sum())


def test_sparse_int4_top_3_percent_is_a_tenth_of_dense_int8() -> None:
    n = 1 << 20
    assert Codec.parse("int4+top0.03").quantised_size(n) < Codec("int8").quantised_size(n) / 10


@pytest.mark.parametrize(
    "index,why",
    [((1, 1, 2), "a value twice"), ((4, 1, 2), "out of order"), ((1, 8, 2), "past its block"),
     ((1, 4, 3), "past the last, partial block"), ((0xFFFF, 1, 2), "far outside")],
)  # fmt: skip
def test_sparse_refuses_bad_indices(index: tuple[int, int, int], why: str) -> None:
    c = Codec("int8", "none", 8, 0.25)
    data = bytearray(c.encode(torch.arange(11, dtype=torch.float32)))
    data[8:14] = struct.pack("<3H", *index)
    with pytest.raises(CodecError, match="indices"):
        c.decode(bytes(data), 11)
