"""All-pairs unbiased linear HSIC of one minibatch without storing L full n x n Grams.

For layer a with kept rows y_i (L2-normalized if asked) and batch mean m, z_i = y_i - m (HSIC does
not see feature centering; centering keeps the Gram entries small). K~_a is the Gram Z Z^T with its
diagonal zeroed, r~_a = K~_a 1 its row sums and S_a = 1^T K~_a 1. Since sum_j z_j = 0,
r~_i = z_i . sum_j z_j - ||z_i||^2 = -||z_i||^2. Song et al.'s estimator, which equals the product of
the U-centered (Szekely-Rizzo) Grams, is then

    n (n - 3) HSIC_ab = <U_a, U_b>_F = <K~_a, K~_b>_F + S_a S_b / ((n-1)(n-2)) - 2 r~_a . r~_b / (n-2)

so only <K~_a, K~_b>_F needs the n x n Grams. The kernel computes, for a chunk of upper-triangular
block_n x block_n tiles and every layer, the zero-diagonal Gram tile (weighted by sqrt 2 off the
diagonal, which counts its mirror image) into a workspace of at most WORKSPACE_BYTES; one GEMM of
the workspace with itself adds that chunk's share of all L x L products. The diagonal tiles also
yield ||z_i||^2 (for r~ and the traces) from the same tensor-core products as the Gram.
Extra memory: O(L d + L n + L^2) plus the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting
from ._layer_table import kept_rows, layer_dim, layer_table, load_rows, row_inv_norms, row_pointers, use_tensor_cores

# Cap on the Gram-tile workspace: the tiles of all layers are produced and consumed in launches of
# at most this size, whatever n is.
WORKSPACE_BYTES = 64 << 20


@dataclass(frozen=True)
class HsicTiles:
    """Launch shape: block_n x block_n Gram tiles, block_k features per K step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_tiles(dtype: torch.dtype) -> HsicTiles:
    if interpreting():
        return HsicTiles(block_n=64, block_k=128)
    if dtype in (torch.float16, torch.bfloat16):
        return HsicTiles(block_n=128, block_k=64, num_warps=8, num_stages=3)
    return HsicTiles(block_n=64, block_k=32, num_warps=4, num_stages=3)


