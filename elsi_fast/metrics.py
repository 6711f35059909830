"""Exact layer-similarity and entropy metrics (docs/method.md section 3).

All functions take torch tensors on any device in fp16 / bf16 / fp32 / fp64 and never accumulate in
half precision: CPU work runs in float64, CUDA work in float32 (eigen-solvers always in float64),
except cka_matrix, whose `dtype` (default: float64 for float64 input, else float32, within 1e-5
of float64) sets its precision.
Token entropies are float32 by contract. On CUDA the token-entropy and HSIC hot paths dispatch to
the Triton kernels of `elsi_fast.kernels`; the torch code here is the reference they are tested
against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._infra._validation import (
    check_alpha,
    check_choice,
    check_layer_list,
    check_positive_int,
    check_tensor,
)

NORMALIZE_MODES = ("center_l2", "center", "none")
# Elements of one stacked block of Grams [L, rows, n]; bounds the working set of cka_matrix /
# MinibatchHSIC (128 MiB in float64) whatever the token count.
_GRAM_BLOCK_ELEMS = 1 << 24
# Token rows per Gram tile: more tiles skip more of the lower triangle, smaller ones run the GEMMs
# less efficiently and sync threads more often; 128 was fastest at n=512, d=256 at 1 and 2 threads.
_GRAM_TILE_ROWS = 128
# fp32 logits materialized at once by token_entropy's default chunking (2 MiB): each of its
# passes then re-reads the chunk from cache, not memory. 2^22 (16 MiB) was 1.6-2.8x slower at
# 64 x 152k (bench/run_metrics.py).
_ENTROPY_CHUNK_ELEMS = 1 << 19


def compute_dtype(device: torch.device) -> torch.dtype:
    """Accumulation dtype for `device`: float64 on CPU, float32 on accelerators."""
    return torch.float64 if device.type == "cpu" else torch.float32


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s computation goes to the Triton kernels (see elsi_fast.kernels.use_triton).

    float64 inputs always take the exact torch path.
    """
    from . import kernels

    return t.dtype != torch.float64 and kernels.use_triton(t)


# ----------------------------------------------------------------------------------------------
# Entropy of spectra and of token representations
# ----------------------------------------------------------------------------------------------


def spectrum_entropy(eigvals: torch.Tensor, alpha: float = 1.0, *, rtol: float | None = None) -> torch.Tensor:
    """Entropy (nats) of the normalized eigenvalue spectrum over the last dim.

    eigvals [..., k] of a PSD matrix -> [...] float64. With p_i = l_i / sum(l):
    alpha=1: H1 = -sum p_i log p_i; alpha=inf: -log max p_i; else log(sum p_i^alpha) / (1 - alpha).
    Negative values down to -rtol * max|l| are round-off and clipped to 0; more negative ones raise
    ValueError. rtol defaults to 10 k eps(eigvals.dtype); pass a larger one when the matrix entries
    were less accurate than eigvals' dtype (e.g. fp32 sums solved in fp64). Orders alpha < 1 weigh
    the round-off eigenvalues of a rank-deficient matrix (tiny, but not zero): prefer alpha >= 1.
    """
    check_tensor("eigvals", eigvals, min_ndim=1)
    alpha = check_alpha(alpha)
    if eigvals.shape[-1] == 0:
        raise ValueError("eigvals has an empty last dim")
    if rtol is None:
        rtol = 10 * eigvals.shape[-1] * torch.finfo(eigvals.dtype).eps
    elif not rtol >= 0:
        raise ValueError(f"rtol must be >= 0, got {rtol}")
    lam = eigvals.to(torch.float64)
    if bool((lam < -rtol * lam.abs().amax(-1, keepdim=True)).any()):
        raise ValueError("eigvals has negative entries beyond round-off: not the spectrum of a PSD matrix")
    lam = lam.clamp_min(0)
    total = lam.sum(-1, keepdim=True)
    if bool((total == 0).any()):
        raise ValueError("eigvals is all zero: the entropy of a zero matrix is undefined")
    p = lam / total
    if alpha == 1.0:
        return -torch.special.xlogy(p, p).sum(-1)
    if math.isinf(alpha):
        return -torch.log(p.amax(-1))
    return torch.log(p.pow(alpha).sum(-1)) / (1.0 - alpha)


