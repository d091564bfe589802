"""MXNet 2-bit gradient compression: exact words, residual carry-over, scalar reference."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hetps.kvstore.compression import TwoBitCompressor, parse_compression_params

POSBITS = (0xC0, 0x30, 0x0C, 0x03)
NEGBITS = (0x80, 0x20, 0x08, 0x02)


# --------------------------------------------------------------------------- reference
def ref_quantize(grad, residual, threshold):
    """Element-by-element transcription of MXNet's quantize_2bit (float32 arithmetic).

    Returns the packed words as little-endian uint32 and updates ``residual`` in place.
    """
    t = np.float32(threshold)
    neg_t = np.float32(-1) * t
    n = len(grad)
    out = bytearray(4 * ((n + 15) // 16))
    for i in range(n):
        r = np.float32(residual[i] + np.float32(grad[i]))
        byte = i >> 2  # block (i >> 4) * 4 bytes + ((i & 15) >> 2)
        if r >= t:
            out[byte] |= POSBITS[i & 3]
            r = np.float32(r - t)
        elif r <= neg_t:
            out[byte] |= NEGBITS[i & 3]
            r = np.float32(r - neg_t)
        residual[i] = r
    return np.frombuffer(bytes(out), dtype="<u4").astype(np.uint32)


def ref_dequantize(packed, n, threshold, dtype=np.float32):
    """Element-by-element transcription of MXNet's dequantize_2bit."""
    raw = np.asarray(packed, dtype=np.uint32).astype("<u4").tobytes()
    t = np.float32(threshold)
    out = np.zeros(n, dtype=dtype)
    for i in range(n):
        b = raw[i >> 2]
        col = i & 3
        masked = b & POSBITS[col]
        if masked == POSBITS[col]:
            out[i] = t
        elif masked == NEGBITS[col]:
            out[i] = -t
        else:
            out[i] = 0
    return out


def f32(values):
    return np.array(values, dtype=np.float32)


# ------------------------------------------------------------------ hand-computed vectors
def test_hand_computed_words_and_residual_carry_over():
    c = TwoBitCompressor(0.5)
    res = np.zeros(5, np.float32)

    # values 0..3 in byte 0 (0xc0 | 0x20 = 0xe0), value 4 in byte 1 (0xc0)
    packed = c.compress(f32([1.0, -1.0, 0.25, 0.0, 0.75]), res)
    assert packed.dtype == np.uint32
    assert packed.tolist() == [0x0000C0E0]
    np.testing.assert_array_equal(res, f32([0.5, -0.5, 0.25, 0.0, 0.25]))

    # the carried residual reaches the thresholds exactly: >= and <= are inclusive
    packed = c.compress(f32([0.0, 0.0, 0.25, -0.5, -0.25]), res)
    assert packed.tolist() == [0xC0 | 0x20 | 0x0C | 0x02]  # 0xee: +, -, +, -
    np.testing.assert_array_equal(res, np.zeros(5, np.float32))


def test_only_one_threshold_is_sent_per_call():
    c = TwoBitCompressor(0.5)
    res = np.zeros(2, np.float32)
    assert c.compress(f32([2.0, -1.75]), res).tolist() == [0xC0 | 0x20]
    np.testing.assert_array_equal(res, f32([1.5, -1.25]))
    assert c.compress(f32([0.0, 0.0]), res).tolist() == [0xC0 | 0x20]
    np.testing.assert_array_equal(res, f32([1.0, -0.75]))
    assert c.compress(f32([0.0, 0.0]), res).tolist() == [0xC0 | 0x20]
    np.testing.assert_array_equal(res, f32([0.5, -0.25]))
    assert c.compress(f32([0.0, 0.0]), res).tolist() == [0xC0]
    np.testing.assert_array_equal(res, f32([0.0, -0.25]))


