"""The draft-format table (elsi_fast/draft/formats): each format written from one fixed tiny draft
checked against what the writers wrote before they moved out of the model (config.json keys and
values in order, tensor names, dtypes and shapes, GGUF metadata and tensor types), the stored
values against the draft's own tensors, option errors, and the model knowing no format."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import elsi_fast
from elsi_fast.draft import Eagle3Config, Eagle3Draft, read_draft, write_draft
from elsi_fast.draft.formats import FORMATS

TARGET = {"hidden_size": 8, "vocab_size": 24, "num_hidden_layers": 4, "architectures": ["LlamaForCausalLM"],
          "_name_or_path": "org/tiny-target"}
DRAFT_IDS = [0, 2, 3, 5, 8, 9, 13, 17, 20, 23]  # target ids of the draft vocabulary


def fixed_values(n: int, salt: int) -> torch.Tensor:
    """Multiples of 1/16 in [-11/16, 11/16]: exact in bfloat16, the same on every machine."""
    return ((torch.arange(n) * 7 + salt) % 23 - 11).to(torch.float32) / 16


def fixed_draft() -> Eagle3Draft:
    """m=2 (ids 1, 3 of a 4-block target), GQA, a 10-token draft vocabulary, norm_before_residual, bf16."""
    config = Eagle3Config(hidden_size=8, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1,
                          vocab_size=24, draft_vocab_size=10, rms_norm_eps=1e-5, rope_theta=10000.0,
                          max_position_embeddings=64, aux_layer_ids=(1, 3), norm_before_residual=True)
    draft = Eagle3Draft(config, fixed_values(24 * 8, 5).reshape(24, 8))
    with torch.no_grad():
        for salt, param in enumerate(draft.parameters()):
            param.copy_(fixed_values(param.numel(), salt).reshape(param.shape))
    draft.set_draft_vocab(torch.tensor(DRAFT_IDS))
    return draft.to(torch.bfloat16)


LAYER_FIELDS = {
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 12, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-05, "vocab_size": 24, "rope_theta": 10000.0,
    "rope_scaling": None, "max_position_embeddings": 64,
}
EAGLE3_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **LAYER_FIELDS,
    "draft_vocab_size": 10, "target_hidden_size": 8, "num_aux_hidden_states": 2, "norm_before_residual": True,
    "eagle_aux_hidden_state_layer_ids": [1, 3],
    "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 2]},
    "torch_dtype": "bfloat16",
}
SPECULATORS_CONFIG = {
    "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
    "transformer_layer_config": {"model_type": "llama", **LAYER_FIELDS, "num_aux_hidden_states": 2},
    "draft_vocab_size": 10, "target_hidden_size": 8, "eagle_aux_hidden_state_layer_ids": [1, 3],
    "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
    "embed_requires_grad": False,
    "speculators_config": {
        "algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]},
    },
    "dtype": "bfloat16",
}
LAYER_TENSORS = {  # name after the layer prefix -> (dtype, shape)
    "hidden_norm.weight": ("BF16", (8,)), "input_layernorm.weight": ("BF16", (8,)),
    "mlp.down_proj.weight": ("BF16", (8, 12)), "mlp.gate_proj.weight": ("BF16", (12, 8)),
    "mlp.up_proj.weight": ("BF16", (12, 8)), "post_attention_layernorm.weight": ("BF16", (8,)),
    "self_attn.k_proj.weight": ("BF16", (4, 16)), "self_attn.o_proj.weight": ("BF16", (8, 8)),
    "self_attn.q_proj.weight": ("BF16", (8, 16)), "self_attn.v_proj.weight": ("BF16", (4, 16)),
}
HEAD_TENSORS = {"d2t": ("I64", (10,)), "fc.weight": ("BF16", (8, 16)), "lm_head.weight": ("BF16", (10, 8)),
                "norm.weight": ("BF16", (8,)), "t2d": ("BOOL", (24,))}
EAGLE3_TENSORS = {**HEAD_TENSORS, **{f"midlayer.{k}": v for k, v in LAYER_TENSORS.items()}}
SPECULATORS_TENSORS = {**HEAD_TENSORS, **{f"layers.0.{k}": v for k, v in LAYER_TENSORS.items()},
                       "embed_tokens.weight": ("BF16", (24, 8))}
GGUF_FIELDS = {  # in the order written; the tokenizer keys are the target's
    "GGUF.version": 3, "GGUF.tensor_count": 14, "GGUF.kv_count": 23, "general.architecture": "eagle3",
    "eagle3.target_layers": [1, 3, 3], "eagle3.target_hidden_size": 8, "eagle3.norm_before_residual": True,
    "eagle3.norm_before_fc": False, "general.type": "model", "general.name": "EAGLE3 draft for target",
    "eagle3.block_count": 1, "eagle3.context_length": 64, "eagle3.embedding_length": 8,
    "eagle3.feed_forward_length": 12, "eagle3.attention.head_count": 2, "eagle3.attention.head_count_kv": 1,
    "eagle3.rope.freq_base": 10000.0, "eagle3.attention.layer_norm_rms_epsilon": float(torch.tensor(1e-5)),
    "eagle3.attention.key_length": 4, "eagle3.attention.value_length": 4, "general.file_type": 32,
    "eagle3.vocab_size": 24, "eagle3.rope.dimension_count": 4, "general.quantization_version": 2,
    "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [f"t{i}" for i in range(24)],
}
GGUF_TENSORS = {  # in the order written; GGUF lists dimensions innermost first
    "fc.weight": ("BF16", (24, 8)), "blk.0.attn_norm.weight": ("F32", (8,)),
    "blk.0.attn_norm_2.weight": ("F32", (8,)), "blk.0.attn_q.weight": ("BF16", (16, 8)),
    "blk.0.attn_k.weight": ("BF16", (16, 4)), "blk.0.attn_v.weight": ("BF16", (16, 4)),
    "blk.0.attn_output.weight": ("BF16", (8, 8)), "blk.0.ffn_norm.weight": ("F32", (8,)),
    "blk.0.ffn_gate.weight": ("BF16", (8, 12)), "blk.0.ffn_up.weight": ("BF16", (8, 12)),
    "blk.0.ffn_down.weight": ("BF16", (12, 8)), "output_norm.weight": ("F32", (8,)),
    "output.weight": ("BF16", (8, 10)), "d2t": ("I64", (10,)),
}


def read_folder(path: Path) -> tuple[list, dict, dict, dict]:
    """(config.json items in file order, {name: (dtype, shape)}, {name: tensor}, safetensors metadata)."""
    config = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        table = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    return list(config.items()), table, tensors, metadata


def test_eagle3_folder_is_what_the_previous_writer_wrote(tmp_path):
    draft = fixed_draft()
    write_draft(draft, tmp_path, format="eagle3")
    config, table, tensors, metadata = read_folder(tmp_path)
    assert config == list(EAGLE3_CONFIG.items())
    assert table == EAGLE3_TENSORS and metadata == {"format": "pt"}
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensors[name], tensor), name
    assert (tmp_path / "config.json").read_text().endswith("}\n")


def test_speculators_folder_is_what_the_previous_writer_wrote(tmp_path):
    draft = fixed_draft()
    write_draft(draft, tmp_path, format="speculators", target_config=TARGET)
    config, table, tensors, metadata = read_folder(tmp_path)
    assert config == list(SPECULATORS_CONFIG.items())
    assert table == SPECULATORS_TENSORS and metadata == {"format": "pt"}
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensors[name.replace("midlayer.", "layers.0.")], tensor), name
    assert torch.equal(tensors["embed_tokens.weight"], draft.embed_tokens.weight.to(torch.bfloat16))


@pytest.mark.parametrize("format", ["eagle3", "speculators"])
def test_folders_read_back_exactly(tmp_path, format):
    draft = fixed_draft()
    write_draft(draft, tmp_path, format=format, target_config=TARGET)
    loaded = read_draft(tmp_path)  # the format is detected; speculators carries the embedding
    assert loaded.config == draft.config
    assert loaded.state_dict().keys() == draft.state_dict().keys()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert (loaded.embed_tokens is not None) == (format == "speculators")


def fake_target(path: Path) -> Path:
    """A GGUF with only the fields the GGUF writer reads from a target (4 blocks, width 8, 24 tokens)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 4)
    writer.add_uint32("llama.embedding_length", 8)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(24)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_file_is_what_the_previous_writer_wrote(tmp_path):
    gguf = pytest.importorskip("gguf")
    draft = fixed_draft()
    write_draft(draft, tmp_path / "draft.gguf", format="gguf", target=fake_target(tmp_path / "target.gguf"))
    reader = gguf.GGUFReader(tmp_path / "draft.gguf")
    assert [(k, f.contents()) for k, f in reader.fields.items()] == list(GGUF_FIELDS.items())
    assert {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors} == GGUF_TENSORS
    assert [t.name for t in reader.tensors] == list(GGUF_TENSORS)
    data = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    bf16 = lambda name: data[name].view(torch.bfloat16).reshape(GGUF_TENSORS[name][1][::-1])  # noqa: E731
    assert data["d2t"].tolist() == DRAFT_IDS  # absolute target ids
    fc = draft.fc.weight.detach()
    assert torch.equal(bf16("fc.weight"), torch.cat([fc, torch.zeros(8, 8, dtype=fc.dtype)], 1))  # h_3 repeated
    # rotate-half pairs (i, i + 2) of each 4-wide head become adjacent rows (2i, 2i + 1)
    q = draft.midlayer.self_attn.q_proj.weight.detach()
    assert torch.equal(bf16("blk.0.attn_q.weight"), q[[0, 2, 1, 3, 4, 6, 5, 7]])
    assert torch.equal(data["blk.0.attn_norm.weight"], draft.midlayer.input_layernorm.weight.detach().float())


