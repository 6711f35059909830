"""The fused native forward of a GGUF target: one C++ call per forward (docs/native-target.md).

`NativeForward(path)` maps a Llama-family GGUF file (`gguf_weights.read_llama_gguf`) and builds the
native model over its blocks: embedding lookup, RMSNorm, Q/K/V with RoPE, GQA attention over a KV
cache the native object owns, the SiLU-gated MLP, the final norm and the head, on the target
runtime's thread pool, with no Python between blocks. Each call appends 1..`MAX_ROWS` tokens to
the cache and returns the logits of the rows asked for and the hidden states h_l of the layers
asked for (h_0 the embeddings, h_l the input of block l; docs/ conventions of DESIGN's layer
indexing). `rollback(position)` forgets rejected draft tokens. Each token row is computed in an
order that does not depend on the other rows, so a verify of k+1 tokens gives exactly the logits
of k+1 one-token forwards. With `sequences=S` the cache holds S independent sequences and a
forward may carry rows of several (`forward(tokens, sequences=...)`): batched generation
(`decoding.native_batch`), each row's logits those of the same row forwarded alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .._infra._extension import _C, IMPORT_ERROR
from .gguf_weights import GgufTarget, read_gguf_target

MAX_ROWS = 8  # csrc/target_runtime.h, kLinearMaxRows
DEFAULT_CAPACITY = 4096


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """transformers' default RoPE inverse frequencies, in its float32 arithmetic: [head_dim / 2]."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    return (1.0 / (theta**exponents)).numpy().astype(np.float32)


