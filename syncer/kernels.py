"""The close of a round with ternary (int2) deltas and changes, in one compiled pass.

Pure math, no I/O. With int2 globals, a round's close decodes each delta,
merges them (weighted and rebased), takes the Nesterov outer step, quantises
the change of the new master from the published version, and adds the
decoded change to that version. As a torch pass per stage, every
fragment-sized tensor crosses memory a dozen times: 0.04 of a memory copy's
speed. Here one pass does all of it a tile of 4096 values at a time, while
the tile is in the cache: the master, momentum and version are read once and
written once, and the deltas never leave their packed codes.

The bytes out are exactly those of ``Codec.encode(change, fit_scales=True)``
(broker/wire/codecs.py; tests/test_kernels.py checks both against each other): the
same largest magnitude, bf16 rounding, division and round half to even, and
least-squares scales summed in float64, where every order of the sum gives
the same result. So the new version is ``previous + Codec.decode(payload)``
bit for bit, as every learner builds it.

Layout of an int2 payload (before the lossless stage): bf16 scales, one per
block, then the codes, four per byte, lowest bits first, stored as q + 2.
"""

from __future__ import annotations

import math

import numba
import numpy as np

_ABS_BITS = np.uint32(0x7FFFFFFF)
_EXPONENT_BITS = np.uint32(0x7F800000)
BLOCK = 64  # values per block of the payloads the compiled close reads and writes
TILE = 64 * BLOCK  # values per tile: its scratch (about 100 KiB) stays in the cache
TILE_BLOCKS = TILE // BLOCK
TILE_BYTES = TILE // 4  # of int2 codes
_ZERO_FIELDS = np.uint64(0xAAAAAAAAAAAAAAAA)  # 0b10 in every field: 32 zero codes
_PAIRS = np.uint64(0x5555555555555555)
_NIBBLES = np.uint64(0x3333333333333333)
_BYTES = np.uint64(0x0F0F0F0F0F0F0F0F)
_ONES = np.uint64(0x0101010101010101)


