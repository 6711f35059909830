"""Which implementation each public function uses on this machine."""

from __future__ import annotations

import functools

import torch


def backends(device: str | torch.device | None = None) -> dict[str, str]:
    """Map each accelerated function to the implementation it dispatches to for `device`.

    `device` defaults to CUDA when present, else CPU. Values read like "triton (cuda)",
    "torch (cpu)" or "native cpu (avx512)".
    """
    from .. import kernels
    from ..draft import native

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


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags of this CPU from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 GEMMs run about
    1.7x fp32's on a training step (bench/bench_train.py); elsewhere they are emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
