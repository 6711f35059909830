"""EAGLE3 checkpoint format: round trips, the public Llama-3.1-8B layout, speculators names, .bin files,
and clear errors for checkpoints that do not match their config."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from elsi_fast.draft import Eagle3Config, Eagle3Draft, read_draft, write_draft


def eagle3_tensor_shapes(d, heads, kv_heads, head_dim, inter, vocab, draft_vocab, target_d, m):
    """Tensor names and shapes of an EAGLE3 draft checkpoint, as docs/method.md section 5 lists them."""
    return {
        "fc.weight": (d, m * target_d),
        "midlayer.hidden_norm.weight": (d,),
        "midlayer.input_layernorm.weight": (d,),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * d),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, d),
        "midlayer.mlp.up_proj.weight": (inter, d),
        "midlayer.mlp.down_proj.weight": (d, inter),
        "norm.weight": (d,),
        "lm_head.weight": (draft_vocab, d),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }


LLAMA31_8B = dict(d=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256, draft_vocab=32000,
                  target_d=4096, m=3)
# The same layout at reduced scale: GQA, head_dim != d / heads, a draft vocab smaller than the target's.
LLAMA31_8B_SMALL = dict(d=32, heads=4, kv_heads=1, head_dim=6, inter=56, vocab=300, draft_vocab=40,
                        target_d=24, m=3)


def public_llama_config(d, heads, kv_heads, head_dim, inter, vocab, draft_vocab, target_d, m):
    """config.json as SpecForge writes it for Llama-3.1-8B (no layer ids: the engine's default 3)."""
    assert m == 3
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 0,
        "hidden_size": d, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_scaling": None,
        "rope_theta": 500000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_d,
    }


def random_checkpoint_tensors(shapes, vocab, draft_vocab, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()
               if name not in ("d2t", "t2d")}
    targets = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = targets - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    tensors["t2d"][targets] = True
    return tensors


def write_checkpoint(path, config, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")


def small_draft(m=2, seed=0):
    cfg = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=50, draft_vocab_size=20, target_hidden_size=12, rope_theta=1e6,
                       aux_layer_ids=tuple(range(2, 2 + 3 * m, 3)))
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    draft = Eagle3Draft(cfg, embed)
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
    draft.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values)
    return draft, embed


def run(draft, seed=1):
    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    aux = torch.randn(1, 5, cfg.fc_in_features, generator=gen).to(draft.fc.weight.dtype)
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=gen)
    return draft.extend(aux, ids, draft.new_cache(5))


@pytest.mark.parametrize("m", [1, 3])
def test_save_load_round_trip_is_bit_exact(tmp_path, m):
    draft, embed = small_draft(m)
    write_draft(draft, tmp_path)
    loaded = read_draft(tmp_path, embed_tokens=embed)
    assert loaded.config == draft.config
    state, loaded_state = draft.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    for name in state:
        assert state[name].dtype == loaded_state[name].dtype
        assert torch.equal(state[name], loaded_state[name]), name
    for a, b in zip(run(draft), run(loaded)):
        assert torch.equal(a, b)
    assert all(p.requires_grad for p in loaded.parameters())
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")


def test_config_json_has_both_layer_id_conventions(tmp_path):
    draft, _ = small_draft(m=3)  # aux ids (2, 5, 8), input-to-layer
    write_draft(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 5, 8]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["target_hidden_size"] == 12
    assert config["draft_vocab_size"] == 20 and config["vocab_size"] == 50
    assert config["torch_dtype"] == "float32" and config["rope_theta"] == 1e6
    # SGLang-only configs carry just the output-of-layer ids
    del config["eagle_aux_hidden_state_layer_ids"]
    assert Eagle3Config.from_dict(config).aux_layer_ids == (2, 5, 8)
    config["eagle_aux_hidden_state_layer_ids"] = [2, 5, 9]
    with pytest.raises(ValueError, match="disagree"):
        Eagle3Config.from_dict(config)


def test_llama31_8b_layout_matches_the_module():
    cfg = Eagle3Config.from_dict(public_llama_config(**LLAMA31_8B))
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    assert {k: tuple(v.shape) for k, v in draft.state_dict().items()} == eagle3_tensor_shapes(**LLAMA31_8B)


