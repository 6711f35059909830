"""Load llama2.c checkpoints (e.g. karpathy's stories260K) as transformers Llama models.

The legacy llama2.c `.bin` is a header of 7 little-endian int32 (dim, hidden_dim, n_layers,
n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means an untied classifier)
followed by float32 arrays. llama2.c rotates interleaved pairs (x[2i], x[2i+1]) while Hugging Face
Llama rotates halves (x[i], x[i + head_dim/2]), so q/k projection rows are permuted per head.

`Llama2cTokenizer` reads llama2.c's `tok*.bin` (pieces and merge scores) and encodes like
llama2.c's BPE (best-scoring adjacent merge first, byte fallback), so no sentencepiece is needed.
"""

from __future__ import annotations

import heapq
import os
import struct
from typing import Sequence

import numpy as np
import torch

_HEADER = struct.Struct("<7i")
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
_BYTE_OFFSET = 3  # pieces 3..258 are the byte-fallback tokens <0x00>..<0xFF>


def _rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs to the rotate-half layout ([out, in])."""
    out_features, in_features = weight.shape
    head_dim = out_features // num_heads
    return (
        weight.view(num_heads, head_dim // 2, 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
    )


def _expected_size(header: tuple[int, ...]) -> int | None:
    """File size in bytes implied by a llama2.c header, or None when the header is implausible."""
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = header
    if min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len) <= 0 or dim % n_heads:
        return None
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    per_layer = 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden_dim * dim
    floats = abs(vocab_size) * dim * (1 if vocab_size > 0 else 2) + n_layers * per_layer + dim + seq_len * head_dim
    return _HEADER.size + 4 * floats


def is_llama2c_checkpoint(path: str) -> bool:
    """Whether `path` is a llama2.c legacy checkpoint: its header predicts its exact size."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        header = f.read(_HEADER.size)
    return len(header) == _HEADER.size and _expected_size(_HEADER.unpack(header)) == os.path.getsize(path)


