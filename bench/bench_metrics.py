"""Metric library vs the plain-torch code it replaces (pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_metrics.py --benchmark-group-by=group

The plain-torch references below are also what bench/run_metrics.py times, side by side, for the
ratios recorded in bench/results/metrics_<device>.jsonl. Set BENCH_DEVICE=cuda to run on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from elsi_fast import StreamingCovariance, cka_matrix, token_entropy

DEVICE = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))
DTYPE = torch.float64 if DEVICE.type == "cpu" else torch.float32

# Issue 2, section 4 sizes.
CKA_SHAPE = dict(num_layers=37, n=512, d=256)
COV_SHAPE = dict(num_layers=37, n=4096, d=256)
COV_CHUNK = 1024
ENTROPY_SHAPE = dict(n=64, vocab=256_000)


# ------------------------------------------------------------------ plain-torch references


def hsic_unbiased_pair(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Song et al.'s unbiased HSIC of one Gram pair, in its O(n^2) form (tr(K~L~) as an
    elementwise sum, 1^T K~ L~ 1 as a dot of row sums)."""
    n = K.shape[0]
    Kt = K - torch.diag(torch.diagonal(K))
    Lt = L - torch.diag(torch.diagonal(L))
    k_rows, l_rows = Kt.sum(1), Lt.sum(1)
    trace = (Kt * Lt).sum()
    return (trace + k_rows.sum() * l_rows.sum() / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * (k_rows @ l_rows)) / (n * (n - 3))


def cka_matrix_per_pair(xs: torch.Tensor) -> torch.Tensor:
    """Unbiased CKA matrix the usual way: each layer's Gram once, then a loop over layer pairs."""
    grams = [x @ x.T for x in xs]
    num_layers = len(grams)
    out = torch.empty(num_layers, num_layers, dtype=xs.dtype, device=xs.device)
    for a in range(num_layers):
        for b in range(a, num_layers):
            out[a, b] = out[b, a] = hsic_unbiased_pair(grams[a], grams[b])
    diag = out.diagonal().clone()
    return out / torch.sqrt(diag[:, None] * diag[None, :])


def covariance_torch_cov(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-layer population covariance of the kept tokens with torch.cov."""
    return torch.stack([torch.cov(h[mask].T, correction=0) for h in hidden])


def covariance_streaming(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same tokens streamed in COV_CHUNK-token batches, as the analysis pass feeds them."""
    acc = StreamingCovariance(hidden.shape[0], hidden.shape[2], normalize="none", device=hidden.device)
    for lo in range(0, hidden.shape[1], COV_CHUNK):
        acc.update(hidden[:, lo : lo + COV_CHUNK], mask=mask[lo : lo + COV_CHUNK])
    return acc.covariance()


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The usual one-liner: an fp32 copy of the logits, then torch.distributions."""
    return torch.distributions.Categorical(logits=logits.float()).entropy()


# ------------------------------------------------------------------ inputs


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def cka_inputs() -> torch.Tensor:
    s = CKA_SHAPE
    return torch.randn(s["num_layers"], s["n"], s["d"], generator=_generator(0), device=DEVICE, dtype=DTYPE)


def covariance_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    s = COV_SHAPE
    hidden = torch.randn(s["num_layers"], s["n"], s["d"], generator=_generator(1), device=DEVICE, dtype=DTYPE)
    mask = torch.rand(s["n"], generator=_generator(2), device=DEVICE) > 0.2
    return hidden, mask


def entropy_inputs() -> torch.Tensor:
    s = ENTROPY_SHAPE
    logits = torch.randn(s["n"], s["vocab"], generator=_generator(3), device=DEVICE, dtype=torch.float32) * 4
    return logits.to(torch.bfloat16)


# ------------------------------------------------------------------ pytest-benchmark


@pytest.fixture(scope="module")
def cka_xs() -> torch.Tensor:
    xs = cka_inputs()
    torch.testing.assert_close(cka_matrix(xs), cka_matrix_per_pair(xs))
    return xs


@pytest.fixture(scope="module")
def cov_case() -> tuple[torch.Tensor, torch.Tensor]:
    case = covariance_inputs()
    torch.testing.assert_close(covariance_streaming(*case), covariance_torch_cov(*case))
    return case


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    x = entropy_inputs()
    torch.testing.assert_close(token_entropy(x), categorical_entropy(x), rtol=1e-4, atol=1e-4)
    return x


@pytest.mark.benchmark(group="cka_matrix L=37 n=512 d=256")
def test_cka_matrix(benchmark, cka_xs):
    benchmark(cka_matrix, cka_xs)


@pytest.mark.benchmark(group="cka_matrix L=37 n=512 d=256")
def test_cka_per_pair_loop(benchmark, cka_xs):
    benchmark.pedantic(cka_matrix_per_pair, args=(cka_xs,), rounds=2, iterations=1)


@pytest.mark.benchmark(group="covariance L=37 n=4096 d=256")
def test_streaming_covariance_update(benchmark, cov_case):
    benchmark(covariance_streaming, *cov_case)


@pytest.mark.benchmark(group="covariance L=37 n=4096 d=256")
def test_torch_cov(benchmark, cov_case):
    benchmark(covariance_torch_cov, *cov_case)


@pytest.mark.benchmark(group="token entropy n=64 V=256k bf16")
def test_token_entropy(benchmark, logits):
    benchmark(token_entropy, logits)


@pytest.mark.benchmark(group="token entropy n=64 V=256k bf16")
def test_categorical_entropy(benchmark, logits):
    benchmark(categorical_entropy, logits)