def test_byte_order_within_the_word_is_mxnet_memory_order():
    c = TwoBitCompressor(1.0)
    grad = np.zeros(16, np.float32)
    grad[0] = 1.0  # byte 0, bits 7-6 -> 0x000000c0
    grad[3] = -1.0  # byte 0, bits 1-0 -> 0x00000002
    grad[5] = 1.0  # byte 1, bits 5-4 -> 0x00003000
    grad[10] = -1.0  # byte 2, bits 3-2 -> 0x00080000
    grad[12] = -1.0  # byte 3, bits 7-6 -> 0x80000000
    grad[15] = 1.0  # byte 3, bits 1-0 -> 0x03000000
    packed = c.compress(grad, np.zeros(16, np.float32))
    assert packed.tolist() == [0x830830C2]
    # the bytes as MXNet has them in memory (little-endian float32 buffer)
    assert packed.astype("<u4").tobytes() == bytes([0xC2, 0x30, 0x08, 0x83])


def test_length_not_a_multiple_of_16():
    c = TwoBitCompressor(0.5)
    grad = np.zeros(17, np.float32)
    grad[15] = 0.5  # last value of word 0: byte 3, bits 1-0
    grad[16] = -0.5  # first value of word 1: byte 0, bits 7-6 = 10
    packed = c.compress(grad, np.zeros(17, np.float32))
    assert packed.tolist() == [0x03000000, 0x00000080]
    out = c.decompress(packed, 17)
    expected = np.zeros(17, np.float32)
    expected[15], expected[16] = 0.5, -0.5
    np.testing.assert_array_equal(out, expected)

    assert c.compress(np.zeros(33, np.float32), np.zeros(33, np.float32)).size == 3
    empty = c.compress(np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert empty.dtype == np.uint32 and empty.size == 0
    assert c.decompress(empty, 0).size == 0


def test_decompress_hand_words_including_unused_code_01():
    c = TwoBitCompressor(0.25)
    # byte 0 = 0b11_10_01_00: +t, -t, 0 (code 01 is never produced and decodes to 0), 0
    # byte 1 = 0b00_00_10_11: 0, 0, -t, +t
    word = 0b11100100 | (0b00001011 << 8)
    out = c.decompress(np.array([word], np.uint32), 8)
    np.testing.assert_array_equal(out, f32([0.25, -0.25, 0, 0, 0, 0, -0.25, 0.25]))


def test_grad_dtypes_and_shapes():
    c = TwoBitCompressor(0.5)
    grad16 = np.array([[0.5, -0.75], [0.25, 1.0]], np.float16)
    res = np.zeros((2, 2), np.float32)
    assert c.compress(grad16, res).tolist() == [0xC0 | 0x20 | 0x03]
    np.testing.assert_array_equal(res, f32([[0.0, -0.25], [0.25, 0.5]]))

    # float64 gradients are rounded to float32 before being added, as in MXNet's kernel
    g64 = np.array([0.1, 0.7], np.float64)
    res = np.zeros(2, np.float32)
    c.compress(g64, res)
    np.testing.assert_array_equal(res, f32([np.float32(0.1), np.float32(0.7) - np.float32(0.5)]))


def test_decompress_dtype_uses_float32_threshold():
    c = TwoBitCompressor(0.1)
    packed = c.compress(f32([1.0, -1.0]), np.zeros(2, np.float32))
    out = c.decompress(packed, 2, np.float64)
    assert out.dtype == np.float64
    assert out.tolist() == [float(np.float32(0.1)), -float(np.float32(0.1))]
    out16 = c.decompress(packed, 2, np.float16)
    assert out16.dtype == np.float16
    assert out16.tolist() == [
        float(np.float16(np.float32(0.1))),
        -float(np.float16(np.float32(0.1))),
    ]


def test_non_contiguous_residual_is_updated_in_place():
    c = TwoBitCompressor(0.5)
    base = np.zeros(10, np.float32)
    res = base[::2]
    packed = c.compress(f32([0.75, 0.0, -0.25, -0.5, 0.0]), res)
    assert packed.tolist() == [0xC0 | 0x02]
    np.testing.assert_array_equal(base[::2], f32([0.25, 0.0, -0.25, 0.0, 0.0]))
    np.testing.assert_array_equal(base[1::2], np.zeros(5, np.float32))


def test_many_chunks_match_a_whole_array_formulation():
    """A length spanning several internal chunks (and not a multiple of them or of 16)."""
    rng = np.random.default_rng(7)
    n = 3 * 65536 + 4099
    c = TwoBitCompressor(0.3)
    res = rng.uniform(-0.3, 0.3, n).astype(np.float32)
    expected_res = res.copy()
    for _ in range(3):
        grad = rng.normal(0, 0.4, n).astype(np.float32)
        packed = c.compress(grad, res)
        # straightforward whole-array NumPy version of the same rule
        t = np.float32(0.3)
        expected_res += grad
        pos = expected_res >= t
        neg = expected_res <= -t
        expected_res[pos] -= t
        expected_res[neg] += t
        codes = np.zeros(packed.size * 16, np.uint8)
        codes[:n][pos] = 3
        codes[:n][neg] = 2
        q = codes.reshape(-1, 4).astype(np.uint32)
        by = (q[:, 0] << 6) | (q[:, 1] << 4) | (q[:, 2] << 2) | q[:, 3]
        words = by.reshape(-1, 4)
        expected = words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24
        np.testing.assert_array_equal(packed, expected.astype(np.uint32))
        np.testing.assert_array_equal(res, expected_res)
        dec = c.decompress(packed, n)
        np.testing.assert_array_equal(dec, np.where(pos, t, np.where(neg, -t, np.float32(0))))


@pytest.mark.skipif(sys.byteorder != "little", reason="checks the native memory layout")
def test_packed_memory_is_mxnet_bytes_on_little_endian():
    c = TwoBitCompressor(0.5)
    packed = c.compress(f32([0.5] + [0.0] * 14 + [-0.5]), np.zeros(16, np.float32))
    assert packed.view(np.uint8).tolist() == [0xC0, 0x00, 0x00, 0x02]


# --------------------------------------------------------------------- property tests
_floats = st.floats(min_value=-4.0, max_value=4.0, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    grads=st.integers(min_value=0, max_value=70).flatmap(
        lambda n: st.lists(hnp.arrays(np.float32, n, elements=_floats), min_size=1, max_size=3)
    ),
    threshold=st.floats(min_value=1e-3, max_value=3.0, allow_nan=False),
    init=st.floats(min_value=-2.0, max_value=2.0, width=32),
)
def test_compress_matches_scalar_reference(grads, threshold, init):
    n = grads[0].size
    c = TwoBitCompressor(threshold)
    res = np.full(n, init, np.float32)
    ref_res = res.copy()
    for grad in grads:
        packed = c.compress(grad, res)
        expected = ref_quantize(grad, ref_res, threshold)
        assert packed.dtype == np.uint32
        np.testing.assert_array_equal(packed, expected)
        np.testing.assert_array_equal(res, ref_res)
        np.testing.assert_array_equal(
            c.decompress(packed, n), ref_dequantize(expected, n, threshold)
        )


@settings(max_examples=100, deadline=None)
@given(
    words=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=6),
    threshold=st.floats(min_value=1e-3, max_value=3.0, allow_nan=False),
    data=st.data(),
)
def test_decompress_any_words_matches_scalar_reference(words, threshold, data):
    packed = np.array(words, dtype=np.uint32)
    n = data.draw(st.integers(min_value=max(0, 16 * len(words) - 15), max_value=16 * len(words)))
    c = TwoBitCompressor(threshold)
    for dtype in (np.float32, np.float64):
        np.testing.assert_array_equal(
            c.decompress(packed, n, dtype), ref_dequantize(packed, n, threshold, dtype)
        )


