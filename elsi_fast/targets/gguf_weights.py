"""A GGUF file's weights as the file holds them, for the native forward (docs/native-target.md).

`read_gguf_target(path)` memory-maps the file with the `gguf` package and hands back its quantized
tensors as raw uint8 blocks, one row of blocks per output feature, without dequantizing anything:
the native kernels (csrc/quant_linear.h) read them in place. Only the norms (fp32 vectors) are
plain floats. Supported block types are Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K (and F32 / F16 for
the embedding lookup only); architectures `llama` and `gemma3`. Anything else is a ValueError
naming it.

A Llama's Q and K projection rows stay in the file's RoPE layout: llama.cpp's converter permutes
each head's rows so that rotating neighbour pairs (2i, 2i+1) equals transformers' rotate_half on
the original rows, and the native forward rotates pairs (attention scores are unchanged by the
permutation). Gemma 3's rows are not permuted (the forward rotates transformers' halves), and its
converter stores every norm weight as 1 + w, the factor Gemma's RMSNorm multiplies by (transformers'
GGUF reader subtracts the 1 again), so the native forward uses the file's norms as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ggml type ids (csrc/quant_linear.h, GgmlType).
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 0, 1, 2, 3, 6, 8, 12, 14
QUANTIZED_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
LOOKUP_TYPES = {F32: "F32", F16: "F16", **QUANTIZED_TYPES}
SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# Per-layer matrices and norms of a block, by their GGUF names.
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = {"llama": ("attn_norm", "ffn_norm"),
               "gemma3": ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
                          "post_ffw_norm")}
# Gemma 3 settings the GGUF file does not hold: transformers' Gemma3TextConfig defaults, which its
# GGUF reader gives this architecture (and llama.cpp assumes): every 6th layer global, the others
# sliding with RoPE base 10,000, queries scaled by 256^-1/2.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0


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
class Gemma3Settings:
    """What a Gemma 3 block adds to a Llama one."""

    sliding_window: int  # keys a sliding layer's query sees, its own included
    sliding_layers: list[bool]  # per layer
    local_rope_theta: float
    rope_scale: float  # linear RoPE scaling of the global layers (1: none)
    query_pre_attn_scalar: float


@dataclass
class GgufTarget:
    """The weights and shapes of a Llama-family or Gemma 3 GGUF file (arrays are views of its memory map)."""

    path: Path
    architecture: str
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
    gemma3: Gemma3Settings | None = None

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


def _rope_scale(reader, arch: str, path: Path) -> float:
    """The factor of a linear RoPE scaling (1.0 without one); any other kind is a ValueError."""
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    kind = scaling.contents() if scaling is not None else "none"
    if kind in ("none", ""):
        return 1.0
    factor = reader.fields.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and arch == "gemma3" and factor is not None:
        return float(factor.contents())
    raise ValueError(f"model: {path} uses RoPE scaling {kind!r}, which the native forward lacks")


def _gemma3_settings(reader, layers: int, path: Path) -> Gemma3Settings:
    # Newer converters write the pattern: one flag per layer (true: sliding) or a period n (every
    # n-th layer global).
    pattern = reader.fields.get("gemma3.attention.sliding_window_pattern")
    pattern = pattern.contents() if pattern is not None else GEMMA3_SLIDING_PATTERN
    if isinstance(pattern, list):
        sliding = [bool(v) for v in pattern]
        if len(sliding) != layers:
            raise ValueError(f"model: {path} has {len(sliding)} sliding-window flags for {layers} layers")
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    return Gemma3Settings(
        sliding_window=int(_field(reader, "gemma3.attention.sliding_window", path)),
        sliding_layers=sliding,
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA,
        rope_scale=_rope_scale(reader, "gemma3", path),
        query_pre_attn_scalar=GEMMA3_QUERY_PRE_ATTN_SCALAR,
    )


def read_gguf_target(path: str | Path) -> GgufTarget:
    """Maps a Llama or Gemma 3 GGUF file; raises ValueError on another architecture or block type."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(str(path), "r")
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: {path} is a {arch!r} model; the native forward supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _rope_scale(reader, arch, path)
    tensors = {t.name: t for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count", path))
    hidden = int(_field(reader, f"{arch}.embedding_length", path))
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    model = GgufTarget(
        path=path,
        architecture=arch,
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
    if arch == "gemma3":
        model.gemma3 = _gemma3_settings(reader, model.layers, path)
    for i in range(model.layers):
        block: dict[str, object] = {
            name: np.asarray(tensors[f"blk.{i}.{name}.weight"].data, dtype=np.float32) for name in LAYER_NORMS[arch]
        }
        for name in LAYER_MATRICES:
            block[name] = _matrix(tensors[f"blk.{i}.{name}.weight"], path, QUANTIZED_TYPES)
        if model.gemma3 is not None:
            block["sliding"] = model.gemma3.sliding_layers[i]
        model.blocks.append(block)
    return model
