"""Input checks shared by the public API: every message names the offending argument.

Conventions: a wrong Python type or dtype raises TypeError; a wrong rank, shape, value or
non-finite entry raises ValueError.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Collection[int] | None = None,
    min_ndim: int | None = None,
    floating: bool = True,
    finite: bool = True,
) -> torch.Tensor:
    """Return `t` after checking it is a tensor of the allowed rank, dtype and values.

    ndim: required rank, or a collection of allowed ranks; min_ndim: lowest allowed rank. floating: dtype must be fp16, bf16,
    fp32 or fp64. finite: no NaN or Inf entries (costs one pass over the data).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(f"{k}-D" for k in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16, float32 or float64, got {t.dtype}")
    if finite and t.numel() and not _all_finite(t):
        raise ValueError(f"{name} contains NaN or Inf values")
    return t


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of a floating tensor is finite.

    A sum is finite only if every term is, so one reduction pass (no bool tensor) settles the
    common case; a non-finite sum may also be an overflow of finite terms, which the exact
    elementwise test then decides.
    """
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def check_layer_list(
    name: str, hidden: object, *, num_layers: int | None = None, dim: int | None = None
) -> tuple[list[torch.Tensor], int]:
    """Validate per-layer token features given as `[L, n, d]` or a list of L `[n, d_l]` tensors.

    Returns (list of L `[n, d_l]` tensors, n). num_layers / dim, when given, must match.
    """
    if isinstance(hidden, torch.Tensor):
        check_tensor(name, hidden, ndim=3)
        layers = list(hidden.unbind(0))
    elif isinstance(hidden, Sequence) and not isinstance(hidden, (str, bytes)):
        if len(hidden) == 0:
            raise ValueError(f"{name} is an empty list; expected one [n, d] tensor per layer")
        layers = [check_tensor(f"{name}[{i}]", h, ndim=2) for i, h in enumerate(hidden)]
    else:
        raise TypeError(f"{name} must be a [L, n, d] tensor or a list of [n, d] tensors, got {type(hidden).__name__}")
    if num_layers is not None and len(layers) != num_layers:
        raise ValueError(f"{name} has {len(layers)} layers, expected num_layers={num_layers}")
    n = layers[0].shape[0]
    for i, h in enumerate(layers):
        if h.shape[0] != n:
            raise ValueError(f"{name}[{i}] has {h.shape[0]} tokens but {name}[0] has {n}; all layers need the same tokens")
        if dim is not None and h.shape[1] != dim:
            raise ValueError(f"{name}[{i}] has feature dim {h.shape[1]}, expected dim={dim}")
        if h.dtype != layers[0].dtype:
            raise ValueError(f"{name}[{i}] has dtype {h.dtype} but {name}[0] has {layers[0].dtype}")
        if h.device != layers[0].device:
            raise ValueError(f"{name}[{i}] is on {h.device} but {name}[0] is on {layers[0].device}")
    return layers, n


def check_mask(name: str, mask: object, n: int, device: torch.device) -> torch.Tensor | None:
    """Validate a token mask (`[n]` bool, True = keep). Returns it on `device`, or None.

    An all-false mask is rejected: it leaves nothing to compute on.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool (True = keep the token), got {mask.dtype}")
    if tuple(mask.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match the tokens, got {tuple(mask.shape)}")
    mask = mask.to(device)
    if not bool(mask.any()):
        raise ValueError(f"{name} is all False: it keeps no tokens")
    return mask


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_alpha(alpha: object) -> float:
    """Renyi order: a positive number or float('inf'); 1 means Shannon."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"alpha must be a number, got {type(alpha).__name__}")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (1 = Shannon, inf = min-entropy), got {alpha}")
    return float(alpha)
