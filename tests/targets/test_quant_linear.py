"""GGUF block products (csrc/quant_linear.h) against float64 references: the weights dequantized by
the gguf package (an independent decoder of the blocks), the input quantized as the kernels document
it (re-derived here in numpy); rows bitwise independent of how many share a call, on every
instruction-set path this CPU has."""

from __future__ import annotations

import numpy as np
import pytest

from elsi_fast._infra._extension import _C

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8}
# (rows, cols): one block, odd row counts, a row wider than a chunk's share of rows; and row counts
# of whole groups of 8, which the forward's layout packs (pack_rows8; packed=True leaves the others; 24: a pair of
# groups for the 512-bit kernel and a group alone).
SHAPES = [(1, 32), (7, 96), (45, 608), (301, 1536), (8, 32), (24, 96), (64, 608), (304, 1536)]


def make_matrix(rows: int, cols: int, name: str, seed: int) -> tuple[tuple, np.ndarray]:
    """A random matrix in GGUF blocks of `name` and its float64 value as gguf decodes the blocks."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[name]
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    dense = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
    assert dense.shape == (rows, cols)
    return (TYPES[name], blocks, rows, cols), dense


def packed_on_every_isa(matrix: tuple, x: np.ndarray, threads: int = 1) -> dict[str, np.ndarray]:
    """The packed product on each instruction-set path this CPU has, by path name."""
    previous = _C.cpu_isa()
    try:
        return {isa: _C.quant_linear([matrix], x, threads, packed=True)[0] for isa in ("scalar", "avx2", "avx512")
                if _C.set_cpu_isa(isa)}
    finally:
        _C.set_cpu_isa(previous)


def quantized_input(x: np.ndarray) -> np.ndarray:
    """x as the kernels quantize it, dequantized, in float64: per 32 columns d = max|x| / 127 (fp32)
    and q = round half to even of x * (1 / d)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv)
    return (q.astype(np.float64) * d).reshape(x.shape)


def test_input_quantization_matches_its_definition(cpu_isa):
    x = np.random.default_rng(1).standard_normal((4, 96)).astype(np.float32)
    x[1, :32] = 0  # an all-zero block: scale 0, codes 0
    # d = 1 exactly: halves round to even (2.5 -> 2, -3.5 -> -4, 0.5 -> 0), +-127 at the ends
    x[3, :32] = np.float32(127.0)
    x[3, 1:8] = [2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 126.5]
    q, d, s = _C.quantize_input(x)
    deq = (q.astype(np.float64).reshape(4, -1, 32) * d[..., None]).reshape(4, 96)
    np.testing.assert_array_equal(deq, quantized_input(x))
    assert np.abs(q).max() <= 127 and d[1, 0] == 0
    assert d[3, 0] == 1 and list(q[3, :9]) == [127, 2, -4, 0, 0, 2, -126, 126, 127]
    np.testing.assert_allclose(s, d * q.reshape(4, -1, 32).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["file", "packed"])
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_products_match_float64(name, shape, packed, cpu_isa):
    rows, cols = shape
    matrix, dense = make_matrix(rows, cols, name, seed=rows * cols)
    rng = np.random.default_rng(rows)
    for n in (1, 3, 8, 11):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        (y,) = _C.quant_linear([matrix], x, 2, packed=packed)
        ref = quantized_input(x) @ dense.T
        # fp32 accumulation of exact block sums: error far below one unit of the terms' magnitude
        bound = 1e-5 * (np.abs(quantized_input(x)) @ np.abs(dense).T)
        assert y.shape == (n, rows) and y.dtype == np.float32
        assert np.all(np.abs(y - ref) <= bound + 1e-6), (n, float(np.abs(y - ref).max()))
        # and close to the unquantized input's product (the input's int8 rounding only)
        exact = x.astype(np.float64) @ dense.T
        assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("rows, packed", [(301, False), (304, True)], ids=["file", "packed"])
@pytest.mark.parametrize("name", TYPES)
def test_rows_are_bitwise_independent(name, rows, packed, cpu_isa):
    matrix, _ = make_matrix(rows, 608, name, seed=5)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, 608)).astype(np.float32)
    alone = np.concatenate([_C.quant_linear([matrix], x[i:i + 1], 1, packed=packed)[0] for i in range(9)])
    for n in range(2, 10):
        for threads in (1, 2):
            (y,) = _C.quant_linear([matrix], x[:n], threads, packed=packed)
            np.testing.assert_array_equal(y, alone[:n])


