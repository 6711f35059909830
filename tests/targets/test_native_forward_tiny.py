"""The native forward of a tiny Llama written as a GGUF file here, against a float64 numpy Llama on the
same (dequantized) weights in transformers' layout: odd sizes, GQA, an untied Q4_1 head, Q4_0 / Q8_0
blocks, and the converter's Q/K row permutation that the forward's pairwise RoPE relies on. Also
the reader's refusals and the re-rounding of a file into another block type."""

from __future__ import annotations

import numpy as np
import pytest

from elsi_fast._infra._extension import _C
from elsi_fast.targets.gguf_requantize import requantize_gguf
from elsi_fast.targets.gguf_weights import read_gguf_target
from elsi_fast.targets.native_forward import NativeForward, rope_inv_freq
from tiny_gguf import (  # tests/ is on sys.path
    EPS, HEAD_DIM, HEADS, KV_HEADS, LAYERS, THETA, alone, forward_interleaved, permute_rows, unpermute_rows,
    write_tiny,
)

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")


def reference_forward(w: dict[str, np.ndarray], tokens: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """float64 Llama (transformers' formulas, rotate_half RoPE): logits [n, V] and h_0 .. h_N."""
    n = len(tokens)

    def rms(x, g):
        return g * x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)

    angles = np.arange(n)[:, None] * rope_inv_freq(HEAD_DIM, THETA).astype(np.float64)[None]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

    def rope(x):  # [n, heads, hd]
        half = HEAD_DIM // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos[:, None] + rotated * sin[:, None]

    h = w["token_embd.weight"][tokens]
    states = []
    for i in range(LAYERS):
        states.append(h.copy())
        x = rms(h, w[f"blk.{i}.attn_norm.weight"])
        q = rope((x @ w[f"blk.{i}.attn_q.weight"].T).reshape(n, HEADS, HEAD_DIM))
        k = rope((x @ w[f"blk.{i}.attn_k.weight"].T).reshape(n, KV_HEADS, HEAD_DIM))
        v = (x @ w[f"blk.{i}.attn_v.weight"].T).reshape(n, KV_HEADS, HEAD_DIM)
        k, v = np.repeat(k, HEADS // KV_HEADS, 1), np.repeat(v, HEADS // KV_HEADS, 1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM)
        scores = np.where(np.tril(np.ones((n, n), bool))[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + np.einsum("hts,shd->thd", p, v).reshape(n, -1) @ w[f"blk.{i}.attn_output.weight"].T
        x = rms(h, w[f"blk.{i}.ffn_norm.weight"])
        g, u = x @ w[f"blk.{i}.ffn_gate.weight"].T, x @ w[f"blk.{i}.ffn_up.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ w[f"blk.{i}.ffn_down.weight"].T
    states.append(h.copy())
    return rms(h, w["output_norm.weight"]) @ w["output.weight"].T, states


@pytest.mark.parametrize("cpu_isa", ["avx512", "avx2", "scalar"], indirect=True)
def test_tiny_llama_matches_float64(tmp_path, cpu_isa):
    dense = write_tiny(tmp_path / "tiny.gguf")
    model = NativeForward(tmp_path / "tiny.gguf", capacity=32, num_threads=2)
    assert model.weights.head.ggml_type == 3 and model.weights.head is not model.weights.embed
    tokens = [3, 17, 69, 0, 42, 8, 8, 23, 5, 61, 30]
    ref_logits, ref_states = reference_forward(dense, tokens)
    logits = np.concatenate([model.forward(tokens[:8], aux_layers=[0, 1, 2])[0], model.forward(tokens[8:])[0]])
    model.reset()
    _, aux = model.forward(tokens[:8], [], aux_layers=[0, 1, 2])
    # int8 inputs per 32 values: about 0.4% rounding per product
    scale = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() < 0.03 * scale, np.abs(logits - ref_logits).max() / scale
    np.testing.assert_array_equal(aux[:, 0], ref_states[0][:8].astype(np.float32))
    for layer in (1, 2):
        ref = ref_states[layer][:8]
        assert np.abs(aux[:, layer] - ref).max() < 0.03 * np.abs(ref).max()


def test_without_the_row_permutation_the_logits_are_wrong(tmp_path):
    """The reference is sensitive to the RoPE layout: reading the permuted rows as transformers' own
    (rotate_half on the GGUF layout) gives clearly different logits."""
    dense = write_tiny(tmp_path / "tiny.gguf")
    wrong = dict(dense)
    for i in range(LAYERS):
        wrong[f"blk.{i}.attn_q.weight"] = permute_rows(dense[f"blk.{i}.attn_q.weight"], HEADS)
        wrong[f"blk.{i}.attn_k.weight"] = permute_rows(dense[f"blk.{i}.attn_k.weight"], KV_HEADS)
    tokens = [3, 17, 69, 0, 42, 8, 8, 23]
    model = NativeForward(tmp_path / "tiny.gguf", capacity=16)
    ours = model.forward(tokens)[0]
    right, wrong_logits = reference_forward(dense, tokens)[0], reference_forward(wrong, tokens)[0]
    assert np.abs(ours - wrong_logits).max() > 5 * np.abs(ours - right).max()


def test_reader_refuses_other_types_and_architectures(tmp_path):
    write_tiny(tmp_path / "f16.gguf", q_type="F16")
    reads = "Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K"
    with pytest.raises(ValueError, match=f"blk.0.attn_q.weight of .* is F16; the native forward reads {reads}$"):
        read_gguf_target(tmp_path / "f16.gguf")
    write_tiny(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="is a 'qwen2' model; the native forward supports llama, gemma3$"):
        read_gguf_target(tmp_path / "qwen.gguf")


def test_requantized_file_holds_the_rounded_weights(tmp_path):
    dense = write_tiny(tmp_path / "tiny.gguf")
    out = requantize_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny-q8.gguf", "Q8_0")
    model = read_gguf_target(out)
    q = model.blocks[0]["attn_q"]
    assert q.ggml_type == 8 and model.head.ggml_type == 8 and model.eps == pytest.approx(EPS)
    back = unpermute_rows(gguf.quants.dequantize(q.blocks, gguf.GGMLQuantizationType.Q8_0).astype(np.float64), HEADS)
    # Q8_0 of the Q8_0 weights: each value within half a step (max|w| / 254 per block) of the old one
    old = dense["blk.0.attn_q.weight"]
    step = np.abs(old).reshape(old.shape[0], -1, 32).max(-1, keepdims=True) / 127
    assert np.all(np.abs(back - old).reshape(old.shape[0], -1, 32) <= step * 0.51 + 1e-7)
    np.testing.assert_array_equal(model.final_norm, dense["output_norm.weight"].astype(np.float32))


def test_rows_of_several_sequences_equal_each_sequence_alone(tmp_path):
    """Batched generation: rows of three sequences in one forward each get the logits of their own
    sequence forwarded alone, one token at a time, whatever else shares the forward."""
    write_tiny(tmp_path / "tiny.gguf", q_type="Q4_1")
    streams = [[3, 17, 69, 0, 42, 8], [5, 61, 30, 8, 2, 9, 11], [23, 23, 7]]
    schedule = [[0, 1, 1, 2], [0, 0, 0], [1, 2, 2], [0, 1, 1, 1], [0, 1]]
    one = NativeForward(tmp_path / "tiny.gguf", capacity=8)
    model = NativeForward(tmp_path / "tiny.gguf", capacity=8, sequences=3)
    for got, stream in zip(forward_interleaved(model, streams, schedule), streams):
        np.testing.assert_array_equal(got, alone(one, stream))
    assert [model.length_of(s) for s in range(3)] == [6, 7, 3] and model.length == 6
    model.rollback(2, sequence=1)  # the others keep theirs
    assert [model.length_of(s) for s in range(3)] == [6, 2, 3]
    np.testing.assert_array_equal(model.forward([30], sequences=[1])[0][0], alone(one, streams[1][:3])[2])
    assert model.kv_cache_bytes() == 3 * one.kv_cache_bytes()
    with pytest.raises(ValueError, match=r"sequence: 3 is outside \[0, 3\)"):
        model.forward([1], sequences=[3])
    with pytest.raises(ValueError, match=r"sequences: expected one sequence per token \(2\), got 1"):
        model.forward([1, 2], sequences=[0])
    with pytest.raises(ValueError, match="past the KV cache capacity of 8"):
        model.forward([1, 2, 3, 4, 5, 6], sequences=[2] * 6)  # 3 held + 6 > 8, though sequence 1 has room
    assert model.length_of(2) == 3
    with pytest.raises(ValueError, match="sequences: must be positive"):
        NativeForward(tmp_path / "tiny.gguf", sequences=0)
