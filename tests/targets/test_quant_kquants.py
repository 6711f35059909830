"""Products with Q5_0, Q4_K and Q6_K blocks (csrc/quant_kquants_cpu.cpp) against float64: the
weights decoded by the gguf package's own dequantize (an independent reader of the block layouts),
the input quantized as the kernels document it; random blocks and real rows of Gemma 3's package
file, odd row counts, rows bitwise independent of how many share a call, every instruction-set path
this CPU has."""

from __future__ import annotations

import numpy as np
import pytest

from elsi_fast._infra._extension import _C
from elsi_fast.targets import catalog
from test_quant_linear import quantized_input  # tests/targets is on sys.path (no __init__.py)

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")

TYPES = {"Q5_0": 6, "Q4_K": 12, "Q6_K": 14}
# Error of the fp32 block sums against float64, in units of sum |x_q| |w| (the exact block
# integers times fp32 scale products, accumulated in fp32): Q4_K adds its minimums' term.
TOLERANCE = {"Q5_0": 1e-5, "Q4_K": 2e-5, "Q6_K": 1e-5}


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of `name` (bytes uniform; the fp16 scales set to small positive values)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[name]
    block_cols, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if name == "Q5_0":  # gguf quantizes Q5_0 itself
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    blocks = rng.integers(0, 256, (rows, cols // block_cols, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, (rows, cols // block_cols, 2)).astype(np.float16).view(np.uint8)
    if name == "Q4_K":
        blocks[..., 0:4] = scales  # d, dmin
    else:
        blocks[..., 208:210] = scales[..., :2]  # d
    return blocks.reshape(rows, -1)


def matrix_of(name: str, blocks: np.ndarray, cols: int) -> tuple[tuple, np.ndarray]:
    dense = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[name]).astype(np.float64)
    assert dense.shape == (blocks.shape[0], cols)
    return (TYPES[name], blocks, blocks.shape[0], cols), dense


def check_product(name: str, matrix: tuple, dense: np.ndarray, seed: int, packed: bool = False) -> None:
    rng = np.random.default_rng(seed)
    for n in (1, 3, 8, 11):
        x = rng.standard_normal((n, dense.shape[1])).astype(np.float32)
        (y,) = _C.quant_linear([matrix], x, 2, packed=packed)
        xq = quantized_input(x)
        bound = TOLERANCE[name] * (np.abs(xq) @ np.abs(dense).T)
        err = np.abs(y - xq @ dense.T)
        assert y.shape == (n, dense.shape[0]) and np.all(err <= bound + 1e-6), (n, float((err - bound).max()))
        # and near the unquantized input's product: the input's int8 rounding only
        exact = x.astype(np.float64) @ dense.T
        assert np.all(np.abs(y - exact) <= 0.01 * (np.abs(x) @ np.abs(dense).T) + 1e-6)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (45, 768), (301, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_random_blocks_match_float64(name, shape, cpu_isa):
    rows, cols = shape
    matrix, dense = matrix_of(name, random_blocks(name, rows, cols, seed=rows), cols)
    check_product(name, matrix, dense, seed=cols)


@pytest.fixture(scope="module")
def gemma_tensors():
    try:
        path = catalog.resolve("gemma3-270m")
    except ValueError as error:
        pytest.skip(str(error))
    return {t.name: t for t in gguf.GGUFReader(str(path), "r").tensors}


@pytest.mark.parametrize("tensor, name", [("blk.0.attn_q.weight", "Q5_0"), ("blk.0.attn_output.weight", "Q4_K"),
                                          ("blk.0.ffn_down.weight", "Q6_K"), ("blk.2.ffn_down.weight", "Q4_K")])
def test_real_gemma_rows_match_float64(gemma_tensors, tensor, name, cpu_isa):
    t = gemma_tensors[tensor]
    assert t.tensor_type.name == name
    blocks = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)[:77])
    matrix, dense = matrix_of(name, blocks, int(t.shape[0]))
    check_product(name, matrix, dense, seed=3)


@pytest.mark.parametrize("name, rows, packed", [("Q5_0", 93, False), ("Q4_K", 93, False), ("Q6_K", 93, False),
                                                ("Q4_K", 96, True), ("Q6_K", 96, True)])
def test_rows_are_bitwise_independent(name, rows, packed, cpu_isa):
    matrix, _ = matrix_of(name, random_blocks(name, rows, 768, seed=5), 768)
    x = np.random.default_rng(6).standard_normal((9, 768)).astype(np.float32)
    alone = np.concatenate([_C.quant_linear([matrix], x[i:i + 1], 1, packed=packed)[0] for i in range(9)])
    for n in range(2, 10):
        for threads in (1, 2):
            np.testing.assert_array_equal(_C.quant_linear([matrix], x[:n], threads, packed=packed)[0], alone[:n])


# The super-block types packed by 8 rows (pack_rows8; csrc/quant_dots_rows8.inc dots8_q4k, dots8_q6k):
# whole groups of 8 rows.
PACKED = ("Q4_K", "Q6_K")


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("shape", [(8, 256), (24, 512), (304, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_packed_matches_float64(name, shape, cpu_isa):
    rows, cols = shape
    matrix, dense = matrix_of(name, random_blocks(name, rows, cols, seed=rows + 1), cols)
    check_product(name, matrix, dense, seed=cols + 1, packed=True)


@pytest.mark.parametrize("tensor, name", [("blk.0.attn_output.weight", "Q4_K"), ("blk.0.ffn_down.weight", "Q6_K")])
def test_packed_real_gemma_rows_match_float64(gemma_tensors, tensor, name):
    t = gemma_tensors[tensor]
    assert t.tensor_type.name == name
    blocks = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)[:80])
    matrix, dense = matrix_of(name, blocks, int(t.shape[0]))
    check_product(name, matrix, dense, seed=4, packed=True)


def saturated_blocks(name: str, blocks: np.ndarray) -> np.ndarray:
    """The first super-block of the first 8 rows with every quant at its largest code (Q4_K 15,
    Q6_K 63)."""
    out = blocks.copy()
    if name == "Q4_K":
        out[:8, 16:144] = 0xFF  # qs
    else:
        out[:8, 0:192] = 0xFF  # ql and qh
    return out


@pytest.mark.parametrize("name", PACKED)
def test_packed_is_the_same_on_every_instruction_set(name):
    """The packed kernels' integer sub-block sums are exact and their fp32 steps those of the scalar
    path (dots8_q4k_scalar, dots8_q6k_scalar), so every path this CPU has gives its bits, the extreme
    codes against inputs of +-127 in every column included."""
    matrix, _ = matrix_of(name, random_blocks(name, 40, 512, seed=9), 512)
    saturated = (TYPES[name], saturated_blocks(name, np.array(matrix[1])), 40, 512)
    x = np.random.default_rng(10).standard_normal((5, 512)).astype(np.float32)
    x[1] = 127.0
    x[2, ::2] = -127.0
    results = {}
    previous = _C.cpu_isa()
    try:
        for isa in ("scalar", "avx2", "avx512"):
            if _C.set_cpu_isa(isa):
                results[isa] = [_C.quant_linear([m], x, 2, packed=True)[0] for m in (matrix, saturated)]
    finally:
        _C.set_cpu_isa(previous)
    for isa, ys in results.items():
        for y, want in zip(ys, results["scalar"]):
            np.testing.assert_array_equal(y, want, err_msg=isa)
