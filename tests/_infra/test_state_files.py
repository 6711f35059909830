"""State files never run code: a crafted pickle in a run folder is refused, not executed."""

from __future__ import annotations

import os

import pytest
import torch

from elsi_fast._infra.state_files import load_state, save_state


class _Payload:
    """Unpickling this calls os.mkdir(marker): the side effect proves whether code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _crafted(path, marker) -> None:
    torch.save({"version": 3, "position": 0, "payload": _Payload(str(marker))}, path)


def test_round_trip_of_tensors_and_plain_containers(tmp_path):
    state = {"a": torch.arange(5), "b": [1, 2.5, "x", None], "c": {"d": (torch.ones(2), True)}}
    save_state(state, tmp_path / "state.pt")
    loaded = load_state(tmp_path / "state.pt")
    assert torch.equal(loaded["a"], state["a"]) and loaded["b"] == state["b"]
    assert torch.equal(loaded["c"]["d"][0], torch.ones(2)) and loaded["c"]["d"][1] is True
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]  # no temporary file left behind


def test_crafted_pickle_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "code-ran"
    _crafted(tmp_path / "state.pt", marker)
    with pytest.raises(ValueError, match="resume: .*state.pt holds objects other than tensors.*nothing in it was run"):
        load_state(tmp_path / "state.pt", "resume")
    assert not marker.exists()
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match="not a readable state file"):
        load_state(tmp_path / "garbage.pt")


def test_analyze_resume_refuses_a_crafted_state(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from elsi_fast.analysis.analyze import analyze

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()

    class Tokenizer:
        all_special_ids: list[int] = []

        def __call__(self, text):
            return {"input_ids": [1 + ord(c) % 60 for c in text]}

    marker = tmp_path / "code-ran"
    _crafted(tmp_path / "state.pt", marker)
    with pytest.raises(ValueError, match="state_path: .*holds objects other than tensors"):
        analyze(model, Tokenizer(), ["a prompt of some length", "another prompt here"], m=1,
                state_path=str(tmp_path / "state.pt"), progress=False)
    assert not marker.exists()


def test_train_draft_resume_refuses_a_crafted_state(tmp_path):
    from elsi_fast.training.train import STATE_FILE, train_draft
    from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER

    marker = tmp_path / "code-ran"
    _crafted(tmp_path / STATE_FILE, marker)
    with pytest.raises(ValueError, match="resume: .*holds objects other than tensors"):
        train_draft(TARGET, TOKENIZER, [1], TEXTS, out_dir=tmp_path, steps=1, **SMALL)
    assert not marker.exists()
