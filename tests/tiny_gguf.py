"""A tiny Llama written as a GGUF file (GQA, odd sizes, Q4_0 / Q4_1 / Q8_0 blocks, an untied Q4_1 head,
llama.cpp's converter's Q/K row permutation), shared by the native-forward tests."""

from __future__ import annotations

import numpy as np

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 96, 4, 2, 24, 160, 70
EPS, THETA = 1e-5, 10000.0


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' rows of a Q or K projection in the GGUF layout: row 2i of a head is row i, row
    2i + 1 is row i + head_dim / 2 (so neighbour pairs rotate as rotate_half's halves)."""
    return w.reshape(heads, 2, -1, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, -1, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def write_tiny(path, arch: str = "llama", q_type: str = "Q8_0") -> dict[str, np.ndarray]:
    """Writes the tiny model; returns its dequantized weights in transformers' layout (float64)."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_rope_freq_base(THETA)
    dense: dict[str, np.ndarray] = {}

    def matrix(name: str, rows: int, cols: int, kind: str, heads: int = 0) -> None:
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        stored = permute_rows(w, heads) if heads else w
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F16":
            writer.add_tensor(name, stored.astype(np.float16))
            back = stored.astype(np.float16).astype(np.float64)
        else:
            blocks = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            back = gguf.quants.dequantize(blocks, qtype).astype(np.float64)
        dense[name] = unpermute_rows(back, heads) if heads else back

    def norm(name: str) -> None:
        g = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        writer.add_tensor(name, g)
        dense[name] = g.astype(np.float64)

    matrix("token_embd.weight", VOCAB, HIDDEN, "Q8_0")
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN, q_type, heads=HEADS)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, "Q4_0", heads=KV_HEADS)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, "Q4_1")
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM, "Q8_0")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, "Q4_1")
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, "Q8_0")
    norm("output_norm.weight")
    matrix("output.weight", VOCAB, HIDDEN, "Q4_1")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dense


def forward_interleaved(model, streams: list[list[int]], schedule: list[list[int]]) -> list[np.ndarray]:
    """Each stream's logits [len, V] when forwards carry the rows `schedule` names (a sequence per
    row, its next token), several sequences per forward."""
    got, at = [[] for _ in streams], [0] * len(streams)
    for rows in schedule:
        tokens = []
        for s in rows:
            tokens.append(streams[s][at[s]])
            at[s] += 1
        logits, _ = model.forward(tokens, sequences=rows)
        for r, s in enumerate(rows):
            got[s].append(logits[r])
    assert at == [len(s) for s in streams]
    return [np.stack(g) for g in got]


def alone(model, stream: list[int]) -> np.ndarray:
    """`stream`'s logits [len, V] from one-token forwards on an emptied `model`."""
    model.reset()
    return np.concatenate([model.forward([t])[0] for t in stream])