def normalize_tokens(z: torch.Tensor, normalize: str) -> torch.Tensor:
    """Center over tokens (dim -2) and/or L2-normalize rows; zero rows stay zero."""
    if normalize in ("center", "center_l2"):
        z = z - z.mean(-2, keepdim=True)
    if normalize == "center_l2":
        z = z / torch.linalg.vector_norm(z, dim=-1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)
    return z


def matrix_entropy(x: torch.Tensor, alpha: float = 1.0, normalize: str = "center_l2") -> torch.Tensor:
    """Matrix (Renyi-alpha, default Shannon) entropy in nats of token representations.

    x [n, d] -> [] or [b, n, d] -> [b], float64. Rows are tokens. `normalize`: "center_l2"
    (z = (x - mean) / ||x - mean||, the paper's prompt mode), "center", or "none". The entropy is
    that of the eigenvalues of Z Z^T (n x n) or, equivalently, Z^T Z (d x d): the smaller is used.
    """
    check_tensor("x", x, ndim=(2, 3))
    check_choice("normalize", normalize, NORMALIZE_MODES)
    alpha = check_alpha(alpha)
    n, d = x.shape[-2:]
    if n == 0 or d == 0:
        raise ValueError(f"x must have at least one token and one feature, got shape {tuple(x.shape)}")
    z = normalize_tokens(x.to(torch.float64), normalize)
    if bool((z.square().sum((-2, -1)) == 0).any()):
        raise ValueError(
            f"x is all zero after normalize={normalize!r} (e.g. one token or identical tokens with "
            "centering): its entropy is undefined"
        )
    a = z @ z.transpose(-2, -1) if n <= d else z.transpose(-2, -1) @ z
    return spectrum_entropy(torch.linalg.eigvalsh(a), alpha)


# ----------------------------------------------------------------------------------------------
# HSIC and CKA
# ----------------------------------------------------------------------------------------------


