"""The fused native forward on SmolLM2's own Q4_1 GGUF file: logits against transformers' model of the
same file (dequantized by transformers' GGUF reader, fp32), aux hidden states in the layer-indexing
convention, a verify of k+1 tokens equal to k+1 one-token forwards bit for bit on every
instruction-set path, the KV cache's rollback and capacity, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elsi_fast._infra._extension import _C
from conftest import catalog_file  # tests/ is on sys.path
from elsi_fast.targets.native_forward import NativeForward

pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")
TARGET = "smollm2-135m-instruct"
# The native forward quantizes activations per 32 values to int8 (as llama.cpp does), transformers
# multiplies the dequantized weights in fp32: the stated tolerances of the comparison.
MIN_TOP1_AGREEMENT = 0.95
MAX_LOGIT_ERROR = 3.0
# Where the argmax differs, transformers' own top two logits are this close (a near tie).
MAX_TIE_GAP = 1.0


@pytest.fixture(scope="module")
def gguf_path():
    return catalog_file(TARGET)


@pytest.fixture(scope="module")
def native(gguf_path):
    return NativeForward(gguf_path, capacity=320, num_threads=2)


def prompt_ids(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_logits_match_transformers_over_greedy_positions(native, smollm2):
    model, tokenizer = smollm2
    prompt = prompt_ids(tokenizer)
    seq = prompt + native.greedy(prompt, 240)
    native.reset()
    ours = np.concatenate([native.forward(seq[s:min(s + 8, len(seq) - 1)])[0] for s in range(0, len(seq) - 1, 8)])
    with torch.no_grad():
        out = model(torch.tensor([seq[:-1]]), output_hidden_states=True)
    ref = out.logits[0].double().numpy()
    assert ours.shape == ref.shape == (len(seq) - 1, native.weights.vocab)
    top1 = ours.argmax(-1) == ref.argmax(-1)
    assert top1.mean() >= MIN_TOP1_AGREEMENT, top1.mean()
    assert np.abs(ours - ref).max() < MAX_LOGIT_ERROR
    for pos in np.flatnonzero(~top1):
        gap = ref[pos].max() - ref[pos, ours[pos].argmax()]
        assert gap < MAX_TIE_GAP, (pos, gap)
    # Hidden states: h_0 is the embedding row exactly; h_l = input of block l (transformers'
    # hidden_states[l] for l < N).
    native.reset()
    _, aux = native.forward(seq[:8], [], aux_layers=[0, 1, 15])
    for i, layer in enumerate([0, 1, 15]):
        hf = out.hidden_states[layer][0, :8].double().numpy()
        err = np.abs(aux[:, i] - hf).max()
        assert err <= 1e-3 * np.abs(hf).max() if layer == 0 else err < 0.02 * np.abs(hf).max(), (layer, err)


@pytest.mark.parametrize("cpu_isa", ["avx512", "avx2", "scalar"], indirect=True)
def test_verify_rows_equal_one_token_forwards(native, cpu_isa):
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 7018]
    draft = [504, 3458, 282, 4649, 314]
    native.reset()
    native.prefill(prompt)
    verify, verify_aux = native.forward(draft, aux_layers=[0, 12, 30])
    assert native.length == len(prompt) + 5
    native.rollback(len(prompt))
    for t, token in enumerate(draft):
        logits, aux = native.forward([token], aux_layers=[0, 12, 30])
        np.testing.assert_array_equal(logits[0], verify[t])
        np.testing.assert_array_equal(aux[0], verify_aux[t])
    # Only the rows asked for: the same values.
    native.rollback(len(prompt))
    last, _ = native.forward(draft, logit_rows=[4, 1])
    np.testing.assert_array_equal(last, verify[[4, 1]])


@pytest.mark.parametrize("cpu_isa", ["avx512", "avx2", "scalar"], indirect=True)
def test_greedy_forward_gives_numpys_argmax_of_the_logits(native, cpu_isa):
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 7018]
    draft = [504, 3458, 282, 4649, 314, 17, 28, 1000]
    native.reset()
    native.prefill(prompt)
    logits, aux = native.forward(draft, logit_rows=[7, 0, 3], aux_layers=[12])
    native.rollback(len(prompt))
    ids, greedy_aux = native.forward_greedy(draft, logit_rows=[7, 0, 3], aux_layers=[12])
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(greedy_aux, aux)
    assert native.length == len(prompt) + len(draft)


def test_rollback_then_new_tokens_equal_a_fresh_context(native):
    native.reset()
    native.prefill([1, 2, 3, 4, 5, 6])
    native.forward([7, 8, 9])
    native.rollback(6)
    after, _ = native.forward([10, 11])
    native.reset()
    native.prefill([1, 2, 3, 4, 5, 6])
    fresh, _ = native.forward([10, 11])
    np.testing.assert_array_equal(after, fresh)


def test_bad_input_raises_one_clear_error(native, gguf_path):
    native.reset()
    native.prefill(list(range(1, 316)))
    with pytest.raises(ValueError, match="a context of 321 tokens is past the KV cache capacity of 320"):
        native.forward([1] * 6)
    assert native.length == 315  # nothing appended
    with pytest.raises(ValueError, match="id 49152 is outside the vocabulary of 49152"):
        native.forward([49152])
    with pytest.raises(ValueError, match="1..8 tokens, got 9"):
        native.forward([1] * 9)
    with pytest.raises(ValueError, match=r"aux_layers: ids must lie in \[0, 30\]"):
        native.forward([1], aux_layers=[31])
    with pytest.raises(ValueError, match=r"position: 400 is outside \[0, 315\]"):
        native.rollback(400)