def load_llama2c(path: str, dtype: torch.dtype = torch.float32):
    """Convert a llama2.c legacy `.bin` checkpoint into a `transformers.LlamaForCausalLM` (eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no such llama2.c checkpoint: {path}")
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < _HEADER.size:
        raise ValueError(f"path: {path} is too short to be a llama2.c checkpoint")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = _HEADER.unpack_from(raw)
    if _expected_size(_HEADER.unpack_from(raw)) is None:
        raise ValueError(f"path: {path} has an invalid llama2.c header {_HEADER.unpack_from(raw)}")
    tied = vocab_size > 0
    vocab_size = abs(vocab_size)
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    floats = np.frombuffer(raw, dtype="<f4", offset=_HEADER.size)
    cursor = 0

    def take(*shape: int) -> torch.Tensor:
        nonlocal cursor
        size = int(np.prod(shape))
        if cursor + size > floats.size:
            raise ValueError(f"path: {path} is truncated (needs more weights than the file holds)")
        out = torch.from_numpy(floats[cursor : cursor + size].copy()).view(*shape)
        cursor += size
        return out

    embed = take(vocab_size, dim)
    rms_att = take(n_layers, dim)
    wq = take(n_layers, dim, dim)
    wk = take(n_layers, kv_dim, dim)
    wv = take(n_layers, kv_dim, dim)
    wo = take(n_layers, dim, dim)
    rms_ffn = take(n_layers, dim)
    w1 = take(n_layers, hidden_dim, dim)
    w2 = take(n_layers, dim, hidden_dim)
    w3 = take(n_layers, hidden_dim, dim)
    rms_final = take(dim)
    cursor += seq_len * head_dim  # the two legacy RoPE tables (cos, sin), recomputed by transformers
    classifier = embed if tied else take(vocab_size, dim)

    config = LlamaConfig(
        hidden_size=dim,
        intermediate_size=hidden_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": rms_final, "lm_head.weight": classifier}
    for i in range(n_layers):
        prefix = f"model.layers.{i}."
        state.update(
            {
                prefix + "input_layernorm.weight": rms_att[i],
                prefix + "self_attn.q_proj.weight": _rotary_permutation(wq[i], n_heads),
                prefix + "self_attn.k_proj.weight": _rotary_permutation(wk[i], n_kv_heads),
                prefix + "self_attn.v_proj.weight": wv[i],
                prefix + "self_attn.o_proj.weight": wo[i],
                prefix + "post_attention_layernorm.weight": rms_ffn[i],
                prefix + "mlp.gate_proj.weight": w1[i],
                prefix + "mlp.down_proj.weight": w2[i],
                prefix + "mlp.up_proj.weight": w3[i],
            }
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"path: weight names do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    return model.to(dtype).eval()


class Llama2cTokenizer:
    """llama2.c BPE tokenizer from a `tok*.bin` file, with the small slice of the transformers
    tokenizer interface that elsi-fast uses (`__call__`, `encode`, `decode`, special ids)."""

    chat_template = None
    pad_token_id = None
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    unk_token_id = UNK_ID

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"path: no such llama2.c tokenizer: {path}")
        with open(path, "rb") as f:
            raw = f.read()
        offset = 4  # int32 max_token_length, not needed in Python
        pieces: list[bytes] = []
        scores: list[float] = []
        while offset < len(raw):
            if offset + 8 > len(raw):
                raise ValueError(f"path: {path} is truncated")
            score, length = struct.unpack_from("<fi", raw, offset)
            offset += 8
            pieces.append(raw[offset : offset + length])
            scores.append(score)
            offset += length
        if len(pieces) <= _BYTE_OFFSET + 255:
            raise ValueError(f"path: {path} has {len(pieces)} pieces, fewer than the 259 special+byte tokens")
        self.pieces = pieces
        self.scores = scores
        self._ids = {piece: i for i, piece in enumerate(pieces)}
        self.all_special_ids = [UNK_ID, BOS_ID, EOS_ID]

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (BOS first when `add_special_tokens`), as llama2.c's `encode`."""
        ids: list[int] = []
        if text:
            # sentencepiece's add_dummy_prefix: words after a space and the first word look alike.
            text = " " + text
        for char in text:
            piece = char.encode("utf-8")
            if piece in self._ids:
                ids.append(self._ids[piece])
            else:
                ids.extend(byte + _BYTE_OFFSET for byte in piece)
        ids = self._merge(ids)
        return [BOS_ID, *ids] if add_special_tokens else ids

    def _merge(self, ids: list[int]) -> list[int]:
        """Apply llama2.c's rule (merge the adjacent pair whose merged piece scores highest,
        leftmost on ties, until no pair merges) in O(n log n): a heap of candidate pairs over a
        linked list of tokens, where entries whose tokens changed since they were pushed are skipped."""
        size = len(ids)
        following = list(range(1, size)) + [-1]
        preceding = list(range(-1, size - 1))
        heap: list[tuple[float, int, int, int, int]] = []

        def push(left: int) -> None:
            right = following[left]
            if right != -1:
                merged = self._ids.get(self.pieces[ids[left]] + self.pieces[ids[right]])
                if merged is not None:
                    heapq.heappush(heap, (-self.scores[merged], left, ids[left], ids[right], merged))

        for position in range(size - 1):
            push(position)
        alive = [True] * size
        while heap:
            _, left, left_id, right_id, merged = heapq.heappop(heap)
            right = following[left] if alive[left] else -1
            if right == -1 or ids[left] != left_id or ids[right] != right_id:
                continue  # stale: one of the two tokens was merged away since
            ids[left] = merged
            alive[right] = False
            following[left] = following[right]
            if following[right] != -1:
                preceding[following[right]] = left
            if preceding[left] != -1:
                push(preceding[left])
            push(left)
        out, position = [], 0 if size else -1
        while position != -1:
            out.append(ids[position])
            position = following[position]
        return out

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = bytearray()
        for token in ids:
            token = int(token)
            if not 0 <= token < len(self.pieces):
                raise ValueError(f"ids: token {token} outside the vocabulary of {len(self.pieces)}")
            if token in self.all_special_ids:
                if not skip_special_tokens:
                    out += self.pieces[token]
                continue
            if _BYTE_OFFSET <= token < _BYTE_OFFSET + 256:
                out.append(token - _BYTE_OFFSET)
            else:
                out += self.pieces[token]
        # The dummy prefix space of the first word is not part of the text.
        return out.decode("utf-8", errors="replace").removeprefix(" ")


def load_llama2c_tokenizer(model_path: str) -> Llama2cTokenizer:
    """The tokenizer beside a llama2.c checkpoint: `tok*.bin` in the same folder (tokenizer.bin
    or tok<vocab>.bin)."""
    folder = os.path.dirname(os.path.abspath(model_path))
    with open(model_path, "rb") as f:
        header = f.read(_HEADER.size)
    vocab_size = abs(_HEADER.unpack(header)[5]) if len(header) == _HEADER.size else None
    for name in (f"tok{vocab_size}.bin", "tokenizer.bin"):
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate):
            return Llama2cTokenizer(candidate)
    raise FileNotFoundError(f"model: no llama2.c tokenizer (tok{vocab_size}.bin or tokenizer.bin) beside {model_path}")
