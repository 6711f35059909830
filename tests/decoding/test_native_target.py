"""Decoding with the target on the native GGUF forward (a tiny Llama GGUF): speculative decoding with a
random draft emits exactly the native greedy tokens, for every k and with an end-of-text id, and
streams them round by round; a draft
for another target and a context past the KV cache are refused with one clear error."""

from __future__ import annotations

import pytest
import torch

from elsi_fast._infra._extension import _C
from elsi_fast.decoding.native_target import (native_draft_decoder, native_greedy_generate,
                                              native_speculative_generate, target_embedding)
from elsi_fast.draft import Eagle3Config, Eagle3Draft
from elsi_fast.targets.native_forward import NativeForward
from tiny_gguf import HIDDEN, LAYERS, VOCAB, write_tiny  # tests/ is on sys.path

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")
PROMPT = torch.tensor([3, 17, 69, 0, 42, 8, 8, 23, 5, 61, 30, 2])  # longer than one 8-token forward


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny(path)
    return NativeForward(path, capacity=96, num_threads=2)


def random_draft(native, layers=(0, 2), vocab=VOCAB, target_hidden=HIDDEN) -> Eagle3Draft:
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=vocab, draft_vocab_size=32, target_hidden_size=target_hidden,
                          aux_layer_ids=tuple(layers))
    embed = target_embedding(native) if vocab == VOCAB else torch.randn(vocab, HIDDEN)
    draft = Eagle3Draft(config, embed).eval()
    draft.set_draft_vocab(torch.arange(32) * 2)
    return draft


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_equals_native_greedy(native, k):
    greedy = native_greedy_generate(native, PROMPT, 40)
    assert greedy.shape == (40,)
    for draft_backend in ("native", "torch"):
        result = native_speculative_generate(native, random_draft(native), PROMPT, 40, k, draft_backend=draft_backend)
        assert torch.equal(result.tokens, greedy), draft_backend
        assert result.target_backend.startswith("native GGUF forward (")


@pytest.mark.parametrize("draft_dtype", ["bf16", "int8"])
def test_one_decoder_serves_every_prompt_on_the_targets_threads(native, draft_dtype):
    # Built once: its team is the target's (no free-core probe per call), its KV cache the target's
    # capacity; a second prompt after a longer first one still equals greedy decoding.
    decoder = native_draft_decoder(native, random_draft(native), draft_dtype)
    assert decoder.threads == native.num_threads == 2 and decoder.max_len == native.capacity
    for prompt in (PROMPT, PROMPT[:5]):
        result = native_speculative_generate(native, decoder, prompt, 30, 3)
        assert torch.equal(result.tokens, native_greedy_generate(native, prompt, 30))
        assert result.draft_backend.startswith("native cpu (") and f", 2 threads) {draft_dtype}" in result.draft_backend
    # A draft passed as a module runs on the target's team too.
    result = native_speculative_generate(native, random_draft(native), PROMPT, 10, 2, draft_backend="native")
    assert ", 2 threads) fp32" in result.draft_backend


def test_on_token_streams_every_emitted_id_in_order(native):
    streamed, rounds_seen = [], []
    draft = random_draft(native)
    result = native_speculative_generate(native, draft, PROMPT, 25, 3,
                                         on_token=lambda t: (streamed.append(t), rounds_seen.append(native.length)))
    assert streamed == result.tokens.tolist()
    # The ids come round by round while decoding runs: the KV cache grows between the first and last.
    assert rounds_seen[0] < rounds_seen[-1]
    greedy_streamed = []
    greedy = native_greedy_generate(native, PROMPT, 25, on_token=greedy_streamed.append)
    assert greedy_streamed == greedy.tolist() == streamed


def test_stops_after_the_end_of_text_id(native):
    greedy = native_greedy_generate(native, PROMPT, 30)
    eos = int(greedy[5])
    first = greedy.tolist().index(eos)
    stopped = native_greedy_generate(native, PROMPT, 30, eos_token_id=eos)
    assert stopped.tolist() == greedy[: first + 1].tolist()
    spec = native_speculative_generate(native, random_draft(native), PROMPT, 30, 4, eos_token_id=eos)
    assert torch.equal(spec.tokens, stopped)


def test_bad_input_raises_one_clear_error(native, monkeypatch):
    with pytest.raises(ValueError, match="a draft for another target"):
        native_speculative_generate(native, random_draft(native, vocab=VOCAB + 1), PROMPT, 8, 2)
    with pytest.raises(ValueError, match="a draft for another target"):
        native_speculative_generate(native, random_draft(native, layers=(LAYERS + 1,)), PROMPT, 8, 2)
    with pytest.raises(ValueError, match="a draft for another target"):
        native_draft_decoder(native, random_draft(native, layers=(LAYERS + 1,)))
    with pytest.raises(ValueError, match="draft_dtype: expected one of fp32, bf16, int8, got 'fp16'"):
        native_draft_decoder(native, random_draft(native), "fp16")
    monkeypatch.setenv("ELSI_FAST_DISABLE_NATIVE", "1")
    with pytest.raises(ValueError, match="the draft cannot run natively: ELSI_FAST_DISABLE_NATIVE=1 is set"):
        native_draft_decoder(native, random_draft(native))
    monkeypatch.delenv("ELSI_FAST_DISABLE_NATIVE")
    with pytest.raises(ValueError, match=r"need 111 KV positions; the native target holds 96"):
        native_speculative_generate(native, random_draft(native), PROMPT, 95, 3)
