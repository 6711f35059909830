"""Loading targets (elsi_fast.targets.loading): GGUF files and named real targets, their dequantized
folders, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from elsi_fast.targets import catalog, loading
from elsi_fast.targets.capture import capture_hidden_states


def _write_gguf(path, arch: str, *, tensors: bool = True, file_type: str | None = None) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    if file_type is not None:
        writer.add_type(file_type)
    if tensors:
        writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_model_loads_with_its_tokenizer_chat_template_and_tied_head(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None  # a plain float model now
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).strip().startswith("Paris")


def test_dequantized_folder_reloads_to_the_gguf_readers_logits(smollm2):
    """The cached folder holds exactly what transformers' GGUF reader dequantizes."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2
    path = catalog.resolve("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    folder = loading.dequantized_folder(path)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    ids = tokenizer("Speculative decoding drafts tokens", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(reference(ids).logits, model(ids).logits)


def test_h_n_is_the_last_block_output_before_the_final_norm_with_tied_embeddings(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("One two three four five", return_tensors="pt").input_ids
    n = model.config.num_hidden_layers
    with torch.inference_mode(), capture_hidden_states(model, layers=[0, n]) as cap:
        logits = model(ids).logits
    torch.testing.assert_close(cap.states[0], model.model.embed_tokens(ids))
    recomputed = model.model.norm(cap.states[n]) @ model.model.embed_tokens.weight.T
    torch.testing.assert_close(recomputed, logits, rtol=1e-5, atol=1e-4)


def test_gemma3_sliding_window_layers_and_scaled_embedding(gemma3):
    model, tokenizer = gemma3
    text = model.config.get_text_config()
    assert model.config.num_hidden_layers == 18 and text.sliding_window == 512
    assert {"sliding_attention", "full_attention"} == set(text.layer_types)
    # a prompt longer than the window, so the sliding layers really differ from full attention
    ids = torch.arange(600).remainder(5000).add(1000).unsqueeze(0)
    with torch.inference_mode(), capture_hidden_states(model, layers=[0, 1, 18]) as cap:
        logits = model(ids).logits
    embed = model.get_input_embeddings()
    torch.testing.assert_close(cap.states[0], embed(ids))  # h_0 includes Gemma's sqrt(d) scale
    assert float(embed.embed_scale) == pytest.approx(640**0.5, rel=1e-3)
    assert all(s.shape == (1, 600, 640) for s in cap.states.values()) and torch.isfinite(logits).all()


def test_a_folder_holding_one_gguf_is_that_model(tmp_path):
    path = catalog.resolve("smollm2-135m-instruct")
    (tmp_path / path.name).symlink_to(path)
    source = loading.describe_source(str(tmp_path), "--model")
    assert source.kind == "gguf" and source.num_blocks == 30
    (tmp_path / "other.gguf").symlink_to(path)
    with pytest.raises(ValueError, match="--model: folder .* holds 2 .gguf files .*; name the file"):
        loading.describe_source(str(tmp_path), "--model")


@pytest.mark.parametrize("case", ["not_gguf", "truncated", "no_tensors", "vocab_only"])
def test_bad_gguf_files_are_one_line_errors(tmp_path, case):
    path = tmp_path / "model.gguf"
    if case == "not_gguf":
        path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
        match = "is not a GGUF file"
    elif case == "truncated":
        source = catalog.resolve("smollm2-135m-instruct")
        with open(source, "rb") as f:
            path.write_bytes(f.read(source.stat().st_size // 3))
        match = "truncated|damaged"
    elif case == "no_tensors":
        _write_gguf(path, "llama", tensors=False)
        match = "truncated"
    else:
        _write_gguf(path, "llama", file_type="vocab")
        match = "a GGUF 'vocab' file, not a model"
    with pytest.raises(ValueError) as err:
        loading.describe_source(str(path), "--model")
    assert err.value.args[0].startswith("--model: ") and "\n" not in str(err.value)
    assert __import__("re").search(match, str(err.value))


def test_unsupported_gguf_architecture_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("ELSI_FAST_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "rwkv6")
    assert loading.describe_source(str(path)).architecture == "rwkv6"
    with pytest.raises(ValueError, match="--target: odd.gguf has GGUF architecture 'rwkv6', which transformers"):
        loading.load_model(str(path), device="cpu", argument="--target")
    assert not any(p.is_dir() for p in (tmp_path / "cache" / "dequantized").iterdir())


def test_export_hf_folder_writes_a_plain_folder(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = smollm2
    out = loading.export_hf_folder(model, tokenizer, tmp_path / "plain")
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors", ".jinja")) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    shutil.rmtree(out)


def test_end_of_generation_ids_are_the_ones_llama_cpp_stops_at(smollm2, gemma3):
    # Known answers from llama.cpp's vocabulary loader on the same files (its log's EOG list):
    # SmolLM2 stops at <|endoftext|> (0) and <|im_end|> (2), Gemma 3 at <eos> (1) and <end_of_turn> (106).
    _, smollm2_tokenizer = smollm2
    _, gemma3_tokenizer = gemma3
    assert loading.end_of_generation_ids(smollm2_tokenizer) == [0, 2]
    assert loading.end_of_generation_ids(gemma3_tokenizer) == [1, 106]
    assert gemma3_tokenizer.convert_ids_to_tokens(106) == "<end_of_turn>"


def test_end_of_generation_ids_without_any_is_one_clear_error():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<s>": 1}, unk_token="a")))
    with pytest.raises(ValueError, match="names no end-of-sequence or end-of-turn token"):
        loading.end_of_generation_ids(plain)
    plain.eos_token = "<s>"  # a named eos counts even where its text is not a known end marker
    assert loading.end_of_generation_ids(plain) == [1]
