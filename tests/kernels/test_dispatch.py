"""The environment switches of elsi_fast.kernels.use_triton (COMMON contract)."""

from __future__ import annotations

import pytest
import torch

from elsi_fast import kernels


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("ELSI_FAST_FORCE_TRITON", raising=False)
    monkeypatch.delenv("ELSI_FAST_DISABLE_TRITON", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return monkeypatch


def test_cpu_tensors_stay_on_torch_unless_forced(clean_env):
    cpu = torch.zeros(2)
    assert kernels.triton_available()
    assert not kernels.use_triton(cpu)
    clean_env.setenv("ELSI_FAST_FORCE_TRITON", "1")
    assert kernels.use_triton(cpu)
    clean_env.setenv("ELSI_FAST_DISABLE_TRITON", "1")
    assert not kernels.use_triton(cpu)


def test_forcing_cpu_tensors_needs_the_interpreter(clean_env):
    clean_env.setenv("ELSI_FAST_FORCE_TRITON", "1")
    clean_env.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.use_triton(torch.zeros(2))


@pytest.mark.gpu
def test_cuda_tensors_use_triton(clean_env):
    clean_env.delenv("TRITON_INTERPRET")
    cuda = torch.zeros(2, device="cuda")
    assert kernels.use_triton(cuda)
    clean_env.setenv("ELSI_FAST_DISABLE_TRITON", "1")
    assert not kernels.use_triton(cuda)
