"""GGUF drafts for llama.cpp: compared key by key and tensor by tensor with llama.cpp's own converter
(`convert_hf_to_gguf.py DRAFT --target-model-dir TARGET` from the llama-cpp-python 0.3.36 sdist) on a
tiny random Llama target; the 3-id equivalent of m=1 / m=2 drafts checked against the original
draft's logits; bad inputs refused."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from elsi_fast.draft import Eagle3Config, Eagle3Draft, write_draft
from elsi_fast.engines.layer_ids import LLAMACPP_ARCHS_WITH_LAYER_INPUTS, llamacpp_layer_ids

from .random_draft import randomize_draft_

gguf = pytest.importorskip("gguf")

N_BLOCKS, D = 4, 32
# Metadata llama.cpp only displays: the converter titles the draft's folder name and adds a
# parameter-count label; elsi-fast names the draft after its target.
COSMETIC_KEYS = {"general.name", "general.size_label", "GGUF.kv_count"}


def tiny_tokenizer():
    """A Llama-style byte-fallback BPE tokenizer (289 tokens) that llama.cpp's converter reads as
    its "llama" (SentencePiece) vocabulary type, built without any download."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[piece] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def llamacpp():
    """bench/integration/llamacpp.py: the sdist's converter (fetched once into ~/.cache/elsi-fast)."""
    from bench.integration import llamacpp

    try:
        llamacpp.source_dir()
        llamacpp.converter_deps()
    except RuntimeError as err:  # no registry access: nothing to compare against
        pytest.skip(f"llama.cpp's converter is not available: {err}")
    return llamacpp


@pytest.fixture(scope="module")
def target(tmp_path_factory, llamacpp):
    """A tiny random Llama target: its transformers folder and its GGUF made by llama.cpp's converter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("target")
    tok = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=D, intermediate_size=48, num_hidden_layers=N_BLOCKS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    llamacpp.convert_hf([[str(root / "hf"), "--outtype", "f32", "--outfile", str(root / "target.gguf")]])
    return {"hf": root / "hf", "gguf": root / "target.gguf", "vocab": len(tok)}


def make_draft(vocab: int, ids: tuple[int, ...], seed: int, dtype=torch.float32, **variants) -> Eagle3Draft:
    config = Eagle3Config(hidden_size=D, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=vocab, draft_vocab_size=100, target_hidden_size=D, rms_norm_eps=1e-5,
                          rope_theta=50000.0, aux_layer_ids=ids, **variants)
    return randomize_draft_(Eagle3Draft(config), torch.Generator().manual_seed(seed)).to(dtype)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
DRAFTS = {  # name -> (layer ids, seed, dtype, variants, converter --outtype)
    "m3": ((1, 2, 3), 1, torch.float32, {}, "f32"),
    "m2": ((1, 3), 2, torch.float32, {}, "f32"),
    "m1": ((2,), 3, torch.float32, {}, "f32"),
    "m1_variants": ((3,), 4, torch.float32, {"norm_before_fc": True, "norm_before_residual": True,
                                             "rope_scaling": LLAMA3_ROPE}, "f32"),
    "m3_bf16": ((0, 2, 3), 5, torch.bfloat16, {}, "bf16"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, target, llamacpp):
    """Each draft of DRAFTS written by elsi-fast (GGUF) and by llama.cpp's converter from its eagle3 folder."""
    root = tmp_path_factory.mktemp("drafts")
    out, jobs = {}, []
    for name, (ids, seed, dtype, variants, outtype) in DRAFTS.items():
        draft = make_draft(target["vocab"], ids, seed, dtype, **variants)
        write_draft(draft, root / name)
        write_draft(draft, root / f"{name}.gguf", format="gguf", target=target["gguf"])
        jobs.append([str(root / name), "--target-model-dir", str(target["hf"]), "--outtype", outtype,
                     "--outfile", str(root / f"{name}.ref.gguf")])
        out[name] = {"draft": draft, "ours": root / f"{name}.gguf", "ref": root / f"{name}.ref.gguf"}
    llamacpp.convert_hf(jobs)
    return out


