"""Metric library vs the torch code a user would write instead (pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_metrics.py --benchmark-group-by=group

The torch peers are the references kept in tests/torch_references.py (one definition, tested in
tests/test_metrics.py against float64 numpy); bench/run_metrics.py times the same pairs
interleaved in one process at 1 and 2 threads and records the ratios in
bench/results/metrics_<device>.jsonl. Set BENCH_DEVICE=cuda to run on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.common import tests_module
from elsi_fast import MinibatchHSIC, StreamingCovariance, cka_matrix, token_entropy

_references = tests_module("torch_references.py")
torch_categorical_entropy = _references.torch_categorical_entropy
torch_cka_one_gemm = _references.torch_cka_one_gemm
torch_hsic_one_gemm = _references.torch_hsic_one_gemm
torch_log_softmax_entropy = _references.torch_log_softmax_entropy

DEVICE = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))

# Realistic sizes: 37 hidden states (a 36-block model plus embeddings), 512 prompt tokens, d=256.
CKA_SHAPE = dict(num_layers=37, n=512, d=256)
COV_SHAPE = dict(num_layers=37, n=4096, d=256)
COV_CHUNK = 1024
HSIC_SHAPE = dict(num_layers=37, n=1024, d=256)
HSIC_BATCH = 512
# Qwen3 and 256k (Gemma-size) vocabularies.
ENTROPY_SHAPES = [dict(n=64, vocab=151_936), dict(n=64, vocab=256_000)]


# ------------------------------------------------------------------ torch peers built on the test references


def covariance_torch_cov(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-layer population covariance of the kept tokens with torch.cov (two-pass, centered)."""
    return torch.stack([torch.cov(h[mask].T, correction=0) for h in hidden])


def covariance_one_gemm(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x^T x / n - mean mean^T for all layers in one batched GEMM, in hidden's dtype (uncentered:
    loses accuracy to large offsets)."""
    x = hidden[:, mask]
    mean = x.mean(1)
    return x.transpose(1, 2) @ x / x.shape[1] - mean[:, :, None] * mean[:, None, :]


def covariance_streaming(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same tokens streamed in COV_CHUNK-token batches, as the analysis pass feeds them."""
    acc = StreamingCovariance(hidden.shape[0], hidden.shape[2], normalize="none", device=hidden.device)
    for lo in range(0, hidden.shape[1], COV_CHUNK):
        acc.update(hidden[:, lo : lo + COV_CHUNK], mask=mask[lo : lo + COV_CHUNK])
    return acc.covariance()


def hsic_minibatches_one_gemm(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean unbiased HSIC [L, L] and covariance traces [L] over HSIC_BATCH-token minibatches,
    each through the one-GEMM reference."""
    hsic_sum, trace_sum, batches = 0.0, 0.0, range(0, hidden.shape[1], HSIC_BATCH)
    for lo in batches:
        x = hidden[:, lo : lo + HSIC_BATCH]
        hsic_sum = hsic_sum + torch_hsic_one_gemm(x)
        trace_sum = trace_sum + (x - x.mean(1, keepdim=True)).square().sum((1, 2)) / (x.shape[1] - 1)
    return hsic_sum / len(batches), trace_sum / len(batches)


def hsic_minibatches_streaming(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = MinibatchHSIC(hidden.shape[0], normalize="none", device=hidden.device)
    for lo in range(0, hidden.shape[1], HSIC_BATCH):
        acc.update(hidden[:, lo : lo + HSIC_BATCH])
    return acc.hsic(), acc.traces()


# ------------------------------------------------------------------ inputs


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def hidden_like(num_layers: int, n: int, d: int, seed: int, case: str = "gaussian") -> torch.Tensor:
    """[L, n, d] float64 features, consecutive layers correlated. case: "gaussian", "offset_1e4"
    (every feature shifted by 1e4) or "outlier_features" (4 features at 300x scale, like the
    massive activations of LLM hidden states)."""
    g = _generator(seed)
    x = torch.randn(num_layers, n, d, generator=g, device=DEVICE, dtype=torch.float64)
    for a in range(1, num_layers):
        x[a] += 0.7 * x[a - 1]
    if case == "offset_1e4":
        x += 1e4
    elif case == "outlier_features":
        x[:, :, :4] *= 300.0
    return x


def cka_inputs(dtype: torch.dtype = torch.float64, case: str = "gaussian") -> torch.Tensor:
    return hidden_like(**CKA_SHAPE, seed=0, case=case).to(dtype)


def covariance_inputs(case: str = "gaussian") -> tuple[torch.Tensor, torch.Tensor]:
    hidden = hidden_like(**COV_SHAPE, seed=1, case=case)
    mask = torch.rand(COV_SHAPE["n"], generator=_generator(2), device=DEVICE) > 0.2
    return hidden, mask


def hsic_inputs() -> torch.Tensor:
    return hidden_like(**HSIC_SHAPE, seed=4)


def entropy_inputs(n: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    logits = torch.randn(n, vocab, generator=_generator(3), device=DEVICE, dtype=torch.float32) * 4
    return logits.to(dtype)


# ------------------------------------------------------------------ pytest-benchmark


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def cka_xs(request) -> torch.Tensor:
    return cka_inputs(request.param)


@pytest.fixture(scope="module")
def cov_case() -> tuple[torch.Tensor, torch.Tensor]:
    return covariance_inputs()


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def logits(request) -> torch.Tensor:
    return entropy_inputs(**ENTROPY_SHAPES[0], dtype=request.param)


@pytest.mark.benchmark(group="cka_matrix L=37 n=512 d=256")
def test_cka_matrix(benchmark, cka_xs):
    benchmark(cka_matrix, cka_xs, dtype=cka_xs.dtype)


@pytest.mark.benchmark(group="cka_matrix L=37 n=512 d=256")
def test_cka_one_gemm(benchmark, cka_xs):
    benchmark(torch_cka_one_gemm, cka_xs)


@pytest.mark.benchmark(group="covariance L=37 n=4096 d=256 fp64")
def test_streaming_covariance_update(benchmark, cov_case):
    benchmark(covariance_streaming, *cov_case)


@pytest.mark.benchmark(group="covariance L=37 n=4096 d=256 fp64")
def test_torch_cov(benchmark, cov_case):
    benchmark(covariance_torch_cov, *cov_case)


@pytest.mark.benchmark(group="token entropy n=64 V=151936")
def test_token_entropy(benchmark, logits):
    benchmark(token_entropy, logits)


@pytest.mark.benchmark(group="token entropy n=64 V=151936")
def test_log_softmax_entropy(benchmark, logits):
    benchmark(torch_log_softmax_entropy, logits)


@pytest.mark.benchmark(group="token entropy n=64 V=151936")
def test_categorical_entropy(benchmark, logits):
    benchmark(torch_categorical_entropy, logits)
