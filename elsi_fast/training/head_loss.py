"""The draft head's cross-entropy on one-hot labels, fused with the head's product (training).

``head_cross_entropy(x, weight, labels, scale, dtype)`` is ``(scale * cross_entropy(x @ weight.T,
labels, reduction="none")).sum()`` (a weight per row) with the head's product in `dtype` (bfloat16 as autocast runs it, or float32) and
the softmax in float32, as the unfused path computes them. The logits [n, Vd] never exist whole:
rows go through in chunks, and each chunk's gradients (softmax minus the one-hot, times `scale`)
are taken in the forward, where the chunk's logits are at hand, so the backward only scales them.
Unfused, a 11,264-token head spent more time copying and re-reading its [n, Vd] logits (bf16 ->
fp32, log-softmax and its backward, the one-hot's gradient, the cast back for the product's
backward) than in its products (docs/performance.md, draft training throughput).

The weight's gradient sums its chunks' products in float32 (unfused, one bf16 product over all
rows), so under bf16 the gradients differ from the unfused path's at bf16 rounding; under float32
they agree to float32 rounding (tests/training/test_head_loss.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows per chunk: their float32 logits (4 MB at 4096 columns) stay in the L2 / L3 cache between
# the softmax and the two gradient products.
CHUNK_ROWS = 256


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, labels: Tensor, scale: Tensor, dtype: torch.dtype):
        w = weight.detach().to(dtype)
        xs = x.detach().to(dtype)
        grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        ce = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        top = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        for r0 in range(0, x.shape[0], CHUNK_ROWS):
            rows = slice(r0, r0 + CHUNK_ROWS)
            xc, lc = xs[rows], labels[rows]
            z = (xc @ w.T).float()  # [c, Vd], the unfused path's logits.float()
            picked = torch.arange(z.shape[0], device=z.device)
            lse = torch.logsumexp(z, dim=-1)
            ce[rows] = lse - z[picked, lc]
            top[rows] = z.argmax(-1)
            z.sub_(lse[:, None]).exp_()  # softmax
            z[picked, lc] -= 1.0
            g = z.mul_(scale[rows, None]).to(dtype)  # d(scale * ce) / d logits
            grad_x[rows] = (g @ w).float()
            grad_w += (g.T @ xc).float()
        ctx.save_for_backward(grad_x.to(x.dtype), grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(ce, top)
        return (scale * ce).sum(), ce, top

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_top):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, grad_w * grad_loss, None, None, None


def head_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, scale: Tensor,
                       dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """x [n, d] the head's inputs, weight [Vd, d], labels [n] indices into Vd, scale [n] each row's
    weight in the loss: (sum of scale * cross-entropy, differentiable in x and weight; each row's
    cross-entropy [n] and the argmax of its logits [n], both detached). dtype: the head product's,
    bfloat16 (as autocast runs it) or float32."""
    n = x.shape[0]
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {list(x.shape)} and weight {list(weight.shape)}: expected [n, d] and [Vd, d]")
    if labels.dtype != torch.long or labels.shape != (n,):
        raise ValueError(f"labels: expected {n} int64 indices, got {labels.dtype} {list(labels.shape)}")
    if scale.shape != (n,):
        raise ValueError(f"scale: expected {n} row weights, got {list(scale.shape)}")
    return _HeadCrossEntropy.apply(x, weight, labels, scale.float(), dtype)
