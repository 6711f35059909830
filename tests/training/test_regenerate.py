"""The target answers training prompts (elsi_fast.training.regenerate): batched answers equal one-by-one greedy
decoding, exact token ids kept, resumable after Ctrl-C, other settings refused."""

from __future__ import annotations

import json

import pytest
import torch

from elsi_fast.analysis.prompts import Prompt, encode_prompt
from elsi_fast.training import regenerate as regen
from tiny_lm import TARGET, TEXTS, TOKENIZER

PROMPTS = [Prompt(text=TEXTS[i][: 20 + 9 * i], id=f"p{i}", category="story" if i % 2 else "qa", chat=True)
           for i in range(7)]


def _greedy_alone(prompt: Prompt, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([encode_prompt(prompt, TOKENIZER)])
    stop = regen._stop_ids(TARGET, TOKENIZER)
    with torch.inference_mode():
        out = TARGET.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                              pad_token_id=stop[0])[0, ids.shape[1]:].tolist()
    for j, token in enumerate(out):
        if token in stop:
            return out[: j + 1]
    return out


def test_batched_answers_equal_greedy_decoding_of_each_prompt(tmp_path):
    summary = regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path, max_new_tokens=6, batch_size=3, progress=False)
    records = regen.read_conversations(tmp_path / regen.CONVERSATIONS_FILE)
    assert summary["answered_now"] == 7 and sorted(r["id"] for r in records) == [f"p{i}" for i in range(7)]
    for record in records:
        prompt = PROMPTS[int(record["id"][1:])]
        assert record["prompt_ids"] == encode_prompt(prompt, TOKENIZER)
        assert record["response_ids"] == _greedy_alone(prompt, 6)
        assert record["stop"] == ("eos" if len(record["response_ids"]) < 6 else record["stop"])
        assert record["category"] == prompt.category and record["prompt"] == prompt.text
    assert summary["new_tokens"] == sum(len(r["response_ids"]) for r in records)


def test_ctrl_c_keeps_finished_batches_and_a_rerun_completes_them(tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    regen.regenerate(TARGET, TOKENIZER, PROMPTS, whole, max_new_tokens=5, batch_size=3, progress=False)
    real, calls = regen._generate, []

    def stop_after_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "_generate", stop_after_second)
    split = tmp_path / "split"
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, split, max_new_tokens=5, batch_size=3, progress=False)
    assert len(regen.read_conversations(split / regen.CONVERSATIONS_FILE)) == 3  # the first batch
    with open(split / regen.CONVERSATIONS_FILE, "a") as f:
        f.write('{"id": "p9", "resp')  # and a line cut by a crash
    monkeypatch.setattr(regen, "_generate", real)
    summary = regen.regenerate(TARGET, TOKENIZER, PROMPTS, split, max_new_tokens=5, batch_size=3, progress=False)
    assert summary["answered_now"] == 4
    by_id = lambda path: {r["id"]: r for r in regen.read_conversations(path / regen.CONVERSATIONS_FILE)}  # noqa: E731
    assert by_id(split) == by_id(whole)
    with pytest.raises(ValueError, match="out: .* other settings"):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, split, max_new_tokens=7, batch_size=3, progress=False)


def test_sampled_answers_are_reproducible_and_differ_from_greedy(tmp_path):
    runs = [regen.regenerate(TARGET, TOKENIZER, PROMPTS[:4], tmp_path / name, max_new_tokens=8, batch_size=2,
                             temperature=1.5, seed=3, progress=False) for name in ("a", "b")]
    a, b = (regen.read_conversations(tmp_path / name / regen.CONVERSATIONS_FILE) for name in ("a", "b"))
    assert a == b and runs[0]["new_tokens"] == runs[1]["new_tokens"]
    greedy = {p.id: _greedy_alone(p, 8) for p in PROMPTS[:4]}
    assert any(r["response_ids"] != greedy[r["id"]] for r in a)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path, temperature=-1)
    with pytest.raises(ValueError, match="batch_size"):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="ids repeat"):
        regen.regenerate(TARGET, TOKENIZER, [PROMPTS[0], PROMPTS[0]], tmp_path)


