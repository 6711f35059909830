"""`elsi-fast train-draft` / `eval-draft` on a tiny target built by the target recipe code."""

from __future__ import annotations

import json

import pytest

from elsi_fast.cli import main
from elsi_fast.targets.toy_targets import TargetRecipe, build_target

TRAIN = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--ttt-steps", "2",
         "--draft-vocab-size", "64", "--intermediate-size", "16", "--no-progress"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"the {w} went to the market on day {i}." for i, w in
                                              enumerate(["cat", "dog", "bird", "king", "queen"] * 8)))
    recipe = TargetRecipe(name="cli-tiny", source=str(corpus), vocab_size=300, hidden_size=16,
                          intermediate_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          seq_len=16, batch_size=2, steps=3, warmup=1)
    target = build_target(recipe, cache_dir=root / "cache", progress=False)
    prompts = root / "prompts.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"the {w} went to"]}
            for i, (cat, w) in enumerate([("qa", "cat"), ("qa", "dog"), ("qa", "king"), ("rag", "bird")])]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root, corpus, target, prompts


def test_train_then_eval(setup, capsys):
    root, corpus, target, prompts = setup
    out = root / "draft"
    assert main(["train-draft", "--target", str(target), "--layers", "1", "3", "--data", str(corpus),
                 "--out", str(out), *TRAIN]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert config["draft_vocab_size"] == 64 and config["intermediate_size"] == 16
    assert "layers [1, 3]" in capsys.readouterr().out

    result = root / "tau.json"
    assert main(["eval-draft", "--target", str(target), "--draft", str(out), "--prompts", str(prompts),
                 "--k", "2", "--max-new-tokens", "6", "--max-prompts", "2", "--json", str(result),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    taus = json.loads(result.read_text())["tau"]
    assert set(taus) == {"qa", "rag", "all"}
    assert all(1.0 <= tau <= 3.0 for tau in taus.values())
    rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines()[2:]}
    assert printed.splitlines()[-1].split()[0] == "all"  # the pooled row comes last
    assert rows["qa"] == ["2", f"{taus['qa']:.3f}"]  # --max-prompts caps each category
    assert rows["all"] == ["3", f"{taus['all']:.3f}"]
    assert printed.splitlines()[0].endswith("target: torch eager")
    from elsi_fast.targets.loading import load_model, stop_token_ids

    model, tokenizer = load_model(str(target), device="cpu", dtype="float32", progress=False)
    assert json.loads(result.read_text())["stop_ids"] == stop_token_ids(model, tokenizer) != []
    assert main(["eval-draft", "--target", str(target), "--draft", str(out), "--prompts", str(prompts),
                 "--k", "2", "--max-new-tokens", "6", "--max-prompts", "1", "--ignore-eos", "--json", str(result),
                 "--no-progress"]) == 0
    assert json.loads(result.read_text())["stop_ids"] is None
    capsys.readouterr()

    from elsi_fast.targets import target_runtime

    if target_runtime.available():
        assert main(["eval-draft", "--target", str(target), "--draft", str(out), "--prompts", str(prompts),
                     "--k", "2", "--max-new-tokens", "6", "--max-prompts", "1", "--target-runtime", "bf16",
                     "--device", "cpu", "--json", str(result), "--no-progress"]) == 0
        assert "target: elsi-fast runtime (" in capsys.readouterr().out
        assert "bf16 weights" in json.loads(result.read_text())["target_backend"]


def test_layers_from_report(setup):
    root, corpus, target, _ = setup
    report = root / "report.json"
    report.write_text(json.dumps({
        "model": "tiny", "num_hidden_layers": 3, "layers": [], "cka": [], "tokens": {}, "options": {},
        "selections": {"elsi": {"1": [2]}, "elsi-c": {"3": [0, 1, 3]}},
    }))
    out = root / "from-report"
    assert main(["train-draft", "--target", str(target), "--report", str(report), "--method", "elsi-c",
                 "--m", "3", "--data", str(corpus), "--out", str(out), *TRAIN]) == 0
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]


def test_errors_exit_2_with_message(setup, capsys):
    root, corpus, target, prompts = setup
    assert main(["eval-draft", "--target", str(target), "--draft", str(root), "--prompts", str(prompts),
                 "--target-runtime", "fp32", "--device", "cuda"]) == 2
    assert "--target-runtime" in capsys.readouterr().err
    assert main(["train-draft", "--target", str(target), "--report", str(root / "nope.json"),
                 "--data", str(corpus), "--out", str(root / "x"), *TRAIN]) == 2
    assert "--report" in capsys.readouterr().err
    assert main(["train-draft", "--target", str(target), "--layers", "7", "--data", str(corpus),
                 "--out", str(root / "x"), *TRAIN]) == 2
    assert "layers" in capsys.readouterr().err
    assert main(["eval-draft", "--target", str(target), "--draft", str(root / "missing"),
                 "--prompts", str(prompts)]) == 2
    assert "--draft" in capsys.readouterr().err


def test_a_draft_of_another_target_is_a_usage_error(setup, capsys):
    from elsi_fast.draft import Eagle3Config, Eagle3Draft, write_draft

    root, _, target, prompts = setup
    # The tiny target is 16 wide with 300 tokens; this draft was made for a 24-wide target.
    other = root / "other-target-draft"
    write_draft(Eagle3Draft(Eagle3Config(hidden_size=24, intermediate_size=16, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=300, draft_vocab_size=64,
                                         target_hidden_size=24, aux_layer_ids=[1])), other)
    assert main(["eval-draft", "--target", str(target), "--draft", str(other), "--prompts", str(prompts),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert err.startswith(f"elsi-fast eval-draft: error: --draft: {other}: embed_tokens has shape (300, 16)")
    assert "[300, 24]" in err and "trained for a target" in err


def test_demo_end_to_end_with_a_tiny_stdlib_recipe(tmp_path, monkeypatch, capsys):
    from elsi_fast.targets import toy_targets as targets

    # The real demo target takes minutes; the same code path on a tiny stdlib recipe takes seconds.
    tiny = TargetRecipe(name="demo-tiny", source=targets.STDLIB, vocab_size=320, hidden_size=16,
                        intermediate_size=24, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
                        seq_len=32, batch_size=2, steps=2, warmup=1, max_chars=200_000,
                        holdout_fraction=0.2)
    monkeypatch.setattr(targets, "DEMO", tiny)
    monkeypatch.setenv("ELSI_FAST_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--train-drafts", "--steps", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["num_hidden_layers"] == 8
    assert (out / "serving_configs.json").is_file() and list(out.glob("*.png"))
    tau = json.loads((out / "drafts" / "tau.json").read_text())
    assert tau["EAGLE3 default m=3"]["layers"] == [2, 4, 5]
    assert tau["ELSI m=1"]["layers"] == report["selections"]["elsi"]["1"]
    for label, entry in tau.items():
        assert f"{entry['tau']:.3f}" in printed and 1.0 <= entry["tau"] <= 5.0
    assert list((tmp_path / "cache" / "targets").iterdir())[0].name.startswith("demo-tiny-")

    # A second run reuses the cached target and the finished drafts.
    monkeypatch.setattr(targets, "train_target", lambda *a, **k: pytest.fail("target trained twice"))
    assert main(["demo", "--out", str(out), "--train-drafts", "--steps", "2", "--no-progress"]) == 0
    assert json.loads((out / "drafts" / "tau.json").read_text()) == tau


def test_demo_runs_its_steps_on_a_given_model_without_building_the_demo_target(tmp_path, monkeypatch, capsys):
    from elsi_fast.targets import toy_targets as targets
    from tiny_lm import TARGET, TOKENIZER

    folder = tmp_path / "model"
    TARGET.save_pretrained(folder)
    TOKENIZER.save_pretrained(folder)
    monkeypatch.setattr(targets, "build_demo_target", lambda *a, **k: pytest.fail("demo target built"))
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(folder), "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_hidden_layers"] == TARGET.config.num_hidden_layers and report["model"] == str(folder)
    assert f"--target {folder} " in capsys.readouterr().out
    assert main(["demo", "--model", str(tmp_path / "missing.gguf"), "--out", str(out)]) == 2


def test_eval_draft_continues_after_ctrl_c(setup, capsys, monkeypatch):
    from elsi_fast.cli import EXIT_INTERRUPTED
    from elsi_fast.cli.draft import EVAL_PROGRESS_FILE
    from elsi_fast.decoding import evaluation

    root, corpus, target, prompts = setup
    out = root / "draft-for-resume"
    assert main(["train-draft", "--target", str(target), "--layers", "2", "--data", str(corpus),
                 "--out", str(out), *TRAIN]) == 0
    evaluate = ["eval-draft", "--target", str(target), "--draft", str(out), "--prompts", str(prompts),
                "--k", "2", "--max-new-tokens", "6", "--no-progress"]
    assert main(evaluate + ["--json", str(root / "whole.json")]) == 0
    whole = json.loads((root / "whole.json").read_text())["tau"]
    assert not (out / EVAL_PROGRESS_FILE).exists()  # removed on success
    capsys.readouterr()

    generate, calls = evaluation.speculative_generate, []

    def ctrl_c_at_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(evaluation, "speculative_generate", ctrl_c_at_third)
    assert main(evaluate) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert str(out / EVAL_PROGRESS_FILE) in err and "continue" in err and "Traceback" not in err
    assert len((out / EVAL_PROGRESS_FILE).read_text().splitlines()) == 1 + 2  # header + two prompts

    calls.clear()
    assert main(evaluate + ["--json", str(root / "resumed.json")]) == 0
    assert len(calls) == len(prompts.read_text().splitlines()) - 2  # only the prompts that had not finished
    assert json.loads((root / "resumed.json").read_text())["tau"] == whole
    assert not (out / EVAL_PROGRESS_FILE).exists()