def read_gguf(path) -> tuple[dict, dict]:
    """({key: (types, raw bytes of every part)}, {tensor name: (type, shape, data)})."""
    reader = gguf.GGUFReader(path)
    fields = {key: (tuple(f.types), [bytes(f.parts[i]) for i in f.data]) for key, f in reader.fields.items()}
    tensors = {t.name: (t.tensor_type, tuple(int(n) for n in t.shape), np.array(t.data)) for t in reader.tensors}
    return fields, tensors


def int_array(field) -> list[int]:
    return [int(np.frombuffer(b, dtype=np.int32)[0]) for b in field[1]]


def assert_same_fields(ours: dict, ref: dict, skip=frozenset()) -> None:
    """Same keys (cosmetic ones aside), value types and bytes."""
    assert set(ours) - COSMETIC_KEYS - skip == set(ref) - COSMETIC_KEYS - skip
    for key in set(ours) - COSMETIC_KEYS - skip:
        assert ours[key] == ref[key], key


def assert_same_tensors(ours: dict, ref: dict, skip=frozenset()) -> None:
    """Same names, GGML types, shapes and bytes."""
    assert set(ours) - skip == set(ref) - skip
    for name in set(ours) - skip:
        assert ours[name][:2] == ref[name][:2], name
        np.testing.assert_array_equal(ours[name][2], ref[name][2], err_msg=name)


@pytest.mark.parametrize("name", ["m3", "m3_bf16"])
def test_m3_draft_equals_llamacpp_converter_output(exported, name):
    """Every metadata key and every tensor (type, shape, bytes) as llama.cpp's converter writes them,
    q/k RoPE row order and absolute d2t ids included; only the cosmetic name keys differ."""
    (ours_kv, ours_t), (ref_kv, ref_t) = read_gguf(exported[name]["ours"]), read_gguf(exported[name]["ref"])
    assert_same_fields(ours_kv, ref_kv)
    assert_same_tensors(ours_t, ref_t)
    assert ours_kv["general.architecture"][1] == [b"eagle3"]


@pytest.mark.parametrize("name", ["m1", "m2", "m1_variants"])
def test_m1_m2_drafts_are_the_converter_output_widened_to_three_ids(exported, name):
    """llama.cpp's converter writes an m<3 draft as is (target_layers of length m, an m-state fc: a file
    llama.cpp refuses to load). elsi-fast's file differs from it exactly by the 3-id equivalent:
    the last id repeated, zero fc columns (and unit norm weights under norm_before_fc) for the repeats."""
    draft = exported[name]["draft"]
    ids = list(draft.config.aux_layer_ids)
    (ours_kv, ours_t), (ref_kv, ref_t) = read_gguf(exported[name]["ours"]), read_gguf(exported[name]["ref"])
    assert int_array(ref_kv["eagle3.target_layers"]) == ids
    assert int_array(ours_kv["eagle3.target_layers"]) == ids + [ids[-1]] * (3 - len(ids))
    assert_same_fields(ours_kv, ref_kv, skip={"eagle3.target_layers"})
    assert_same_tensors(ours_t, ref_t, skip={"fc.weight", "enc.output_norm.weight", "rope_freqs.weight"})
    fc, fc_ref = ours_t["fc.weight"][2], ref_t["fc.weight"][2]  # [d, 3 * d_t] vs [d, m * d_t]
    np.testing.assert_array_equal(fc[:, : fc_ref.shape[1]], fc_ref)
    assert fc.shape[1] == 3 * D and not fc[:, fc_ref.shape[1]:].any()
    if draft.config.norm_before_fc:
        norm, norm_ref = ours_t["enc.output_norm.weight"][2], ref_t["enc.output_norm.weight"][2]
        np.testing.assert_array_equal(norm[:D], norm_ref)
        np.testing.assert_array_equal(norm[D:], np.ones(2 * D, dtype=np.float32))
        assert ours_kv["eagle3.norm_before_fc"][1] == [b"\x01"]
    if draft.config.rope_scaling is not None:
        # The converter computes the Llama-3.1 factors in float32, elsi-fast in float64 then rounds.
        np.testing.assert_allclose(ours_t["rope_freqs.weight"][2], ref_t["rope_freqs.weight"][2], rtol=1e-6)
    else:
        assert "rope_freqs.weight" not in ours_t and "rope_freqs.weight" not in ref_t


