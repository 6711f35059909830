"""bench.draft_long_run's --init-from: a cell of the run, or a kept draft folder on a fresh clone."""

from __future__ import annotations

import json

import pytest

from bench.draft_long_run import continued_from
from elsi_fast.training.train import SUMMARY_FILE


def test_a_finished_cell_counts_its_parents(tmp_path):
    cell = tmp_path / "elsi-m1-seed0-steps100+50"
    cell.mkdir()
    history = [{"step": s, "tokens": 1000} for s in range(1, 51)]
    (cell / SUMMARY_FILE).write_text(json.dumps({"history": history, "parent_tokens": 7, "parent_steps": 100}))
    assert continued_from(cell.name, tmp_path) == (cell, 7 + 50 * 1000, 150, cell.name)


def test_a_kept_draft_continues_its_source_cell(tmp_path):
    kept = tmp_path / "drafts" / "elsi-m1-11"
    kept.mkdir(parents=True)
    facts = {"tokens_seen": 7657591, "steps": 1780, "source": "runs/long-run/m/elsi-m1-seed0-steps480+400"}
    (kept / "training.json").write_text(json.dumps(facts))
    assert continued_from(str(kept), tmp_path / "work") == (kept, 7657591, 1780, "elsi-m1-seed0-steps480+400")


def test_neither_is_refused_naming_the_argument(tmp_path):
    (tmp_path / "half-written").mkdir()  # a cell whose training never finished
    with pytest.raises(SystemExit, match="--init-from: half-written is neither"):
        continued_from("half-written", tmp_path)