# ----------------------------------------------------------------------------- errors
def test_compress_argument_errors():
    c = TwoBitCompressor(0.5)
    with pytest.raises(TypeError, match="residual must be a float32"):
        c.compress(f32([1.0]), np.zeros(1, np.float64))
    with pytest.raises(ValueError, match="residual has 2 elements but grad has 1"):
        c.compress(f32([1.0]), np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="grad must be a float array"):
        c.compress(np.array([1], np.int32), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="cannot hold 17 values"):
        c.decompress(np.zeros(1, np.uint32), 17)
    with pytest.raises(TypeError, match="uint32"):
        c.decompress(np.zeros(1, np.int64), 1)


@pytest.mark.parametrize("bad", [0, -0.5, math.inf, math.nan, 1e-50])
def test_threshold_must_be_positive(bad):
    with pytest.raises(ValueError, match="threshold"):
        TwoBitCompressor(bad)


# ---------------------------------------------------------------- parameter parsing
def test_parse_compression_params_valid_forms():
    c = parse_compression_params({"type": "2bit", "threshold": 0.25})
    assert isinstance(c, TwoBitCompressor) and c.threshold == 0.25
    assert parse_compression_params({"type": "2bit"}).threshold == 0.5  # MXNet's default
    assert parse_compression_params({"type": "2bit", "threshold": "0.125"}).threshold == 0.125
    assert parse_compression_params({"type": "none"}) is None
    assert parse_compression_params(None) is None