def _center_gram(k: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """HKH (biased) or the Szekely-Rizzo U-centering (unbiased) of Grams [..., n, n]."""
    n = k.shape[-1]
    if not unbiased:
        k = k - k.mean(-1, keepdim=True)
        return k - k.mean(-2, keepdim=True)
    k = k - torch.diag_embed(k.diagonal(dim1=-2, dim2=-1))
    row = k.sum(-1)
    col = k.sum(-2)
    total = row.sum(-1)
    u = k - row[..., :, None] / (n - 2) - col[..., None, :] / (n - 2) + total[..., None, None] / ((n - 1) * (n - 2))
    u.diagonal(dim1=-2, dim2=-1).zero_()
    return u


def hsic(K: torch.Tensor, L: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """HSIC of two Gram matrices K, L [n, n] (or batched [b, n, n]) -> [] (or [b]).

    unbiased=True: Song et al. (2012), equal to <U(K), U(L)>_F / (n (n - 3)) with U the unbiased
    centering; needs n >= 4. unbiased=False: tr(K H L H) / (n - 1)^2 with H = I - 11^T / n.
    Result dtype: float64 on CPU, float32 on CUDA.
    """
    check_tensor("K", K, ndim=(2, 3))
    check_tensor("L", L, ndim=(2, 3))
    if K.shape[-1] != K.shape[-2]:
        raise ValueError(f"K must be square in its last two dims, got shape {tuple(K.shape)}")
    if K.shape != L.shape:
        raise ValueError(f"K and L must have the same shape, got {tuple(K.shape)} and {tuple(L.shape)}")
    if K.device != L.device:
        raise ValueError(f"K is on {K.device} but L is on {L.device}")
    n = K.shape[-1]
    if n < (4 if unbiased else 2):
        need = "n >= 4 for the unbiased estimator" if unbiased else "n >= 2"
        raise ValueError(f"K and L are {n} x {n}: HSIC needs {need}")
    dtype = compute_dtype(K.device)
    k, l = K.to(dtype), L.to(dtype)
    for name, given, g in (("K", K, k), ("L", L, l)):
        # Grams from a low-precision matmul may be asymmetric by a few ulps of the input dtype.
        tol = max(1e-6, 16 * torch.finfo(given.dtype).eps) * float(g.abs().amax())
        if float((g - g.transpose(-2, -1)).abs().amax()) > tol:
            raise ValueError(f"{name} is not symmetric: expected a Gram matrix")
    inner = (_center_gram(k, unbiased) * _center_gram(l, unbiased)).sum((-2, -1))
    return inner / (n * (n - 3)) if unbiased else inner / (n - 1) ** 2


def _centered_stack(layers: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Column-centered layers stacked as [L, n, w] in `dtype`, w the widest layer (narrower ones
    zero-padded: zero features leave a Gram unchanged).

    The mean is taken and subtracted in float64 when the input or `dtype` is float64, else in
    float32, and the difference is rounded to `dtype` once: a 1e4-scale offset never reaches the
    Grams, and any residual of the centering is removed exactly by the row-sum terms of
    _centered_gram_inner_products.
    """
    n, width = layers[0].shape[0], max(x.shape[1] for x in layers)
    wide = torch.float64 if torch.float64 in (dtype, *(x.dtype for x in layers)) else torch.float32
    make = torch.empty if all(x.shape[1] == width for x in layers) else torch.zeros
    y = make(len(layers), n, width, dtype=dtype, device=layers[0].device)
    for a, x in enumerate(layers):
        torch.sub(x, x.mean(0, dtype=wide), out=y[a, :, : x.shape[1]])
    return y


def _centered_gram_inner_products(y: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """[L, L] matrix of <C(K_a), C(K_b)>_F for the Grams K_a = Y_a Y_a^T of y [L, n, w].

    C is H.H (biased) or the U-centering (unbiased). With r = K 1 and S = 1^T K 1 (unbiased: K~, the
    Gram with zeroed diagonal, r~ = K~ 1, S~ = 1^T K~ 1):
        biased:   <H K_a H, H K_b H> = <K_a, K_b> - 2 r_a . r_b / n + S_a S_b / n^2
        unbiased: <U(K_a), U(K_b)> = <K~_a, K~_b> - 2 r~_a . r~_b / (n-2) + S~_a S~_b / ((n-1)(n-2))
    (Song et al. 2012), exact for any y; column-centered y keeps the correction terms small. r comes
    from y's column sums s: r = Y s, r~ = Y s - diag(K). <K_a, K_b> is symmetric in the token pair,
    so only the upper triangle of the Grams is built, in row tiles: tile i's diagonal block counts
    once and its block right of the diagonal twice, each tile stacked over all layers and reduced
    by one GEMM. Work: (1 + 1/T) / 2 of the full Grams and of their flattened products, T tiles.
    """
    num_layers, n, _ = y.shape
    tile = max(1, min(_GRAM_TILE_ROWS, _GRAM_BLOCK_ELEMS // (num_layers * n)))
    out = torch.zeros(num_layers, num_layers, device=y.device, dtype=y.dtype)
    sq_norms = torch.empty(num_layers, n, device=y.device, dtype=y.dtype)  # diag(K_a)
    for start in range(0, n, tile):
        stop = min(n, start + tile)
        rows = y[:, start:stop]
        block = torch.bmm(rows, rows.transpose(1, 2))
        diagonal = block.diagonal(dim1=1, dim2=2)
        sq_norms[:, start:stop] = diagonal
        if unbiased:
            diagonal.zero_()
        flat = block.view(num_layers, -1)
        out.addmm_(flat, flat.T)
        if stop < n:
            flat = torch.bmm(rows, y[:, stop:].transpose(1, 2)).view(num_layers, -1)
            out.addmm_(flat, flat.T, alpha=2.0)
    col_sums = y.sum(1)
    row_sums = torch.bmm(y, col_sums[:, :, None])[:, :, 0]  # r [L, n]
    if unbiased:
        row_sums -= sq_norms
        totals = row_sums.sum(1)
        out.addmm_(row_sums, row_sums.T, alpha=-2.0 / (n - 2))
        out += torch.outer(totals, totals) / ((n - 1) * (n - 2))
    else:
        totals = col_sums.square().sum(1)
        out.addmm_(row_sums, row_sums.T, alpha=-2.0 / n)
        out += torch.outer(totals, totals) / n**2
    return out


def _cka_from_inner_products(products: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """CKA_ab = P_ab / sqrt(P_aa P_bb); a zero self-similarity raises naming that input."""
    diag = products.diagonal()
    constant = torch.nonzero(diag <= 0).flatten().tolist()
    if constant:
        raise ValueError(f"{names[constant[0]]} has no variance across tokens (constant rows): its CKA is undefined")
    return products / torch.sqrt(diag[:, None] * diag[None, :])


def cka_matrix(
    xs: torch.Tensor | Sequence[torch.Tensor], unbiased: bool = True, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Linear CKA between every pair of layers -> [L, L] in `dtype`.

    xs: [L, n, d] or a list of L tensors [n, d_l] (same n tokens). CKA_ab = <C(K_a), C(K_b)> /
    sqrt(<C(K_a), C(K_a)> <C(K_b), C(K_b)>), K_a = X_a X_a^T, C = U-centering (unbiased, Song et
    al.; n >= 4) or H.H (biased, Kornblith et al.). All pairs come from GEMMs over the upper
    triangles of the flattened Grams of the column-centered features (Nguyen et al. 2021).

    Precision: `dtype` (float32 or float64; default float64 for float64 input, else float32) is the
    precision of the Grams and their products; centering is done in float64 for float64 input, so a common offset costs no
    accuracy. float32 results are within 1e-5 (absolute) of float64 ones: measured at L=37,
    n=512, d=256 on Gaussian, 1e4-offset and outlier-feature data, the max error was 6.4e-7
    (bench/run_metrics.py). Unbiased CKA of CUDA tensors in float32 runs in the Triton HSIC kernel.
    """
    layers, n = check_layer_list("xs", xs)
    if n < (4 if unbiased else 2):
        raise ValueError(f"xs has {n} tokens: {'unbiased CKA needs n >= 4' if unbiased else 'CKA needs n >= 2'}")
    if dtype is None:
        dtype = torch.float64 if layers[0].dtype == torch.float64 else torch.float32
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if unbiased and dtype == torch.float32 and use_triton(layers[0]):
        from .kernels.hsic import minibatch_hsic

        products, _ = minibatch_hsic(layers, None, False)
    else:
        products = _centered_gram_inner_products(_centered_stack(layers, dtype), unbiased)
    return _cka_from_inner_products(products, [f"xs[{i}]" for i in range(len(layers))])


def linear_cka(x: torch.Tensor, y: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Linear CKA of features x [n, d1] and y [n, d2] (rows are the same n tokens) -> [].

    Biased: ||Xc^T Yc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F) with column-centered Xc, Yc, computed
    in feature space when n >= max(d1, d2), else on the Grams. Unbiased: through the U-centered
    Grams (n >= 4). float64 on CPU, float32 on CUDA.
    """
    check_tensor("x", x, ndim=2)
    check_tensor("y", y, ndim=2)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same number of rows (tokens), got {x.shape[0]} and {y.shape[0]}")
    if x.device != y.device:
        raise ValueError(f"x is on {x.device} but y is on {y.device}")
    n = x.shape[0]
    if n < (4 if unbiased else 2):
        raise ValueError(f"x and y have {n} rows: {'unbiased CKA needs n >= 4' if unbiased else 'CKA needs n >= 2'}")
    dtype = compute_dtype(x.device)
    if unbiased or n < max(x.shape[1], y.shape[1]):
        products = _centered_gram_inner_products(_centered_stack([x, y], dtype), unbiased)
    else:
        # <Kx_c, Ky_c>_F = ||Xc^T Yc||_F^2: the d x d side is cheaper here.
        feats = [_centered_stack([t], dtype)[0] for t in (x, y)]
        products = torch.stack([torch.stack([(a.T @ b).square().sum() for b in feats]) for a in feats])
    return _cka_from_inner_products(products, ["x", "y"])[0, 1]


# ----------------------------------------------------------------------------------------------
# Predictive (token) entropy
# ----------------------------------------------------------------------------------------------


def _entropy_rows_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax over the last dim of a [rows, V] chunk, in fp32 with two temporaries.

    With z = logit - max, e = exp(z), s = sum e: H = log s - sum(e z) / s. torch's fused softmax
    gives p = e / s' (its exp is faster than torch.exp); s' may differ from s in the last bits,
    which c = sum p (pairwise) measures: s = s' c, and max p = e^0 / s' = 1 / s', so
    H = log(c / max p) - sum(p z) / c.
    """
    z = logits.to(torch.float32, copy=True)
    z -= z.amax(-1, keepdim=True)
    p = torch.softmax(z, -1)
    c = p.sum(-1)
    return torch.log(c / p.amax(-1)) - p.mul_(z).sum(-1) / c


def _token_entropy_into(out: torch.Tensor, logits: torch.Tensor, chunk_size: int) -> None:
    """Fill out [...] with the entropies of logits [..., V], chunk_size rows at a time. Leading
    dims that cannot be flattened without a copy (e.g. a sliced [B, T, V]) are walked one index
    at a time, so a strided input is never copied whole."""
    try:
        rows = logits.view(-1, logits.shape[-1])
    except RuntimeError:
        for i in range(logits.shape[0]):
            _token_entropy_into(out[i], logits[i], chunk_size)
        return
    flat_out = out.view(-1)
    for start in range(0, rows.shape[0], chunk_size):
        flat_out[start : start + chunk_size] = _entropy_rows_fp32(rows[start : start + chunk_size])


def token_entropy(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Predictive entropy in nats of softmax(logits) over the last dim: [..., V] -> [...] float32.

    H = log s - sum_v e_v z_v / s with z = logits - max, e = exp(z), s = sum e, computed in fp32
    (through torch's softmax, see _entropy_rows_fp32) `chunk_size` rows at a time (default: as
    many rows as fit in 2^19 fp32 elements), so a bf16 [n, 256k] tensor is never copied to fp32
    whole. NaN / Inf logits raise ValueError (mask vocabulary entries with a large finite
    negative value).
    Precision: fp32 with pairwise sums, within 2e-6 nats of float64 (measured 6e-7 to 1e-6 at
    64 x 151936 and 64 x 256000; the log_softmax one-liner is at 8e-5 to 1.4e-4, its
    torch.compile at 1.2e-5 to 1.9e-5).
    """
    check_tensor("logits", logits, min_ndim=1, finite=False)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError("logits has an empty vocabulary (last dim 0)")
    if chunk_size is None:
        chunk_size = max(1, _ENTROPY_CHUNK_ELEMS // vocab)
    check_positive_int("chunk_size", chunk_size)
    if use_triton(logits):
        from .kernels import entropy as _kernel

        out = _kernel.token_entropy(logits)
    else:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        _token_entropy_into(out, logits, chunk_size)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("logits contains NaN or Inf values")
    return out


def linear_token_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 8192,
) -> torch.Tensor:
    """Entropy (nats) of softmax(hidden @ weight.T + bias) per row without materializing the logits.

    hidden [n, d], weight [V, d], bias [V] or None -> [n] float32. The vocabulary is processed
    `chunk_size` columns at a time with running fp32 statistics per row: max m, s = sum exp(l - m),
    u = sum exp(l - m) (l - m); H = log s - u / s.
    """
    check_tensor("hidden", hidden, ndim=2, finite=False)
    check_tensor("weight", weight, ndim=2, finite=False)
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}] to match hidden [n, d], got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V = 0)")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, finite=False)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight, got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    check_positive_int("chunk_size", chunk_size)
    if use_triton(hidden) and all(t.dtype != torch.float64 for t in (weight, bias) if t is not None):
        from .kernels import entropy as _kernel

        out = _kernel.linear_token_entropy(hidden, weight, bias)
    else:
        out = _linear_token_entropy_torch(hidden, weight, bias, chunk_size)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("hidden, weight or bias contains NaN or Inf values, or the logits overflow fp32")
    return out


def _linear_token_entropy_torch(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_size: int
) -> torch.Tensor:
    h = hidden.to(torch.float32)
    n = h.shape[0]
    run_max = torch.full((n,), -math.inf, dtype=torch.float32, device=h.device)
    run_sum = torch.zeros(n, dtype=torch.float32, device=h.device)
    run_ez = torch.zeros(n, dtype=torch.float32, device=h.device)
    for start in range(0, weight.shape[0], chunk_size):
        logits = h @ weight[start : start + chunk_size].to(torch.float32).T
        if bias is not None:
            logits += bias[start : start + chunk_size].to(torch.float32)
        new_max = torch.maximum(run_max, logits.amax(-1))
        # Rescale the running sums to the new max: sum e^(l-m') (l-m') = r (u + (m - m') s), r = e^(m-m').
        shift = run_max - new_max
        rescale = torch.exp(shift)
        run_ez = rescale * (run_ez + torch.where(run_sum > 0, shift * run_sum, 0.0))
        run_sum = rescale * run_sum
        logits -= new_max[:, None]
        e = torch.exp(logits)
        run_sum += e.sum(-1)
        run_ez += e.mul_(logits).sum(-1)
        run_max = new_max
    return torch.log(run_sum) - run_ez / run_sum
