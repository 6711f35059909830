"""training.head_loss (the draft head's cross-entropy fused with its product) against float64 autograd
of the unfused formula: odd row counts around its chunk size, both product dtypes, refusals."""

from __future__ import annotations

import pytest
import torch

from elsi_fast.training import head_loss
from elsi_fast.training.head_loss import head_cross_entropy

# (rows, columns of x, vocabulary): none, fewer than a chunk, a chunk and one row, several chunks
SHAPES = [(0, 8, 5), (7, 8, 5), (head_loss.CHUNK_ROWS + 1, 16, 33), (3 * head_loss.CHUNK_ROWS - 5, 12, 70)]
# the head's product in bf16 rounds the inputs to 8 bits of mantissa
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def reference(x, weight, labels, scale, dtype):
    """float64 autograd of sum(scale * cross_entropy(x W^T)), x and W rounded to `dtype` first."""
    x64 = x.detach().to(dtype).double().requires_grad_()
    w64 = weight.detach().to(dtype).double().requires_grad_()
    ce = torch.nn.functional.cross_entropy(x64 @ w64.T, labels, reduction="none")
    loss = (scale.double() * ce).sum()
    loss.backward()
    return loss.detach(), ce.detach(), (x64 @ w64.T).argmax(-1), x64.grad, w64.grad


@pytest.mark.parametrize("dtype", TOLERANCES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_autograd(shape, dtype):
    n, d, vd = shape
    gen = torch.Generator().manual_seed(n + vd)
    x = torch.randn(n, d, generator=gen, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vd, d, generator=gen) / d**0.5)
    labels = torch.randint(0, vd, (n,), generator=gen)
    scale = torch.rand(n, generator=gen) + 0.01
    argmax_rows = n // 2 + 1 if n else 0  # the argmax of the first rows only (a loss's first step)
    loss, ce, top = head_cross_entropy(x, weight, labels, scale, dtype, argmax_rows)
    (2.0 * loss).backward()  # the backward scales by the loss's own gradient
    want_loss, want_ce, want_top, want_gx, want_gw = reference(x, weight, labels, scale, dtype)
    tol = TOLERANCES[dtype]
    assert loss.dtype == torch.float32 and ce.shape == (n,) and top.shape == (argmax_rows,)
    assert float(loss.detach()) == pytest.approx(float(want_loss), rel=tol, abs=1e-6)
    torch.testing.assert_close(ce.double(), want_ce, rtol=tol, atol=1e-5)
    if dtype == torch.float32:  # the argmax wherever the reference's top two are apart (no near ties)
        logits = (x.detach().double() @ weight.detach().double().T)[:argmax_rows]
        best = logits.topk(min(2, vd), dim=-1).values
        clear = best[:, 0] - best[:, -1] > 1e-4
        assert torch.equal(top[clear], want_top[:argmax_rows][clear]) and int(clear.sum()) >= 0.9 * argmax_rows
    for got, want in ((x.grad, 2 * want_gx), (weight.grad, 2 * want_gw)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * (float(want.abs().max()) if want.numel() else 1.0))


def test_refuses_mismatched_inputs():
    x, weight = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="labels: expected 4 int64 indices"):
        head_cross_entropy(x, weight, torch.zeros(4, dtype=torch.int32), torch.ones(4))
    with pytest.raises(ValueError, match="scale: expected 4 positive row weights"):
        head_cross_entropy(x, weight, torch.zeros(4, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="scale: expected 4 positive row weights"):
        head_cross_entropy(x, weight, torch.zeros(4, dtype=torch.long), torch.tensor([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match=r"argmax_rows: expected 0..4, got 5"):
        head_cross_entropy(x, weight, torch.zeros(4, dtype=torch.long), torch.ones(4), argmax_rows=5)
    with pytest.raises(ValueError, match=r"x \[4, 8\] and weight \[5, 7\]"):
        head_cross_entropy(x, torch.randn(5, 7), torch.zeros(4, dtype=torch.long), torch.ones(4))