@pytest.mark.parametrize(
    ("params", "exc", "needle"),
    [
        ({"type": "1bit"}, ValueError, "'type' '1bit' is not supported; use '2bit' or 'none'"),
        ({"threshold": 0.5}, ValueError, "need a 'type' key"),
        ({"type": "2bit", "threshold": 0}, ValueError, "'threshold' must be a number > 0"),
        ({"type": "2bit", "threshold": -1.0}, ValueError, "'threshold' must be a number > 0"),
        ({"type": "2bit", "threshold": "abc"}, ValueError, "'threshold' must be a number > 0"),
        ({"type": "2bit", "threshold": True}, ValueError, "'threshold' must be a number > 0"),
        ({"type": "2bit", "threshold": float("inf")}, ValueError, "'threshold'"),
        ({"type": "2bit", "thresh": 0.5}, ValueError, "unknown gradient compression key"),
        ({"type": "none", "threshold": 0.5}, ValueError, "allowed keys: ['type']"),
        ("2bit", TypeError, "must be a dict"),
    ],
)
def test_parse_compression_params_errors(params, exc, needle):
    with pytest.raises(exc) as info:
        parse_compression_params(params)
    assert needle in str(info.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_decompress_into_an_array_or_adding_to_it_is_bit_for_bit_a_new_array(dtype):
    from hetps.optim import kernels

    kernels.set_threads(2)
    try:
        c = TwoBitCompressor(0.5)
        rng = np.random.default_rng(5)
        # sizes around the 16-value words and the kernel's chunks and threads
        for n in (0, 1, 15, 17, 1000, kernels.MIN_PARALLEL + 3 * kernels.CHUNK + 5):
            packed = c.compress(rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32))
            ref = c.decompress(packed, n, dtype)
            out = np.full(n, 7, dtype)
            assert c.decompress(packed, n, dtype, out=out) is out
            assert out.tobytes() == ref.tobytes()
            base = rng.standard_normal(n).astype(dtype)
            expect = base + ref
            c.decompress(packed, n, dtype, out=base, add=True)
            assert base.tobytes() == expect.tobytes()
    finally:
        kernels.set_threads(0)


def test_decompress_out_must_fit():
    c = TwoBitCompressor(0.5)
    packed = c.compress(np.ones(32, np.float32), np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="out must be a writeable contiguous 1-D array of 32"):
        c.decompress(packed, 32, out=np.zeros(31, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        c.decompress(packed, 32, out=np.zeros(32, np.float64))
    with pytest.raises(ValueError, match="needs the array to add to"):
        c.decompress(packed, 32, add=True)
