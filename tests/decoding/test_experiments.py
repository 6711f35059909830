"""Experiment cells (elsi_fast.decoding.experiments): resumable grids of drafts, their replayed tau."""

from __future__ import annotations

import json

import pytest

from elsi_fast.decoding import evaluation, experiments
from elsi_fast.decoding.experiments import Cell, ExperimentData, grid, run_cell
from elsi_fast.training.train import train_draft
from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The tiny target's greedy continuations of 6 prompts with their states, 8 training
    conversations with theirs, and one trained draft (what a stubbed trainer hands back)."""
    from elsi_fast.analysis.prompts import Prompt
    from elsi_fast.training.feature_cache import build
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations, regenerate
    from tiny_lm import conversation_samples_of_tiny_target

    root = tmp_path_factory.mktemp("experiment")
    samples = conversation_samples_of_tiny_target(root / "train", count=8, max_new_tokens=12)
    prompts = [Prompt(text=TEXTS[i][2 + i : 28 + 3 * i], id=str(i), category=f"c{i % 2}", chat=True) for i in range(6)]
    regenerate(TARGET, TOKENIZER, prompts, root / "eval", max_new_tokens=16, batch_size=3, progress=False)
    records = read_conversations(root / "eval" / CONVERSATIONS_FILE)
    shared = ExperimentData(TARGET, TOKENIZER, samples, build(TARGET, samples, [1, 2, 4], root / "train-states",
                                                              progress=False),
                            records, build(TARGET, evaluation.continuation_samples(records), [1, 2, 4],
                                           root / "eval-states", progress=False), 24)
    trained = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=root / "draft", feature_cache=shared.train_cache,
                          **{**SMALL, "steps": 6})
    return shared, trained


RECIPE = {k: v for k, v in SMALL.items() if k not in ("seq_len", "progress")} | {"steps": 2}


def test_a_cell_trains_once_and_replays_every_k(data, tmp_path):
    shared, _ = data
    cell = Cell("elsi-m2", [2, 4], 0, RECIPE)
    result, fresh = run_cell(cell, shared, tmp_path / "cells", tmp_path / "work", ks=(1, 4))
    assert fresh and (tmp_path / "work" / cell.stem / "config.json").is_file()
    from elsi_fast.draft import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(tmp_path / "work" / cell.stem,
                                        embed_tokens=TARGET.get_input_embeddings().weight.detach())
    for k in (1, 4):  # the kept tau is the replay of the kept draft, per category and per prompt
        runs = evaluation.replay_runs(draft, shared.eval_records, shared.eval_cache, k=k, draft_backend="torch")
        assert result["tau"][str(k)]["pooled"] == pytest.approx(evaluation.pooled_tau(runs))
        assert result["tau"][str(k)]["per_prompt"] == {c: pytest.approx([r.tau for r in rs]) for c, rs in runs.items()}
    assert json.loads((tmp_path / "cells" / f"{cell.stem}.json").read_text()) == result
    assert result["train_tokens"] > 0 and result["recipe"] == RECIPE and result["layers"] == [2, 4]


def test_a_grid_resumes_skipping_finished_cells(data, tmp_path, monkeypatch):
    shared, trained = data
    calls = []

    def counting_trainer(target, tokenizer, layers, samples, **settings):
        calls.append((tuple(layers), settings["seed"]))
        return trained

    monkeypatch.setattr(experiments, "train_draft", counting_trainer)
    cells = grid({"elsi-m2": [2, 4], "eagle3-m3": [1, 2, 4]}, [0, 1], RECIPE)
    assert [c.stem for c in cells] == ["elsi-m2-seed0-claims", "eagle3-m3-seed0-claims", "elsi-m2-seed1-claims",
                                       "eagle3-m3-seed1-claims"]  # every set at a seed before the next seed
    results, work = tmp_path / "cells", tmp_path / "work"
    first = [run_cell(c, shared, results, work, ks=(2,)) for c in cells]
    assert len(calls) == 4 and all(fresh for _, fresh in first)
    assert [experiments.cell_status(c, results, work) for c in cells] == ["done"] * 4
    again = [run_cell(c, shared, results, work, ks=(2,)) for c in cells]
    assert len(calls) == 4 and [r for r, _ in again] == [r for r, _ in first] and not any(f for _, f in again)
    (results / f"{cells[2].stem}.json").unlink()  # lost (or never written: a cell interrupted before its end)
    (results / f"{cells[0].stem}.json.tmp.123").write_text('{"cut')  # a write cut by a crash: not a cell
    assert experiments.cell_status(cells[2], results, work) == "todo"
    [run_cell(c, shared, results, work, ks=(2,)) for c in cells]
    assert calls[4:] == [((2, 4), 1)] and len(experiments.read_cells(results)) == 4
    with pytest.raises(ValueError, match="recipe"):  # a changed recipe never reuses old cells
        run_cell(Cell("elsi-m2", [2, 4], 0, {**RECIPE, "steps": 3}), shared, results, work)
    (results / f"{cells[1].stem}.json").write_text('{"name": "x"')
    with pytest.raises(ValueError, match=f"cell: .*{cells[1].stem}.json is not valid JSON"):
        run_cell(cells[1], shared, results, work)


def test_layer_sets_take_fixed_rules_at_their_own_size():
    class Report:
        def select(self, method, m):
            return {"elsi": {1: [3], 3: [1, 3, 5]}, "eagle3": {3: [2, 4, 7]}, "last": {1: [9]}}[method][m]

    assert experiments.layer_sets(Report(), ["elsi", "eagle3", "last"], [1, 3]) == {
        "elsi-m1": [3], "elsi-m3": [1, 3, 5], "eagle3-m3": [2, 4, 7], "last-m1": [9]}
