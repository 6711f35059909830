"""Triton token entropy and fused linear entropy against float64 torch references."""

from __future__ import annotations

import math

import pytest
import torch

from elsi_fast.kernels import entropy as entropy_module
from elsi_fast.kernels.entropy import EntropyTiles, LinearEntropyTiles, linear_token_entropy, token_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Absolute error in nats. token_entropy computes in fp32 from the given logits whatever their dtype;
# linear_token_entropy forms bf16/fp16 logits on the tensor cores (fp32 accumulation) on the GPU.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def entropy_reference(logits, dtype=torch.float64):
    """Plain torch: entropy in nats of softmax over the last dim."""
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def linear_entropy_reference(hidden, weight, bias=None, dtype=torch.float64):
    logits = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits = logits + bias.to(dtype)
    return entropy_reference(logits, dtype)


def randn(*shape, scale=1.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def assert_close(got, want, dtype, atol=None):
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    assert err <= (atol or ATOL[torch.float32 if dtype is None else dtype]), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 1), (13, 301), (2, 3, 1000)])
@pytest.mark.parametrize("tiles", [None, EntropyTiles(block_v=128, split_v=256)], ids=["default", "split"])
def test_token_entropy_matches_reference(dtype, shape, tiles):
    logits = randn(*shape, scale=4.0, dtype=dtype)
    got = token_entropy(logits, tiles=tiles)
    # Computed in fp32 from the given (rounded) logits: the tolerance does not depend on dtype.
    assert_close(got, entropy_reference(logits), torch.float32)


def test_token_entropy_strided_views():
    full = randn(2, 5, 300, scale=3.0)
    shifted = full[:, :-1, :]  # rows not collapsible into one stride
    every_other = full[:, :, ::2]  # vocabulary stride 2
    for view in (shifted, every_other, full.transpose(0, 1)):
        assert_close(token_entropy(view, tiles=EntropyTiles(block_v=64)), entropy_reference(view), None)


def test_token_entropy_known_answers():
    vocab = 1000
    uniform = torch.zeros(2, vocab, device=DEVICE)
    assert_close(token_entropy(uniform), torch.full((2,), math.log(vocab), dtype=torch.float64, device=DEVICE), None)
    # Huge logits (one dominant token) and masked entries: no overflow, entropy ~ 0.
    peaked = randn(4, vocab, scale=1e4)
    peaked[:, 10:20] = -1e30
    got = token_entropy(peaked, tiles=EntropyTiles(block_v=128, split_v=256))
    assert_close(got, entropy_reference(peaked), None)
    assert float(got.abs().max()) < 1e-3
    assert token_entropy(torch.zeros(0, 5, device=DEVICE)).shape == (0,)
    single = token_entropy(torch.zeros(7, device=DEVICE))  # one distribution: [V] -> []
    assert single.shape == () and abs(float(single) - math.log(7)) < 1e-6


def test_token_entropy_bad_inputs():
    with pytest.raises(TypeError, match="logits"):
        token_entropy(torch.zeros(3, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="logits"):
        token_entropy(torch.zeros(3, 0, device=DEVICE))
    with pytest.raises(ValueError, match="split_v"):
        token_entropy(torch.zeros(3, 100, device=DEVICE), tiles=EntropyTiles(block_v=64, split_v=100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,dim,vocab", [(1, 16, 5), (37, 45, 301)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_entropy_matches_reference(dtype, n, dim, vocab, with_bias):
    hidden = randn(n, dim, dtype=dtype)
    weight = randn(vocab, dim, scale=dim**-0.5 * 3, seed=1, dtype=dtype)
    bias = randn(vocab, seed=2, dtype=dtype) if with_bias else None
    tiles = LinearEntropyTiles(block_m=16, block_v=32, block_k=16, group_m=2)  # 3 row blocks: a partial group
    got = linear_token_entropy(hidden, weight, bias, tiles=tiles)
    assert_close(got, linear_entropy_reference(hidden, weight, bias), dtype)


def test_linear_entropy_strided_and_mixed_dtypes():
    hidden = randn(40, 90)[::2, 5:50]  # row stride 180
    weight = randn(200, 45, seed=1, dtype=torch.bfloat16)  # differs from hidden: computed in fp32
    got = linear_token_entropy(hidden, weight)
    assert_close(got, linear_entropy_reference(hidden, weight), None)
    transposed = randn(45, 200, seed=1).T  # feature stride != 1
    assert_close(linear_token_entropy(hidden, transposed), linear_entropy_reference(hidden, transposed), None)


def test_linear_entropy_bad_inputs():
    hidden, weight = randn(4, 8), randn(10, 8)
    with pytest.raises(ValueError, match="weight"):
        linear_token_entropy(hidden, randn(10, 9))
    with pytest.raises(ValueError, match="bias"):
        linear_token_entropy(hidden, weight, randn(9))
    with pytest.raises(ValueError, match="hidden"):
        linear_token_entropy(hidden[0], weight)
    with pytest.raises(TypeError, match="weight"):
        linear_token_entropy(hidden, weight.to(torch.int32))


def test_public_functions_dispatch(monkeypatch):
    """elsi_fast.metrics gives the same entropies through the kernels as through torch."""
    from elsi_fast import metrics

    logits = randn(2, 5, 700, scale=3.0, dtype=torch.bfloat16)
    hidden, weight, bias = randn(9, 32), randn(300, 32, seed=1), randn(300, seed=2)
    monkeypatch.setenv("ELSI_FAST_DISABLE_TRITON", "1")
    want = metrics.token_entropy(logits), metrics.linear_token_entropy(hidden, weight, bias)
    monkeypatch.delenv("ELSI_FAST_DISABLE_TRITON")
    monkeypatch.setenv("ELSI_FAST_FORCE_TRITON", "1")
    calls = []
    for name in ("token_entropy", "linear_token_entropy"):
        original = getattr(entropy_module, name)
        monkeypatch.setattr(entropy_module, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    got = metrics.token_entropy(logits), metrics.linear_token_entropy(hidden, weight, bias)
    assert len(calls) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert float((g.double() - w.double()).abs().max()) < 1e-4


@pytest.mark.gpu
def test_token_entropy_real_size_gpu():
    logits = randn(512, 151936, scale=3.0, dtype=torch.bfloat16)
    # fp32 sums over 152k terms: entropies near 11 nats carry ~1e-5 relative rounding.
    assert_close(token_entropy(logits), entropy_reference(logits), None, atol=2e-4)
    few_rows = logits[:3]  # split across programs and merged
    assert_close(token_entropy(few_rows), entropy_reference(few_rows), None, atol=2e-4)


@pytest.mark.gpu
def test_linear_entropy_real_size_gpu():
    hidden = randn(300, 2560, dtype=torch.bfloat16)
    weight = randn(151936, 2560, scale=2560**-0.5 * 4, seed=1, dtype=torch.bfloat16)
    assert_close(linear_token_entropy(hidden, weight), linear_entropy_reference(hidden, weight), torch.bfloat16)