def test_public_llama31_8b_style_checkpoint_loads(tmp_path):
    shapes = eagle3_tensor_shapes(**LLAMA31_8B_SMALL)
    tensors = random_checkpoint_tensors(shapes, LLAMA31_8B_SMALL["vocab"], LLAMA31_8B_SMALL["draft_vocab"])
    write_checkpoint(tmp_path, public_llama_config(**LLAMA31_8B_SMALL), tensors)
    embed = torch.randn(LLAMA31_8B_SMALL["vocab"], LLAMA31_8B_SMALL["d"])
    draft = read_draft(tmp_path, embed_tokens=embed)
    assert draft.config.num_aux_layers == 3 and draft.config.aux_layer_ids is None
    assert draft.config.rope_theta == 500000.0
    state = draft.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.d2t.dtype == torch.int64
    logits, hidden = run(draft)
    assert logits.shape == (1, 5, 40) and torch.isfinite(logits.float()).all()
    ids, _ = draft.decode_step(hidden[:, -1:], torch.tensor([[3]]), draft.new_cache(2), from_target=False,
                               top_k=2)
    assert tensors["t2d"][ids].all()


def test_speculators_names_and_config_load(tmp_path):
    draft, embed = small_draft(m=2)
    write_draft(draft, tmp_path / "eagle3")
    tensors = load_file(tmp_path / "eagle3" / "model.safetensors")
    renamed = {name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}
    renamed["embed_tokens.weight"] = embed  # speculators checkpoints may carry the embedding
    flat = draft.config.to_dict()
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "vocab_size", "rope_theta", "max_position_embeddings", "num_hidden_layers")
    speculators_config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"model_type": "llama", **{k: flat[k] for k in layer_keys}},
        "draft_vocab_size": flat["draft_vocab_size"], "target_hidden_size": flat["target_hidden_size"],
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": flat["eagle_aux_hidden_state_layer_ids"],
    }
    write_checkpoint(tmp_path / "spec", speculators_config, renamed)
    loaded = read_draft(tmp_path / "spec")  # embedding taken from the checkpoint
    assert loaded.config == draft.config
    for a, b in zip(run(draft), run(loaded)):
        assert torch.equal(a, b)
    # speculators' default training flag is read as the variant it is, never as the plain layer
    speculators_config["norm_before_residual"] = True
    write_checkpoint(tmp_path / "spec", speculators_config, renamed)
    variant = read_draft(tmp_path / "spec")
    assert variant.config.norm_before_residual
    assert not torch.allclose(run(variant)[0], run(draft)[0])


class NotATensor:
    pass


