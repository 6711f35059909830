"""`elsi-fast analyze` on the real stories260K model and Spec-Bench prompts."""

import argparse
import json
import os

import pytest

from elsi_fast.cli.analyze import register


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="elsi-fast")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.check(args)
    return args.func(args)


def test_analyze_stories260k(shared_data, tmp_path, capsys):
    out = tmp_path / "out"
    code = run_cli([
        "analyze", "--model", os.path.join(shared_data, "models", "stories260K", "stories260K.bin"),
        "--prompts", os.path.join(shared_data, "prompts", "spec_bench_question.jsonl"),
        "--out", str(out), "--max-prompts", "6", "--m", "1", "2", "--batch-size", "3", "--no-progress",
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "h_0..h_5" in printed and "elsi" in printed and "eagle3" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["num_hidden_layers"] == 5 and len(report["layers"]) == 6
    assert report["options"]["m"] == [1, 2] and report["options"]["max_prompts"] is None
    for name in ("entropy.png", "cka.png", "pair_gain.png", "serving_configs.json"):
        assert (out / name).stat().st_size > 0
    # the state and the prompt-mode factor file beside it are removed after a successful run
    assert not list(out.glob("state.pt*")), sorted(p.name for p in out.iterdir())
    configs = json.loads((out / "serving_configs.json").read_text())
    elsi2 = report["selections"]["elsi"]["2"]
    assert configs["elsi/m=2/vllm"]["config"] == {"eagle_aux_hidden_state_layer_ids": elsi2, "num_aux_hidden_states": 2}
    assert configs["elsi/m=2/sglang"]["config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [l - 1 for l in elsi2]
    assert any("exactly 3" in note for note in configs["elsi/m=2/specforge"]["notes"])


def test_analyze_default_budget_and_store_bound(shared_data, tmp_path, capsys):
    """No --max-prompts: the default budget, spread over Spec-Bench's categories; a store bound too
    small for every kept token caps each prompt's prompt-mode tokens, and the report says so."""
    from elsi_fast.cli.analyze import DEFAULT_PROMPT_BUDGET

    out = tmp_path / "out"
    code = run_cli([
        "analyze", "--model", os.path.join(shared_data, "models", "stories260K", "stories260K.bin"),
        "--prompts", os.path.join(shared_data, "prompts", "spec_bench_question.jsonl"),
        "--out", str(out), "--m", "1", "--batch-size", "16", "--max-tokens", "64", "--max-store-gb", "0.0005",
        "--keep-state", "--no-progress",
    ])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"]["count"] == DEFAULT_PROMPT_BUDGET
    cap = report["options"]["gram_tokens"]
    assert cap is not None and cap < 63, cap  # all kept tokens (up to 63 a prompt) would not fit
    assert report["memory"]["gram_store_bytes"] <= 0.0005 * 2**30
    assert f"<= {cap} tokens each, within the 0.0005 GiB bound" in capsys.readouterr().out


def test_analyze_bad_prompt_file(shared_data, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    model = os.path.join(shared_data, "models", "stories260K", "stories260K.bin")
    with pytest.raises(ValueError, match="--prompts: .* contains no prompts"):
        run_cli(["analyze", "--model", model, "--prompts", str(empty), "--out", str(tmp_path / "o"), "--no-progress"])
    with pytest.raises(ValueError, match="--all-prompts: give either"):
        run_cli(["analyze", "--model", model, "--prompts", os.path.join(shared_data, "prompts", "mt_bench_question.jsonl"),
                 "--out", str(tmp_path / "o"), "--all-prompts", "--max-prompts", "3", "--no-progress"])
    with pytest.raises(ValueError, match="--max-store-gb: must be a number >= 0"):
        run_cli(["analyze", "--model", model, "--prompts", os.path.join(shared_data, "prompts", "mt_bench_question.jsonl"),
                 "--out", str(tmp_path / "o"), "--max-store-gb", "-1", "--no-progress"])
    with pytest.raises(ValueError, match="--m: each set size"):
        run_cli(["analyze", "--model", model, "--prompts", os.path.join(shared_data, "prompts", "mt_bench_question.jsonl"),
                 "--out", str(tmp_path / "o"), "--m", "5", "--max-prompts", "2", "--no-progress"])


def test_entry_point_reports_bad_input_with_exit_code_2(shared_data, tmp_path, capsys):
    from elsi_fast.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    model = os.path.join(shared_data, "models", "stories260K", "stories260K.bin")
    assert main(["analyze", "--model", model, "--prompts", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "elsi-fast analyze: error: --prompts:" in capsys.readouterr().err


def test_kept_draft_lines_name_the_draft_of_the_pick(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from elsi_fast.cli import analyze

    for name, layers, tau in (("elsi-m1-11", [11], 1.5), ("eagle3-m3-2-15-27", [2, 15, 27], 1.25)):
        folder = tmp_path / "smollm2-135m-instruct" / name
        folder.mkdir(parents=True)
        (folder / "training.json").write_text(json.dumps(
            {"layers": layers, "conversations": 3697, "tau": {"spec-bench": {"k=4": tau}}}))
    monkeypatch.setattr(analyze, "KEPT_DRAFTS", str(tmp_path))
    report = SimpleNamespace(selections={"elsi": {"1": [18], "3": [5, 18, 27]}, "eagle3": {"3": [2, 15, 27]}})
    lines = analyze.kept_draft_lines("smollm2-135m-instruct", report)
    # the draft on a layer set this run picked comes first
    assert "kept draft eagle3-m3-2-15-27: layers [2, 15, 27] (this run's eagle3 m=3 pick), tau 1.250" in lines[0]
    assert "kept draft elsi-m1-11: layers [11] (not a pick of this run), tau 1.500" in lines[3]
    assert "elsi-fast eval-draft --target smollm2-135m-instruct --draft" in lines[1]
    assert "elsi-fast serve --draft" in lines[2] and len(lines) == 6
    assert analyze.kept_draft_lines("gemma3-270m", report) == []
