"""A GGUF file's weights as the file holds them, for the native forward (docs/native-target.md).

`read_llama_gguf(path)` memory-maps the file with the `gguf` package and hands back its quantized
tensors as raw uint8 blocks, one row of blocks per output feature, without dequantizing anything:
the native kernels (csrc/quant_linear.h) read them in place. Only the norms (fp32 vectors) are
plain floats. Supported block types are Q8_0, Q4_0 and Q4_1 (and F32 / F16 for the embedding
lookup only); anything else, or an architecture other than Llama, is a ValueError naming it.

Q and K projection rows stay in the file's RoPE layout: llama.cpp's converter permutes each head's
rows so that rotating neighbour pairs (2i, 2i+1) equals transformers' rotate_half on the original
rows, and the native forward rotates pairs (attention scores are unchanged by the permutation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ggml type ids (csrc/quant_linear.h, GgmlType).
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8
QUANTIZED_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
LOOKUP_TYPES = {F32: "F32", F16: "F16", **QUANTIZED_TYPES}
SUPPORTED_ARCHITECTURES = ("llama",)
# Per-layer matrices of a Llama block, by their GGUF names.
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class GgufMatrix:
    """W [rows, cols] as GGUF blocks: `blocks` is uint8 [rows, cols / 32 * block bytes]."""

    name: str
    ggml_type: int
    blocks: np.ndarray
    rows: int
    cols: int

    def as_native(self) -> tuple[int, np.ndarray, int, int]:
        return (self.ggml_type, self.blocks, self.rows, self.cols)


@dataclass
class LlamaGguf:
    """The weights and shapes of a Llama-family GGUF file (arrays are views of its memory map)."""

    path: Path
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_theta: float
    context_length: int
    embed: GgufMatrix
    head: GgufMatrix
    final_norm: np.ndarray  # [hidden] fp32
    blocks: list[dict[str, object]] = field(default_factory=list)  # per layer: norms and matrices

    def weight_bytes(self) -> int:
        """Bytes of the weights the forward reads (the tied head counted once)."""
        mats = [m for b in self.blocks for m in b.values() if isinstance(m, GgufMatrix)]
        total = sum(m.blocks.nbytes for m in mats) + self.embed.blocks.nbytes
        return total + (0 if self.head is self.embed else self.head.blocks.nbytes)


def _field(reader, key: str, path: Path):
    f = reader.fields.get(key)
    if f is None:
        raise ValueError(f"model: {path} has no GGUF metadata key {key!r}")
    return f.contents()


def _matrix(tensor, path: Path, allowed: dict[int, str]) -> GgufMatrix:
    ggml_type = int(tensor.tensor_type)
    if ggml_type not in allowed:
        raise ValueError(
            f"model: tensor {tensor.name} of {path} is {tensor.tensor_type.name}; the native forward "
            f"reads {', '.join(allowed.values())}"
        )
    cols, rows = (int(s) for s in tensor.shape)  # GGUF lists the fastest-varying dimension first
    blocks = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
    return GgufMatrix(tensor.name, ggml_type, blocks, rows, cols)


def read_llama_gguf(path: str | Path) -> LlamaGguf:
    """Maps a Llama GGUF file; raises ValueError on another architecture or block type."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(path), "r")
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = " (Gemma 3 is not implemented in the native forward yet)" if arch == "gemma3" else ""
        raise ValueError(
            f"model: {path} is a {arch!r} model; the native forward supports {', '.join(SUPPORTED_ARCHITECTURES)}{hint}"
        )
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling.contents() not in ("none", ""):
        raise ValueError(f"model: {path} uses RoPE scaling {scaling.contents()!r}, which the native forward lacks")
    tensors = {t.name: t for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count", path))
    hidden = int(_field(reader, f"{arch}.embedding_length", path))
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    model = LlamaGguf(
        path=path,
        layers=int(_field(reader, f"{arch}.block_count", path)),
        hidden=hidden,
        heads=heads,
        kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", path)),
        head_dim=int(key_length.contents()) if key_length is not None else hidden // heads,
        ffn=int(_field(reader, f"{arch}.feed_forward_length", path)),
        vocab=0,
        eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", path)),
        context_length=int(_field(reader, f"{arch}.context_length", path)),
        embed=_matrix(tensors["token_embd.weight"], path, LOOKUP_TYPES),
        head=None,  # type: ignore[arg-type]
        final_norm=np.asarray(tensors["output_norm.weight"].data, dtype=np.float32),
    )
    model.vocab = model.embed.rows
    head = tensors.get("output.weight")
    model.head = _matrix(head, path, QUANTIZED_TYPES) if head is not None else model.embed
    if model.head is model.embed and model.embed.ggml_type not in QUANTIZED_TYPES:
        raise ValueError(f"model: the tied head of {path} is {LOOKUP_TYPES[model.embed.ggml_type]}, not quantized")
    for i in range(model.layers):
        block: dict[str, object] = {
            "attn_norm": np.asarray(tensors[f"blk.{i}.attn_norm.weight"].data, dtype=np.float32),
            "ffn_norm": np.asarray(tensors[f"blk.{i}.ffn_norm.weight"].data, dtype=np.float32),
        }
        for name in LAYER_MATRICES:
            block[name] = _matrix(tensors[f"blk.{i}.{name}.weight"], path, QUANTIZED_TYPES)
        model.blocks.append(block)
    return model
