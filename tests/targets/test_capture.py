"""Capture of h_0..h_N on tiny random models of several architectures (input-to-layer convention)."""

import pytest
import torch
from torch import nn

from elsi_fast.targets.capture import capture_hidden_states, decoder_layers
from tiny_models import TINY_MODELS, VOCAB, _final_norm, tiny_model


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_states_match_output_hidden_states(arch):
    model = tiny_model(arch)
    blocks = decoder_layers(model)
    n = len(blocks)
    assert n == 4
    ids = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad(), capture_hidden_states(model) as cap:
        out = model(ids, output_hidden_states=True)
    assert sorted(cap.states) == list(range(n + 1))
    for l in range(n):  # HF hidden_states[l] is the input of block l for l < N
        torch.testing.assert_close(cap.states[l], out.hidden_states[l], rtol=0, atol=0)
    # HF's last entry is after the final norm; h_N is the last block's raw output
    assert not torch.allclose(cap.states[n], out.hidden_states[n])
    torch.testing.assert_close(_final_norm(model)(cap.states[n]), out.hidden_states[n], rtol=1e-5, atol=1e-5)


def test_h_n_is_the_last_block_output_from_an_independent_hook():
    model = tiny_model("llama")
    seen = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, o: seen.update(h=o[0] if isinstance(o, tuple) else o))
    ids = torch.randint(3, VOCAB, (1, 5))
    with torch.no_grad(), capture_hidden_states(model, layers=[4]) as cap:
        model(ids)
    handle.remove()
    assert list(cap.states) == [4]
    torch.testing.assert_close(cap.states[4], seen["h"], rtol=0, atol=0)


class _TupleBlock(nn.Module):
    """A block in the transformers 4.x style: returns (hidden, extra)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, hidden_states, attention_mask=None):
        return (hidden_states + self.linear(hidden_states), None)


class _TupleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_TupleBlock() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(hidden_states=x)[0]  # keyword call: the pre-hook must read kwargs
        return x


def test_tuple_returning_blocks_and_keyword_inputs():
    torch.manual_seed(0)
    model = _TupleModel()
    x = torch.randn(2, 4, 6)
    seen = []
    with torch.no_grad(), capture_hidden_states(model, callback=lambda l, h: seen.append((l, h))) as cap:
        y = model(x)
    assert cap.states == {}  # callback mode keeps nothing
    assert [l for l, _ in seen] == [0, 1, 2, 3]  # in production order
    torch.testing.assert_close(seen[0][1], x)
    torch.testing.assert_close(seen[-1][1], y)


def test_hooks_are_removed_on_exit_even_after_an_error():
    model = tiny_model("gpt2")
    blocks = decoder_layers(model)
    with pytest.raises(RuntimeError):
        with capture_hidden_states(model):
            raise RuntimeError("boom")
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in blocks)


def test_unsupported_model_error_names_its_class():
    with pytest.raises(TypeError, match="Sequential"):
        decoder_layers(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    with pytest.raises(TypeError, match="model"):
        decoder_layers("not a model")


def test_layer_index_out_of_range():
    with pytest.raises(ValueError, match="layers"):
        with capture_hidden_states(tiny_model("llama"), layers=[5]):
            pass


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
@pytest.mark.parametrize("layers", [[0], [1, 3], [2], [4]])
def test_stop_ends_the_forward_at_the_deepest_layer(arch, layers):
    """stop=True: the same states as a whole forward, no block above the deepest wanted one runs,
    the rest of the `with` block is skipped and the hooks are gone afterwards."""
    model = tiny_model(arch)
    blocks = decoder_layers(model)
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad(), capture_hidden_states(model, layers=layers) as whole:
        model(ids)
    ran = []
    counters = [b.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, b in enumerate(blocks)]
    after = []
    with torch.no_grad(), capture_hidden_states(model, layers=layers, stop=True) as cap:
        model(ids)
        after.append("ran")
    for handle in counters:
        handle.remove()
    assert after == []
    assert ran == list(range(max(layers)))
    assert sorted(cap.states) == layers
    for l in layers:
        torch.testing.assert_close(cap.states[l], whole.states[l], rtol=0, atol=0)
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in blocks)
    model(ids)  # and the model runs whole again
