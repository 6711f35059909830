"""The report tables (elsi_fast.decoding.experiment_report) rebuilt from the committed cells
(bench/results/draft_experiment/) give the paired differences docs/real-models.md quotes."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from elsi_fast.decoding.experiment_report import claims_tables
from elsi_fast.decoding.experiments import read_cells
from elsi_fast.decoding.paired_stats import emitted_tokens

ROOT = Path(__file__).resolve().parents[2]
KEEP = ROOT / "bench" / "results" / "draft_experiment"
DOC = (ROOT / "docs" / "real-models.md").read_text()


def _tables(model: str, shared_data: str):
    from elsi_fast.analysis.prompts import load_prompts

    keep = KEEP / model
    prompts = load_prompts(os.path.join(shared_data, "prompts", "spec_bench_question.jsonl"))
    emitted = emitted_tokens(json.loads((keep / "eval.answers.json").read_text())["answers"],
                             {p.id: p.category for p in prompts})
    return claims_tables(read_cells(keep / "cells"), json.loads((keep / "sets.json").read_text()), emitted)


def _doc_rows(label_to_set: dict[str, str], columns: int) -> dict[str, list[str]]:
    """Rows of the docs' tables whose first cell is a label, by set name."""
    rows = {}
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in label_to_set and len(cells) == columns:
            rows[label_to_set[cells[0]]] = cells[1:]
    return rows


def test_gemma3_paired_differences_at_every_k_are_the_docs(shared_data):
    _, _, delta_k, _ = _tables("gemma3-270m", shared_data)
    documented = _doc_rows({"ELSI m=1": "elsi-m1", "ELSI m=3": "elsi-m3", "low-entropy": "low-entropy-m3"}, 6)
    assert set(documented) == {"elsi-m1", "elsi-m3", "low-entropy-m3"}
    assert {row[0]: row[1:] for row in delta_k.rows} == documented


def test_smollm2_claims_differences_are_the_docs(shared_data):
    main = _tables("smollm2-135m-instruct", shared_data)[0]
    documented = _doc_rows({"ELSI-C [1, 11, 29]": "elsi-c-m3", "ELSI m=3 [5, 11, 27]": "elsi-m3",
                            "last [30]": "last-m1", "uniform [8, 15, 23]": "uniform-m3",
                            "ELSI m=1 [11]": "elsi-m1", "low-entropy [0, 1, 2]": "low-entropy-m3"}, 5)
    assert len(documented) == 6
    number = r"[+-]?\d+\.\d+"
    for row in main.rows:
        if row[0] not in documented:
            continue
        _, mean, paired, interval = documented[row[0]]
        seeds = re.match(r"\S+ ± \S+ \((\d+) seeds", paired).group(1)
        assert row[3] == mean  # tau at k=4 over seeds, all prompts
        assert re.findall(number, row[-1]) == re.findall(number, paired)[:2] + re.findall(number, interval)
        assert f"(n={seeds} seeds)" in row[-1]