class NativeForward:
    """A GGUF target's decoder on native kernels with its own KV cache of `capacity` positions."""

    def __init__(self, model: str | Path | GgufTarget, capacity: int = DEFAULT_CAPACITY, num_threads: int = 1,
                 sequences: int = 1) -> None:
        if _C is None:
            raise RuntimeError(f"the native forward needs the compiled extension: {IMPORT_ERROR}")
        if capacity < 1:
            raise ValueError(f"capacity: must be positive, got {capacity}")
        if sequences < 1:
            raise ValueError(f"sequences: must be positive, got {sequences}")
        if num_threads < 1:
            raise ValueError(f"num_threads: must be positive, got {num_threads}")
        self.weights = model if isinstance(model, GgufTarget) else read_gguf_target(model)
        w = self.weights
        self.capacity = capacity
        self.num_threads = num_threads
        self.sequences = sequences
        dims = dict(layers=w.layers, hidden=w.hidden, heads=w.heads, kv_heads=w.kv_heads, head_dim=w.head_dim,
                    ffn=w.ffn, vocab=w.vocab, capacity=capacity, eps=w.eps, sequences=sequences)
        layers = [{k: (v.as_native() if hasattr(v, "as_native") else v) for k, v in b.items()} for b in w.blocks]
        inv_freq, inv_freq_local = rope_inv_freq(w.head_dim, w.rope_theta), None
        if w.gemma3 is not None:
            g = w.gemma3
            # transformers: the embedding times float32(sqrt(hidden)); linear RoPE scaling divides
            # the global layers' frequencies
            dims.update(gemma3=True, embed_scale=float(np.float32(w.hidden**0.5)),
                        query_scale=g.query_pre_attn_scalar**-0.5, sliding_window=g.sliding_window)
            inv_freq = (inv_freq / np.float32(g.rope_scale)).astype(np.float32)
            inv_freq_local = rope_inv_freq(w.head_dim, g.local_rope_theta)
        self._native = _C.NativeTarget(dims, w.embed.as_native(), w.head.as_native(), w.final_norm, inv_freq, layers,
                                       inv_freq_local)

    @property
    def length(self) -> int:
        """Positions held in the KV cache (of sequence 0)."""
        return self._native.length(0)

    def length_of(self, sequence: int) -> int:
        """Positions held in the KV cache of `sequence`."""
        self._check_sequence(sequence)
        return self._native.length(sequence)

    def packed_weight_bytes(self) -> int:
        """Bytes of the products' weights packed by 8 rows in memory (csrc/quant_linear.h, pack_rows8):
        every matrix whose type and rows allow it, a tied head apart from the embedding its lookups read."""
        return self._native.packed_bytes()

    def kv_cache_bytes(self) -> int:
        w = self.weights
        return 2 * 4 * w.layers * w.kv_heads * self.capacity * w.head_dim * self.sequences

    def rollback(self, position: int, sequence: int = 0) -> None:
        """Keeps positions [0, position) of the KV cache of `sequence`."""
        held = self.length_of(sequence)
        if not 0 <= position <= held:
            raise ValueError(f"position: {position} is outside [0, {held}]")
        self._native.rollback(position, sequence)

    def reset(self) -> None:
        for sequence in range(self.sequences):
            self._native.rollback(0, sequence)

    def _check_sequence(self, sequence: int) -> None:
        if not 0 <= sequence < self.sequences:
            raise ValueError(f"sequence: {sequence} is outside [0, {self.sequences})")

    def forward(
        self, tokens: Sequence[int] | np.ndarray, logit_rows: Sequence[int] | None = None,
        aux_layers: Sequence[int] = (), sequences: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Appends tokens [n] (1..MAX_ROWS), token t to sequence sequences[t] (default: all to sequence
        0) after that sequence's held positions, and returns (logits [len(logit_rows), vocab] fp32
        for the rows asked for (default: every row), aux [n, len(aux_layers), hidden] fp32)."""
        return self._forward(tokens, logit_rows, aux_layers, sequences, greedy=False)

    def forward_greedy(
        self, tokens: Sequence[int] | np.ndarray, logit_rows: Sequence[int] | None = None,
        aux_layers: Sequence[int] = (), sequences: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """`forward`, returning each asked row's greedy token instead of its logits: (ids
        [len(logit_rows)] int64, what numpy.argmax gives on `forward`'s logits; aux). The logits never
        leave C++ (csrc/argmax_cpu.cpp)."""
        return self._forward(tokens, logit_rows, aux_layers, sequences, greedy=True)

    def _forward(self, tokens: Sequence[int] | np.ndarray, logit_rows: Sequence[int] | None,
                 aux_layers: Sequence[int], sequences: Sequence[int] | None,
                 greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64).reshape(-1)
        n = tokens.shape[0]
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"tokens: a forward takes 1..{MAX_ROWS} tokens, got {n}")
        seqs = np.zeros(n, dtype=np.int64) if sequences is None else \
            np.ascontiguousarray(sequences, dtype=np.int64).reshape(-1)
        if seqs.shape[0] != n:
            raise ValueError(f"sequences: expected one sequence per token ({n}), got {seqs.shape[0]}")
        for sequence, count in zip(*np.unique(seqs, return_counts=True)):
            self._check_sequence(int(sequence))
            context = self._native.length(int(sequence)) + int(count)
            if context > self.capacity:
                raise ValueError(f"tokens: a context of {context} tokens is past the KV cache capacity of "
                                 f"{self.capacity}")
        bad = tokens[(tokens < 0) | (tokens >= self.weights.vocab)]
        if bad.size:
            raise ValueError(f"tokens: id {int(bad[0])} is outside the vocabulary of {self.weights.vocab}")
        rows = np.arange(n, dtype=np.int64) if logit_rows is None else np.asarray(logit_rows, dtype=np.int64)
        layers = np.asarray(aux_layers, dtype=np.int64)
        if layers.size and (layers.min() < 0 or layers.max() > self.weights.layers):
            raise ValueError(f"aux_layers: ids must lie in [0, {self.weights.layers}], got {list(aux_layers)}")
        return self._native.forward(tokens, seqs, rows, layers, self.num_threads, greedy)

    def prefill(self, tokens: Sequence[int] | np.ndarray, sequence: int = 0) -> np.ndarray:
        """Appends any number of tokens to `sequence` in forwards of MAX_ROWS; returns the last token's
        logits [vocab]."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("tokens: the prompt is empty")
        logits = None
        for start in range(0, tokens.size, MAX_ROWS):
            chunk = tokens[start:start + MAX_ROWS]
            last = start + chunk.size == tokens.size
            logits, _ = self.forward(chunk, [chunk.size - 1] if last else [], sequences=[sequence] * chunk.size)
        return logits[0]

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int] = ()) -> list[int]:
        """Greedy decoding from an empty cache: the new token ids (stopping after a `stop` id)."""
        self.reset()
        token = int(np.argmax(self.prefill(prompt)))
        out = [token]
        while len(out) < max_new_tokens and token not in stop:
            ids, _ = self.forward_greedy([token])
            token = int(ids[0])
            out.append(token)
        return out