def test_bin_checkpoint_loads_only_plain_tensors(tmp_path):
    draft, embed = small_draft(m=1)
    write_draft(draft, tmp_path / "st")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(dict(draft.state_dict()), tmp_path / "bin" / "pytorch_model.bin")
    loaded = read_draft(tmp_path / "bin", embed_tokens=embed, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.t2d.dtype == torch.bool
    assert torch.equal(loaded.fc.weight, draft.fc.weight.to(torch.bfloat16))
    torch.save({**draft.state_dict(), "extra": NotATensor()}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refusing to unpickle"):
        read_draft(tmp_path / "bin", embed_tokens=embed)


@pytest.fixture
def saved(tmp_path):
    draft, embed = small_draft(m=2)
    write_draft(draft, tmp_path)
    return tmp_path, load_file(tmp_path / "model.safetensors"), json.loads((tmp_path / "config.json").read_text())


def rewrite(saved, tensors=None, config=None):
    path, orig_tensors, orig_config = saved
    write_checkpoint(path, orig_config if config is None else config, orig_tensors if tensors is None else tensors)
    return path


def test_missing_tensor_is_named_with_its_shape(saved):
    tensors = dict(saved[1])
    del tensors["midlayer.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing midlayer\.self_attn\.k_proj\.weight \[8, 32\]"):
        read_draft(rewrite(saved, tensors))


def test_misshaped_and_unexpected_tensors_are_named(saved):
    tensors = dict(saved[1])
    tensors["midlayer.mlp.up_proj.weight"] = torch.zeros(24, 15)
    tensors["midlayer.rotary.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \[24, 15\], expected \[24, 16\]") as err:
        read_draft(rewrite(saved, tensors))
    assert "unexpected midlayer.rotary.bias [3]" in str(err.value)


def test_fc_width_must_be_m_times_target_hidden(saved):
    config = dict(saved[2])
    config["eagle_aux_hidden_state_layer_ids"] = [2, 5, 8]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}
    config["num_aux_hidden_states"] = 3
    with pytest.raises(ValueError, match=r"input width 24 .* 3 \* 12 = 36 \(the weights fit m = 2"):
        read_draft(rewrite(saved, config=config))


def test_vocab_maps_are_checked(saved):
    tensors = dict(saved[1])
    del tensors["d2t"]
    with pytest.raises(ValueError, match="lacks d2t"):
        read_draft(rewrite(saved, tensors))
    tensors = dict(saved[1])
    tensors["t2d"] = ~tensors["t2d"]
    with pytest.raises(ValueError, match="t2d does not mark"):
        read_draft(rewrite(saved, tensors))
    tensors = dict(saved[1])
    tensors["d2t"] = tensors["d2t"] + 1000
    with pytest.raises(ValueError, match="outside the target vocab"):
        read_draft(rewrite(saved, tensors))
    tensors = dict(saved[1])
    del tensors["t2d"]  # implied by d2t
    loaded = read_draft(rewrite(saved, tensors))
    assert torch.equal(loaded.t2d, saved[1]["t2d"])


def test_missing_files_and_embedding(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_draft(tmp_path / "nowhere")
    (saved[0] / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        read_draft(saved[0])
    loaded = read_draft(rewrite(saved))
    with pytest.raises(ValueError, match="no token embedding"):
        run(loaded)


def test_sharded_safetensors_load(tmp_path):
    draft, embed = small_draft(m=2)
    write_draft(draft, tmp_path / "one")
    tensors = load_file(tmp_path / "one" / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / "two" / file)
    index = {"weight_map": {n: file for file, shard_names in shards.items() for n in shard_names}}
    (tmp_path / "two" / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = read_draft(tmp_path / "two", embed_tokens=embed)
    for a, b in zip(run(draft), run(loaded)):
        assert torch.equal(a, b)


def test_transformers5_rope_parameters_are_read():
    base = public_llama_config(**LLAMA31_8B_SMALL)
    del base["rope_theta"], base["rope_scaling"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = Eagle3Config.from_dict({**base, "rope_parameters": {"rope_theta": 500000.0, **scaling}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == scaling
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg
    assert Eagle3Config.from_dict(base).rope_theta == 10000.0  # absent theta means 10000


# ----------------------------------------------------------------------------------------------
# Formats: "eagle3" that every engine's fallback reads alike, "speculators" that speculators loads
# ----------------------------------------------------------------------------------------------


def tiny_target_config(num_layers=9, hidden=16, vocab=50, name="org/tiny-target"):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=num_layers, vocab_size=vocab)
    config.architectures = ["LlamaForCausalLM"]
    config._name_or_path = name
    return config


def square_draft(m=3, seed=0, **variants):
    """A draft whose target_hidden_size equals hidden_size, as speculators requires."""
    cfg = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=50, draft_vocab_size=20, rope_theta=1e6, aux_layer_ids=tuple(range(2, 2 + 3 * m, 3)),
                       **variants)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
    draft = Eagle3Draft(cfg, embed)
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
    draft.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values)
    return draft, embed


@pytest.mark.parametrize("m", [1, 3])
def test_eagle3_config_gives_every_engine_fallback_the_same_m(tmp_path, m):
    draft, _ = small_draft(m)
    write_draft(draft, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    ids = list(draft.config.aux_layer_ids)
    # vLLM 0.32 fc width: num_aux_hidden_states, else len(eagle_config ids), else 3
    assert config["num_aux_hidden_states"] == m == len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    # vLLM's capture ids: the top-level key; its fallback key eagle_config.layer_ids is never written
    assert config["eagle_aux_hidden_state_layer_ids"] == ids and "layer_ids" not in config["eagle_config"]
    # SGLang / SpecForge capture ids: output-of-layer
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in ids]
    assert "norm_output" not in config  # read differently by vLLM / SGLang and SpecForge
    config["num_aux_hidden_states"] = m + 1
    with pytest.raises(ValueError, match="num_aux_hidden_states"):
        Eagle3Config.from_dict(config)


@pytest.mark.parametrize("m", [1, 3])
def test_speculators_format_round_trip_and_layout(tmp_path, m):
    draft, embed = square_draft(m)
    target = tiny_target_config()
    write_draft(draft, tmp_path, format="speculators", target_config=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == list(draft.config.aux_layer_ids)
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-target",
                                                        "architectures": ["LlamaForCausalLM"]}
    assert config["speculators_config"]["algorithm"] == "eagle3"
    # every switch explicit: vLLM reads a missing norm_before_residual of a speculators config as true
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert config[flag] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 50
    # vLLM 0.32's speculators path: the draft config is transformer_layer_config plus the switches, and
    # its fc width is num_aux_hidden_states there, else the eagle_config id count, else 3
    eagle_config = layer.get("eagle_config") or {}
    fc_states = layer.get("num_aux_hidden_states") or len(eagle_config.get("eagle_aux_hidden_state_layer_ids", [])) or 3
    assert fc_states == m
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    assert {"d2t", "t2d"} <= names
    loaded = read_draft(tmp_path, embed_tokens=embed)
    assert loaded.config == draft.config
    for a, b in zip(run(draft), run(loaded)):
        assert torch.equal(a, b)


def test_speculators_format_carries_the_embedding_by_default(tmp_path):
    """speculators 0.9 fills a missing embedding from the verifier only when it reads NaN, and can
    keep uninitialized memory instead; so the speculators format writes it unless told not to."""
    draft, embed = square_draft(m=1)
    target = tiny_target_config()
    write_draft(draft, tmp_path / "spec", format="speculators", target_config=target)
    assert torch.equal(load_file(tmp_path / "spec" / "model.safetensors")["embed_tokens.weight"], embed)
    loaded = read_draft(tmp_path / "spec")  # no embed_tokens argument needed
    for a, b in zip(run(draft), run(loaded)):
        assert torch.equal(a, b)
    write_draft(draft, tmp_path / "bare", format="speculators", target_config=target, include_embedding=False)
    write_draft(draft, tmp_path / "eagle3")
    for name in ("bare", "eagle3"):
        assert "embed_tokens.weight" not in load_file(tmp_path / name / "model.safetensors")
    bare = Eagle3Draft(draft.config)
    with pytest.raises(ValueError, match="has none attached.*include_embedding=False"):
        write_draft(bare, tmp_path / "x", format="speculators", target_config=target)
    with pytest.raises(ValueError, match="has none attached"):
        write_draft(bare, tmp_path / "x", include_embedding=True)


def test_full_vocab_speculators_checkpoint_has_no_vocab_maps(tmp_path):
    cfg = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=50, aux_layer_ids=(3,))
    write_draft(Eagle3Draft(cfg), tmp_path, format="speculators", target_config=tiny_target_config(),
                                     include_embedding=False)
    # speculators 0.9 has no d2t / t2d buffers when the draft vocab is the target's
    assert not {"d2t", "t2d"} & set(load_file(tmp_path / "model.safetensors"))
    assert read_draft(tmp_path).config == cfg


@pytest.mark.parametrize("variants", [
    dict(norm_before_residual=True, norm_before_fc=True, norm_feedback=True, sliding_window=4),
    dict(fc_norm=True, qk_norm=True),
])
def test_speculators_format_round_trips_variants(tmp_path, variants):
    draft, embed = square_draft(m=3, **variants)
    write_draft(draft, tmp_path, format="speculators", target_config=tiny_target_config())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["norm_output"] is variants.get("norm_feedback", False)
    if "sliding_window" in variants:
        assert config["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
        assert config["transformer_layer_config"]["sliding_window"] == 4
    if variants.get("qk_norm"):
        assert config["transformer_layer_config"]["model_type"] == "qwen3"
        assert "layers.0.self_attn.q_norm.weight" in load_file(tmp_path / "model.safetensors")
    loaded = read_draft(tmp_path, embed_tokens=embed)
    assert loaded.config == draft.config
    for a, b in zip(run(draft), run(loaded)):
        assert torch.equal(a, b)


def test_format_errors_name_the_problem(tmp_path):
    draft, _ = square_draft(m=3)
    with pytest.raises(ValueError, match="format must be one of"):
        write_draft(draft, tmp_path, format="onnx")
    with pytest.raises(ValueError, match="needs target_config"):
        write_draft(draft, tmp_path, format="speculators")
    with pytest.raises(ValueError, match=r"exceed the target's N=5 blocks"):
        write_draft(draft, tmp_path, format="speculators", target_config=tiny_target_config(num_layers=5))
    with pytest.raises(ValueError, match="target has hidden_size=32"):
        write_draft(draft, tmp_path, format="speculators", target_config=tiny_target_config(hidden=32))
    narrow, _ = small_draft(m=1)  # target_hidden_size 12 != hidden_size 16
    with pytest.raises(ValueError, match="target_hidden_size == hidden_size"):
        write_draft(narrow, tmp_path, format="speculators", target_config=tiny_target_config(hidden=12))
    with pytest.raises(ValueError, match=r"format='eagle3' cannot state the variant \['norm_feedback'\]"):
        write_draft(square_draft(m=1, norm_feedback=True)[0], tmp_path)
    with pytest.raises(ValueError, match="final_norm=False"):
        write_draft(square_draft(m=1, final_norm=False)[0], tmp_path, format="speculators",
                                                               target_config=tiny_target_config())


def speculators_dict(**overrides):
    draft, _ = square_draft(m=3)
    config = draft.config.to_speculators_dict({"name_or_path": None, "architectures": []})
    layer_overrides = overrides.pop("layer", {})
    config["transformer_layer_config"].update(layer_overrides)
    config.update(overrides)
    return config


def test_speculators_switches_are_read_with_their_meaning():
    cfg = Eagle3Config.from_dict(speculators_dict(norm_before_residual=True, norm_before_fc=True, norm_output=True))
    assert (cfg.norm_before_residual, cfg.norm_before_fc, cfg.norm_feedback, cfg.final_norm) == (True, True, True, True)
    assert Eagle3Config.from_dict(speculators_dict(fc_norm=True)).fc_norm
    cfg = Eagle3Config.from_dict(speculators_dict(layer={"layer_types": ["sliding_attention"], "sliding_window": 7}))
    assert cfg.sliding_window == 7
    assert Eagle3Config.from_dict(speculators_dict(layer={"layer_types": ["full_attention"],
                                                          "sliding_window": 7})).sliding_window is None
    assert Eagle3Config.from_dict(speculators_dict(layer={"model_type": "qwen3"})).qk_norm


def test_eagle3_norm_output_needs_its_meaning():
    config = small_draft(m=3)[0].config.to_dict()
    for value in (True, False):
        with pytest.raises(ValueError, match=f"norm_output={str(value).lower()} has two meanings"):
            Eagle3Config.from_dict({**config, "norm_output": value})
    specforge = Eagle3Config.from_dict({**config, "norm_output": False}, norm_output_meaning="specforge")
    assert specforge.final_norm is False and specforge.norm_feedback is False
    assert Eagle3Config.from_dict({**config, "norm_output": True}, norm_output_meaning="specforge").variants == {}
    vllm = Eagle3Config.from_dict({**config, "norm_output": True}, norm_output_meaning="sglang")
    assert vllm.norm_feedback is True and vllm.final_norm is True
    with pytest.raises(ValueError, match="norm_output_meaning must be one of"):
        Eagle3Config.from_dict({**config, "norm_output": True}, norm_output_meaning="trtllm")


@pytest.mark.parametrize("layer,match", [
    ({"logit_scale": 2.0}, "logit_scale=2.0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"], "sliding_window": None}, "needs a positive sliding_window"),
    ({"layer_types": ["full_attention", "full_attention"]}, "layer_types"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
])
def test_unimplemented_math_is_refused_by_name(layer, match):
    with pytest.raises(ValueError, match=match):
        Eagle3Config.from_dict(speculators_dict(layer=layer))
    if "model_type" not in layer:  # the same field in an eagle3 config
        with pytest.raises(ValueError, match=match):
            Eagle3Config.from_dict({**small_draft(m=3)[0].config.to_dict(), **layer})


def test_speculators_layer_config_is_a_diff_against_its_model_type_defaults():
    """speculators writes transformer_layer_config with to_diff_dict(): absent fields take the
    layer class's defaults (Qwen3: head_dim 128), not Llama's or elsi-fast's."""
    config = speculators_dict(layer={"model_type": "qwen3", "num_attention_heads": 2, "num_key_value_heads": 1})
    del config["transformer_layer_config"]["head_dim"]
    assert Eagle3Config.from_dict(config).head_dim == 128
    config["transformer_layer_config"]["model_type"] = "llama"
    assert Eagle3Config.from_dict(config).head_dim == 8
