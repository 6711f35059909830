"""Streaming covariance accumulation: sum (y - shift)^T (y - shift) for all layers in one launch.

Program (t, l) owns output tile t = (bi, bj) of layer l's d x d accumulator and walks the kept token
rows in BLOCK_N steps; programs with bi > bj exit at once, so only the upper-triangular tiles cost
FLOPs (half of x^T x). bf16/fp16 tiles are multiplied on the tensor cores with fp32 accumulation.
y - shift = x / ||x|| - shift is formed in fp32 and rounded back to the input dtype, in one of two
ways (CovarianceTiles.pack):
- pack=True: a pre-pass writes y - shift of the kept rows of all layers, compacted, to one
  [L, kept, d] buffer (one read and one write of the batch) plus per-row-block column sums; the
  product is then a plain GEMM whose operand tiles go straight from memory to the tensor cores.
- pack=False: no extra buffer; every program normalizes and shifts its operand tiles itself (rows
  gathered by index, norms from a small pre-pass), which costs a shared-memory round trip per step.
  Its diagonal-tile programs also produce the column sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting
from ._layer_table import (
    kept_rows,
    layer_table,
    load_rows,
    row_inv_norms,
    row_pointers,
    rows_inv_norm,
    use_tensor_cores,
)


@dataclass(frozen=True)
class CovarianceTiles:
    """Launch shape: block_d x block_d output tiles, block_n token rows per K step."""

    block_d: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    pack: bool = True  # see the module docstring


def default_tiles(dtype: torch.dtype) -> CovarianceTiles:
    if interpreting():
        # The interpreter pays per program and per K step: few, large tiles.
        return CovarianceTiles(block_d=64, block_n=128)
    if dtype in (torch.float16, torch.bfloat16):
        return CovarianceTiles(block_d=128, block_n=64, num_warps=8, num_stages=3)
    return CovarianceTiles(block_d=64, block_n=32, num_warps=4, num_stages=3)


@triton.jit
def _pack_kernel(x0, offsets, row_strides, rows, num_rows, dim, shift, packed, col_sums, num_row_blocks,
                 HAS_ROWS: tl.constexpr, NORMALIZE: tl.constexpr, ALIGN: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    row_block = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    r = row_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    ptrs = row_pointers(x0, offsets, row_strides, rows, layer, r, r_ok, HAS_ROWS, ALIGN)
    if NORMALIZE:
        inv = rows_inv_norm(ptrs, r_ok, dim, BLOCK_R, BLOCK_D)
    else:
        inv = tl.zeros((BLOCK_R,), dtype=tl.float32)
    out_rows = packed + (layer * num_rows + r) * dim
    for c0 in range(0, dim, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        c_ok = cols < dim
        y = load_rows(ptrs, r_ok, cols, c_ok, inv, tl.load(shift + layer * dim + cols, mask=c_ok, other=0.0),
                      NORMALIZE)
        tl.store(out_rows[:, None] + cols[None, :], y.to(packed.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])
        tl.store(col_sums + (layer * num_row_blocks + row_block) * dim + cols, tl.sum(y, axis=0), mask=c_ok)


@triton.jit
def _covariance_kernel(x0, offsets, row_strides, rows, num_rows, dim, inv_norm, shift, sum_xx, sum_x,
                       PACKED: tl.constexpr, HAS_ROWS: tl.constexpr, NORMALIZE: tl.constexpr,
                       USE_TC: tl.constexpr, ALIGN: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    num_blocks = tl.cdiv(dim, BLOCK_D)
    bi = tile // num_blocks
    bj = tile % num_blocks
    if bi > bj:
        return
    ci = bi * BLOCK_D + tl.arange(0, BLOCK_D)
    cj = bj * BLOCK_D + tl.arange(0, BLOCK_D)
    ci_ok = ci < dim
    cj_ok = cj < dim
    if not PACKED:
        shift_i = tl.load(shift + layer * dim + ci, mask=ci_ok, other=0.0)
        shift_j = tl.load(shift + layer * dim + cj, mask=cj_ok, other=0.0)
    acc = tl.zeros((BLOCK_D, BLOCK_D), dtype=tl.float32)
    col_sum = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_N):
        r = r0 + tl.arange(0, BLOCK_N)
        r_ok = r < num_rows
        ptrs = row_pointers(x0, offsets, row_strides, rows, layer, r, r_ok, HAS_ROWS, ALIGN)
        if PACKED:
            # Already y - shift in the operand dtype: loaded tiles feed the product directly.
            a = tl.load(ptrs[:, None] + ci[None, :], mask=r_ok[:, None] & ci_ok[None, :], other=0.0)
            b = tl.load(ptrs[:, None] + cj[None, :], mask=r_ok[:, None] & cj_ok[None, :], other=0.0)
            if USE_TC:
                acc = tl.dot(tl.trans(a), b, acc)
            else:
                acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
        else:
            if NORMALIZE:
                inv = tl.load(inv_norm + layer * num_rows + r, mask=r_ok, other=0.0)
            else:
                inv = tl.zeros((BLOCK_N,), dtype=tl.float32)
            a = load_rows(ptrs, r_ok, ci, ci_ok, inv, shift_i, NORMALIZE)
            b = load_rows(ptrs, r_ok, cj, cj_ok, inv, shift_j, NORMALIZE)
            if USE_TC:
                acc = tl.dot(tl.trans(a.to(x0.dtype.element_ty)), b.to(x0.dtype.element_ty), acc)
            else:
                acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
            if bi == bj:
                col_sum += tl.sum(a, axis=0)
    out = sum_xx + layer * dim * dim + ci.to(tl.int64)[:, None] * dim + cj[None, :]
    ok = ci_ok[:, None] & cj_ok[None, :]
    tl.store(out, tl.load(out, mask=ok, other=0.0) + acc, mask=ok)
    if not PACKED and bi == bj:
        out_x = sum_x + layer * dim + ci
        tl.store(out_x, tl.load(out_x, mask=ci_ok, other=0.0) + col_sum, mask=ci_ok)


def _check_accumulator(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the hidden states are on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous: it is updated in place")
    return t


def covariance_accumulate_(
    hidden: torch.Tensor | list[torch.Tensor],
    mask: torch.Tensor | None,
    shift: torch.Tensor,
    l2_normalize: bool,
    sum_xx: torch.Tensor,
    sum_x: torch.Tensor,
    *,
    tiles: CovarianceTiles | None = None,
) -> int:
    """Add one batch of token rows of every layer to the running sums, in place.

    hidden: [L, n, d] or a list of L [n, d] (any row stride), fp16/bf16/fp32. mask: [n] bool (True
    keeps the token) or None. shift: [L, d] fp32. With y = x / max(||x||, fp32 tiny) if l2_normalize
    else x, over the kept rows: sum_xx [L, d, d] fp32 += (y - shift)^T (y - shift), upper-triangular
    tiles only (entries below the diagonal tiles are left untouched: read with triu + mirror), and
    sum_x [L, d] fp32 += sum (y - shift). Returns the number of kept rows.
    """
    table = layer_table("hidden", hidden, same_dim=True)
    num_layers, n, dim = table.num_layers, table.num_rows, table.max_dim
    device = table.device
    _check_accumulator("sum_xx", sum_xx, (num_layers, dim, dim), device)
    _check_accumulator("sum_x", sum_x, (num_layers, dim), device)
    if not isinstance(shift, torch.Tensor) or tuple(shift.shape) != (num_layers, dim):
        raise ValueError(f"shift must be a tensor of shape {(num_layers, dim)}")
    if shift.device != device:
        raise ValueError(f"shift is on {shift.device} but the hidden states are on {device}")
    shift = shift.to(torch.float32).contiguous()
    rows = kept_rows(mask, n, device)
    num_kept = n if rows is None else rows.numel()
    if num_kept == 0:
        return 0
    tiles = tiles or default_tiles(table.dtype)
    use_tc = use_tensor_cores(table.dtype)
    if tiles.pack:
        operand_dtype = table.dtype if use_tc else torch.float32
        packed = torch.empty(num_layers, num_kept, dim, dtype=operand_dtype, device=device)
        block_r = 64 if interpreting() else 32
        num_row_blocks = triton.cdiv(num_kept, block_r)
        col_sums = torch.empty(num_layers, num_row_blocks, dim, dtype=torch.float32, device=device)
        _pack_kernel[(num_row_blocks, num_layers)](
            table.base, table.offsets, table.row_strides, rows if rows is not None else table.offsets,
            num_kept, dim, shift, packed, col_sums, num_row_blocks,
            HAS_ROWS=rows is not None, NORMALIZE=bool(l2_normalize), ALIGN=table.align,
            BLOCK_R=block_r, BLOCK_D=min(256, triton.next_power_of_2(dim)), num_warps=4,
        )
        sum_x += col_sums.sum(1)
        # From here on the product reads the packed rows: contiguous, normalized and shifted.
        table, rows, l2_normalize = layer_table("packed", packed, same_dim=True), None, False
    inv_norm = row_inv_norms(table, rows, num_kept) if l2_normalize else shift
    num_blocks = triton.cdiv(dim, tiles.block_d)
    _covariance_kernel[(num_blocks * num_blocks, num_layers)](
        table.base, table.offsets, table.row_strides, rows if rows is not None else table.offsets,
        num_kept, dim, inv_norm, shift, sum_xx, sum_x,
        PACKED=tiles.pack, HAS_ROWS=rows is not None, NORMALIZE=bool(l2_normalize), USE_TC=use_tc,
        ALIGN=table.align, BLOCK_D=tiles.block_d, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return num_kept
