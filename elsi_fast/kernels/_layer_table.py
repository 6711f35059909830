"""Per-layer token rows as the covariance and HSIC kernels read them.

The L layers arrive as one [L, n, d] tensor or as L separate [n, d_l] tensors with any row stride.
Instead of stacking them (a full copy), the kernels get one base pointer (layer 0, so Triton sees
its dtype and 16-byte alignment) plus an int64 table of each layer's element offset from it and its
row stride: one launch covers all layers. Masked tokens are skipped by gathering the kept row
indices, so they cost neither bandwidth nor FLOPs. Row L2 norms come from one small pre-pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._infra._validation import check_tensor
from . import interpreting

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Rows are divided by max(||x||, fp32 tiny), as on the torch path: zero rows stay zero.
NORM_EPS = tl.constexpr(1.1754943508222875e-38)


@dataclass(frozen=True)
class LayerTable:
    """Device-side description of L layers of token rows (see the module docstring)."""

    layers: tuple[torch.Tensor, ...]  # kept alive: the kernels read them through raw offsets
    offsets: torch.Tensor  # int64 [L], elements from layers[0]'s first element
    row_strides: torch.Tensor  # int64 [L], elements
    dims: torch.Tensor  # int64 [L], widths
    num_rows: int
    max_dim: int
    align: int  # elements (16 bytes) that every offset, row stride and width is a multiple of, or 1

    @property
    def base(self) -> torch.Tensor:
        return self.layers[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


def layer_table(name: str, hidden: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
                same_dim: bool) -> LayerTable:
    """Validate `hidden` ([L, n, d] or a sequence of L [n, d_l]) and build its LayerTable.

    same_dim: require every layer to have the same width. Layers whose feature dim is not unit-stride
    are copied to contiguous memory (rows may have any stride). Values are not scanned for NaN / Inf:
    the public API does that once before dispatching here.
    """
    if isinstance(hidden, torch.Tensor):
        if hidden.dim() != 3:
            raise ValueError(f"{name} must be [L, n, d] or a list of [n, d] tensors, got shape {tuple(hidden.shape)}")
        layers = list(hidden.unbind(0))
    elif isinstance(hidden, (list, tuple)):
        layers = list(hidden)
    else:
        raise TypeError(f"{name} must be a tensor [L, n, d] or a list of [n, d] tensors, got {type(hidden).__name__}")
    if not layers:
        raise ValueError(f"{name} has no layers")
    first = layers[0]  # validated first by the loop below
    for i, t in enumerate(layers):
        check_kernel_tensor(f"{name}[{i}]", t, ndim=2)
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name}[{i}] is {t.dtype} on {t.device}, but {name}[0] is {first.dtype} on {first.device}"
            )
        if t.shape[0] != first.shape[0]:
            raise ValueError(f"{name}[{i}] has {t.shape[0]} rows, but {name}[0] has {first.shape[0]}")
        if same_dim and t.shape[1] != first.shape[1]:
            raise ValueError(f"{name}[{i}] has {t.shape[1]} features, but {name}[0] has {first.shape[1]}")
        if t.shape[1] == 0:
            raise ValueError(f"{name}[{i}] has no features (d = 0)")
    layers = [t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous() for t in layers]
    elem = first.element_size()
    base_ptr = layers[0].data_ptr()
    offsets = [(t.data_ptr() - base_ptr) // elem for t in layers]
    strides = [t.stride(0) for t in layers]
    vec = 16 // elem
    aligned = base_ptr % 16 == 0 and all(v % vec == 0 for v in (*offsets, *strides, *(t.shape[1] for t in layers)))
    dims = [t.shape[1] for t in layers]
    # One host-to-device copy for the three per-layer tables.
    packed = torch.tensor([*offsets, *strides, *dims], dtype=torch.int64, device=first.device)
    num_layers = len(layers)
    return LayerTable(
        layers=tuple(layers),
        offsets=packed[:num_layers],
        row_strides=packed[num_layers : 2 * num_layers],
        dims=packed[2 * num_layers :],
        num_rows=first.shape[0],
        max_dim=max(dims),
        align=vec if aligned else 1,
    )


def check_kernel_tensor(name: str, t: object, ndim: int | None = None) -> torch.Tensor:
    """Structure and dtype checks of a kernel input (fp16 / bf16 / fp32; no value scan)."""
    check_tensor(name, t, ndim=ndim, finite=False)
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32 for the Triton kernels, got {t.dtype}")
    return t


def kept_rows(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor | None:
    """int64 indices of the rows `mask` keeps (None when there is no mask: every row is kept)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if mask.shape != (n,):
        raise ValueError(f"mask must have shape ({n},) to match the token rows, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the hidden states are on {device}")
    return mask.nonzero().flatten()


