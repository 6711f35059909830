"""Every user error of the CLI: exit code 2, one line naming the argument, nothing on disk, found
before torch is imported; Ctrl-C: exit 130 with a resume hint; outputs of a successful run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elsi_fast.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from elsi_fast.targets import catalog
from elsi_fast.targets.toy_targets import TargetRecipe, build_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-block target folder, a prompts JSONL and a training text."""
    root = tmp_path_factory.mktemp("cli-validation")
    corpus = root / "corpus"
    corpus.mkdir()
    text = "\n\n".join(f"the {w} went to the market on day {i} and bought {i % 7} apples."
                       for i, w in enumerate(["cat", "dog", "bird", "king", "queen"] * 8))
    (corpus / "a.txt").write_text(text)
    recipe = TargetRecipe(name="cli-validation", source=str(corpus), vocab_size=300, hidden_size=16,
                          intermediate_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          seq_len=16, batch_size=2, steps=2, warmup=1)
    target = build_target(recipe, cache_dir=root / "cache", progress=False)
    prompts = root / "prompts.jsonl"
    rows = [{"question_id": i, "category": "qa", "turns": [f"the {w} went to the market on day {i} and bought"]}
            for i, w in enumerate(["cat", "dog", "bird", "king", "queen", "cat", "dog", "bird"] * 2)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {"root": root, "target": str(target), "prompts": str(prompts), "data": str(corpus / "a.txt")}


def _bad_inputs(t: dict, tmp) -> list[tuple[list[str], str]]:
    """(argv, text the one-line message must contain) for every kind of bad input."""
    a_file = tmp / "a-file"
    a_file.write_text("x")
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    truncated = tmp / "report.json"
    truncated.write_text('{"model": "tiny", "num_hidden_layers": 3, "lay')
    no_config = tmp / "no-config"
    no_config.mkdir()
    not_gguf = tmp / "not-a-model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip file named .gguf")
    smollm2 = catalog.resolve("smollm2-135m-instruct")
    truncated_gguf = tmp / "truncated.gguf"
    with open(smollm2, "rb") as f:
        truncated_gguf.write_bytes(f.read(1 << 20))
    out = str(tmp / "out")
    analyze = ["analyze", "--model", t["target"], "--prompts", t["prompts"], "--out", out, "--no-progress", "--m", "1", "2"]
    train = ["train-draft", "--target", t["target"], "--data", t["data"], "--out", out, "--no-progress"]
    evaluate = ["eval-draft", "--target", t["target"], "--draft", str(tmp / "no-draft"), "--prompts", t["prompts"]]
    return [
        (analyze[:4] + [str(tmp / "missing.jsonl")] + analyze[5:], "--prompts: no such file or folder"),
        (analyze[:4] + [str(empty)] + analyze[5:], "--prompts:"),
        (analyze + ["--m", "0"], "--m"),
        (analyze + ["--m", "1", "3"], "--m: each set size must be at most 2"),  # N=3 from config.json
        (analyze + ["--max-tokens", "1"], "--max-tokens"),
        (analyze + ["--gram-tokens", "1"], "--gram-tokens"),
        (analyze + ["--batch-size", "x"], "--batch-size"),
        (analyze + ["--min-token-entropy", "-1"], "--min-token-entropy"),
        (analyze + ["--device", "gpu0"], "--device"),
        (analyze + ["--resume"], "--resume: no state.pt"),
        (analyze + ["--threads", "0"], "--threads"),
        (analyze[:6] + [str(a_file)] + analyze[7:], "--out: "),
        (["analyze", "--model", str(tmp / "no" / "such" / "model.bin")] + analyze[3:], "--model: no such file or folder"),
        (["analyze", "--model", "./missing-model"] + analyze[3:], "--model: no such file or folder"),
        (["analyze", "--model", str(no_config)] + analyze[3:], "--model: folder"),
        (["analyze", "--model", str(a_file)] + analyze[3:], "--model:"),  # a file, not a llama2.c checkpoint
        (["analyze", "--model", str(not_gguf)] + analyze[3:], "--model: " + str(not_gguf) + " is not a GGUF file"),
        (["analyze", "--model", str(truncated_gguf)] + analyze[3:], "--model: "),
        (["analyze", "--model", str(smollm2)] + analyze[3:] + ["--m", "30"], "--m: each set size must be at most 29"),
        (["analyze", "--model", "smollm2-135m-instruct"] + analyze[3:] + ["--m", "30"], "--m: each set size must be at most 29"),
        (train[:2] + [str(truncated_gguf)] + train[3:] + ["--layers", "1"], "--target: "),
        (train + ["--report", str(truncated)], f"--report: {truncated} is not valid JSON"),
        (train + ["--layers", "1", "--steps", "10", "--keep-steps", "5", "20"], "--keep-steps: steps past --steps 10: [20]"),
        (train + ["--layers", "1", "--precision", "fp16"], "--precision"),
        (train + ["--report", str(tmp / "none.json")], "--report: no such file"),
        (train + ["--layers", "-1"], "--layers"),
        (train + ["--layers", "1", "--init-from", str(no_config)], f"--init-from: {no_config} is not a draft folder"),
        (train + ["--layers", "1", "--lr", "0"], "--lr"),
        (train + ["--layers", "1", "--label-temperature", "0"], "--label-temperature: must be a positive number"),
        (train + ["--layers", "1", "--label-temperature", "nan"], "--label-temperature"),
        (train + ["--layers", "1", "--labels", "answers"], "--labels: answers needs conversations"),
        (train + ["--layers", "1", "--labels", "answers", "--label-temperature", "0.5"],
         "--label-temperature: labels from the answers are one-hot"),
        (train + ["--layers", "1", "--draft-vocab-coverage", "1.5"], "--draft-vocab-coverage: must be a share in (0, 1]"),
        (train + ["--layers", "1", "--draft-vocab-coverage", "nan"], "--draft-vocab-coverage: must be a share"),
        (train + ["--layers", "1", "--draft-vocab-coverage", "0.9", "--draft-vocab-size", "64"],
         "--draft-vocab-coverage: give it or --draft-vocab-size, not both"),
        (train + ["--layers", "1", "--seq-len", "2"], "--seq-len"),
        (train[:4] + [str(tmp / "missing.txt")] + train[5:] + ["--layers", "1"], "--data: no such file"),
        (evaluate, "--draft: no such folder"),
        (evaluate[:4] + [str(no_config)] + evaluate[5:], "--draft: has no config.json"),
    ]


