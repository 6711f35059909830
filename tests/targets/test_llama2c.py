"""stories260K (llama2.c) conversion: known greedy continuation, tokenizer, bad files."""

import os
import struct

import numpy as np
import pytest
import torch

from elsi_fast.targets.llama2c import (
    Llama2cTokenizer,
    _rotary_permutation,
    is_llama2c_checkpoint,
    load_llama2c,
    load_llama2c_tokenizer,
)

KNOWN = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, red ball."


@pytest.fixture(scope="module")
def stories(request):
    data = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "models", "stories260K")
    if not os.path.isdir(data):
        pytest.skip("shared data not found")
    path = os.path.join(data, "stories260K.bin")
    return load_llama2c(path), load_llama2c_tokenizer(path)


def test_known_greedy_continuation(stories):
    model, tokenizer = stories
    ids = tokenizer.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    assert tokenizer.decode(out[0]).startswith(KNOWN)
    assert model.config.num_hidden_layers == 5 and model.config.hidden_size == 64
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied classifier


def test_tokenizer_round_trip_and_byte_fallback(stories):
    _, tokenizer = stories
    text = "Tom and Sue went to the park. Ünïcode ☃!"
    ids = tokenizer.encode(text)
    assert ids[0] == 1 and tokenizer.decode(ids) == text
    assert any(3 <= i < 259 for i in ids)  # the snowman needs byte-fallback tokens
    assert tokenizer("hi", add_special_tokens=False)["input_ids"] == tokenizer.encode("hi")[1:]
    with pytest.raises(ValueError, match="ids"):
        tokenizer.decode([512])


def reference_encode(tokenizer, text):
    """llama2.c's encode loop as written there: rescan all pairs after every merge (O(n^2))."""
    ids = []
    for char in (" " + text if text else ""):  # llama2.c adds the dummy prefix to non-empty text
        piece = char.encode("utf-8")
        ids += [tokenizer._ids[piece]] if piece in tokenizer._ids else [b + 3 for b in piece]
    while True:
        best, at, best_id = float("-inf"), -1, -1
        for i in range(len(ids) - 1):
            merged = tokenizer._ids.get(tokenizer.pieces[ids[i]] + tokenizer.pieces[ids[i + 1]])
            if merged is not None and tokenizer.scores[merged] > best:
                best, at, best_id = tokenizer.scores[merged], i, merged
        if at < 0:
            return [1, *ids]
        ids[at : at + 2] = [best_id]


def test_fast_merge_equals_llama2c_loop(stories, shared_data):
    _, tokenizer = stories
    from elsi_fast.analysis.prompts import load_prompts

    prompts = load_prompts(os.path.join(shared_data, "prompts", "mt_bench_question.jsonl"))[::8]
    for text in [p.text[:300] for p in prompts] + ["aaaaaaa", "the the the", "", "x"]:
        assert tokenizer.encode(text) == reference_encode(tokenizer, text)


def test_rotary_permutation_maps_interleaved_pairs_to_halves():
    # one head of dim 4, rows r0..r3: llama2.c pairs (r0, r1), (r2, r3) -> HF halves (r0, r2 | r1, r3)
    weight = torch.arange(8.0).view(4, 2)
    permuted = _rotary_permutation(weight, num_heads=1)
    np.testing.assert_array_equal(permuted.numpy(), weight[[0, 2, 1, 3]].numpy())


def test_checkpoint_detection(shared_data, tmp_path):
    folder = os.path.join(shared_data, "models", "stories260K")
    assert is_llama2c_checkpoint(os.path.join(folder, "stories260K.bin"))
    assert not is_llama2c_checkpoint(os.path.join(folder, "tok512.bin"))  # a tokenizer, not weights
    zip_like = tmp_path / "pytorch_model.bin"
    zip_like.write_bytes(b"PK\x03\x04" + bytes(range(60)))
    assert not is_llama2c_checkpoint(str(zip_like))


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_llama2c(str(tmp_path / "missing.bin"))
    header_only = tmp_path / "short.bin"
    header_only.write_bytes(struct.pack("<7i", 8, 16, 1, 2, 2, 10, 4))
    with pytest.raises(ValueError, match="truncated"):
        load_llama2c(str(header_only))
    bad_header = tmp_path / "bad.bin"
    bad_header.write_bytes(struct.pack("<7i", 8, 16, 0, 2, 2, 10, 4))
    with pytest.raises(ValueError, match="invalid llama2.c header"):
        load_llama2c(str(bad_header))
    tokens = tmp_path / "tok.bin"
    tokens.write_bytes(struct.pack("<i", 3) + struct.pack("<fi", 0.0, 3) + b"abc")
    with pytest.raises(ValueError, match="pieces"):
        Llama2cTokenizer(str(tokens))
