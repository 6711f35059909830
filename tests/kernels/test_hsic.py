"""Triton all-pairs minibatch HSIC against a float64 torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from elsi_fast.kernels import hsic as hsic_module
from elsi_fast.kernels.hsic import HsicTiles, minibatch_hsic

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max error relative to the natural scale of H, the largest squared trace (H_aa = ||Cov_a||_F^2 <=
# tr(Cov_a)^2; at small n, H is a difference of terms of that size), and for the traces relative to
# the largest trace. On the GPU, bf16/fp16 Gram tiles are multiplied on the tensor cores from inputs
# rounded after normalization and centering.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SMALL = HsicTiles(block_n=16, block_k=16)


def u_center(k):
    """Szekely-Rizzo U-centering of a Gram [n, n] (float64)."""
    n = k.shape[0]
    k = k - torch.diag(torch.diag(k))
    row = k.sum(1)
    u = k - row[:, None] / (n - 2) - row[None, :] / (n - 2) + row.sum() / ((n - 1) * (n - 2))
    return u - torch.diag(torch.diag(u))


def hsic_reference(layers, mask, l2_normalize, dtype=torch.float64):
    """Plain torch: (H [L, L], traces [L]) from the explicit U-centered Grams of the kept rows."""
    flat, traces = [], []
    for x in layers:
        y = (x if mask is None else x[mask]).to(dtype)
        if l2_normalize:
            y = y / torch.linalg.vector_norm(y, dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        flat.append(u_center(y @ y.T).flatten())
        traces.append((y - y.mean(0)).square().sum() / (y.shape[0] - 1))
    u = torch.stack(flat)
    n = y.shape[0]
    return u @ u.T / (n * (n - 3)), torch.stack(traces)


def make_layers(n, dims, dtype, seed=0):
    """Layers of different widths that share structure (so H has sizeable off-diagonal entries)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 8, generator=g)
    layers = []
    for a, d in enumerate(dims):
        mix = torch.randn(8, d, generator=g)
        x = base @ mix + 0.5 * torch.randn(n, d, generator=g) + a
        layers.append(x.to(dtype).to(DEVICE))
    return layers


def assert_matches(h, traces, ref_h, ref_traces, dtype):
    err_h = float((h.double() - ref_h).abs().max())
    err_t = float((traces.double() - ref_traces).abs().max())
    assert err_h <= TOLERANCE[dtype] * float(ref_traces.max()) ** 2, err_h
    assert err_t <= TOLERANCE[dtype] * float(ref_traces.abs().max()), err_t
    assert h.dtype == traces.dtype == torch.float32
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,dims", [(4, [8]), (37, [45, 30, 45]), (50, [33, 33])])
@pytest.mark.parametrize("l2_normalize", [True, False])
def test_matches_reference(dtype, n, dims, l2_normalize):
    layers = make_layers(n, dims, dtype)
    mask = None
    h, traces = minibatch_hsic(layers, mask, l2_normalize, tiles=SMALL)
    ref_h, ref_traces = hsic_reference(layers, mask, l2_normalize)
    assert_matches(h, traces, ref_h, ref_traces, dtype)


@pytest.mark.parametrize("keep", ["four", "random", "all"])
def test_masks(keep):
    n = 37
    layers = make_layers(n, [45, 45], torch.float32)
    mask = {
        "four": torch.isin(torch.arange(n), torch.tensor([0, 9, 20, 36])),
        "random": torch.rand(n, generator=torch.Generator().manual_seed(2)) > 0.4,
        "all": torch.ones(n, dtype=torch.bool),
    }[keep].to(DEVICE)
    h, traces = minibatch_hsic(layers, mask, True, tiles=SMALL)
    ref_h, ref_traces = hsic_reference(layers, mask, True)
    assert_matches(h, traces, ref_h, ref_traces, torch.float32)


@pytest.mark.parametrize("kept", [0, 1, 3])
def test_too_few_tokens_raise(kept):
    layers = make_layers(10, [16], torch.float32)
    mask = (torch.arange(10) < kept).to(DEVICE)
    with pytest.raises(ValueError, match="at least 4 kept tokens"):
        minibatch_hsic(layers, mask, True)


def test_strided_stacked_input_and_chunked_workspace(monkeypatch):
    """Row-strided [L, n, d] view; a workspace of two tiles forces many chunks of tile pairs."""
    wide = torch.stack(make_layers(37, [60, 60, 60], torch.float32))
    hidden = wide[:, :, 5:50]
    monkeypatch.setattr(hsic_module, "WORKSPACE_BYTES", 2 * 3 * SMALL.block_n**2 * 4)
    h, traces = minibatch_hsic(hidden, None, False, tiles=SMALL)
    ref_h, ref_traces = hsic_reference(list(hidden), None, False)
    assert_matches(h, traces, ref_h, ref_traces, torch.float32)


def test_rotated_copy_has_identical_hsic():
    """HSIC is invariant to orthogonal maps of the features: H of [X, X Q] is one repeated value."""
    x = make_layers(30, [24], torch.float64)[0]
    q, _ = torch.linalg.qr(torch.randn(24, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    layers = [x.float(), (x @ q.to(DEVICE)).float()]
    h, _ = minibatch_hsic(layers, None, False, tiles=SMALL)
    assert float((h - h[0, 0]).abs().max()) <= 1e-5 * float(h[0, 0])


def test_minibatch_hsic_dispatch(monkeypatch):
    """MinibatchHSIC gives the same statistics through the kernel as through torch."""
    from elsi_fast import MinibatchHSIC

    layers = make_layers(33, [20, 28, 20], torch.bfloat16)
    mask = (torch.arange(33) % 5 != 2).to(DEVICE)
    monkeypatch.setenv("ELSI_FAST_DISABLE_TRITON", "1")
    torch_acc = MinibatchHSIC(3, device=DEVICE)
    torch_acc.update(layers, mask)
    monkeypatch.delenv("ELSI_FAST_DISABLE_TRITON")
    monkeypatch.setenv("ELSI_FAST_FORCE_TRITON", "1")
    calls = []
    original = hsic_module.minibatch_hsic
    monkeypatch.setattr(hsic_module, "minibatch_hsic", lambda *a, **k: calls.append(1) or original(*a, **k))
    triton_acc = MinibatchHSIC(3, device=DEVICE)
    triton_acc.update(layers, mask)
    assert calls == [1]
    want_traces = torch_acc.traces().double()
    got_h, want_h = triton_acc.hsic().double(), torch_acc.hsic().double()
    assert float((got_h - want_h).abs().max()) <= TOLERANCE[torch.bfloat16] * float(want_traces.max()) ** 2
    got_traces = triton_acc.traces().double()
    assert float((got_traces - want_traces).abs().max()) <= TOLERANCE[torch.bfloat16] * float(want_traces.max())


@pytest.mark.gpu
def test_real_size_gpu():
    layers = make_layers(1024, [2560] * 5 + [2048], torch.bfloat16)
    mask = (torch.arange(1024) % 7 != 0).to(DEVICE)
    h, traces = minibatch_hsic(layers, mask, True)
    ref_h, ref_traces = hsic_reference(layers, mask, True)
    assert_matches(h, traces, ref_h, ref_traces, torch.bfloat16)