def test_options_belong_to_their_format(tmp_path):
    draft = fixed_draft()
    assert {name: entry.options for name, entry in FORMATS.items()} == {
        "eagle3": ("target_config", "include_embedding"),
        "speculators": ("target_config", "include_embedding", "speculative_tokens"),
        "gguf": ("target",),
    }
    assert [name for name, entry in FORMATS.items() if entry.read is not None] == ["eagle3", "speculators"]
    with pytest.raises(ValueError, match=r"format must be one of \('eagle3', 'speculators', 'gguf'\), got 'onnx'"):
        write_draft(draft, tmp_path, format="onnx")
    with pytest.raises(ValueError, match=r"^target: only format 'gguf' takes it; format='eagle3' takes target_config"):
        write_draft(draft, tmp_path, target="t.gguf")
    with pytest.raises(ValueError, match=r"^speculative_tokens: only format 'speculators' takes it"):
        write_draft(draft, tmp_path, speculative_tokens=4)
    with pytest.raises(ValueError, match=r"^target_config: only formats 'eagle3', 'speculators' take it; "
                                         r"format='gguf' takes target$"):
        write_draft(draft, tmp_path / "d.gguf", format="gguf", target_config=TARGET)
    with pytest.raises(ValueError, match=r"^tokenizer: no format takes it"):
        write_draft(draft, tmp_path, tokenizer=None)
    assert not any(tmp_path.iterdir())


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at module level or inside functions (relative ones as written)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {"." * node.level + (node.module or "") + "." + alias.name for alias in node.names}
    return names


def test_the_model_knows_no_format():
    draft_dir = Path(elsi_fast.__file__).parent / "draft"
    for module in ("model.py", "config.py", "native.py", "quant.py"):
        assert not [name for name in imported_modules(draft_dir / module) if "formats" in name], module
    assert not any(hasattr(Eagle3Draft, name) for name in ("save_pretrained", "from_pretrained"))
