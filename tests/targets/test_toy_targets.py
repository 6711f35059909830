"""Target recipes: deterministic training, caching, held-out split, reload as transformers objects."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from elsi_fast.targets import toy_targets as targets
from elsi_fast.targets.loading import load_model
from elsi_fast.targets.toy_targets import (
    DEMO,
    EOS_TOKEN,
    TargetRecipe,
    build_target,
    heldout_texts,
    recipe_key,
    training_texts,
)


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    lines = [f"line {i}: the quick brown fox {'jumps' if i % 2 else 'sleeps'} over dog {i % 7}." for i in range(60)]
    (src / "a.txt").write_text("\n".join(lines[:30]) + "\n")
    (src / "b.txt").write_text("\n".join(lines[30:]) + "\n")
    return src


def _tiny(source, **changes) -> TargetRecipe:
    fields = dict(name="tiny", source=str(source), vocab_size=300, hidden_size=16, intermediate_size=24,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, seq_len=16,
                  batch_size=2, steps=4, warmup=2, holdout_fraction=0.2)
    fields.update(changes)
    return TargetRecipe(**fields)


def test_training_is_deterministic_and_reloads(tmp_path, corpus):
    recipe = _tiny(corpus)
    first = build_target(recipe, cache_dir=tmp_path / "c1", progress=False)
    second = build_target(recipe, cache_dir=tmp_path / "c2", progress=False)
    w1, w2 = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert w1.keys() == w2.keys()
    for name in w1:
        assert torch.equal(w1[name], w2[name]), name
    assert (first / "tokenizer.json").read_text() == (second / "tokenizer.json").read_text()

    model, tokenizer = load_model(first, device="cpu", dtype="float32")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tokenizer)
    ids = tokenizer("the quick brown fox")["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(EOS_TOKEN)  # prompts start like documents
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the quick brown fox"
    summary = json.loads((first / "recipe.json").read_text())
    assert summary["key"] == recipe_key(recipe) and summary["recipe"] == dataclasses.asdict(recipe)


def test_cache_is_reused_and_keyed_by_recipe_and_text(tmp_path, corpus, monkeypatch):
    recipe = _tiny(corpus)
    path = build_target(recipe, cache_dir=tmp_path, progress=False)

    def must_not_train(*args, **kwargs):
        raise AssertionError("a cached target was trained again")

    monkeypatch.setattr(targets, "train_target", must_not_train)
    assert build_target(recipe, cache_dir=tmp_path, progress=False) == path

    assert recipe_key(_tiny(corpus, seed=1)) != recipe_key(recipe)
    assert recipe_key(_tiny(corpus, hidden_size=32)) != recipe_key(recipe)
    (corpus / "b.txt").write_text("different text\n" * 20)
    assert recipe_key(recipe) != json.loads((path / "recipe.json").read_text())["key"]


def test_failed_build_leaves_no_cache_entry(tmp_path, corpus, monkeypatch):
    def interrupted(recipe, out_dir, progress=True):
        out_dir.mkdir()
        (out_dir / "model.safetensors").write_text("half-written")
        raise KeyboardInterrupt

    monkeypatch.setattr(targets, "train_target", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_target(_tiny(corpus), cache_dir=tmp_path, progress=False)
    assert not targets.target_dir(_tiny(corpus), tmp_path).exists()  # nothing a later call would reuse


def test_ctrl_c_saves_the_target_training_and_the_next_build_continues_it(tmp_path, corpus, monkeypatch):
    recipe = _tiny(corpus, steps=6)
    reference = build_target(recipe, cache_dir=tmp_path / "full", progress=False)

    from transformers import LlamaForCausalLM

    real_forward = LlamaForCausalLM.forward
    calls = {"n": 0}

    def ctrl_c_in_third_step(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_forward(self, *a, **kw)

    monkeypatch.setattr(LlamaForCausalLM, "forward", ctrl_c_in_third_step)
    with pytest.raises(KeyboardInterrupt):
        build_target(recipe, cache_dir=tmp_path / "split", progress=False)
    monkeypatch.setattr(LlamaForCausalLM, "forward", real_forward)
    assert calls["n"] == 3
    final = targets.target_dir(recipe, tmp_path / "split")
    assert not final.exists()
    state = torch.load(final.parent / f".{final.name}.partial" / targets.TRAIN_STATE_FILE, weights_only=True)
    assert len(state["losses"]) == 3  # saved at the end of the interrupted step

    resumed = build_target(recipe, cache_dir=tmp_path / "split", progress=False)
    assert resumed == final and not (final / targets.TRAIN_STATE_FILE).exists()
    w1, w2 = load_file(reference / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in w1:
        assert torch.equal(w1[name], w2[name]), name
    assert json.loads((resumed / "recipe.json").read_text())["final_loss"] == pytest.approx(
        json.loads((reference / "recipe.json").read_text())["final_loss"], rel=0, abs=0)


def test_holdout_split_partitions_every_document(corpus):
    recipe = _tiny(corpus)
    train, held = training_texts(recipe), heldout_texts(recipe)
    docs = [(corpus / name).read_text() for name in ("a.txt", "b.txt")]
    assert [t + h for t, h in zip(train, held)] == docs
    for t, h, doc in zip(train, held, docs):
        assert t.endswith("\n") and 0 < len(h) <= 0.2 * len(doc) + 80  # cut at a line boundary


def test_stdlib_source_needs_no_download():
    docs = targets._documents(DEMO)
    assert len(docs) > 20
    assert sum(map(len, docs)) <= DEMO.max_chars
    assert any("def " in d and "import " in d for d in docs)


def test_bad_recipes(tmp_path):
    with pytest.raises(ValueError, match="num_attention_heads"):
        _tiny(tmp_path, hidden_size=15)
    with pytest.raises(ValueError, match="holdout_fraction"):
        _tiny(tmp_path, holdout_fraction=1.0)
    with pytest.raises(ValueError, match="vocab_size"):
        _tiny(tmp_path, vocab_size=100)
    with pytest.raises(FileNotFoundError, match="source"):
        training_texts(_tiny(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        training_texts(_tiny(empty))
