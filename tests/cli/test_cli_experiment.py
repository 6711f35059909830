"""`elsi-fast eval-draft --replay` and `elsi-fast experiment` on a tiny target built by the target recipe code."""

from __future__ import annotations

import json

import pytest
import torch

from elsi_fast.cli import main
from elsi_fast.targets.toy_targets import TargetRecipe, build_target

TRAIN = ["--steps", "3", "--batch-size", "2", "--seq-len", "24", "--warmup", "1", "--ttt-steps", "2",
         "--draft-vocab-size", "64", "--no-progress"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its greedy answers to 6 prompts (the replay folder) and a draft on layers 1 3."""
    root = tmp_path_factory.mktemp("cli-replay")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"the {w} went to the market on day {i}." for i, w in
                                              enumerate(["cat", "dog", "bird", "king", "queen"] * 8)))
    recipe = TargetRecipe(name="cli-replay", source=str(corpus), vocab_size=300, hidden_size=16,
                          intermediate_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          seq_len=16, batch_size=2, steps=3, warmup=1)
    target = build_target(recipe, cache_dir=root / "cache", progress=False)
    prompts = root / "prompts.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"the {w} went to the"]} for i, (cat, w) in
            enumerate([("qa", "cat"), ("qa", "dog"), ("qa", "king"), ("rag", "bird"), ("rag", "queen"), ("qa", "bird")])]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    answers = root / "answers"
    assert main(["regenerate", "--target", str(target), "--prompts", str(prompts), "--out", str(answers),
                 "--max-new-tokens", "10", "--no-progress"]) == 0
    draft = root / "draft"
    assert main(["train-draft", "--target", str(target), "--layers", "1", "3", "--data",
                 str(answers / "conversations.jsonl"), "--out", str(draft), "--intermediate-size", "16", *TRAIN]) == 0
    return root, target, answers, draft


def _no_target_forward(monkeypatch):
    """Every target loaded from now on raises on a forward."""
    from elsi_fast.cli import draft as cli_draft

    load = cli_draft.load_target

    def loaded_without_forward(args):
        model, tokenizer = load(args)

        def forward(*_, **__):
            raise AssertionError("the replay ran a target forward")

        monkeypatch.setattr(model, "forward", forward)
        return model, tokenizer

    monkeypatch.setattr(cli_draft, "load_target", loaded_without_forward)


def test_replayed_tau_equals_live_tau_without_a_target_forward(setup, monkeypatch, capsys):
    root, target, answers, draft_dir = setup
    out = root / "replay.json"
    base = ["eval-draft", "--target", str(target), "--draft", str(draft_dir), "--replay", str(answers), "--k", "3",
            "--no-progress", "--json", str(out)]
    assert main([*base, "--cache-layers", "1", "2", "3"]) == 0  # dumps answers/states once: the only target forward
    first = json.loads(out.read_text())["tau"]
    from elsi_fast.decoding.evaluation import pooled_tau
    from elsi_fast.decoding.speculative import speculative_generate
    from elsi_fast.draft import read_draft
    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.regenerate import read_conversations

    model, _ = load_model(str(target), device="cpu", dtype="float32", progress=False)
    draft = read_draft(draft_dir, embed_tokens=model.get_input_embeddings().weight.detach())

    def live_tau(**settings):
        """Pooled tau of live speculative decoding of every cached prompt, its continuation's length."""
        live = {}
        for record in read_conversations(answers / "conversations.jsonl"):
            eos = record["response_ids"][-1] if record["stop"] == "eos" else None
            live.setdefault(record["category"], []).append(speculative_generate(
                model, draft, torch.tensor(record["prompt_ids"]), len(record["response_ids"]), 3, eos_token_id=eos,
                draft_backend="torch", **settings))
        return pooled_tau(live)

    assert first == pytest.approx(live_tau()) and set(first) == {"qa", "rag", "all"}
    capsys.readouterr()
    _no_target_forward(monkeypatch)
    assert main(base) == 0  # the states are there now: no target forward
    assert json.loads(out.read_text())["tau"] == first
    printed = capsys.readouterr().out
    assert "no target forward" in printed and printed.splitlines()[-1].split() == ["all", "6", f"{first['all']:.3f}"]
    assert main([*base, "--max-prompts", "1"]) == 0
    assert "rag                            1" in capsys.readouterr().out
    # with prompt lookup in front of the draft: the replay equals live decoding with it
    assert main([*base, "--prompt-lookup", "1"]) == 0
    written = json.loads(out.read_text())
    assert written["prompt_lookup"] == 1 and "prompt lookup n=1 before the draft" in capsys.readouterr().out
    assert written["tau"] == pytest.approx(live_tau(prompt_lookup=1)) and written["tau"] != first
    # and with lookup rounds longer than the draft's k
    assert main([*base, "--prompt-lookup", "1", "--lookup-k", "7"]) == 0
    written = json.loads(out.read_text())
    assert written["lookup_k"] == 7 and "prompt lookup n=1, up to 7 tokens before the draft" in capsys.readouterr().out
    assert written["tau"] == pytest.approx(live_tau(prompt_lookup=1, lookup_k=7))
    _fails([*base, "--lookup-k", "7"], capsys, "--lookup-k: sets how long prompt-lookup proposals are")


def _fails(args, capsys, match):
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("elsi-fast")]  # not transformers' loading bar
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]) and match in errors[0], err
    return errors[0]