@triton.jit
def _col_sum_kernel(x0, offsets, row_strides, dims, rows, num_rows, inv_norm, out, max_dim,
                    HAS_ROWS: tl.constexpr, NORMALIZE: tl.constexpr, ALIGN: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    layer = tl.program_id(1).to(tl.int64)
    dim = layer_dim(dims, layer, ALIGN)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = cols < dim
    no_shift = tl.zeros((BLOCK_D,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(0, num_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < num_rows
        ptrs = row_pointers(x0, offsets, row_strides, rows, layer, r, r_ok, HAS_ROWS, ALIGN)
        if NORMALIZE:
            inv = tl.load(inv_norm + layer * num_rows + r, mask=r_ok, other=0.0)
        else:
            inv = tl.zeros((BLOCK_R,), dtype=tl.float32)
        acc += tl.sum(load_rows(ptrs, r_ok, cols, c_ok, inv, no_shift, NORMALIZE), axis=0)
    tl.store(out + layer * max_dim + cols, acc, mask=c_ok)


@triton.jit
def _gram_tiles_kernel(x0, offsets, row_strides, dims, rows, num_rows, inv_norm, mean, max_dim,
                       tile_rows, tile_cols, first_tile, work, num_slots, sq_norms,
                       HAS_ROWS: tl.constexpr, NORMALIZE: tl.constexpr, USE_TC: tl.constexpr,
                       ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    slot = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    bi = tl.load(tile_rows + first_tile + slot)
    bj = tl.load(tile_cols + first_tile + slot)
    i = bi * BLOCK_N + tl.arange(0, BLOCK_N)
    j = bj * BLOCK_N + tl.arange(0, BLOCK_N)
    i_ok = i < num_rows
    j_ok = j < num_rows
    ptrs_i = row_pointers(x0, offsets, row_strides, rows, layer, i, i_ok, HAS_ROWS, ALIGN)
    ptrs_j = row_pointers(x0, offsets, row_strides, rows, layer, j, j_ok, HAS_ROWS, ALIGN)
    if NORMALIZE:
        inv_i = tl.load(inv_norm + layer * num_rows + i, mask=i_ok, other=0.0)
        inv_j = tl.load(inv_norm + layer * num_rows + j, mask=j_ok, other=0.0)
    else:
        inv_i = tl.zeros((BLOCK_N,), dtype=tl.float32)
        inv_j = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dim = layer_dim(dims, layer, ALIGN)
    acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, dim, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)
        c_ok = cols < dim
        m = tl.load(mean + layer * max_dim + cols, mask=c_ok, other=0.0)
        zi = load_rows(ptrs_i, i_ok, cols, c_ok, inv_i, m, NORMALIZE)
        zj = load_rows(ptrs_j, j_ok, cols, c_ok, inv_j, m, NORMALIZE)
        if USE_TC:
            acc = tl.dot(zi.to(x0.dtype.element_ty), tl.trans(zj.to(x0.dtype.element_ty)), acc)
        else:
            acc = tl.dot(zi, tl.trans(zj), acc, input_precision="ieee")
    if bi == bj:
        diag = i[:, None] == j[None, :]
        tl.store(sq_norms + layer * num_rows + i, tl.sum(tl.where(diag, acc, 0.0), axis=1), mask=i_ok)
        acc = tl.where(diag, 0.0, acc)
    else:
        acc = acc * 1.4142135623730951  # an off-diagonal tile also stands for its mirror image
    tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(work + (layer * num_slots + slot) * (BLOCK_N * BLOCK_N) + tile, acc)


def minibatch_hsic(
    hidden: torch.Tensor | list[torch.Tensor],
    mask: torch.Tensor | None,
    l2_normalize: bool,
    *,
    tiles: HsicTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased linear HSIC of every layer pair on one minibatch's kept rows.

    hidden: [L, n, d] or a list of L [n, d_l] (any row stride), fp16/bf16/fp32; mask: [n] bool (True
    keeps the token) or None; rows are divided by max(||x||, fp32 tiny) first if l2_normalize.
    Returns (H [L, L] fp32, traces [L] fp32) with H_ab = <U(K_a), U(K_b)>_F / (n (n - 3)) over the
    n kept rows (n >= 4) and traces[a] = sum_i ||y_i - mean||^2 / (n - 1) (unbiased tr Cov_a).
    """
    table = layer_table("hidden", hidden, same_dim=False)
    num_layers, device = table.num_layers, table.device
    rows = kept_rows(mask, table.num_rows, device)
    n = table.num_rows if rows is None else rows.numel()
    if n < 4:
        raise ValueError(f"minibatch_hsic needs at least 4 kept tokens for the unbiased estimator, got {n}")
    tiles = tiles or default_tiles(table.dtype)
    rows_arg = rows if rows is not None else table.offsets
    common = dict(HAS_ROWS=rows is not None, NORMALIZE=bool(l2_normalize), ALIGN=table.align)
    inv_norm = row_inv_norms(table, rows, n) if l2_normalize else table.offsets

    col_sums = torch.zeros(num_layers, table.max_dim, dtype=torch.float32, device=device)
    block_d = min(256, triton.next_power_of_2(table.max_dim))
    _col_sum_kernel[(triton.cdiv(table.max_dim, block_d), num_layers)](
        table.base, table.offsets, table.row_strides, table.dims, rows_arg, n, inv_norm, col_sums,
        table.max_dim, BLOCK_R=128 if interpreting() else 32, BLOCK_D=block_d, num_warps=4, **common,
    )
    mean = col_sums / n

    num_blocks = triton.cdiv(n, tiles.block_n)
    tile_rows, tile_cols = torch.triu_indices(num_blocks, num_blocks, device=device).to(torch.int32)
    num_tiles = tile_rows.numel()
    tile_bytes = num_layers * tiles.block_n * tiles.block_n * 4
    num_launches = triton.cdiv(num_tiles, max(1, WORKSPACE_BYTES // tile_bytes))
    num_slots = triton.cdiv(num_tiles, num_launches)  # balanced launches
    work = torch.empty(num_layers, num_slots, tiles.block_n * tiles.block_n, dtype=torch.float32, device=device)
    sq_norms = torch.empty(num_layers, n, dtype=torch.float32, device=device)
    gram_products = torch.zeros(num_layers, num_layers, dtype=torch.float32, device=device)
    for first in range(0, num_tiles, num_slots):
        count = min(num_slots, num_tiles - first)
        _gram_tiles_kernel[(count, num_layers)](
            table.base, table.offsets, table.row_strides, table.dims, rows_arg, n, inv_norm, mean,
            table.max_dim, tile_rows, tile_cols, first, work, num_slots, sq_norms,
            USE_TC=use_tensor_cores(table.dtype), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **common,
        )
        flat = work[:, :count].reshape(num_layers, -1)
        gram_products.addmm_(flat, flat.T)

    sq = sq_norms.double()
    row_sums = -sq  # r~_i = -||z_i||^2 (see the module docstring)
    totals = row_sums.sum(1)
    products = (
        gram_products.double()
        + torch.outer(totals, totals) / ((n - 1) * (n - 2))
        - 2.0 * (row_sums @ row_sums.T) / (n - 2)
    )
    hsic = products / (n * (n - 3))
    traces = sq.sum(1) / (n - 1)
    return hsic.float(), traces.float()