@pytest.mark.parametrize("name", TYPES)
def test_packed_products_are_the_same_on_every_instruction_set(name):
    """The packed kernels' integer block sums are exact and their fp32 steps the same on each path
    (csrc/quant_dots_rows8.inc), so every path this CPU has gives the scalar path's bits; 72 rows
    are 4 pairs of groups (AVX-512's 512-bit kernel) and a last group alone."""
    matrix, _ = make_matrix(72, 608, name, seed=7)
    x = np.random.default_rng(8).standard_normal((5, 608)).astype(np.float32)
    x[2] *= 50  # large inputs: the extreme codes (|q| = 127) in every block
    results = packed_on_every_isa(matrix, x, threads=2)
    for isa, y in results.items():
        np.testing.assert_array_equal(y, results["scalar"], err_msg=isa)


def test_packing_keeps_extreme_q8_codes():
    """Q8_0 codes -128 and 127 (a file may hold -128 though gguf never writes it): the VNNI path's
    offset (w + 128) and the AVX2 path's |w| <= 128 both keep the block sums exact (24 rows: a pair
    of groups and a group alone)."""
    rows, cols = 24, 64
    blocks = np.zeros((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    codes = np.random.default_rng(9).choice(np.array([-128, 127, -1, 0], np.int8), (rows, cols // 32, 32))
    blocks[..., 2:] = codes.view(np.uint8)
    x = np.full((2, cols), -127.0, np.float32)  # scale 1, codes -127: the largest products of each sign
    x[1] = 127.0
    expected = 0.5 * (x.astype(np.float64) @ codes.reshape(rows, cols).astype(np.float64).T)
    for isa, y in packed_on_every_isa((8, blocks.reshape(rows, -1), rows, cols), x).items():
        np.testing.assert_array_equal(y, expected.astype(np.float32), err_msg=isa)


def test_packing_keeps_extreme_q5_codes():
    """Q5_0 codes 31 and 0 (values 15 and -16) against inputs of +-127 in every column: the AVX2
    path's int16 chains (4 pairs of 2 x 31 x 127 each) and the fifth bits of every column (24 rows:
    a pair of groups and a group alone)."""
    rows, cols = 24, 64
    rng = np.random.default_rng(10)
    codes = rng.choice(np.array([0, 31, 15, 16], np.uint8), (rows, cols // 32, 32))
    codes[0] = 31  # a row of only the largest code
    blocks = np.zeros((rows, cols // 32, 22), np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(0.25).tobytes(), np.uint8)
    high = (codes >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    blocks[..., 2:6] = np.bitwise_or.reduce(high, axis=-1).astype("<u4")[..., None].view(np.uint8)
    blocks[..., 6:] = (codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)
    x = np.full((2, cols), 127.0, np.float32)  # scale 1, codes 127
    x[1, ::2] = -127.0
    values = codes.reshape(rows, cols).astype(np.float64) - 16
    expected = 0.25 * (x.astype(np.float64) @ values.T)
    np.testing.assert_array_equal(gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType.Q5_0),
                                  0.25 * values)
    results = packed_on_every_isa((6, blocks.reshape(rows, -1), rows, cols), x)
    assert "scalar" in results and len(results) >= 2  # every CPU here has AVX2 at least
    for isa, y in results.items():
        np.testing.assert_array_equal(y, expected.astype(np.float32), err_msg=isa)


def test_matrices_sharing_an_input_equal_separate_calls():
    a, _ = make_matrix(64, 96, "Q4_1", seed=1)
    b, _ = make_matrix(31, 96, "Q8_0", seed=2)
    x = np.random.default_rng(3).standard_normal((4, 96)).astype(np.float32)
    ya, yb = _C.quant_linear([a, b], x, 2)
    np.testing.assert_array_equal(ya, _C.quant_linear([a], x, 1)[0])
    np.testing.assert_array_equal(yb, _C.quant_linear([b], x, 1)[0])


def test_bad_matrices_raise_one_clear_error():
    x = np.zeros((1, 64), np.float32)
    f16 = (1, np.zeros((2, 128), np.uint8), 2, 64)
    with pytest.raises(ValueError, match="weight type 1 is not Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K"):
        _C.quant_linear([f16], x, 1)
    with pytest.raises(ValueError, match="ggml type 10 is not supported"):  # Q2_K
        _C.quant_linear([(10, np.zeros((2, 84), np.uint8), 2, 256)], x, 1)
    with pytest.raises(ValueError, match="do not hold a \\[2, 64\\] matrix of ggml type 12"):  # Q4_K: 256 columns
        _C.quant_linear([(12, np.zeros((2, 36), np.uint8), 2, 64)], x, 1)
    with pytest.raises(ValueError, match="do not hold a \\[3, 64\\] matrix"):
        _C.quant_linear([(8, np.zeros((2, 68), np.uint8), 3, 64)], x, 1)
    with pytest.raises(ValueError, match="weight has 64 columns, input 32"):
        _C.quant_linear([(8, np.zeros((2, 68), np.uint8), 2, 64)], np.zeros((1, 32), np.float32), 1)
