"""The native forward of a tiny Gemma 3 written as a GGUF file here, against transformers' own
Gemma3ForCausalLM on the same (dequantized) weights: a sliding window of 3 keys over 11 tokens,
per-layer sliding flags in the file, linear RoPE scaling on the global layer, Q5_0 / Q8_0 blocks,
norms stored as 1 + w. The reference is shown sensitive to the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elsi_fast._infra._extension import _C
from elsi_fast.targets.native_forward import NativeForward
from tiny_gguf import alone, forward_interleaved  # tests/ is on sys.path

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 3, 64, 2, 1, 32, 96, 50
SLIDING = [True, False, True]
WINDOW, EPS, THETA, LOCAL_THETA, ROPE_FACTOR = 3, 1e-6, 1e6, 1e4, 4.0
TOKENS = [2, 17, 49, 0, 42, 8, 8, 23, 5, 31, 30]


def write_tiny_gemma3(path) -> dict[str, np.ndarray]:
    """Writes the model; returns its weights as transformers holds them (norms minus 1), float32."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_freq_base(THETA)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(ROPE_FACTOR)
    writer.add_sliding_window(WINDOW)
    writer.add_sliding_window_pattern(SLIDING)
    hf: dict[str, np.ndarray] = {}

    def matrix(name: str, hf_name: str, rows: int, cols: int, kind: str) -> None:
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        blocks = gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
        hf[hf_name] = gguf.quants.dequantize(blocks, qtype).astype(np.float32)

    def norm(name: str, hf_name: str, size: int) -> None:
        g = (1 + 0.2 * rng.standard_normal(size)).astype(np.float32)
        writer.add_tensor(name, g)
        hf[hf_name] = g - np.float32(1)

    matrix("token_embd.weight", "model.embed_tokens.weight", VOCAB, HIDDEN, "Q8_0")
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        norm(b + "attn_norm.weight", p + "input_layernorm.weight", HIDDEN)
        matrix(b + "attn_q.weight", p + "self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN, "Q5_0")
        matrix(b + "attn_k.weight", p + "self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN, "Q5_0")
        matrix(b + "attn_v.weight", p + "self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN, "Q8_0")
        norm(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", HEAD_DIM)
        norm(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", HEAD_DIM)
        matrix(b + "attn_output.weight", p + "self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM, "Q8_0")
        norm(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", HIDDEN)
        norm(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight", HIDDEN)
        matrix(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", FFN, HIDDEN, "Q5_0")
        matrix(b + "ffn_up.weight", p + "mlp.up_proj.weight", FFN, HIDDEN, "Q5_0")
        matrix(b + "ffn_down.weight", p + "mlp.down_proj.weight", HIDDEN, FFN, "Q8_0")
        norm(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight", HIDDEN)
    norm("output_norm.weight", "model.norm.weight", HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def transformers_model(weights: dict[str, np.ndarray], window: int, rope_factor: float, local_theta: float):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=EPS,
        sliding_window=window, layer_types=["sliding_attention" if s else "full_attention" for s in SLIDING],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": rope_factor, "rope_theta": THETA},
                         "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        tie_word_embeddings=True, attn_implementation="eager",
    )
    model = Gemma3ForCausalLM(config).eval()
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def reference(weights, window: int = WINDOW, rope_factor: float = ROPE_FACTOR,
              local_theta: float = LOCAL_THETA) -> tuple[np.ndarray, tuple]:
    model = transformers_model(weights, window, rope_factor, local_theta)
    with torch.no_grad():
        out = model(torch.tensor([TOKENS]), output_hidden_states=True)
    return out.logits[0].double().numpy(), out.hidden_states


@pytest.mark.parametrize("cpu_isa", ["avx512", "avx2", "scalar"], indirect=True)
def test_tiny_gemma3_matches_transformers(tmp_path, cpu_isa):
    weights = write_tiny_gemma3(tmp_path / "tiny.gguf")
    model = NativeForward(tmp_path / "tiny.gguf", capacity=16, num_threads=2)
    assert model.weights.gemma3.sliding_layers == SLIDING and model.weights.gemma3.rope_scale == ROPE_FACTOR
    ref, hidden = reference(weights)
    ours = np.concatenate([model.forward(TOKENS[:8], aux_layers=[0, 2])[0], model.forward(TOKENS[8:])[0]])
    # int8 inputs per 32 values: about 0.4% rounding per product
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err < 0.03 * scale, err / scale
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    # The reference is sensitive to the window, the global layer's RoPE scaling and the local RoPE
    # base: each changed moves its logits far more than our error.
    for changed in ({"window": WINDOW + 1}, {"rope_factor": 1.0}, {"local_theta": 10.0}):
        assert np.abs(ours - reference(weights, **changed)[0]).max() > 5 * err, changed
    model.reset()
    _, aux = model.forward(TOKENS[:8], [], aux_layers=[0, 2])
    np.testing.assert_allclose(aux[:, 0], hidden[0][0, :8].numpy(), rtol=1e-6, atol=1e-6)
    assert np.abs(aux[:, 1] - hidden[2][0, :8].numpy()).max() < 0.03 * np.abs(hidden[2][0, :8].numpy()).max()


def test_verify_rows_equal_one_token_forwards_across_the_window(tmp_path):
    write_tiny_gemma3(tmp_path / "tiny.gguf")
    model = NativeForward(tmp_path / "tiny.gguf", capacity=16)
    model.prefill(TOKENS[:2])
    verify, _ = model.forward(TOKENS[2:9])
    model.rollback(2)
    for t, token in enumerate(TOKENS[2:9]):
        np.testing.assert_array_equal(model.forward([token])[0][0], verify[t])


def test_rows_of_several_sequences_equal_each_sequence_alone_across_the_window(tmp_path):
    write_tiny_gemma3(tmp_path / "tiny.gguf")
    streams = [TOKENS, TOKENS[::-1][:7], TOKENS[3:8]]
    schedule = [[0, 1, 2, 0], [0, 0, 1, 1, 1], [2, 2, 0, 0], [0, 0, 1, 2, 2, 1], [0, 0, 0, 1]]
    one = NativeForward(tmp_path / "tiny.gguf", capacity=16)
    model = NativeForward(tmp_path / "tiny.gguf", capacity=16, sequences=3)
    for got, stream in zip(forward_interleaved(model, streams, schedule), streams):
        np.testing.assert_array_equal(got, alone(one, stream))