def test_answers_carried_over_from_a_batch_stopped_early_are_exact(tmp_path, monkeypatch):
    """A greedy batch stops once most of its answers are finished (here half); the unfinished ones
    continue in later batches from their partial answers and end with the tokens one-by-one
    decoding gives."""
    real, calls = regen._generate, []
    # A stop token that some answers reach early and others late or never: the first token of
    # one prompt's answer that other answers also contain.
    answers = [_greedy_alone(p, 14) for p in PROMPTS]
    counts = {tok: sum(tok in a for a in answers) for a in answers for tok in a}
    stop = max(counts, key=lambda tok: (counts[tok] < len(answers), counts[tok]))
    monkeypatch.setattr(regen, "_stop_ids", lambda target, tokenizer: [stop])
    monkeypatch.setattr(regen, "_FINISH_FRACTION", 0.5)

    def spy(target, prompts, budgets, *args, **kwargs):
        calls.append(budgets)
        return real(target, prompts, budgets, *args, **kwargs)

    monkeypatch.setattr(regen, "_generate", spy)
    regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path, max_new_tokens=14, batch_size=4, progress=False)
    assert any(b < 14 for budgets in calls for b in budgets)  # some answer was carried over
    for record in regen.read_conversations(tmp_path / regen.CONVERSATIONS_FILE):
        assert record["response_ids"] == _greedy_alone(PROMPTS[int(record["id"][1:])], 14), record["id"]


def test_exported_answers_restore_the_folder_without_the_prompts(tmp_path):
    """export_answers keeps ids and token ids only; restore_answers with the same prompts and settings
    rebuilds conversations equal to the original, and regenerate then has nothing left to do."""
    regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "a", max_new_tokens=5, batch_size=3, progress=False)
    exported = regen.export_answers(tmp_path / "a")
    assert all(set(a) == set(regen.ANSWER_FIELDS) for a in exported["answers"])
    assert not any(p.text in json.dumps(exported) for p in PROMPTS)
    assert regen.restore_answers(TARGET, TOKENIZER, PROMPTS, tmp_path / "b", exported, max_new_tokens=5) == len(PROMPTS)
    original = regen.read_conversations(tmp_path / "a" / regen.CONVERSATIONS_FILE)
    assert sorted(regen.read_conversations(tmp_path / "b" / regen.CONVERSATIONS_FILE), key=lambda r: r["id"]) == \
        sorted(original, key=lambda r: r["id"])
    again = regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "b", max_new_tokens=5, batch_size=2, progress=False)
    assert again["answered_now"] == 0
    with pytest.raises(ValueError, match="exported: .*other settings"):
        regen.restore_answers(TARGET, TOKENIZER, PROMPTS, tmp_path / "c", exported, max_new_tokens=6)
    with pytest.raises(ValueError, match="out_dir: .*already holds"):
        regen.restore_answers(TARGET, TOKENIZER, PROMPTS, tmp_path / "b", exported, max_new_tokens=5)


STAND_IN_VLLM = '''
"""A stand-in for vllm's offline API (LLM.generate on token prompts), greedy through transformers."""
import types, torch
from transformers import AutoModelForCausalLM

class SamplingParams:
    def __init__(self, max_tokens, stop_token_ids, temperature, **sampling):
        assert temperature == 0.0 and not sampling
        self.max_tokens, self.stop = max_tokens, stop_token_ids

class LLM:
    def __init__(self, model, dtype, max_model_len, max_num_seqs, seed, enforce_eager):
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for prompt, p in zip(prompts, params):
            ids = torch.tensor([prompt["prompt_token_ids"]])
            with torch.inference_mode():
                new = self.model.generate(ids, max_new_tokens=p.max_tokens, do_sample=False, eos_token_id=p.stop,
                                          pad_token_id=p.stop[0])[0, ids.shape[1]:].tolist()
            ended = next((j for j, t in enumerate(new) if t in p.stop), None)
            # like vLLM for a stop id that is not EOS: the stop token is reported, not returned
            tokens, reason = (new[:ended], new[ended]) if ended is not None else (new, None)
            completion = types.SimpleNamespace(token_ids=tokens, finish_reason="stop" if ended is not None else "length",
                                               stop_reason=reason)
            outputs.append(types.SimpleNamespace(outputs=[completion]))
        return outputs
'''


