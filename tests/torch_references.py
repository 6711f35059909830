"""The torch code a user would write instead of the metric library: the references the metric
tests check the library against (tests/test_metrics.py) and the peers bench/bench_metrics.py and
bench/run_metrics.py time it against (they load this file by its path)."""

import torch


def torch_hsic_one_gemm(xs: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """All-pairs HSIC [L, L] of xs [L, n, d] the direct way, in xs's dtype: L full Grams, centered
    (U or H) in separate passes, flattened to V [L, n^2], all pairs from one GEMM V V^T."""
    num_layers, n, _ = xs.shape
    k = xs @ xs.transpose(1, 2)
    if unbiased:
        k.diagonal(dim1=1, dim2=2).zero_()
        row = k.sum(-1)
        total = row.sum(-1)[:, None, None]
        k = k - row[:, :, None] / (n - 2) - row[:, None, :] / (n - 2) + total / ((n - 1) * (n - 2))
        k.diagonal(dim1=1, dim2=2).zero_()
    else:
        k = k - k.mean(-1, keepdim=True)
        k = k - k.mean(-2, keepdim=True)
    v = k.reshape(num_layers, -1)
    return (v @ v.T) / (n * (n - 3) if unbiased else (n - 1) ** 2)


def torch_cka_one_gemm(xs: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """CKA matrix [L, L] from torch_hsic_one_gemm."""
    products = torch_hsic_one_gemm(xs, unbiased)
    diag = products.diagonal()
    return products / torch.sqrt(diag[:, None] * diag[None, :])


def torch_categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """torch.distributions on an fp32 copy of the logits."""
    return torch.distributions.Categorical(logits=logits.float()).entropy()


def torch_log_softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The log_softmax one-liner."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)
