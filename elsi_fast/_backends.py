"""Which implementation each public function uses on this machine."""

from __future__ import annotations

import torch


def backends(device: str | torch.device | None = None) -> dict[str, str]:
    """Map each accelerated function to the implementation it dispatches to for `device`.

    `device` defaults to CUDA when present, else CPU. Values read like "triton (cuda)",
    "torch (cpu)" or "native cpu (avx512)".
    """
    from . import kernels
    from .draft import native

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    gpu_kernels = device.type == "cuda" and kernels.triton_available()
    stat = "triton (cuda)" if gpu_kernels else f"torch ({device.type})"
    out = {
        "matrix_entropy": f"torch ({device.type}, eigvalsh)",
        "cka_matrix (unbiased)": stat,
        "cka_matrix (biased)": f"torch ({device.type})",
        "token_entropy": stat,
        "linear_token_entropy": stat,
        "StreamingCovariance.update": stat,
        "MinibatchHSIC.update": stat,
        "NativeDraftDecoder.step": native.describe(device),
    }
    return out