def draft_from_gguf(path, like: Eagle3Draft) -> Eagle3Draft:
    """An m=3 torch draft from a draft GGUF, read the way llama.cpp's eagle3 graph reads it (q/k rows
    back to rotate-half order, d2t from absolute ids); the RoPE scaling is taken from `like`."""
    _, tensors = read_gguf(path)
    t = {name: torch.from_numpy(data.copy()).to(torch.float64) for name, (_, _, data) in tensors.items()}
    config = dataclasses.replace(like.config, aux_layer_ids=None)  # 3 states of target_hidden_size

    def rotate_half_rows(w, heads):
        rows, cols = w.shape
        return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    draft = Eagle3Draft(config).to(torch.float64)
    state = {
        "fc.weight": t["fc.weight"], "midlayer.input_layernorm.weight": t["blk.0.attn_norm.weight"],
        "midlayer.hidden_norm.weight": t["blk.0.attn_norm_2.weight"],
        "midlayer.self_attn.q_proj.weight": rotate_half_rows(t["blk.0.attn_q.weight"], config.num_attention_heads),
        "midlayer.self_attn.k_proj.weight": rotate_half_rows(t["blk.0.attn_k.weight"], config.num_key_value_heads),
        "midlayer.self_attn.v_proj.weight": t["blk.0.attn_v.weight"],
        "midlayer.self_attn.o_proj.weight": t["blk.0.attn_output.weight"],
        "midlayer.post_attention_layernorm.weight": t["blk.0.ffn_norm.weight"],
        "midlayer.mlp.gate_proj.weight": t["blk.0.ffn_gate.weight"],
        "midlayer.mlp.up_proj.weight": t["blk.0.ffn_up.weight"],
        "midlayer.mlp.down_proj.weight": t["blk.0.ffn_down.weight"],
        "norm.weight": t["output_norm.weight"], "lm_head.weight": t["output.weight"],
    }
    if config.norm_before_fc:
        state["input_norm.weight"] = t["enc.output_norm.weight"]
    with torch.no_grad():
        for name, value in state.items():
            draft.get_parameter(name).copy_(value)
    draft.set_draft_vocab(torch.from_numpy(tensors["d2t"][2].copy()))
    return draft


@pytest.mark.parametrize("name", ["m1", "m2", "m1_variants"])
def test_three_id_equivalent_computes_the_same_logits(exported, name):
    """The GGUF's m=3 draft fed the three captured states [h_a, (h_b,) h_last, ...] gives the original
    draft's logits (float64) over a prompt and several fed-back draft steps."""
    original = copy.deepcopy(exported[name]["draft"]).to(torch.float64)
    equivalent = draft_from_gguf(exported[name]["ours"], original)
    assert torch.equal(equivalent.d2t, original.d2t)
    gen = torch.Generator().manual_seed(7)
    embed = torch.randn(original.config.vocab_size, D, generator=gen, dtype=torch.float64)
    original.attach_embedding(embed)
    equivalent.attach_embedding(embed)
    ids = list(original.config.aux_layer_ids)
    states = {i: 3.0 * torch.randn(1, 6, D, generator=gen, dtype=torch.float64) for i in ids}
    tokens = torch.randint(0, original.config.vocab_size, (1, 6), generator=gen)
    caches = [original.new_cache(16), equivalent.new_cache(16)]
    out = [original.extend(torch.cat([states[i] for i in ids], -1), tokens, caches[0]),
           equivalent.extend(torch.cat([states[i] for i in llamacpp_layer_ids(ids)], -1), tokens, caches[1])]
    for _ in range(4):
        torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-10)
        token = original.draft_to_target(out[0][0][:, -1:].argmax(-1))
        out = [model.forward(hidden[:, -1:], token, cache)
               for model, (_, hidden), cache in zip((original, equivalent), out, caches)]
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-10)