def padded_blocks(numel: int) -> int:
    """Blocks of the scale arrays of :func:`close_int2` for ``numel`` values: whole tiles."""
    return -(-numel // TILE) * TILE_BLOCKS


def unpack_int2(raw: np.ndarray, numel: int, scales: np.ndarray, codes: np.ndarray) -> None:
    """An int2 payload of ``numel`` values (blocks of :data:`BLOCK`) into a row
    of each of :func:`close_int2`'s ``scales`` (float32) and ``codes``, made
    (:func:`new_rows`) for that many values: their padding stays zero scales and
    zero codes. The last byte's unused fields become zero codes too: a payload
    may hold anything there, and nothing decodes it."""
    blocks = -(-numel // BLOCK)
    head = 2 * blocks
    bits = scales[:blocks].view(np.uint32)
    np.left_shift(raw[:head].view("<u2"), 16, out=bits, dtype=np.uint32)
    body = raw[head:]
    codes[: body.size] = body
    if numel % 4:
        used = (1 << (2 * (numel % 4))) - 1
        codes[body.size - 1] = (body[-1] & used) | (0xAA & ~used)


def new_rows(count: int, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` rows of scales and of codes for payloads of ``numel`` values,
    padded to whole tiles with zero scales and zero codes (0b10 fields)."""
    blocks = padded_blocks(numel)
    scales = np.zeros((count, blocks), dtype=np.float32)
    return scales, np.full((count, blocks * BLOCK // 4), 0xAA, dtype=np.uint8)


def pack_int2(scales: np.ndarray, codes: np.ndarray, numel: int) -> np.ndarray:
    """:func:`close_int2`'s ``new_scales`` and ``new_codes`` as an int2 payload
    (before the lossless stage)."""
    blocks = -(-numel // BLOCK)
    head = 2 * blocks
    raw = np.empty(head + -(-numel // 4), dtype=np.uint8)
    raw[:head].view("<u2")[:] = scales[:blocks].view(np.uint32) >> np.uint32(16)
    raw[head:] = codes[: raw.size - head]
    return raw


# Every kernel: cache (compiled once per machine, not in every process that
# closes a round), nogil, and error_model numpy (a division by zero is inf or
# NaN, as in torch, not a check per division that keeps loops from vectorising).
@numba.njit(cache=True, nogil=True, error_model="numpy")
def _bits_as_float(bits: np.uint32) -> np.float32:
    word = np.uint32(bits)
    return word.view(np.float32)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _bf16_bits(bits: np.uint32) -> np.uint32:
    """The float32 of ``bits`` rounded to bfloat16 (to nearest, ties to even), as
    float32 bits: what ``torch.Tensor.to(torch.bfloat16)`` does, NaN included.
    Integer operations and a select, so that a loop of them is vectorised."""
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return np.uint32(0x7FC00000 if (bits & _ABS_BITS) > _EXPONENT_BITS else rounded)


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def int2_stats(scales: np.ndarray, codes: np.ndarray) -> tuple[float, float]:
    """(sum of squares, largest magnitude) of the values of :func:`unpack_int2`'s
    ``scales`` and ``codes``, from a count of nonzero codes per block; both inf
    when a scale is not finite (0 x inf decodes to NaN)."""
    words = codes.view(np.uint64)  # a block's 64 codes are two words
    squares = 0.0
    for b in range(scales.size):
        scale = np.float64(scales[b])
        squares += scale * scale * (_nonzero(words[2 * b]) + _nonzero(words[2 * b + 1]))
    if not math.isfinite(squares):
        return math.inf, math.inf
    largest = np.uint32(0)
    for bits in scales.view(np.uint32):
        largest = max(largest, np.uint32(bits & _ABS_BITS))
    return squares, np.float64(_bits_as_float(largest))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _nonzero(word: np.uint64) -> np.uint64:
    """How many of a word's 32 int2 codes are not zero (0b10)."""
    flipped = word ^ _ZERO_FIELDS
    fields = (flipped | (flipped >> np.uint64(1))) & _PAIRS  # one bit per nonzero field
    fours = (fields & _NIBBLES) + ((fields >> np.uint64(2)) & _NIBBLES)
    eights = (fours + (fours >> np.uint64(4))) & _BYTES
    return (eights * _ONES) >> np.uint64(56)


# reassoc: lets sums be vectorised. Nothing that must be exact depends on the
# order of a sum: the change's codes and scales, and so the new version, come
# from divisions, roundings, integer maxima and float64 sums that are exact in
# any order (the least-squares sums); only the master's last bits do, and it
# stays here.
@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def close_int2(
    scales: np.ndarray,
    codes: np.ndarray,
    rows: np.ndarray,
    fractions: np.ndarray,
    dense: np.ndarray,
    rebase: np.float32,
    share: np.float32,
    lr: np.float32,
    mu: np.float32,
    master: np.ndarray,
    momentum: np.ndarray,
    previous: np.ndarray,
    new_master: np.ndarray,
    new_momentum: np.ndarray,
    new_version: np.ndarray,
    new_scales: np.ndarray,
    new_codes: np.ndarray,
) -> tuple[bool, np.float32, np.float32]:
    """One outer step of a fragment, and the int2 change that publishes it.

    The update is ``sum_m fractions[m] delta_m + dense + rebase * (master -
    previous)``, times ``share``. Delta m is row ``rows[m]`` of ``codes``
    (int2 codes, four per byte as in a payload) times the same row of
    ``scales`` (one per block of :data:`BLOCK`); ``dense`` (empty for none)
    holds everything else, already weighted (deltas of other codecs, shifts
    of older bases to ``previous``, the current version); ``rebase`` is the
    deltas' total fraction, whose gradients are all taken against the master,
    which leads ``previous`` (docs/design.md, rule 1). Then ``b = mu *
    momentum + update`` (``update`` alone when ``momentum`` is empty),
    ``new_master = master - lr * (update + mu * b)``
    (``new_master`` and ``new_momentum`` empty: both written into ``master``
    and ``momentum``, or into ``new_momentum`` where ``momentum`` is empty),
    and the change ``new_master - previous`` is quantised into ``new_scales``
    (least-squares, bf16-rounded) and ``new_codes``; ``new_version =
    previous + decoded change``. ``codes`` and ``new_codes`` hold whole tiles
    (:data:`TILE` values; the padding of ``new_codes`` is zero codes),
    ``scales`` and ``new_scales`` one scale per block of them.

    Returns (the change is finite, its largest magnitude, the largest
    magnitude of its decoded values). Published versions are finite, so a
    change that is not finite is a master that is not, or one so far from the
    version that their difference overflows: either way, nothing to publish.
    """
    numel = master.size
    deltas = rows.size
    has_momentum, has_dense = momentum.size > 0, dense.size > 0
    in_place = new_master.size == 0
    if in_place:
        new_master = master
        if has_momentum:
            new_momentum = momentum
    # update, change, codes, the last tile's version
    scratch = np.zeros((4, TILE), np.float32)
    per_block = np.zeros((4, TILE_BLOCKS), np.float32)  # absmax, energy, dot / energy, scale
    fields = np.zeros((2, TILE // 4), np.uint32)  # two deltas' 2-bit fields of a tile, a byte each
    tops = np.zeros(2, np.uint32)  # largest magnitudes (as bits) of the change, and of a scale
    padded = np.zeros((6, TILE), np.float32)  # the last tile's inputs and outputs
    for start in range(0, numel, TILE):
        count = min(TILE, numel - start)
        end = start + count
        if count == TILE:
            inputs = (master[start:end], previous[start:end], momentum[start:end], dense[start:end])
            outputs = (new_master[start:end], new_momentum[start:end], new_version[start:end])
        else:  # past the end, zeros (and zero codes): a zero update and change there
            padded[:] = 0.0
            padded[0, :count] = master[start:]
            padded[1, :count] = previous[start:]
            if has_momentum:
                padded[2, :count] = momentum[start:]
            if has_dense:
                padded[3, :count] = dense[start:]
            inputs = (padded[0], padded[1], padded[2], padded[3])
            outputs = (padded[4], padded[5], scratch[3])
        _close_tile(
            inputs,
            outputs,
            (scales, codes, rows, fractions, new_scales, new_codes, start // BLOCK),
            (rebase, share, lr, mu),
            (deltas, has_momentum, has_dense, in_place),
            scratch,
            per_block,
            fields,
            tops,
        )
        if count < TILE:  # in place, the step went into the padded inputs
            new_master[start:] = padded[0 if in_place else 4, :count]
            new_momentum[start:] = padded[2 if in_place and has_momentum else 5, :count]
            new_version[start:] = scratch[3, :count]
    finite = np.uint32(tops[0] & _EXPONENT_BITS) != _EXPONENT_BITS  # NaN's bits are the largest
    return finite, _bits_as_float(tops[0]), _bits_as_float(tops[1])


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"}, inline="always")
def _close_tile(inputs, outputs, blocks, factors, shape, scratch, per_block, fields, tops):
    """One tile of :func:`close_int2`, from block ``first`` on: every loop runs
    over the whole tile or a whole block, a constant length, so is vectorised."""
    weights, base, momentum, dense = inputs  # the tile's master, version, momentum, dense
    stepped, buffers, version = outputs  # its new master, momentum and version
    scales, codes, rows, fractions, new_scales, new_codes, first = blocks
    rebase, share, lr, mu = factors
    deltas, has_momentum, has_dense, in_place = shape
    update, moved, levels = scratch[0], scratch[1], scratch[2]
    field_bytes = fields[0].view(np.uint8)
    # -- the merged update (the master's lead is added in the step below)
    if has_dense:
        for j in range(TILE):
            update[j] = dense[j]
    else:
        for j in range(TILE):
            update[j] = 0.0
    # Two deltas a pass (the update is read and written half as often), then the
    # last one of an odd count.
    offset = first * (BLOCK // 4)
    other = fields[1].view(np.uint8)
    for m in range(0, deltas - 1, 2):
        _spread(codes[rows[m], offset : offset + TILE_BYTES], fields[0])
        _spread(codes[rows[m + 1], offset : offset + TILE_BYTES], fields[1])
        for b in range(TILE_BLOCKS):
            scale = scales[rows[m], first + b] * fractions[m]
            scale_other = scales[rows[m + 1], first + b] * fractions[m + 1]
            for j in range(b * BLOCK, b * BLOCK + BLOCK):
                update[j] += (np.float32(field_bytes[j]) - np.float32(2.0)) * scale + (
                    np.float32(other[j]) - np.float32(2.0)
                ) * scale_other
    if deltas % 2:
        m = deltas - 1
        _spread(codes[rows[m], offset : offset + TILE_BYTES], fields[0])
        for b in range(TILE_BLOCKS):
            scale = scales[rows[m], first + b] * fractions[m]
            for j in range(b * BLOCK, b * BLOCK + BLOCK):
                update[j] += (np.float32(field_bytes[j]) - np.float32(2.0)) * scale
    # -- the outer step, and the change from the published version. Each loop
    # writes its outputs through the arrays it reads them from, or into arrays
    # apart from its inputs: an output that may overlap an input (in place
    # through another name) keeps a loop from being vectorised.
    # Without momentum, the new momentum's array stands in for the old one:
    # _outer_step reads it but does not use it.
    if has_momentum and in_place:
        _step_tile(update, weights, base, momentum, True, factors, weights, momentum, moved)
    elif has_momentum:
        _step_tile(update, weights, base, momentum, True, factors, stepped, buffers, moved)
    elif in_place:
        _step_tile(update, weights, base, buffers, False, factors, weights, buffers, moved)
    else:
        _step_tile(update, weights, base, buffers, False, factors, stepped, buffers, moved)
    # -- each block's codes and least-squares scale (broker.wire.quantise.Levels.scaled_codes). What
    # is done once per block is done for every block of the tile in one loop, so
    # that it is vectorised too.
    moved_bits = moved.view(np.uint32)
    absmax, energy, dot = per_block[0], per_block[1], per_block[2]
    absmax_bits, scale_bits = absmax.view(np.uint32), per_block[3].view(np.uint32)
    for b in range(TILE_BLOCKS):
        largest = np.uint32(0)
        for j in range(b * BLOCK, b * BLOCK + BLOCK):
            largest = max(largest, np.uint32(moved_bits[j] & _ABS_BITS))
        absmax_bits[b] = largest
    for b in range(TILE_BLOCKS):
        tops[0] = max(tops[0], absmax_bits[b])
        absmax_bits[b] = _bf16_bits(absmax_bits[b])
    for b in range(TILE_BLOCKS):
        safe = absmax[b] if absmax[b] > 0 else np.float32(1.0)
        squares = np.float32(0.0)
        total = 0.0
        for j in range(b * BLOCK, b * BLOCK + BLOCK):
            # Through an integer, as the codec's int8 codes: a level is never -0.0
            # (-0.0 x scale added to a -0.0 weight stays -0.0; a learner adds +0.0).
            code = np.int32(min(max(np.rint(moved[j] / safe), np.float32(-1.0)), np.float32(1.0)))
            level = np.float32(code)
            levels[j] = level
            squares += level * level
            total += np.float64(moved[j]) * np.float64(level)
        energy[b] = squares
        dot[b] = np.float32(total / squares)  # exact sum, rounded once
    for b in range(TILE_BLOCKS):
        fitted = _bf16_bits(np.float32(dot[b]).view(np.uint32))
        scale_bits[b] = fitted if energy[b] > 0 else absmax_bits[b]
        tops[1] = max(tops[1], np.uint32(scale_bits[b] & _ABS_BITS))
        new_scales[first + b] = per_block[3, b]
    for b in range(TILE_BLOCKS):
        scale = per_block[3, b]
        for j in range(b * BLOCK, b * BLOCK + BLOCK):
            version[j] = base[j] + levels[j] * scale
    # -- the codes, packed: the inverse of the spreading above
    for j in range(TILE):
        field_bytes[j] = np.uint8(np.int32(levels[j]) + 2)
    for k in range(TILE_BYTES):
        spread = fields[0, k]
        packed = (spread | (spread >> 6) | (spread >> 12) | (spread >> 18)) & 0xFF
        new_codes[first * (BLOCK // 4) + k] = np.uint8(packed)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _spread(packed_codes: np.ndarray, fields: np.ndarray) -> None:
    """Each byte's four 2-bit fields spread to a byte each (of ``fields``, as
    bytes), with the same shifts for every byte."""
    for k in range(packed_codes.size):
        packed = np.uint32(packed_codes[k])
        fields[k] = (packed | (packed << 6) | (packed << 12) | (packed << 18)) & 0x03030303


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"}, inline="always")
def _step_tile(
    update, weights, base, momentum, has_momentum, factors, new_weights, new_momentum, moved
):
    """A tile's outer step into ``new_weights`` and ``new_momentum``, and its
    change from ``base`` into ``moved``. Inlined, so an output that is an input
    (in place) is the same array to the compiler, and the loop is vectorised."""
    for j in range(TILE):
        value, buffer = _outer_step(
            update[j], weights[j], base[j], momentum[j], has_momentum, factors
        )
        new_weights[j] = value
        new_momentum[j] = buffer
        moved[j] = value - base[j]


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"}, inline="always")
def _outer_step(update, weights, base, momentum, has_momentum, factors):
    """One value's new master and momentum: the update with the master's lead
    over the version, scaled by the share, into Nesterov momentum (the step
    itself before the first step)."""
    rebase, share, lr, mu = factors
    step = (update + rebase * (weights - base)) * share
    buffer = mu * momentum + step if has_momentum else step
    return weights - lr * (step + mu * buffer), buffer


def warm_up() -> None:
    """Compile (or load from the cache) every kernel, with the argument types the
    syncer passes, once per process: a syncer's first round would otherwise wait
    for the compiler (6 s on 2 cores; 0.4 s to load from the cache)."""
    if close_int2.signatures:
        return
    numel = 5
    one = np.float32(1.0)
    values = np.zeros(numel, dtype=np.float32)
    raw = np.full(2 + 2, 0xAA, dtype=np.uint8)
    scales, codes = new_rows(1, numel)
    unpack_int2(raw, numel, scales[0], codes[0])
    int2_stats(scales[0], codes[0])
    empty = np.empty(0, dtype=np.float32)
    close_int2(
        scales, codes, np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.float32), empty,
        one, one, one, one, values, empty, values,
        np.empty_like(values), np.empty_like(values), np.empty_like(values),
        np.empty_like(scales[0]), np.empty_like(codes[0]),
    )  # fmt: skip
