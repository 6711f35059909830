"""Int8 weight quantization of the draft head, per output channel (one fp32 scale a row).

A decode step at batch 1 reads every weight once, so on a memory-bound device int8 weights make it
about 4x cheaper than fp32. The native int8 kernel multiplies them with the input vector quantized
to int16, one fp32 scale per ACT_BLOCK consecutive elements (integer dot products run close to
memory speed on the CPU; widening every int8 weight to fp32 made the step compute-bound). That rounding, at most 2^-16 of a
block's largest magnitude, is ~250x finer than the weights' own int8 rounding.
`dequantized_reference` is the torch reference of the native int8 path: the same draft with every
quantized matrix replaced by its dequantized round trip and its input passed through
`fake_quantize_activation`.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

# nn.Linear modules of Eagle3Draft whose weights the native int8 path quantizes (docs/method.md section 5).
QUANTIZED_LINEARS = (
    "fc",
    "midlayer.self_attn.q_proj",
    "midlayer.self_attn.k_proj",
    "midlayer.self_attn.v_proj",
    "midlayer.self_attn.o_proj",
    "midlayer.mlp.gate_proj",
    "midlayer.mlp.up_proj",
    "midlayer.mlp.down_proj",
    "lm_head",
)


# Activation quantization of the native int8 products (csrc/draft_decode_cpu.cpp, kActBlock).
ACT_BLOCK = 256
ACT_LEVELS = 32767


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 quantization of a `[out, in]` matrix.

    Returns (q int8 [out, in], scale fp32 [out]) with weight ~= q * scale[:, None]; each row's
    largest magnitude maps to +-127 (an all-zero row gets scale 1 and q = 0).
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(f"weight must be a non-empty [out, in] matrix, got shape {list(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight contains NaN or infinite values; int8 quantization needs finite weights")
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """`q [out, in]` int8 and `scale [out]` -> the `[out, in]` matrix they stand for, in `dtype`."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise TypeError(f"q must be a 2-D int8 tensor, got {q.dtype} with shape {list(q.shape)}")
    if scale.shape != (q.shape[0],):
        raise ValueError(f"scale must have shape [{q.shape[0]}], got {list(scale.shape)}")
    return (q.float() * scale.float()[:, None]).to(dtype)


def fake_quantize_activation(x: Tensor) -> Tensor:
    """`x [..., n]` as the native int8 products see it, in x's dtype.

    Along the last dim, each block of ACT_BLOCK elements (the last one possibly shorter) becomes
    q * amax / ACT_LEVELS with q = round_half_even(x * ACT_LEVELS / amax), amax the block's largest
    magnitude (an all-zero block stays zero).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the quantized one is the last)")
    n = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -n % ACT_BLOCK))
    blocks = padded.reshape(*x.shape[:-1], -1, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, ACT_LEVELS / amax, torch.zeros_like(amax))
    rounded = torch.round(blocks * inv) * (amax / ACT_LEVELS)
    return rounded.reshape(padded.shape)[..., :n]


def _fake_quantize_input(module: nn.Module, args: tuple) -> tuple:
    return (fake_quantize_activation(args[0]), *args[1:])


def dequantized_reference(draft: nn.Module) -> nn.Module:
    """A copy of `draft` whose QUANTIZED_LINEARS hold their int8 round trip (fp32) and quantize their
    input with `fake_quantize_activation`, as the native int8 kernel does.

    The native int8 decode must match this copy's torch forward up to fp32 rounding.
    """
    ref = copy.deepcopy(draft).float()
    with torch.no_grad():
        for name in QUANTIZED_LINEARS:
            linear = ref.get_submodule(name)
            linear.weight.copy_(dequantize_int8(*quantize_int8(linear.weight)))
            linear.register_forward_pre_hook(_fake_quantize_input)
    return ref
