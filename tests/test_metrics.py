"""elsi_fast.metrics against float64 numpy references, properties and known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elsi_fast import cka_matrix, hsic, linear_cka, matrix_entropy, spectrum_entropy, token_entropy
from elsi_fast import metrics
from elsi_fast.metrics import linear_token_entropy
from numpy_references import np_hsic_song
from torch_references import torch_cka_one_gemm

HYPOTHESIS = settings(max_examples=15, deadline=None)
# Input rounding is shared with the reference (it sees the same rounded values), so every dtype
# gets float64-level agreement; token entropies are float32 by contract.
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


# ------------------------------------------------------------------ float64 numpy references


def np_normalize(x: np.ndarray, mode: str) -> np.ndarray:
    if mode in ("center", "center_l2"):
        x = x - x.mean(axis=0)
    if mode == "center_l2":
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        x = np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    return x


def np_spectrum_entropy(eig: np.ndarray, alpha: float) -> float:
    eig = np.clip(eig, 0, None)
    p = eig / eig.sum()
    if alpha == 1:
        nz = p[p > 0]
        return float(-(nz * np.log(nz)).sum())
    if np.isinf(alpha):
        return float(-np.log(p.max()))
    return float(np.log((p**alpha).sum()) / (1 - alpha))


def np_matrix_entropy(x: np.ndarray, alpha: float, mode: str) -> float:
    """Always the Gram side, with numpy's eigh."""
    z = np_normalize(x, mode)
    return np_spectrum_entropy(np.linalg.eigh(z @ z.T)[0], alpha)


def np_hsic_biased(K: np.ndarray, L: np.ndarray) -> float:
    n = K.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    return float(np.trace(K @ H @ L @ H) / (n - 1) ** 2)


