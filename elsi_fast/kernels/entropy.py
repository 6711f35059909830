"""Predictive entropy of softmax rows in one pass, from logits or straight from hidden states.

Each program keeps three fp32 running statistics per row over its share of the vocabulary: the max
m, s = sum exp(l - m) and t = sum exp(l - m) (l - m). When a new chunk raises the max to m', both
sums are rescaled by exp(m - m') and t also gains (m - m') s. Then H = log s - t / s, with no
cancellation against the size of the logits. No probability tensor exists at any time.

`token_entropy` streams the logits (any strides) once; when there are too few rows to fill the GPU,
the vocabulary is split across programs. `linear_token_entropy` is a GEMM hidden @ weight^T whose
epilogue reduces each logit tile to its rows' statistics, never materializing the [n, V] logits.
Partial statistics of disjoint vocabulary parts are merged by `_merge_partials`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting
from ._layer_table import check_kernel_tensor

LOG2E = tl.constexpr(1.4426950408889634)


@dataclass(frozen=True)
class EntropyTiles:
    """token_entropy launch shape: block_v logits per step; split_v vocabulary columns per program
    (a multiple of block_v; None picks enough splits to fill the device)."""

    block_v: int
    split_v: int | None = None
    num_warps: int = 8


@dataclass(frozen=True)
class LinearEntropyTiles:
    """linear_token_entropy launch shape: block_m rows x block_v vocabulary logit tiles, block_k
    features per K step, tiles ordered in groups of group_m row blocks."""

    block_m: int
    block_v: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_entropy_tiles() -> EntropyTiles:
    return EntropyTiles(block_v=1024 if interpreting() else 4096)


def default_linear_tiles(dtype: torch.dtype) -> LinearEntropyTiles:
    if interpreting():
        return LinearEntropyTiles(block_m=64, block_v=64, block_k=64)
    if dtype in (torch.float16, torch.bfloat16):
        # 128 x 128 keeps the fp32 tile and its exp / (l - m) temporaries in registers (256 threads).
        return LinearEntropyTiles(block_m=128, block_v=128, block_k=64, num_warps=8, num_stages=3)
    return LinearEntropyTiles(block_m=64, block_v=64, block_k=32, num_warps=4, num_stages=3)


@triton.jit
def _fold_chunk(m, s, t, logits, ok, AXIS: tl.constexpr):
    """Fold a chunk of logits (masked-out entries are -inf) into the running (m, s, t)."""
    m_new = tl.maximum(m, tl.max(logits, axis=AXIS))
    if AXIS == 0:
        z = logits - m_new
    else:
        z = logits - m_new[:, None]
    shift = m - m_new  # -inf on the first chunk, where s = 0 and the shift term must vanish
    scale = tl.exp2(shift * LOG2E)
    t = scale * (t + tl.where(s > 0, shift, 0.0) * s)
    e = tl.exp2(z * LOG2E)
    s = scale * s + tl.sum(e, axis=AXIS)
    t = t + tl.sum(e * tl.where(ok, z, 0.0), axis=AXIS)
    return m_new, s, t


@triton.jit
def _entropy_kernel(x, row_offsets, stride_v, vocab, split_cols, num_splits, stats, out,
                    FINAL: tl.constexpr, ALIGN: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offset = tl.load(row_offsets + row)
    if ALIGN > 1:
        offset = tl.multiple_of(offset, ALIGN)  # keeps 16-byte vector loads (see token_entropy)
    base = x + offset
    start = split * split_cols
    stop = tl.minimum(start + split_cols, vocab)
    m = float("-inf")
    s = 0.0
    t = 0.0
    for v0 in range(start, stop, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < stop
        logits = tl.load(base + cols.to(tl.int64) * stride_v, mask=ok, other=float("-inf")).to(tl.float32)
        m, s, t = _fold_chunk(m, s, t, logits, ok, 0)
    if FINAL:
        tl.store(out + row, tl.log(s) - t / s)
    else:
        slot = stats + (row * num_splits + split) * 3
        tl.store(slot, m)
        tl.store(slot + 1, s)
        tl.store(slot + 2, t)


@triton.jit
def _linear_entropy_kernel(h, stride_h, w, stride_w, bias, n, vocab, dim, stats, HAS_BIAS: tl.constexpr,
                           USE_TC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # One logit tile per program, like a GEMM; tiles are visited in groups of GROUP_M row blocks
    # so that programs running together share hidden rows and weight tiles in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(n, BLOCK_M)
    num_v = tl.cdiv(vocab, BLOCK_V)
    group = pid // (GROUP_M * num_v)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_v)) % group_rows
    pid_v = (pid % (GROUP_M * num_v)) // group_rows
    r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    r_ok = r < n
    v_ok = v < vocab
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < dim
        a = tl.load(h + r[:, None] * stride_h + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + v[:, None] * stride_w + k[None, :], mask=v_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_TC:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias + v, mask=v_ok, other=0.0).to(tl.float32)[None, :]
    logits = tl.where(v_ok[None, :], acc, float("-inf"))
    m = tl.zeros((BLOCK_M,), dtype=tl.float32) - float("inf")
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m, s, t = _fold_chunk(m, s, t, logits, v_ok[None, :], 1)
    slot = stats + (r * num_v + pid_v) * 3
    tl.store(slot, m, mask=r_ok)
    tl.store(slot + 1, s, mask=r_ok)
    tl.store(slot + 2, t, mask=r_ok)


def _merge_partials(stats: torch.Tensor) -> torch.Tensor:
    """Entropies [R] from per-split statistics [R, S, 3] = (m, s, t) of disjoint vocabulary parts."""
    m, s, t = stats.unbind(-1)
    m_all = m.amax(1, keepdim=True)
    shift = m - m_all
    scale = torch.exp(shift)
    s_all = (scale * s).sum(1)
    t_all = (scale * (t + shift * s)).sum(1)
    return torch.log(s_all) - t_all / s_all


def _split_columns(num_rows: int, vocab: int, block: int, split_v: int | None, device: torch.device) -> int:
    """Vocabulary columns per program: a multiple of `block`; fills the GPU when rows are few."""
    if split_v is not None:
        if split_v <= 0 or split_v % block:
            raise ValueError(f"split_v must be a positive multiple of block {block}, got {split_v}")
        return split_v
    if device.type != "cuda":
        return triton.cdiv(vocab, block) * block
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(triton.cdiv(target, num_rows), triton.cdiv(vocab, block)))
    return triton.cdiv(triton.cdiv(vocab, splits), block) * block


def _row_offsets(x: torch.Tensor) -> torch.Tensor:
    """int64 element offset of every row (all leading indices, row-major) of x [..., V]."""
    offsets = torch.zeros((), dtype=torch.int64, device=x.device)
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        offsets = offsets[..., None] + torch.arange(size, device=x.device) * stride
    return offsets.reshape(-1)


def token_entropy(logits: torch.Tensor, *, tiles: EntropyTiles | None = None) -> torch.Tensor:
    """Entropy (nats) of softmax over the last dim: logits [..., V] (any strides, fp16/bf16/fp32)
    -> [...] fp32, reading the logits once."""
    check_kernel_tensor("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    out = torch.empty(lead, dtype=torch.float32, device=logits.device)
    num_rows = out.numel()
    if num_rows == 0:
        return out
    tiles = tiles or default_entropy_tiles()
    split_cols = _split_columns(num_rows, vocab, tiles.block_v, tiles.split_v, logits.device)
    num_splits = triton.cdiv(vocab, split_cols)
    stats = torch.empty(num_rows, num_splits, 3, dtype=torch.float32, device=logits.device) if num_splits > 1 else out
    # Row offsets come from a table, so Triton cannot see their alignment: pass it as a hint when
    # every leading stride is a multiple of 16 bytes.
    vec = 16 // logits.element_size()
    align = vec if all(st % vec == 0 for st in logits.stride()[:-1]) else 1
    _entropy_kernel[(num_rows, num_splits)](
        logits, _row_offsets(logits), logits.stride(-1), vocab, split_cols, num_splits, stats, out,
        FINAL=num_splits == 1, ALIGN=align, BLOCK_V=tiles.block_v, num_warps=tiles.num_warps,
    )
    return out if num_splits == 1 else _merge_partials(stats).reshape(lead)


def linear_token_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: LinearEntropyTiles | None = None,
) -> torch.Tensor:
    """Entropy (nats) of softmax(hidden @ weight^T + bias) per row without the [n, V] logits.

    hidden [n, d], weight [V, d], bias [V] or None (fp16/bf16/fp32; any row strides) -> [n] fp32.
    Same-dtype bf16/fp16 hidden and weight multiply on the tensor cores (fp32 accumulation); other
    combinations in fp32. Each block_m x block_v logit tile is reduced in registers to per-row
    (m, s, t), so the extra memory is n * ceil(V / block_v) * 12 bytes (3 / block_v of the fp32
    logits), merged at the end.
    """
    check_kernel_tensor("hidden", hidden, 2)
    check_kernel_tensor("weight", weight, 2)
    n, dim = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != dim:
        raise ValueError(f"weight must be [V, {dim}] to match hidden [n, d], got {tuple(weight.shape)}")
    if vocab == 0 or dim == 0:
        raise ValueError(f"weight must have V >= 1 and d >= 1, got shape {tuple(weight.shape)}")
    if bias is not None:
        check_kernel_tensor("bias", bias, 1)
        if bias.shape[0] != vocab:
            raise ValueError(f"bias must have shape ({vocab},) to match weight, got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=hidden.device)
    # The feature dim must be unit-stride for vectorized tile loads; rows may have any stride.
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    use_tc = hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16) and not interpreting()
    tiles = tiles or default_linear_tiles(hidden.dtype if use_tc else torch.float32)
    num_m, num_v = triton.cdiv(n, tiles.block_m), triton.cdiv(vocab, tiles.block_v)
    stats = torch.empty(n, num_v, 3, dtype=torch.float32, device=hidden.device)
    _linear_entropy_kernel[(num_m * num_v,)](
        hidden, hidden.stride(0), weight, weight.stride(0), bias if bias is not None else stats,
        n, vocab, dim, stats, HAS_BIAS=bias is not None, USE_TC=use_tc,
        BLOCK_M=tiles.block_m, BLOCK_V=tiles.block_v, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return _merge_partials(stats)