@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch):
    """A `vllm` package on the worker's PYTHONPATH and the tiny target saved as a folder."""
    import os
    import sys

    from transformers import AutoModelForCausalLM

    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(STAND_IN_VLLM)
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *sys.path]))
    TARGET.save_pretrained(tmp_path / "target")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval(), sys.executable


def test_vllm_engine_writes_the_same_records_and_resumes(tmp_path, stand_in_vllm):
    target, python = stand_in_vllm
    # The tiny target never emits its EOS: make the third token of one greedy answer a stop token,
    # so some answers end at a stop and others at the budget.
    target.generation_config.eos_token_id = [_greedy_alone(PROMPTS[0], 6)[2]]
    regen.regenerate(target, TOKENIZER, PROMPTS, tmp_path / "hf", max_new_tokens=6, batch_size=3, progress=False)
    summary = regen.regenerate(target, TOKENIZER, PROMPTS, tmp_path / "vllm", max_new_tokens=6, batch_size=2,
                               progress=False, engine="vllm", vllm_python=python)
    assert summary["answered_now"] == len(PROMPTS)
    by_id = lambda folder: {r["id"]: r for r in regen.read_conversations(folder / regen.CONVERSATIONS_FILE)}
    ours, reference = by_id(tmp_path / "vllm"), by_id(tmp_path / "hf")
    assert ours == reference  # the stop token the engine left out is put back
    assert any(r["stop"] == "eos" for r in ours.values()) and any(r["stop"] == "length" for r in ours.values())
    settings = json.loads((tmp_path / "vllm" / regen.SETTINGS_FILE).read_text())
    assert settings["engine"] == "vllm" and "engine" not in json.loads((tmp_path / "hf" / regen.SETTINGS_FILE).read_text())
    path = tmp_path / "vllm" / regen.CONVERSATIONS_FILE
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))  # as if stopped after 4 answers
    again = regen.regenerate(target, TOKENIZER, PROMPTS, tmp_path / "vllm", max_new_tokens=6, batch_size=2,
                             progress=False, engine="vllm", vllm_python=python)
    assert again["answered_now"] == len(PROMPTS) - 4 and by_id(tmp_path / "vllm") == reference
    # another engine may continue the folder (nothing is left here), which keeps its first engine
    assert regen.regenerate(target, TOKENIZER, PROMPTS, tmp_path / "vllm", max_new_tokens=6,
                            progress=False)["answered_now"] == 0
    assert json.loads((tmp_path / "vllm" / regen.SETTINGS_FILE).read_text())["engine"] == "vllm"


def test_vllm_engine_needs_the_target_folder_and_an_environment(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="engine: vLLM loads the target itself"):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "a", engine="vllm", vllm_python=__import__("sys").executable,
                         progress=False)
    with pytest.raises(ValueError, match="vllm_python: .* is not an executable Python"):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "b", engine="vllm", vllm_python=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="engine: expected one of transformers, vllm"):
        regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "c", engine="sglang")


def _perturbed_copy(scale: float, seed: int = 1):
    import copy as _copy

    model = _copy.deepcopy(TARGET)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs().mean())
    return model


def test_target_identity_survives_float_noise_and_refuses_another_model():
    """A re-dequantization elsewhere changes weight bytes by rounding, not the model: the identity
    (config, tokenizer, greedy choices on a probe away from ties) stays; another model's does not."""
    ours = regen._target_identity(TARGET, TOKENIZER)
    assert regen.same_target(ours, regen._target_identity(_perturbed_copy(1e-6), TOKENIZER))
    assert not regen.same_target(ours, regen._target_identity(_perturbed_copy(1.0), TOKENIZER))
    other = regen._target_identity(TARGET, TOKENIZER)
    other["vocab_size"] += 1
    assert not regen.same_target(ours, other)