def np_cka_feature_space(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al. (2019) biased linear CKA on column-centered features."""
    x = x - x.mean(0)
    y = y - y.mean(0)
    return float(np.linalg.norm(x.T @ y) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def np_cka_gram(x: np.ndarray, y: np.ndarray, unbiased: bool) -> float:
    """CKA from Grams: HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))."""
    K, L = x @ x.T, y @ y.T
    h = np_hsic_song if unbiased else np_hsic_biased
    return h(K, L) / math.sqrt(h(K, K) * h(L, L))


def np_token_entropy(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def as_np(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


# ------------------------------------------------------------------ matrix entropy


@pytest.mark.parametrize("n,d", [(7, 13), (13, 7), (32, 32), (5, 1)])
@pytest.mark.parametrize("mode", ["center_l2", "center", "none"])
@pytest.mark.parametrize("alpha", [1.0, 2.0, 3.0, math.inf])
def test_matrix_entropy_matches_numpy(n, d, mode, alpha):
    x = rand(n, d, seed=n * d) + 0.5
    got = matrix_entropy(x, alpha=alpha, normalize=mode)
    assert got.dtype == torch.float64 and got.shape == ()
    assert got.item() == pytest.approx(np_matrix_entropy(as_np(x), alpha, mode), abs=1e-9)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_matrix_entropy_dtypes(dtype):
    x = rand(20, 9, seed=1, dtype=dtype)
    assert matrix_entropy(x).item() == pytest.approx(np_matrix_entropy(as_np(x), 1.0, "center_l2"), abs=1e-9)


def test_matrix_entropy_batched_equals_per_matrix():
    x = rand(4, 11, 6, seed=2)
    got = matrix_entropy(x, alpha=2.0)
    assert got.shape == (4,)
    torch.testing.assert_close(got, torch.stack([matrix_entropy(m, alpha=2.0) for m in x]))


def test_renyi2_is_minus_log_trace_ratio():
    z = np_normalize(as_np(rand(15, 40, seed=3)), "center_l2")
    A = z @ z.T
    expected = -math.log(np.trace(A @ A) / np.trace(A) ** 2)
    assert matrix_entropy(rand(15, 40, seed=3), alpha=2.0).item() == pytest.approx(expected, abs=1e-10)


@HYPOTHESIS
@given(n=st.integers(2, 12), d=st.integers(1, 12), pad=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_entropy_gram_side_equals_covariance_side(n, d, pad, seed):
    """Zero columns leave the Gram unchanged but flip which side is the smaller one."""
    x = rand(n, d, seed=seed)
    padded = torch.cat([x, torch.zeros(n, pad + n, dtype=x.dtype)], dim=1)
    h = matrix_entropy(x, normalize="center")
    assert h.item() == pytest.approx(matrix_entropy(padded, normalize="center").item(), abs=1e-9)
    # 0 <= H1 <= log(rank)
    rank = torch.linalg.matrix_rank(x - x.mean(0)).item()
    assert -1e-12 <= h.item() <= math.log(rank) + 1e-9


def test_matrix_entropy_of_isotropic_and_rank_one_data():
    iso = torch.cat([torch.eye(6), -torch.eye(6)])  # centered, covariance ~ I_6
    assert matrix_entropy(iso, normalize="none").item() == pytest.approx(math.log(6), abs=1e-12)
    line = torch.arange(10.0)[:, None] * torch.tensor([[1.0, 2.0, -1.0]])
    assert matrix_entropy(line, normalize="center").item() == pytest.approx(0.0, abs=1e-12)


def test_spectrum_entropy_clips_round_off_and_rejects_non_psd():
    assert spectrum_entropy(torch.tensor([1.0, 1.0, -1e-9])).item() == pytest.approx(math.log(2), abs=1e-8)
    with pytest.raises(ValueError, match="eigvals has negative entries"):
        spectrum_entropy(torch.tensor([1.0, -0.5]))
    with pytest.raises(ValueError, match="eigvals is all zero"):
        spectrum_entropy(torch.zeros(3))
    # Entries accurate to fp32 but solved in fp64: a looser rtol accepts their round-off.
    fp32_round_off = torch.tensor([1.0, 0.5, -1e-7], dtype=torch.float64)
    with pytest.raises(ValueError, match="negative entries"):
        spectrum_entropy(fp32_round_off)
    assert spectrum_entropy(fp32_round_off, rtol=1e-6).item() == pytest.approx(
        -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)), abs=1e-12)


@pytest.mark.parametrize("alpha", [1.0, 0.5, 3.0, math.inf])
def test_spectrum_entropy_matches_numpy(alpha):
    eig = torch.rand(5, 17, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = spectrum_entropy(eig, alpha)
    np.testing.assert_allclose(got.numpy(), [np_spectrum_entropy(e, alpha) for e in eig.numpy()], atol=1e-12)


# ------------------------------------------------------------------ HSIC and CKA


@pytest.mark.parametrize("n", [4, 5, 17, 40])
def test_hsic_matches_song_and_biased_formulas(n):
    x, y = rand(n, 6, seed=n), rand(n, 3, seed=n + 1)
    K, L = x @ x.T, (y @ y.T) + 2.0  # an offset kernel is still a kernel
    assert hsic(K, L).item() == pytest.approx(np_hsic_song(as_np(K), as_np(L)), rel=1e-9, abs=1e-12)
    assert hsic(K, L, unbiased=False).item() == pytest.approx(np_hsic_biased(as_np(K), as_np(L)), rel=1e-9, abs=1e-12)


def test_hsic_batched_and_low_precision():
    x = rand(3, 12, 5, seed=5, dtype=torch.bfloat16)
    K = x @ x.transpose(1, 2)
    L = K.flip(0)
    got = hsic(K, L)
    assert got.shape == (3,) and got.dtype == torch.float64
    expected = [np_hsic_song(as_np(a), as_np(b)) for a, b in zip(K, L)]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9)


def test_unbiased_hsic_ignores_feature_centering():
    x, y = rand(20, 4, seed=6), rand(20, 4, seed=7)
    shifted = x + torch.tensor([3.0, -2.0, 100.0, 0.5], dtype=x.dtype)
    assert hsic(shifted @ shifted.T, y @ y.T).item() == pytest.approx(hsic(x @ x.T, y @ y.T).item(), rel=1e-8)


@pytest.mark.parametrize("n,d1,d2", [(30, 5, 8), (6, 20, 9), (50, 50, 3)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_linear_cka_matches_kornblith(n, d1, d2, dtype):
    x = rand(n, d1, seed=8, dtype=dtype)
    y = (x[:, :1] * rand(1, d2, seed=9, dtype=dtype) + rand(n, d2, seed=10, dtype=dtype)).to(dtype)
    xn, yn = as_np(x), as_np(y)
    assert linear_cka(x, y).item() == pytest.approx(np_cka_feature_space(xn, yn), rel=1e-9)
    assert linear_cka(x, y).item() == pytest.approx(np_cka_gram(xn, yn, unbiased=False), rel=1e-9)
    assert linear_cka(x, y, unbiased=True).item() == pytest.approx(np_cka_gram(xn, yn, unbiased=True), rel=1e-8)


@pytest.mark.parametrize("unbiased", [True, False])
def test_cka_matrix_matches_pairwise_reference(unbiased):
    xs = [rand(23, d, seed=d) for d in (4, 9, 16, 1)]
    xs[1] = xs[1] + 0.3 * xs[0] @ rand(4, 9, seed=11)
    got = cka_matrix(xs, unbiased=unbiased, dtype=torch.float64)
    expected = [[np_cka_gram(as_np(a), as_np(b), unbiased) for b in xs] for a in xs]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("unbiased", [True, False])
def test_cka_matrix_matches_torch_one_gemm_reference(unbiased):
    xs = rand(6, 33, 12, seed=30) + 3.0
    xs[2] += 0.5 * xs[0]
    reference = torch_cka_one_gemm(xs, unbiased)
    expected = [[np_cka_gram(as_np(a), as_np(b), unbiased) for b in xs] for a in xs]
    np.testing.assert_allclose(reference.numpy(), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cka_matrix(xs, unbiased, dtype=torch.float64), reference, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("tile_rows,block_elems", [(64, 1 << 24), (1, 1 << 24), (4, 1 << 24), (64, 2 * 5 * 19)])
@pytest.mark.parametrize("unbiased", [True, False])
def test_cka_matrix_gram_tiles(monkeypatch, tile_rows, block_elems, unbiased):
    """Any tiling of the upper triangle (1-row tiles, tiles not dividing n, a block budget that
    forces 2-row tiles) gives the same products; lists of different widths too."""
    xs = rand(5, 19, 7, seed=12)
    as_list = [x[:, : 7 - i] for i, x in enumerate(xs)]
    expected = torch_cka_one_gemm(xs, unbiased)
    expected_list = [[np_cka_gram(as_np(a), as_np(b), unbiased) for b in as_list] for a in as_list]
    monkeypatch.setattr(metrics, "_GRAM_TILE_ROWS", tile_rows)
    monkeypatch.setattr(metrics, "_GRAM_BLOCK_ELEMS", block_elems)
    f64 = dict(unbiased=unbiased, dtype=torch.float64)
    torch.testing.assert_close(cka_matrix(xs, **f64), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cka_matrix(list(xs), **f64), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cka_matrix(as_list, **f64).numpy(), expected_list, rtol=1e-9, atol=1e-12)


FLOAT32_CKA_CASES = [(case, dtype) for case in ("gaussian", "offset_1e4", "outlier_features")
                     for dtype in (torch.float32, torch.bfloat16, torch.float64)
                     if (case, dtype) != ("offset_1e4", torch.bfloat16)]  # bf16 cannot hold 1e4 + N(0, 1)


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("case,input_dtype", FLOAT32_CKA_CASES)
def test_cka_matrix_float32_within_documented_bound(unbiased, case, input_dtype):
    """float32 Grams stay within the docstring's 1e-5 of the float64 answer on the same inputs,
    also with a 1e4 offset on every feature and with a few 300x-scale features (as in LLM hidden
    states); float32 is the default."""
    xs = rand(6, 96, 40, seed=31)
    xs[1:] += 0.7 * xs[:-1]  # correlated neighbours, like consecutive layers
    if case == "offset_1e4":
        xs = xs + 1e4
    elif case == "outlier_features":
        xs[:, :, :3] *= 300.0
    xs = xs.to(input_dtype)
    # Centering changes neither CKA; numpy centers first so that its Grams carry no offset.
    centered = [as_np(x) - as_np(x).mean(0) for x in xs]
    expected = np.array([[np_cka_gram(a, b, unbiased) for b in centered] for a in centered])
    got = cka_matrix(xs, unbiased, dtype=torch.float32)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(cka_matrix(xs, unbiased, dtype=torch.float64).numpy(), expected, rtol=1e-9, atol=1e-12)
    # the default precision follows the input: float64 in, float64 out; anything else float32
    default = cka_matrix(xs, unbiased)
    assert default.dtype == (torch.float64 if input_dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(default, got.to(default.dtype) if default.dtype == torch.float32
                               else cka_matrix(xs, unbiased, dtype=torch.float64), rtol=0, atol=0)


@HYPOTHESIS
@given(n=st.integers(6, 30), d=st.integers(1, 10), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16),
       unbiased=st.booleans())
def test_cka_invariances(n, d, scale, seed, unbiased):
    x, y = rand(n, d, seed=seed), rand(n, d + 2, seed=seed + 1)
    q, _ = torch.linalg.qr(rand(d, d, seed=seed + 2))
    rotated = x @ q * scale
    assert linear_cka(x, x, unbiased=unbiased).item() == pytest.approx(1.0, abs=1e-9)
    assert linear_cka(x, rotated, unbiased=unbiased).item() == pytest.approx(1.0, abs=1e-9)
    f64 = dict(unbiased=unbiased, dtype=torch.float64)
    torch.testing.assert_close(cka_matrix([rotated, y], **f64), cka_matrix([x, y], **f64))


# Independent standard Gaussian layers: (d, n) -> mean biased CKA (docs/method.md section 3).
KNOWN_BIASED_CKA = {
    (8, 32): 0.19, (8, 64): 0.11, (8, 128): 0.06, (8, 256): 0.03,
    (64, 32): 0.67, (64, 64): 0.50, (64, 128): 0.34, (64, 256): 0.20,
}


@pytest.mark.parametrize("d,n", list(KNOWN_BIASED_CKA))
def test_independent_gaussian_cka_known_answers(d, n):
    """40 independent layers give 780 pairs; the table is rounded to 0.01 and the mean over the
    pairs has a sampling s.d. below 0.003, hence the 0.015 tolerance."""
    xs = rand(40, n, d, seed=d * 1000 + n)
    off_diagonal = ~torch.eye(40, dtype=torch.bool)
    biased = cka_matrix(xs, unbiased=False)[off_diagonal].mean().item()
    unbiased = cka_matrix(xs, unbiased=True)[off_diagonal].mean().item()
    assert biased == pytest.approx(KNOWN_BIASED_CKA[(d, n)], abs=0.015)
    assert abs(unbiased) < 0.01


def test_cka_of_constant_layer_raises():
    xs = [rand(10, 3, seed=0), torch.ones(10, 3, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"xs\[1\] has no variance"):
        cka_matrix(xs)
    with pytest.raises(ValueError, match="y has no variance"):
        linear_cka(xs[0], xs[1])


# ------------------------------------------------------------------ token entropy


@pytest.mark.parametrize("shape", [(13,), (4, 7), (2, 3, 1001), (5, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5), (torch.float16, 2e-5)])
def test_token_entropy_matches_numpy(shape, dtype, tol):
    logits = (rand(*shape, seed=len(shape)) * 4).to(dtype)
    got = token_entropy(logits)
    assert got.shape == shape[:-1] and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), np_token_entropy(as_np(logits)), rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_token_entropy_chunking_and_large_offsets(chunk_size):
    logits = rand(11, 300, seed=13, dtype=torch.float32) * 3 + 1e4
    got = token_entropy(logits, chunk_size=chunk_size)
    np.testing.assert_allclose(got.numpy(), np_token_entropy(as_np(logits)), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_entropy_error_bound_at_llm_vocab(dtype):
    """The docstring's bound (2e-6 nats against float64) at a 151936-token vocabulary: spread,
    peaked, near-uniform and 1e4-offset rows."""
    logits = rand(4, 151_936, seed=24) * 4
    logits[1, :5] += 60.0
    logits[2] *= 0.01
    logits[3] = logits[3] * 12 + (1e4 if dtype == torch.float32 else 0.0)
    logits = logits.to(dtype)
    np.testing.assert_allclose(token_entropy(logits).numpy(), np_token_entropy(as_np(logits)), rtol=0, atol=2e-6)


def test_token_entropy_of_strided_logits():
    """A sliced [B, T, V] cannot be flattened without a copy; results are per position."""
    logits = rand(3, 6, 50, seed=21, dtype=torch.float32)
    for view in (logits[:, 1:], logits.transpose(0, 1), logits[..., ::2]):
        np.testing.assert_allclose(token_entropy(view, chunk_size=2).numpy(), np_token_entropy(as_np(view)),
                                   rtol=2e-5, atol=2e-5)


def test_token_entropy_known_values():
    uniform = torch.zeros(2, 1000, dtype=torch.bfloat16)
    peaked = torch.tensor([[0.0, -1e4, -1e4]])
    assert token_entropy(uniform).tolist() == pytest.approx([math.log(1000)] * 2, rel=1e-6)
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-4)])
def test_linear_token_entropy_matches_explicit_logits(chunk_size, with_bias, dtype, tol):
    hidden = rand(9, 16, seed=14, dtype=dtype)
    weight = (rand(300, 16, seed=15) * 2).to(dtype)
    bias = rand(300, seed=16, dtype=dtype) if with_bias else None
    logits = as_np(hidden) @ as_np(weight).T + (as_np(bias) if with_bias else 0)
    got = linear_token_entropy(hidden, weight, bias, chunk_size=chunk_size)
    assert got.shape == (9,) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), np_token_entropy(logits), rtol=tol, atol=tol)


def test_triton_dispatch_matches_torch_path(monkeypatch):
    """ELSI_FAST_FORCE_TRITON routes CPU tensors to the kernels (interpreter): same results."""
    logits = rand(3, 2, 77, seed=17, dtype=torch.bfloat16) * 3
    hidden, weight, bias = (rand(*shape, seed=seed, dtype=torch.float32) for shape, seed in
                            (((5, 16), 18), ((130, 16), 19), ((130,), 20)))
    xs = [rand(12, d, seed=d, dtype=torch.float32) + 1.0 for d in (3, 8)]
    torch_path = token_entropy(logits), linear_token_entropy(hidden, weight, bias), cka_matrix(xs, dtype=torch.float64)
    monkeypatch.setenv("ELSI_FAST_FORCE_TRITON", "1")
    torch.testing.assert_close(token_entropy(logits), torch_path[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_token_entropy(hidden, weight, bias), torch_path[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cka_matrix(xs).double(), torch_path[2], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_results_match_cpu():
    xs = rand(6, 300, 64, seed=22, dtype=torch.bfloat16)
    for unbiased in (True, False):
        torch.testing.assert_close(cka_matrix(xs.cuda(), unbiased).double().cpu(),
                                   cka_matrix(xs, unbiased, dtype=torch.float64),
                                   rtol=1e-3, atol=1e-3)
    logits = rand(4, 9, 128_000, seed=23, dtype=torch.bfloat16) * 3
    torch.testing.assert_close(token_entropy(logits.cuda()).cpu(), token_entropy(logits), rtol=1e-4, atol=1e-4)
    hidden, weight = rand(33, 256, seed=24, dtype=torch.bfloat16), rand(50_000, 256, seed=25, dtype=torch.bfloat16)
    torch.testing.assert_close(linear_token_entropy(hidden.cuda(), weight.cuda()).cpu(),
                               linear_token_entropy(hidden, weight), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ bad input

_x = rand(10, 4, seed=0)
_K = _x @ _x.T
_nan = _x.clone()
_nan[2, 1] = float("nan")
_inf_logits = torch.zeros(3, 5)
_inf_logits[1, 2] = float("-inf")

BAD_INPUTS = [
    (lambda: matrix_entropy(torch.ones(3)), ValueError, "x must be 2-D or 3-D"),
    (lambda: matrix_entropy(torch.ones(4, 3, dtype=torch.int64)), TypeError, "x must have dtype"),
    (lambda: matrix_entropy(_nan), ValueError, "x contains NaN or Inf"),
    (lambda: matrix_entropy(_x[:1]), ValueError, "x is all zero after normalize"),
    (lambda: matrix_entropy(_x, normalize="l2"), ValueError, "normalize must be one of"),
    (lambda: matrix_entropy(_x, alpha=0), ValueError, "alpha must be > 0"),
    (lambda: matrix_entropy(_x.numpy()), TypeError, "x must be a torch.Tensor"),
    (lambda: spectrum_entropy(torch.tensor(1.0)), ValueError, "eigvals must have at least 1 dims"),
    (lambda: hsic(_K[:3, :3], _K[:3, :3]), ValueError, "n >= 4 for the unbiased"),
    (lambda: hsic(_K, _K[:9, :9]), ValueError, "K and L must have the same shape"),
    (lambda: hsic(_K[:, :5], _K[:, :5]), ValueError, "K must be square"),
    (lambda: hsic(_K, _x @ rand(4, 10)), ValueError, "L is not symmetric"),
    (lambda: hsic(_K.long(), _K.long()), TypeError, "K must have dtype"),
    (lambda: linear_cka(_x, _x[:9]), ValueError, "same number of rows"),
    (lambda: linear_cka(_x, _nan), ValueError, "y contains NaN"),
    (lambda: linear_cka(_x[:3], _x[:3], unbiased=True), ValueError, "unbiased CKA needs n >= 4"),
    (lambda: cka_matrix([_x, _x[:9]]), ValueError, r"xs\[1\] has 9 tokens"),
    (lambda: cka_matrix(_x), ValueError, "xs must be 3-D"),
    (lambda: cka_matrix([]), ValueError, "xs is an empty list"),
    (lambda: cka_matrix([_x, _nan]), ValueError, r"xs\[1\] contains NaN"),
    (lambda: cka_matrix(torch.ones(2, 3, 4, dtype=torch.int32)), TypeError, "xs must have dtype"),
    (lambda: cka_matrix(rand(2, 3, 4)), ValueError, "unbiased CKA needs n >= 4"),
    (lambda: cka_matrix(rand(2, 5, 4), dtype=torch.bfloat16), ValueError, "dtype must be torch.float32 or"),
    (lambda: token_entropy(_inf_logits), ValueError, "logits contains NaN or Inf"),
    (lambda: token_entropy(torch.zeros(3, 0)), ValueError, "empty vocabulary"),
    (lambda: token_entropy(torch.zeros(3, 5, dtype=torch.int64)), TypeError, "logits must have dtype"),
    (lambda: token_entropy(torch.zeros(3, 5), chunk_size=0), ValueError, "chunk_size must be >= 1"),
    (lambda: linear_token_entropy(_x, rand(7, 5)), ValueError, "weight must be"),
    (lambda: linear_token_entropy(_x, rand(7, 4), rand(6)), ValueError, "bias must have shape"),
    (lambda: linear_token_entropy(_nan, rand(7, 4)), ValueError, "contains NaN or Inf"),
    (lambda: linear_token_entropy(_x.int(), rand(7, 4)), TypeError, "hidden must have dtype"),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