def test_replay_bad_input_is_one_line_and_exit_2(setup, capsys, tmp_path):
    root, target, answers, draft_dir = setup
    base = ["eval-draft", "--target", str(target), "--draft", str(draft_dir), "--no-progress"]
    _fails([*base, "--replay", str(tmp_path / "none")], capsys, "--replay: no such file or folder")
    _fails([*base, "--replay", str(tmp_path)], capsys, "has no conversations.jsonl")
    _fails([*base, "--replay", str(answers / "regenerate.json")], capsys, "is a file; give a regenerate folder")
    _fails([*base, "--replay", str(answers), "--max-new-tokens", "8"], capsys, "--max-new-tokens: a replay")
    _fails([*base, "--replay", str(answers), "--prompts", "x"], capsys, "not allowed with argument")
    _fails([*base, "--prompts", str(root / "prompts.jsonl"), "--states", "x"], capsys, "--states: only a replay")
    _fails([*base, "--replay", str(answers), "--states", str(tmp_path / "s")], capsys,
           "--states: no target states at")
    _fails([*base, "--replay", str(answers), "--states", str(tmp_path / "s"), "--cache-layers", "1"], capsys,
           "--cache-layers: must include the draft's layers")
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    lines = (answers / "conversations.jsonl").read_text().splitlines()
    settings = json.loads((answers / "regenerate.json").read_text())
    (sampled / "regenerate.json").write_text(json.dumps({**settings, "temperature": 0.7}))
    (sampled / "conversations.jsonl").write_text("\n".join(lines) + "\n")
    _fails([*base, "--replay", str(sampled)], capsys, "sampled at temperature 0.7")
    (sampled / "regenerate.json").write_text(json.dumps(settings))
    (sampled / "conversations.jsonl").write_text("\n".join(lines[:2]) + '\n{"prompt_ids": [1], "response_ids": "x"}\n')
    _fails([*base, "--replay", str(sampled / "conversations.jsonl")], capsys, "line 3 of")
    (sampled / "conversations.jsonl").write_text("\n".join(lines[:2]) + "\n")  # other continuations than the states'
    assert main([*base, "--replay", str(answers), "--cache-layers", "1", "2", "3"]) == 0  # the states (if not yet)
    _fails([*base, "--replay", str(sampled), "--states", str(answers / "states")], capsys,
           "holds the states of 6 sequences, --replay has 2")


def test_experiment_runs_resumes_and_reports(setup, capsys, tmp_path):
    root, target, answers, _ = setup
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"model": "tiny", "num_hidden_layers": 3, "layers": [], "cka": [], "tokens": {},
                                  "options": {}, "selections": {"elsi": {"1": [2]}, "eagle3": {"3": [1, 2, 3]}}}))
    out = tmp_path / "grid"
    run = ["experiment", "run", "--target", str(target), "--report", str(report), "--train", str(answers),
           "--eval", str(answers), "--out", str(out), "--m", "1", "--seeds", "0", "1", "--steps", "2",
           "--batch-size", "2", "--warmup", "1", "--ttt-steps", "2", "--draft-vocab-size", "64", "--seq-len", "24",
           "--ks", "1", "4", "--no-progress"]
    _fails(["experiment", "status", "--out", str(out)], capsys, "holds no experiment.json")
    _fails(run[:3] + run[5:], capsys, "--report: experiment run needs it")
    _fails([*run, "--methods", "elsi", "nope"], capsys, "--methods/--m: method: expected one of")
    assert main(run) == 0
    printed = capsys.readouterr().out
    assert printed.count(" trained ") == 4 and "| elsi-m1 | [2] | 2 |" in printed
    assert "Δ all vs EAGLE3 (paired)" in printed and "| eagle3-m3 | [1, 2, 3] | 2 |" in printed
    assert main(run) == 0  # every cell is kept: nothing trains again
    again = capsys.readouterr().out
    assert again.count(" kept ") == 4 and again.split("###")[1] == printed.split("###")[1]
    assert main(["experiment", "status", "--out", str(out)]) == 0
    assert "4 done" in capsys.readouterr().out
    assert main(["experiment", "report", "--out", str(out), "--reference", "elsi-m1"]) == 0
    assert "Δ all vs elsi-m1 (paired)" in capsys.readouterr().out
    _fails([*run[:-2], "--ks", "2", "--no-progress"], capsys, "--out: ")  # another --ks in the same folder


def test_train_draft_on_the_answers_labels_dumps_the_layers_only(setup):
    """--labels answers --cache-dir: the cache holds the layers and no final state, and the run's
    summary names its labels."""
    from elsi_fast.training.feature_cache import open_cache

    root, target, answers, _ = setup
    base = ["train-draft", "--target", str(target), "--layers", "2", "--data", str(answers / "conversations.jsonl"),
            "--labels", "answers", "--cache-dir", str(root / "layers-cache"), *TRAIN]
    assert main([*base, "--out", str(root / "answers-draft")]) == 0
    cache = open_cache(root / "layers-cache")
    assert cache.complete and not cache.has_final and not (root / "layers-cache" / "final.bin").exists()
    summary = json.loads((root / "answers-draft" / "train_summary.json").read_text())
    assert summary["labels"] == "answers" and summary["history"][-1]["tokens"] > 0