def test_a_legacy_export_restores_only_onto_the_target_whose_greedy_answers_it_holds(tmp_path):
    regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "a", max_new_tokens=6, batch_size=3, progress=False)
    exported = regen.export_answers(tmp_path / "a")
    import hashlib

    old_hash = hashlib.sha256(json.dumps(sorted(TOKENIZER.get_vocab().items())[:4096]).encode()).hexdigest()[:16]
    exported["settings"]["target"] = {"weights": "2ce0faa5c9f688bd", "tokenizer": old_hash,  # the old form
                                      "vocab_size": len(TOKENIZER), "chat_template": False}
    assert regen.restore_answers(TARGET, TOKENIZER, PROMPTS, tmp_path / "b", exported, max_new_tokens=6) == len(PROMPTS)
    again = regen.regenerate(TARGET, TOKENIZER, PROMPTS, tmp_path / "b", max_new_tokens=6, batch_size=3, progress=False)
    assert again["answered_now"] == 0  # the folder continues with the new identity
    with pytest.raises(ValueError, match="exported: .*other settings"):
        regen.restore_answers(_perturbed_copy(1.0), TOKENIZER, PROMPTS, tmp_path / "c", exported, max_new_tokens=6)
    exported["settings"]["target"]["tokenizer"] = "another"
    with pytest.raises(ValueError, match="exported: .*other settings"):
        regen.restore_answers(TARGET, TOKENIZER, PROMPTS, tmp_path / "d", exported, max_new_tokens=6)


class CountingServer:
    """A stand-in engine: answers each prompt with its last id + 1, + 2, ... (`generate` as
    LlamaServer's)."""

    def __init__(self, engine: str):
        self.ENGINE = engine

    def generate(self, prompts, max_new_tokens, temperature, seeds, stop):
        for j, prompt in enumerate(prompts):
            yield j, [prompt[-1] + 1 + k for k in range(max_new_tokens)]


def test_another_engine_continues_a_folder_and_its_records_name_it(tmp_path):
    """llama.cpp's server starts a folder, the native forward continues it: regenerate.json keeps the
    first engine, the continuation's records name theirs, and an export restores both."""
    prompts = [Prompt(text=TEXTS[i][:25], id=f"p{i}", chat=True) for i in range(4)]
    regen.regenerate(TARGET, TOKENIZER, prompts[:2], tmp_path / "a", max_new_tokens=3, engine="llama.cpp",
                     server=CountingServer("llama.cpp"), progress=False)
    regen.regenerate(TARGET, TOKENIZER, prompts, tmp_path / "a", max_new_tokens=3, engine="native",
                     server=CountingServer("native"), progress=False)
    assert json.loads((tmp_path / "a" / regen.SETTINGS_FILE).read_text())["engine"] == "llama.cpp"
    records = regen.read_conversations(tmp_path / "a" / regen.CONVERSATIONS_FILE)
    assert {r["id"]: r.get("engine") for r in records} == {"p0": None, "p1": None, "p2": "native", "p3": "native"}
    with pytest.raises(ValueError, match="other settings, prompts or target"):  # an engine is no licence for other settings
        regen.regenerate(TARGET, TOKENIZER, prompts, tmp_path / "a", max_new_tokens=4, engine="native",
                         server=CountingServer("native"), progress=False)
    exported = regen.export_answers(tmp_path / "a")
    assert [a.get("engine") for a in exported["answers"]] == [None, None, "native", "native"]
    regen.restore_answers(TARGET, TOKENIZER, prompts, tmp_path / "b", exported, max_new_tokens=3, engine="llama.cpp")
    assert regen.read_conversations(tmp_path / "b" / regen.CONVERSATIONS_FILE) == records
    with pytest.raises(ValueError, match="server: engines 'llama.cpp' and 'native'"):
        regen.regenerate(TARGET, TOKENIZER, prompts, tmp_path / "c", engine="native")
