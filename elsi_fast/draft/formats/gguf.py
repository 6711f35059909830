"""The "gguf" format: an EAGLE3 draft as one GGUF file for llama.cpp (`--spec-type draft-eagle3 -md
draft.gguf`). Written only, never read back.

What llama.cpp (the copy vendored in llama-cpp-python 0.3.36: `src/models/eagle3.cpp`,
`common/speculative.cpp`) reads from a draft GGUF:

* architecture "eagle3"; `eagle3.target_layers`: exactly three input-to-layer ids (h_l = input
  of target block l, id N = the target graph's `t_h_nextn` state; `engines.layer_ids`); each
  id's state is copied into the fc input in turn, so an id may repeat; `eagle3.target_hidden_size`;
  `eagle3.norm_before_residual`, `eagle3.norm_before_fc` (optional, default false); the usual
  Llama hyperparameters under `eagle3.*`.
* tensors under llama.cpp's names: `fc.weight`, `blk.0.attn_norm` (input_layernorm),
  `blk.0.attn_norm_2` (hidden_norm), `blk.0.attn_{q,k,v,output}`, `blk.0.ffn_{norm,gate,up,down}`,
  `output_norm`, `output` (lm_head), `enc.output_norm` (the norm_before_fc norm), `rope_freqs`
  (Llama-3.1 RoPE scaling), and `d2t` as I64 *absolute* target ids (the checkpoint's offsets
  plus the draft id). q and k rows are reordered from rotate-half RoPE to llama.cpp's
  adjacent-pair RoPE (the "norm" RoPE type of Llama-family graphs, eagle3 included).
* the target's tokenizer: the draft is only accepted when its vocabulary matches the target's
  (type, BOS/EOS, token texts), so every `tokenizer.*` key is copied from the target's GGUF.
  The draft has no token embedding and uses the target's.

An m=1 or m=2 draft is written as its exact three-id equivalent: the last id repeated (m=1
[a] -> [a, a, a], m=2 [a, b] -> [a, b, b]) and fc widened with zero columns for the repeats,
so fc sees the same sum. The extra capture and the wider fc cost what m=3 costs; the layer
choice is kept.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from ...engines.layer_ids import (LLAMACPP_ARCHS_WITH_LAST_BLOCK_OUTPUT, LLAMACPP_ARCHS_WITH_LAYER_INPUTS,
                                  LLAMACPP_LAYERS, eagle3_default_layers, llamacpp_layer_ids)
from ..model import Eagle3Draft, rope_inv_freq

ARCH = "eagle3"
# Variants eagle3.cpp does not implement: it would compute the plain layer.
_UNSUPPORTED_VARIANTS = ("fc_norm", "norm_feedback", "final_norm", "qk_norm", "sliding_window")
_FILE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}  # general.file_type (llama_ftype)


def write(draft: Eagle3Draft, path: str | os.PathLike, *, target: str | os.PathLike | None = None) -> None:
    """Write `draft` as a llama.cpp EAGLE3 draft GGUF at `path` (one file), for the target GGUF file
    `target` (required: its tokenizer is copied, its layer count and vocabulary checked)."""
    import gguf

    if target is None:
        raise ValueError("target: format='gguf' needs target=<the target model's .gguf file> (llama.cpp takes the "
                         "draft's tokenizer and checks its layer ids against it)")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path: {path} is a directory; format='gguf' writes one file, e.g. {path / 'draft.gguf'}")
    info = _read_target(Path(target))
    config = draft.config
    ids = _check_draft(config, info)
    dtype = draft.fc.weight.dtype
    if dtype not in _FILE_TYPES and dtype != torch.float64:
        raise ValueError(f"draft: weights are {dtype}; convert the draft to float32, float16 or bfloat16")
    store = dtype if dtype in _FILE_TYPES else torch.float32

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_array(f"{ARCH}.target_layers", llamacpp_layer_ids(ids))
    writer.add_uint32(f"{ARCH}.target_hidden_size", config.target_hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", config.norm_before_residual)
    writer.add_bool(f"{ARCH}.norm_before_fc", config.norm_before_fc)
    writer.add_string("general.type", "model")
    writer.add_string("general.name", f"EAGLE3 draft for {info['name']}")
    writer.add_uint32(f"{ARCH}.block_count", 1)
    writer.add_uint32(f"{ARCH}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{ARCH}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{ARCH}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{ARCH}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{ARCH}.attention.head_count_kv", config.num_key_value_heads)
    writer.add_float32(f"{ARCH}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32(f"{ARCH}.attention.key_length", config.head_dim)
    writer.add_uint32(f"{ARCH}.attention.value_length", config.head_dim)
    writer.add_uint32("general.file_type", _FILE_TYPES[store])
    writer.add_uint32(f"{ARCH}.vocab_size", config.vocab_size)
    writer.add_uint32(f"{ARCH}.rope.dimension_count", config.head_dim)
    writer.add_uint32("general.quantization_version", gguf.GGML_QUANT_VERSION)
    for key, (value, vtype, sub_type) in info["tokenizer"].items():
        writer.add_key_value(key, value, vtype, sub_type)

    for name, tensor in _tensors(draft, len(ids)).items():
        if tensor.dtype == torch.int64:  # d2t: numpy int64 is written as I64
            writer.add_tensor(name, tensor.numpy())
        elif tensor.dim() == 1 or store == torch.float32:  # norms, rope factors: F32 as llama.cpp's converter
            writer.add_tensor(name, tensor.to(torch.float32).numpy())
        elif store == torch.float16:
            writer.add_tensor(name, tensor.to(torch.float16).numpy())
        else:  # numpy has no bfloat16: hand over the raw 16-bit words
            writer.add_tensor(name, tensor.to(torch.bfloat16).view(torch.int16).numpy(),
                              raw_shape=tensor.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _read_target(target: Path) -> dict:
    """Block count, hidden size, vocabulary size, name and `tokenizer.*` fields of a target GGUF."""
    import gguf

    if not target.is_file():
        raise ValueError(f"target: {target} is not a file; pass the target model's .gguf file")
    try:
        reader = gguf.GGUFReader(target)
    except Exception as err:  # the reader raises ValueError / struct errors on anything not GGUF
        raise ValueError(f"target: {target} is not a readable GGUF file ({err})") from err
    fields = reader.fields
    arch = _scalar(fields, "general.architecture")
    if arch == ARCH:
        raise ValueError(f"target: {target} is an EAGLE3 draft itself; pass the target model's .gguf file")
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = _scalar(fields, f"{arch}.vocab_size", None)
    if vocab is None and tokens is not None:
        vocab = len(tokens.data)
    return {
        "arch": arch,
        "name": _scalar(fields, "general.name", target.stem),
        "num_blocks": _scalar(fields, f"{arch}.block_count"),
        "hidden_size": _scalar(fields, f"{arch}.embedding_length"),
        "vocab_size": vocab,
        "tokenizer": {key: _raw_value(field) for key, field in fields.items() if key.startswith("tokenizer.")},
    }


_REQUIRED = object()


def _scalar(fields: dict, key: str, default=_REQUIRED):
    if key not in fields:
        if default is _REQUIRED:
            raise ValueError(f"target: the GGUF has no {key!r}; is it a llama.cpp model file?")
        return default
    return fields[key].contents()


def _raw_value(field) -> tuple:
    """(value, type, array item type) of a reader field, strings as raw bytes so they copy exactly."""
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return field.contents(), main, sub
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    return field.contents(), main, None


def _check_draft(config, info: dict) -> tuple[int, ...]:
    """The draft's input-to-layer ids, after checking that llama.cpp can serve the draft on this target."""
    n = info["num_blocks"]
    if info["arch"] not in LLAMACPP_ARCHS_WITH_LAYER_INPUTS:
        raise ValueError(f"target: llama.cpp (llama-cpp-python 0.3.36) cannot serve an EAGLE3 draft on a "
                         f"{info['arch']!r} target: its graph publishes no layer states (llama.cpp aborts); "
                         f"serve it with `elsi-fast generate --draft` or vLLM")
    variants = [name for name in _UNSUPPORTED_VARIANTS if name in config.variants]
    if variants:
        raise ValueError(f"draft: llama.cpp's eagle3 graph implements norm_before_residual and norm_before_fc only, "
                         f"not {variants}; it would compute a different draft")
    if config.vocab_size != info["vocab_size"]:
        raise ValueError(f"target: the draft's vocab_size={config.vocab_size} differs from the target's "
                         f"{info['vocab_size']}; llama.cpp refuses a draft whose vocabulary differs from the target's")
    if config.target_hidden_size != info["hidden_size"]:
        raise ValueError(f"target: the draft's target_hidden_size={config.target_hidden_size} differs from the "
                         f"target's hidden size {info['hidden_size']}")
    ids = config.aux_layer_ids if config.aux_layer_ids is not None else eagle3_default_layers(n)
    if len(ids) > LLAMACPP_LAYERS:
        raise ValueError(f"aux_layer_ids: llama.cpp feeds a draft exactly {LLAMACPP_LAYERS} target states, so only "
                         f"m <= 3 has an exact equivalent, got m={len(ids)} {list(ids)}")
    if config.norm_before_fc and len(ids) == 2:
        raise ValueError("aux_layer_ids: norm_before_fc with m=2 has no exact 3-id equivalent (the RMS over "
                         "[h_a, h_b, h_b] differs from the RMS over [h_a, h_b]); train m=1 or m=3")
    outside = [i for i in ids if i > n]
    if outside:
        raise ValueError(f"aux_layer_ids: {list(ids)} include {outside}, beyond the target's h_0..h_{n} "
                         f"(N={n} blocks)")
    if n in ids and info["arch"] not in LLAMACPP_ARCHS_WITH_LAST_BLOCK_OUTPUT:
        raise ValueError(f"aux_layer_ids: {list(ids)} include h_{n}, the last block's output, which llama.cpp "
                         f"(llama-cpp-python 0.3.36) does not deliver for a {info['arch']!r} target (its graph does "
                         f"not publish that state); choose ids in 0..{n - 1}")
    return tuple(ids)


