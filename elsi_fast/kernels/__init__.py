"""Triton GPU kernels behind the metric API (issue 3): one module per op.

- `covariance.covariance_accumulate_`: streaming x^T x of all layers, upper-triangular tiles only.
- `hsic.minibatch_hsic`: unbiased HSIC of every layer pair without storing L full n x n Grams.
- `entropy.token_entropy` / `entropy.linear_token_entropy`: one-pass online log-sum-exp entropies.

Only this module is imported eagerly and it does not import triton: the kernel modules are imported
by the dispatching code once `use_triton(t)` is true. Environment switches:
ELSI_FAST_DISABLE_TRITON=1 keeps everything on the torch paths; ELSI_FAST_FORCE_TRITON=1 also routes
CPU tensors to the kernels, which then run in the Triton interpreter (TRITON_INTERPRET=1, which must
be set before the kernel modules are imported; the test suite's conftest does that).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["triton_available", "use_triton", "interpreting"]


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether @triton.jit functions run in the Triton interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """Triton is importable and can run: a CUDA device is present, or the interpreter is on."""
    return _triton_importable() and (torch.cuda.is_available() or interpreting())


def use_triton(t: torch.Tensor) -> bool:
    """Whether work on tensor `t` goes to the Triton kernels.

    True for CUDA tensors when Triton is available; CPU tensors only with ELSI_FAST_FORCE_TRITON=1
    (and then TRITON_INTERPRET=1 is required). ELSI_FAST_DISABLE_TRITON=1 makes it always False.
    """
    if os.environ.get("ELSI_FAST_DISABLE_TRITON", "0") == "1":
        return False
    if t.is_cuda:
        return triton_available()
    if os.environ.get("ELSI_FAST_FORCE_TRITON", "0") == "1" and t.device.type == "cpu":
        if not interpreting():
            raise RuntimeError(
                "ELSI_FAST_FORCE_TRITON=1 routes CPU tensors to the Triton kernels, which needs the "
                "interpreter: set TRITON_INTERPRET=1 before importing elsi_fast.kernels modules"
            )
        return _triton_importable()
    return False