def test_each_bad_input_exits_2_with_one_line_and_creates_nothing(tiny, tmp_path, capsys):
    for argv, expected in _bad_inputs(tiny, tmp_path):
        before = sorted(os.listdir(tmp_path))
        assert main(argv) == EXIT_USAGE, argv
        captured = capsys.readouterr()
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], (argv, captured.err)
        assert lines[0].startswith("elsi-fast"), lines
        assert captured.out == ""
        assert sorted(os.listdir(tmp_path)) == before, argv


def test_model_layer_count_checked_after_loading_before_writing(shared_data, tmp_path, capsys):
    # A llama2.c .bin has no config.json: N is known once loaded, still before OUT is created.
    out = tmp_path / "out"
    argv = ["analyze", "--model", os.path.join(shared_data, "models", "stories260K", "stories260K.bin"),
            "--prompts", os.path.join(shared_data, "prompts", "mt_bench_question.jsonl"), "--out", str(out), "--m", "5"]
    assert main(argv) == EXIT_USAGE
    assert "--m: each set size must be in 1..4" in capsys.readouterr().err
    assert not out.exists()


_HEAVY = ("torch", "transformers", "triton")
_PROBE = """
import sys
from elsi_fast.cli import main
codes = [main(argv) for argv in {cases!r}]
print(codes, sorted(m for m in {heavy!r} if m in sys.modules))
"""