def _tensors(draft: Eagle3Draft, m: int) -> dict[str, Tensor]:
    """llama.cpp's tensor names -> CPU tensors (torch layout [out, in]; GGUF lists dims reversed)."""
    config = draft.config
    layer = draft.midlayer
    attn = layer.self_attn
    d_t = config.target_hidden_size
    pad = LLAMACPP_LAYERS - m
    weight = lambda module: module.weight.detach().to("cpu")  # noqa: E731
    fc = weight(draft.fc)
    out = {
        # Zero columns for the repeated states: fc([h_a, .., h_a]) = fc_m([h_a, ..]).
        "fc.weight": torch.cat([fc, fc.new_zeros(fc.shape[0], pad * d_t)], dim=1),
        "blk.0.attn_norm.weight": weight(layer.input_layernorm),
        "blk.0.attn_norm_2.weight": weight(layer.hidden_norm),
        "blk.0.attn_q.weight": _pair_rope_rows(weight(attn.q_proj), config.num_attention_heads),
        "blk.0.attn_k.weight": _pair_rope_rows(weight(attn.k_proj), config.num_key_value_heads),
        "blk.0.attn_v.weight": weight(attn.v_proj),
        "blk.0.attn_output.weight": weight(attn.o_proj),
        "blk.0.ffn_norm.weight": weight(layer.post_attention_layernorm),
        "blk.0.ffn_gate.weight": weight(layer.mlp.gate_proj),
        "blk.0.ffn_up.weight": weight(layer.mlp.up_proj),
        "blk.0.ffn_down.weight": weight(layer.mlp.down_proj),
        "output_norm.weight": weight(draft.norm),
        "output.weight": weight(draft.lm_head),
    }
    if config.norm_before_fc:
        # m=1 only (checked): the RMS over [h_a, h_a, h_a] equals the RMS over h_a, and the weights of
        # the repeats meet zero fc columns.
        norm = weight(draft.input_norm)
        out["enc.output_norm.weight"] = torch.cat([norm, norm.new_ones(pad * d_t)])
    if config.rope_scaling is not None:
        # llama.cpp divides each base frequency by its factor: the factor is base / scaled.
        plain = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
        out["rope_freqs.weight"] = plain / rope_inv_freq(config)
    out["d2t"] = draft.d2t.detach().to("cpu", torch.int64) + torch.arange(config.draft_vocab_size)
    return out


def _pair_rope_rows(weight: Tensor, heads: int) -> Tensor:
    """Reorder each head's rows from rotate-half pairs (i, i + hd/2) to adjacent pairs (2i, 2i + 1)."""
    rows, cols = weight.shape
    head_dim = rows // heads
    return weight.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)