def fake_target(path, arch="llama", blocks=N_BLOCKS, hidden=D, vocab=289):
    """A GGUF with only the fields the export reads from a target (no tensors)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", blocks)
    writer.add_uint32(f"{arch}.embedding_length", hidden)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("ids,variants,match", [
    ((1, 5), {}, r"aux_layer_ids: .*beyond the target's h_0..h_4"),
    ((1, N_BLOCKS), {}, r"aux_layer_ids: .*h_4, the last block's output.*'llama' target"),
    ((0, 1, 2, 3), {}, r"aux_layer_ids: .*m <= 3.*m=4"),
    ((1, 3), {"norm_before_fc": True}, r"aux_layer_ids: norm_before_fc with m=2"),
    ((1, 2, 3), {"fc_norm": True}, r"draft: .*\['fc_norm'\]"),
])
def test_bad_drafts_are_refused(tmp_path, ids, variants, match):
    target = fake_target(tmp_path / "target.gguf")
    with pytest.raises(ValueError, match=match):
        write_draft(make_draft(289, ids, 0, **variants), tmp_path / "d.gguf", format="gguf", target=target)
    assert not (tmp_path / "d.gguf").exists()


def test_bad_targets_are_refused(tmp_path):
    draft = make_draft(289, (1, 2, 3), 0)
    with pytest.raises(ValueError, match=r"target: format='gguf' needs target="):
        write_draft(draft, tmp_path / "d.gguf", format="gguf")
    with pytest.raises(ValueError, match=r"target: the draft's vocab_size=289 differs from the target's 300"):
        write_draft(draft, tmp_path / "d.gguf", format="gguf", target=fake_target(tmp_path / "t300.gguf", vocab=300))
    with pytest.raises(ValueError, match=r"target_hidden_size=32 differs from the target's hidden size 64"):
        write_draft(draft, tmp_path / "d.gguf", format="gguf", target=fake_target(tmp_path / "t64.gguf", hidden=64))
    (tmp_path / "not.gguf").write_text(json.dumps({}))
    with pytest.raises(ValueError, match=r"target: .*not a readable GGUF file"):
        write_draft(draft, tmp_path / "d.gguf", format="gguf", target=tmp_path / "not.gguf")
    with pytest.raises(ValueError, match=r"target: .*is not a file"):
        write_draft(draft, tmp_path / "d.gguf", format="gguf", target=tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match=r"target: only format 'gguf' takes it"):
        write_draft(draft, tmp_path / "dir", target=tmp_path / "t300.gguf")


def test_targets_whose_graph_publishes_no_layer_states_are_refused(tmp_path):
    """llama.cpp aborts an eagle3 draft on a gemma3 target ("layer input tensor is null"): one line."""
    target = fake_target(tmp_path / "target.gguf", arch="gemma3")
    with pytest.raises(ValueError, match=r"target: .*cannot serve an EAGLE3 draft on a 'gemma3' target"):
        write_draft(make_draft(289, (1,), 0), tmp_path / "d.gguf", format="gguf", target=target)
    assert not (tmp_path / "d.gguf").exists()


def test_layer_input_archs_are_the_vendored_graphs_that_publish_them(llamacpp):
    """LLAMACPP_ARCHS_WITH_LAYER_INPUTS against llama.cpp's own source: the architectures mapped to a
    model class whose graph sets `res->t_layer_inp[il]`."""
    src = llamacpp.source_dir() / "src"
    publishing = {m.group(1) for f in (src / "models").glob("*.cpp") if "t_layer_inp[il]" in (text := f.read_text())
                  for m in re.finditer(r"(llama_model_\w+)::build_arch_graph", text)}
    mapping = (src / "llama-model.cpp").read_text()
    mapping = mapping[mapping.index("llama_model_mapping"):]
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', (src / "llama-arch.cpp").read_text()))
    archs = {names[arch] for cases, cls in re.findall(r"((?:case LLM_ARCH_\w+:\s*)+)return new (llama_model_\w+)\(",
                                                       mapping[: mapping.index("\n}\n")])
             if cls in publishing for arch in re.findall(r"LLM_ARCH_\w+", cases)}
    assert {"llama", "qwen3"} <= archs and "gemma3" not in archs
    assert archs == LLAMACPP_ARCHS_WITH_LAYER_INPUTS


def test_last_block_output_is_allowed_where_llamacpp_delivers_it(tmp_path):
    """gpt-oss's llama.cpp graph publishes the last block's pre-norm output: id N is exported there."""
    target = fake_target(tmp_path / "target.gguf", arch="gpt-oss")
    write_draft(make_draft(289, (N_BLOCKS,), 0), tmp_path / "d.gguf", format="gguf", target=target)
    fields, _ = read_gguf(tmp_path / "d.gguf")
    assert int_array(fields["eagle3.target_layers"]) == [N_BLOCKS] * 3
    assert fields["tokenizer.ggml.tokens"][1][:2] == [b"t0", b"t1"]
