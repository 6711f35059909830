"""Triton covariance accumulation against a float64 torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from elsi_fast.kernels.covariance import CovarianceTiles, covariance_accumulate_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max error relative to the largest reference entry. bf16/fp16 tiles are rounded to the input
# dtype after normalization and shift before the tensor-core product (GPU).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Small tiles so that tiny inputs still span several tiles (and odd remainders) per dimension.
SMALL = CovarianceTiles(block_d=16, block_n=16)
SMALL_FUSED = CovarianceTiles(block_d=16, block_n=16, pack=False)


def covariance_reference(layers, mask, shift, l2_normalize, dtype=torch.float64):
    """Plain torch: (sum_xx [L, d, d], sum_x [L, d], kept) of y - shift over the kept rows."""
    sums_xx, sums_x = [], []
    for a, x in enumerate(layers):
        y = (x if mask is None else x[mask]).to(dtype)
        if l2_normalize:
            y = y / torch.linalg.vector_norm(y, dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        y = y - shift[a].to(dtype)
        sums_xx.append(y.T @ y)
        sums_x.append(y.sum(0))
    kept = layers[0].shape[0] if mask is None else int(mask.sum())
    return torch.stack(sums_xx), torch.stack(sums_x), kept


def run_kernel(hidden, mask, shift, l2_normalize, tiles=SMALL):
    num_layers, dim = len(hidden), hidden[0].shape[1]
    sum_xx = torch.zeros(num_layers, dim, dim, device=DEVICE)
    sum_x = torch.zeros(num_layers, dim, device=DEVICE)
    kept = covariance_accumulate_(hidden, mask, shift, l2_normalize, sum_xx, sum_x, tiles=tiles)
    return sum_xx, sum_x, kept


def assert_matches(sum_xx, sum_x, ref_xx, ref_x, dtype):
    scale = max(float(ref_xx.abs().max()), 1e-30)
    err_xx = float((sum_xx.double().triu() - ref_xx.triu()).abs().max())
    err_x = float((sum_x.double() - ref_x).abs().max())
    assert err_xx <= TOLERANCE[dtype] * scale, (err_xx, scale)
    assert err_x <= TOLERANCE[dtype] * max(float(ref_x.abs().max()), 1.0), err_x


def make_layers(num_layers, n, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Anisotropic rows with an offset, like residual-stream states.
    x = torch.randn(num_layers, n, dim, generator=g) * torch.linspace(0.2, 3.0, dim) + 0.5
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_layers,n,dim", [(1, 5, 16), (3, 37, 45), (2, 50, 33)])
@pytest.mark.parametrize("l2_normalize", [True, False])
def test_matches_reference(dtype, num_layers, n, dim, l2_normalize):
    x = make_layers(num_layers, n, dim, dtype)
    shift = (x.float().mean(1) * 0.9).contiguous()
    mask = torch.rand(n, generator=torch.Generator().manual_seed(1)) > 0.3
    mask = mask.to(DEVICE)
    sum_xx, sum_x, kept = run_kernel(x, mask, shift, l2_normalize)
    ref_xx, ref_x, ref_kept = covariance_reference(list(x), mask, shift, l2_normalize)
    assert kept == ref_kept
    assert_matches(sum_xx, sum_x, ref_xx, ref_x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("l2_normalize", [True, False])
def test_fused_path_matches_reference(dtype, l2_normalize):
    """pack=False: operands normalized and shifted inside the product kernel, rows gathered by index."""
    x = make_layers(3, 37, 45, dtype)
    shift = (x.float().mean(1) * 0.9).contiguous()
    mask = (torch.arange(37) % 4 != 3).to(DEVICE)
    sum_xx, sum_x, kept = run_kernel(x, mask, shift, l2_normalize, tiles=SMALL_FUSED)
    ref_xx, ref_x, ref_kept = covariance_reference(list(x), mask, shift, l2_normalize)
    assert kept == ref_kept
    assert_matches(sum_xx, sum_x, ref_xx, ref_x, dtype)


@pytest.mark.parametrize("keep", ["none", "one", "all", "no_mask"])
def test_masks(keep):
    n = 37
    x = make_layers(2, n, 45, torch.float32)
    mask = {
        "none": torch.zeros(n, dtype=torch.bool),
        "one": torch.arange(n) == 17,
        "all": torch.ones(n, dtype=torch.bool),
        "no_mask": None,
    }[keep]
    mask = None if mask is None else mask.to(DEVICE)
    shift = torch.full((2, 45), 0.01, device=DEVICE)
    sum_xx, sum_x, kept = run_kernel(x, mask, shift, True)
    ref_xx, ref_x, ref_kept = covariance_reference(list(x), mask, shift, True)
    assert kept == ref_kept == {"none": 0, "one": 1, "all": n, "no_mask": n}[keep]
    assert_matches(sum_xx, sum_x, ref_xx, ref_x, torch.float32)


def test_strided_layers_and_in_place_accumulation():
    """A list of row-strided views and a column-strided layer, added on top of existing sums."""
    wide = make_layers(2, 40, 64, torch.float32)
    col_strided = make_layers(1, 45, 40, torch.float32, seed=3)[0].T  # [40, 45], feature stride 40
    layers = [wide[0, :, 3:48], wide[1, :, 10:55], col_strided]
    assert layers[0].stride(0) == 64 and col_strided.stride(1) != 1
    shift = torch.zeros(3, 45, device=DEVICE)
    mask = (torch.arange(40) % 3 != 0).to(DEVICE)
    sum_xx = torch.eye(45, device=DEVICE).repeat(3, 1, 1)
    sum_x = torch.ones(3, 45, device=DEVICE)
    kept = covariance_accumulate_(layers, mask, shift, False, sum_xx, sum_x, tiles=SMALL)
    ref_xx, ref_x, ref_kept = covariance_reference(layers, mask, shift, False)
    assert kept == ref_kept
    assert_matches(sum_xx, sum_x, ref_xx + torch.eye(45, device=DEVICE, dtype=torch.float64), ref_x + 1, torch.float32)


@pytest.mark.parametrize("tiles", [SMALL, SMALL_FUSED], ids=["pack", "fused"])
def test_only_upper_triangular_tiles_are_written(tiles):
    x = make_layers(2, 20, 40, torch.float32)
    sentinel = 123.0
    sum_xx = torch.full((2, 40, 40), sentinel, device=DEVICE)
    sum_x = torch.zeros(2, 40, device=DEVICE)
    covariance_accumulate_(x, None, torch.zeros(2, 40, device=DEVICE), True, sum_xx, sum_x, tiles=tiles)
    block = torch.arange(40, device=DEVICE) // SMALL.block_d
    below = block[:, None] > block[None, :]
    assert bool((sum_xx[:, below] == sentinel).all())
    assert not bool((sum_xx[:, ~below] == sentinel).any())


def test_large_offset_is_accurate_with_a_shift():
    """Raw rows offset by 1e4: subtracting a nearby shift keeps the fp32 sums exact enough."""
    g = torch.Generator().manual_seed(5)
    x = (1e4 + torch.randn(1, 64, 24, generator=g)).to(DEVICE)
    shift = x.mean(1).round()
    sum_xx, sum_x, _ = run_kernel(x, None, shift, False, tiles=None)
    ref_xx, ref_x, _ = covariance_reference(list(x.double()), None, shift.double(), False)
    n = 64
    cov = (sum_xx.double().triu() - torch.outer(sum_x[0].double(), sum_x[0].double()).triu() / n) / n
    ref_cov = (ref_xx.triu() - torch.outer(ref_x[0], ref_x[0]).triu() / n) / n
    assert float((cov - ref_cov).abs().max()) < 1e-4


def test_default_tiles_match_reference():
    x = make_layers(3, 37, 45, torch.bfloat16)
    shift = torch.zeros(3, 45, device=DEVICE)
    sum_xx, sum_x, _ = run_kernel(x, None, shift, True, tiles=None)
    ref_xx, ref_x, _ = covariance_reference(list(x), None, shift, True)
    assert_matches(sum_xx, sum_x, ref_xx, ref_x, torch.bfloat16)


def test_bad_inputs():
    x = make_layers(2, 8, 16, torch.float32)
    shift = torch.zeros(2, 16, device=DEVICE)
    sum_xx, sum_x = torch.zeros(2, 16, 16, device=DEVICE), torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(TypeError, match="sum_xx"):
        covariance_accumulate_(x, None, shift, True, sum_xx.double(), sum_x)
    with pytest.raises(ValueError, match="sum_x"):
        covariance_accumulate_(x, None, shift, True, sum_xx, sum_x[:1])
    with pytest.raises(ValueError, match=r"hidden\[1\]"):
        covariance_accumulate_([x[0], x[1, :, :8]], None, shift, True, sum_xx, sum_x)
    with pytest.raises(TypeError, match="mask"):
        covariance_accumulate_(x, torch.ones(8, device=DEVICE), shift, True, sum_xx, sum_x)
    with pytest.raises(ValueError, match="mask"):
        covariance_accumulate_(x, torch.ones(7, dtype=torch.bool, device=DEVICE), shift, True, sum_xx, sum_x)
    with pytest.raises(TypeError, match="hidden"):
        covariance_accumulate_(x.to(torch.int32), None, shift, True, sum_xx, sum_x)
    with pytest.raises(ValueError, match="shift"):
        covariance_accumulate_(x, None, shift[:, :4], True, sum_xx, sum_x)


def test_streaming_covariance_dispatch(monkeypatch):
    """The public accumulator gives the same statistics through the kernel as through torch."""
    from elsi_fast import StreamingCovariance
    from elsi_fast.kernels import covariance as kernel_module

    x = make_layers(3, 30, 20, torch.bfloat16)
    mask = (torch.arange(30) % 4 != 1).to(DEVICE)
    monkeypatch.setenv("ELSI_FAST_DISABLE_TRITON", "1")
    torch_acc = StreamingCovariance(3, 20, device=DEVICE)
    torch_acc.update(x, mask)
    torch_acc.update(list(x[:, :9]))
    monkeypatch.delenv("ELSI_FAST_DISABLE_TRITON")
    monkeypatch.setenv("ELSI_FAST_FORCE_TRITON", "1")
    calls = []
    original = kernel_module.covariance_accumulate_
    monkeypatch.setattr(kernel_module, "covariance_accumulate_", lambda *a, **k: calls.append(1) or original(*a, **k))
    triton_acc = StreamingCovariance(3, 20, device=DEVICE)
    triton_acc.update(x, mask)
    triton_acc.update(list(x[:, :9]))
    assert len(calls) == 2
    assert triton_acc.count == torch_acc.count
    cov_t, cov_ref = triton_acc.covariance().double(), torch_acc.covariance().double()
    assert float((cov_t - cov_ref).abs().max()) <= TOLERANCE[torch.bfloat16] * float(cov_ref.abs().max())


@pytest.mark.gpu
def test_real_size_gpu():
    x = make_layers(4, 4096, 2560, torch.bfloat16)
    mask = (torch.arange(4096) % 5 != 0).to(DEVICE)
    shift = x.float().mean(1) / x.float().mean(1).norm(dim=1, keepdim=True) * 0.5
    sum_xx, sum_x, kept = run_kernel(x, mask, shift, True, tiles=None)
    ref_xx, ref_x, ref_kept = covariance_reference(list(x), mask, shift, True)
    assert kept == ref_kept
    assert_matches(sum_xx, sum_x, ref_xx, ref_x, torch.bfloat16)