def use_tensor_cores(dtype: torch.dtype) -> bool:
    """bf16/fp16 GEMM tiles go to the tensor cores; the interpreter computes bf16 wrongly, so it
    (and fp32 input) upcasts to fp32 first."""
    return dtype in (torch.float16, torch.bfloat16) and not interpreting()


@triton.jit
def row_pointers(x0, offsets, row_strides, rows, layer, r, r_ok, HAS_ROWS: tl.constexpr, ALIGN: tl.constexpr):
    """Pointers to the first element of rows r (positions among the kept rows) of `layer`."""
    offset = tl.load(offsets + layer)
    stride = tl.load(row_strides + layer)
    if ALIGN > 1:
        offset = tl.multiple_of(offset, ALIGN)
        stride = tl.multiple_of(stride, ALIGN)
    if HAS_ROWS:
        row = tl.load(rows + r, mask=r_ok, other=0)
    else:
        row = r.to(tl.int64)
    return x0 + offset + row * stride


@triton.jit
def layer_dim(dims, layer, ALIGN: tl.constexpr):
    """Width of `layer`; the alignment hint lets masked loads along features stay vectorized."""
    dim = tl.load(dims + layer)
    if ALIGN > 1:
        dim = tl.multiple_of(dim, ALIGN)
    return dim


@triton.jit
def load_rows(row_ptrs, r_ok, cols, c_ok, inv_norm, shift, NORMALIZE: tl.constexpr):
    """fp32 tile [rows, cols] of (x * inv_norm if NORMALIZE else x) - shift, zero outside the mask."""
    ok = r_ok[:, None] & c_ok[None, :]
    x = tl.load(row_ptrs[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORMALIZE:
        x = x * inv_norm[:, None]
    return tl.where(ok, x - shift[None, :], 0.0)


@triton.jit
def rows_inv_norm(ptrs, r_ok, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """1 / max(||x_r||, NORM_EPS) for the rows at `ptrs` (fp32 [BLOCK_R])."""
    sum_sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, dim, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        x = tl.load(ptrs[:, None] + cols[None, :], mask=r_ok[:, None] & (cols < dim)[None, :], other=0.0)
        x = x.to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
    return 1.0 / tl.maximum(tl.sqrt(sum_sq), NORM_EPS)


@triton.jit
def _inv_norm_kernel(x0, offsets, row_strides, dims, rows, num_rows, inv_out,
                     HAS_ROWS: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    layer = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    ptrs = row_pointers(x0, offsets, row_strides, rows, layer, r, r_ok, HAS_ROWS, ALIGN)
    inv = rows_inv_norm(ptrs, r_ok, layer_dim(dims, layer, ALIGN), BLOCK_R, BLOCK_D)
    tl.store(inv_out + layer * num_rows + r, inv, mask=r_ok)


def row_inv_norms(table: LayerTable, rows: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """fp32 [L, num_rows]: 1 / max(||x_i||, NORM_EPS) of every kept row of every layer."""
    out = torch.empty(table.num_layers, num_rows, dtype=torch.float32, device=table.device)
    block_r = 16
    block_d = min(1024 if interpreting() else 256, triton.next_power_of_2(table.max_dim))
    grid = (triton.cdiv(num_rows, block_r), table.num_layers)
    _inv_norm_kernel[grid](
        table.base, table.offsets, table.row_strides, table.dims, rows if rows is not None else table.offsets,
        num_rows, out, HAS_ROWS=rows is not None, ALIGN=table.align, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=4,
    )
    return out
