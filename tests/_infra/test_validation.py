"""elsi_fast._infra._validation: the shared input checks other modules build on."""

from __future__ import annotations

import pytest
import torch

from elsi_fast._infra._validation import check_alpha, check_layer_list, check_mask, check_positive_int, check_tensor


def test_check_tensor_accepts_valid_input_and_returns_it():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert check_tensor("t", t, ndim=(2, 3)) is t
    assert check_tensor("t", t, min_ndim=1) is t
    ints = torch.arange(3)
    assert check_tensor("ids", ints, ndim=1, floating=False) is ints
    nan = torch.tensor([float("nan")])
    assert check_tensor("t", nan, finite=False) is nan


@pytest.mark.parametrize(
    "kwargs,value,error,message",
    [
        ({"ndim": 2}, torch.zeros(3), ValueError, r"t must be 2-D, got shape \(3,\)"),
        ({"ndim": (2, 3)}, torch.zeros(1, 1, 1, 1), ValueError, "t must be 2-D or 3-D"),
        ({"min_ndim": 2}, torch.zeros(3), ValueError, "t must have at least 2 dims"),
        ({}, torch.zeros(3, dtype=torch.int8), TypeError, "t must have dtype float16, bfloat16, float32 or float64"),
        ({}, torch.zeros(3, dtype=torch.complex64), TypeError, "t must have dtype"),
        ({}, torch.tensor([1.0, float("inf")]), ValueError, "t contains NaN or Inf"),
        ({}, [1.0, 2.0], TypeError, "t must be a torch.Tensor, got list"),
    ],
)
def test_check_tensor_rejects(kwargs, value, error, message):
    with pytest.raises(error, match=message):
        check_tensor("t", value, **kwargs)


def test_finite_check_is_exact_when_a_finite_sum_overflows():
    huge = torch.full((4,), 3e38, dtype=torch.float32)  # fp32 sum overflows, entries are finite
    assert check_tensor("t", huge) is huge
    huge[2] = float("nan")
    with pytest.raises(ValueError, match="t contains NaN or Inf"):
        check_tensor("t", huge)


def test_check_layer_list_forms():
    stacked = torch.zeros(3, 5, 2)
    layers, n = check_layer_list("h", stacked, num_layers=3, dim=2)
    assert n == 5 and len(layers) == 3 and all(x.shape == (5, 2) for x in layers)
    layers, n = check_layer_list("h", [torch.zeros(5, 2), torch.zeros(5, 7)])
    assert n == 5 and [x.shape[1] for x in layers] == [2, 7]
    with pytest.raises(ValueError, match=r"h\[1\] has feature dim 7, expected dim=2"):
        check_layer_list("h", [torch.zeros(5, 2), torch.zeros(5, 7)], dim=2)


def test_check_mask():
    mask = torch.tensor([True, False, True])
    assert torch.equal(check_mask("m", mask, 3, torch.device("cpu")), mask)
    assert check_mask("m", None, 3, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="m is all False"):
        check_mask("m", torch.zeros(3, dtype=torch.bool), 3, torch.device("cpu"))


def test_scalar_checks():
    assert check_positive_int("k", 4) == 4
    assert check_alpha(2) == 2.0 and check_alpha(float("inf")) == float("inf")
    with pytest.raises(TypeError, match="k must be an int"):
        check_positive_int("k", True)
    with pytest.raises(TypeError, match="alpha must be a number"):
        check_alpha("2")
