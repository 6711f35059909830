"""The draft head's cross-entropy on one-hot labels, fused with the head's product (training).

``head_cross_entropy(x, weight, labels, scale, dtype)`` is ``(scale * cross_entropy(x @ weight.T,
labels, reduction="none")).sum()`` (a weight per row) with the head's product in `dtype` (bfloat16 as autocast runs it, or float32) and
the softmax in float32, as the unfused path computes them. The logits [n, Vd] never exist whole:
rows go through in chunks, and each chunk's gradients (softmax minus the one-hot, times `scale`)
are taken in the forward, where the chunk's logits are at hand, so the backward only scales them.
Unfused, a 11,264-token head spent more time copying and re-reading its [n, Vd] logits (bf16 ->
fp32, log-softmax and its backward, the one-hot's gradient, the cast back for the product's
backward) than in its products (docs/performance.md, draft training throughput).

The logits' gradients are kept (in `dtype`, as the unfused backward holds them) for the weight's
gradient, one product over all rows at the end. The softmax times the row's scale is one exp(z -
lse + log scale). The results agree with the unfused path's to float32 rounding under float32 and
to bf16 rounding under bf16 (tests/training/test_head_loss.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows per chunk: their float32 logits (11.5 MB at Gemma's 11,264 columns) stay in cache between
# the softmax and the gradient product; of 64-512 rows, 256 was fastest on that head.
CHUNK_ROWS = 256


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, labels: Tensor, scale: Tensor, dtype: torch.dtype,
                argmax_rows: int):
        w = weight.detach().to(dtype)
        xs = x.detach().to(dtype)
        n = x.shape[0]
        grad_x = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        # every row's logits' gradient, for one weight-gradient product at the end: per chunk, its
        # [Vd, d] result's conversion and sum cost more than the product
        grad_logits = torch.empty(n, weight.shape[0], dtype=dtype, device=x.device)
        ce = torch.empty(n, dtype=torch.float32, device=x.device)
        top = torch.empty(argmax_rows, dtype=torch.long, device=x.device)
        log_scale = torch.log(scale)
        for r0 in range(0, n, CHUNK_ROWS):
            rows = slice(r0, r0 + CHUNK_ROWS)
            xc, lc = xs[rows], labels[rows]
            z = (xc @ w.T).float()  # [c, Vd], the unfused path's logits.float()
            picked = torch.arange(z.shape[0], device=z.device)
            lse = torch.logsumexp(z, dim=-1)
            ce[rows] = lse - z[picked, lc]
            if r0 < argmax_rows:
                top[rows] = z[: argmax_rows - r0].argmax(-1)
            z.sub_((lse - log_scale[rows])[:, None]).exp_()  # scale * softmax
            z[picked, lc] -= scale[rows]  # d(scale * ce) / d logits
            g = grad_logits[rows]
            g.copy_(z)
            grad_x[rows] = (g @ w).float()
        grad_w = (grad_logits.T @ xs).float()
        ctx.save_for_backward(grad_x.to(x.dtype), grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(ce, top)
        return (scale * ce).sum(), ce, top

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_top):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_loss, grad_w * grad_loss, None, None, None, None


def head_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, scale: Tensor,
                       dtype: torch.dtype = torch.float32, argmax_rows: int | None = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """x [n, d] the head's inputs, weight [Vd, d], labels [n] indices into Vd, scale [n] each row's
    weight in the loss (> 0): (sum of scale * cross-entropy, differentiable in x and weight; each
    row's cross-entropy [n] and the argmax of the logits of its first `argmax_rows` rows (default
    all), both detached). dtype: the head product's, bfloat16 (as autocast runs it) or float32."""
    n = x.shape[0]
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {list(x.shape)} and weight {list(weight.shape)}: expected [n, d] and [Vd, d]")
    if labels.dtype != torch.long or labels.shape != (n,):
        raise ValueError(f"labels: expected {n} int64 indices, got {labels.dtype} {list(labels.shape)}")
    if scale.shape != (n,) or not bool((scale > 0).all()):
        raise ValueError(f"scale: expected {n} positive row weights, got {list(scale.shape)}")
    argmax_rows = n if argmax_rows is None else argmax_rows
    if not 0 <= argmax_rows <= n:
        raise ValueError(f"argmax_rows: expected 0..{n}, got {argmax_rows}")
    return _HeadCrossEntropy.apply(x, weight, labels, scale.float(), dtype, argmax_rows)