def test_help_and_argument_errors_import_no_heavy_module(tiny, tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    cases = [
        ["--help"],
        ["analyze", "--help"],
        ["train-draft", "--help"],
        ["eval-draft", "--help"],
        ["demo", "--help"],
        ["analyze", "--model", tiny["target"], "--prompts", missing, "--out", str(tmp_path / "o")],
        ["analyze", "--model", tiny["target"], "--prompts", tiny["prompts"], "--out", str(tmp_path / "o"), "--m", "0"],
        ["analyze", "--model", tiny["target"], "--prompts", tiny["prompts"], "--out", str(tmp_path / "o"), "--m", "3"],
        ["train-draft", "--target", tiny["target"], "--report", missing, "--data", tiny["data"], "--out", "x"],
        ["eval-draft", "--target", "./nope", "--draft", "d", "--prompts", tiny["prompts"]],
        ["analyze", "--model", "smollm2-135m-instruct", "--prompts", tiny["prompts"], "--out", "x", "--m", "30"],
        ["serve", "--help"],
        ["serve", "--draft", str(tmp_path), "--engine", "vllm", "--target", tiny["target"]],
    ]
    probe = _PROBE.format(cases=cases, heavy=_HEAVY)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"{[0] * 5 + [2] * 6 + [0, 2]} []"


def test_interrupt_saves_state_and_resume_continues(tiny, tmp_path, capsys, monkeypatch):
    from elsi_fast.analysis import analyze as analysis

    out = tmp_path / "out"
    argv = ["analyze", "--model", tiny["target"], "--prompts", tiny["prompts"], "--out", str(out),
            "--m", "1", "2", "--batch-size", "1", "--no-progress", "--threads", "1"]
    process_batch = analysis._process_batch
    calls = []

    def interrupted_after_9(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # state is saved every 8 batches
            raise KeyboardInterrupt
        return process_batch(*args, **kwargs)

    monkeypatch.setattr(analysis, "_process_batch", interrupted_after_9)
    assert main(argv) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--resume" in err and str(out / "state.pt") in err
    assert (out / "state.pt").is_file()

    monkeypatch.setattr(analysis, "_process_batch", process_batch)
    assert main(argv + ["--resume"]) == 0
    resumed = json.loads((out / "report.json").read_text())
    assert not (out / "state.pt").exists()  # removed on success
    fresh_out = tmp_path / "fresh"
    assert main(argv[:6] + [str(fresh_out)] + argv[7:] + ["--keep-state"]) == 0
    fresh = json.loads((fresh_out / "report.json").read_text())
    assert (fresh_out / "state.pt").is_file()
    assert resumed["tokens"] == fresh["tokens"] and resumed["selections"] == fresh["selections"]
    for a, b in zip(resumed["layers"], fresh["layers"]):
        assert a["entropy_dataset"] == pytest.approx(b["entropy_dataset"], rel=1e-9)
        assert a["entropy_prompt_mean"] == pytest.approx(b["entropy_prompt_mean"], rel=1e-9)

    # serving_configs.json: every method and m the report selected, for every engine.
    from elsi_fast.engines.layer_ids import ENGINES

    configs = json.loads((fresh_out / "serving_configs.json").read_text())
    expected = {f"{method}/m={m}/{engine}" for method, by_m in fresh["selections"].items() for m in by_m
                for engine in ENGINES}
    assert set(configs) == expected
    assert {key.split("/")[0] for key in configs} == {"elsi", "elsi-c", "eagle3", "low-entropy", "last", "uniform"}


def test_training_state_file_name_matches_the_trainer():
    from elsi_fast.cli.draft import TRAINING_STATE_FILE
    from elsi_fast.training.train import STATE_FILE

    assert TRAINING_STATE_FILE == STATE_FILE


def test_every_option_has_help():
    import argparse

    from elsi_fast.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.option_strings[0]}" for name, parser in subparsers.choices.items()
               for action in parser._actions if action.option_strings and not action.help]
    assert missing == []
