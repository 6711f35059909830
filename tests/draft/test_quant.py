"""Int8 per-output-channel weight quantization and the dequantized reference draft."""

from __future__ import annotations

import pytest
import torch

from elsi_fast.draft import Eagle3Config, Eagle3Draft
from elsi_fast.draft.quant import (
    ACT_BLOCK,
    ACT_LEVELS,
    QUANTIZED_LINEARS,
    dequantize_int8,
    dequantized_reference,
    fake_quantize_activation,
    quantize_int8,
)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(shape, dtype):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[0])[:, None]).to(dtype)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == shape and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    w64 = w.double()
    absmax = w64.abs().amax(dim=1)
    torch.testing.assert_close(scale.double(), absmax / 127, rtol=1e-6, atol=0)
    # each row's largest magnitude lands on +-127, and every element within half a quantization step
    # (plus the fp32 rounding of w / scale, ~1e-5 of a step)
    assert torch.equal(q.abs().amax(dim=1), torch.full((shape[0],), 127, dtype=torch.int8))
    err = (dequantize_int8(q, scale, torch.float64) - w64).abs()
    assert bool((err <= scale.double()[:, None] * (0.5 + 1e-4)).all())


def test_zero_row_gets_unit_scale():
    w = torch.zeros(3, 5)
    w[1] = torch.arange(5.0) - 2
    q, scale = quantize_int8(w)
    assert scale[0] == 1 and scale[2] == 1 and not q[0].any() and not q[2].any()
    assert q[1].tolist() == [-127, -64, 0, 64, 127]  # -1 / (2 / 127) = -63.5 rounds to even


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (torch.randn(4), ValueError, "matrix"),
        (torch.ones(2, 3, dtype=torch.int32), TypeError, "floating point"),
        (torch.tensor([[1.0, float("nan")]]), ValueError, "NaN"),
        ([[1.0]], TypeError, "Tensor"),
    ],
)
def test_quantize_rejects_bad_weights(bad, error, match):
    with pytest.raises(error, match=match):
        quantize_int8(bad)


def test_dequantize_checks_its_arguments():
    with pytest.raises(TypeError, match="int8"):
        dequantize_int8(torch.zeros(2, 2), torch.ones(2))
    with pytest.raises(ValueError, match="scale must have shape"):
        dequantize_int8(torch.zeros(2, 2, dtype=torch.int8), torch.ones(3))


def test_dequantized_reference_replaces_exactly_the_quantized_matrices():
    config = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                          vocab_size=40, draft_vocab_size=20, target_hidden_size=8, aux_layer_ids=(1, 2))
    draft = Eagle3Draft(config, torch.randn(40, 16))
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    ref = dequantized_reference(draft)
    for name, value in draft.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} of the original changed"
    quantized = {f"{name}.weight" for name in QUANTIZED_LINEARS}
    for name, value in ref.state_dict().items():
        if name in quantized:
            assert torch.equal(value, dequantize_int8(*quantize_int8(before[name])))
            assert not torch.equal(value, before[name])
        else:
            assert torch.equal(value, before[name]), f"{name} should be untouched"


def test_fake_quantize_activation_known_values():
    x = torch.tensor([1.0, -0.5, 0.25, 0.0], dtype=torch.float64)
    # -0.5 * 32767 = -16383.5 rounds to even; 0.25 * 32767 = 8191.75
    assert (fake_quantize_activation(x) * ACT_LEVELS).tolist() == [32767.0, -16384.0, 8192.0, 0.0]
    assert not fake_quantize_activation(torch.zeros(3)).any()


@pytest.mark.parametrize("n", [1, ACT_BLOCK - 1, ACT_BLOCK, 2 * ACT_BLOCK + 37])
def test_fake_quantize_activation_rounds_each_block_to_half_a_step(n):
    gen = torch.Generator().manual_seed(n)
    # blocks of very different magnitudes: each must get its own scale
    x = torch.randn(2, n, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, n, dtype=torch.float64)
    y = fake_quantize_activation(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    for start in range(0, n, ACT_BLOCK):
        block, out = x[:, start:start + ACT_BLOCK], y[:, start:start + ACT_BLOCK]
        step = block.abs().amax(dim=1, keepdim=True) / ACT_LEVELS
        assert bool(((out - block).abs() <= step * (0.5 + 1e-9)).all())
        # on the block's grid of integer multiples of the step
        assert bool(((out / step - torch.round(out / step)).abs() < 1e-6).all())


def test_fake_quantize_activation_rejects_bad_input():
    with pytest.raises(TypeError, match="floating point"):
        fake_quantize_activation(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one dimension"):
        fake_quantize_activation(torch.tensor(1.0))
    with pytest.raises(TypeError, match="Tensor"):
        fake_quantize_activation([1.0])


def test_dequantized_reference_quantizes_product_inputs():
    config = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                          vocab_size=40, draft_vocab_size=20, target_hidden_size=8, aux_layer_ids=(1, 2))
    ref = dequantized_reference(Eagle3Draft(config, torch.randn(40, 16)))
    x = torch.randn(3, 16) * torch.logspace(-2, 2, 16)
    lm_head = ref.get_submodule("lm_head")
    torch.testing.assert_close(lm_head(x), fake_quantize_activation(x) @ lm_head.weight.T, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(lm_head(x), x @ lm_head.weight.T, rtol=1e-7, atol=0)
