"""The result tables in README.md and docs/performance.md must be what bench/results generates.

This is CI's staleness check: after a benchmark writes new rows, run `python -m bench.tables` and
commit the rewritten tables with the rows."""

import json
import shutil
from pathlib import Path

import pytest

from bench.tables import ROOT, TABLES, generate, stale_tables


def test_tables_match_bench_results():
    stale = stale_tables(ROOT)
    assert not stale, f"stale tables, run `python -m bench.tables`: {stale}"


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The documents and result rows the tables read, in a scratch repository root."""
    for doc in {table.doc for table in TABLES}:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    (tmp_path / "bench" / "results").mkdir(parents=True, exist_ok=True)  # the index document made it
    for rows in (ROOT / "bench" / "results").glob("*.jsonl"):
        shutil.copy(rows, tmp_path / "bench" / "results" / rows.name)
    return tmp_path


def _edit_rows(root: Path, file: str, edit) -> None:
    path = root / "bench" / "results" / file
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps(row) + "\n" for row in edit(rows)))


def test_a_changed_row_makes_its_tables_stale(copy: Path):
    def slower_int8(rows):
        for row in rows:
            if row["metric"] == "elsi_int8_vs_ggml_Q8_0" and row["commit"] == "1c4094a":
                row["ratio"] *= 0.5
        return rows

    _edit_rows(copy, "llamacpp_kernels_cpu.jsonl", slower_int8)
    assert "docs/performance.md: table ggml-barrier" in stale_tables(copy)

    texts, _ = generate(copy)
    for doc, text in texts.items():
        (copy / doc).write_text(text)
    assert stale_tables(copy) == []


def test_a_later_row_replaces_the_earlier_one(copy: Path):
    def rerun(rows):
        newer = next(dict(row) for row in rows if row["metric"] == "mean_acceptance_length" and row["params"]["engine"] == "vllm")
        newer["date"], newer["value"] = "2099-01-01", 9.876
        return [*rows, newer]

    _edit_rows(copy, "serve_check_cpu.jsonl", rerun)
    # bench/results/README.md's index counts the rows and their dates, so it goes stale with them
    assert sorted(stale_tables(copy)) == ["bench/results/README.md: table results-index",
                                          "docs/performance.md: table serve-check"]
    assert "| 9.876 |" in generate(copy)[0]["docs/performance.md"]


def test_a_table_without_its_rows_is_an_error(copy: Path):
    _edit_rows(copy, "serve_check_cpu.jsonl", lambda rows: [r for r in rows if r["params"]["engine"] != "vllm"])
    with pytest.raises(LookupError, match="serve_check_cpu.jsonl"):
        stale_tables(copy)


def test_a_results_file_the_index_does_not_know_is_an_error(copy: Path):
    (copy / "bench" / "results" / "new_benchmark_cpu.jsonl").write_text(
        (copy / "bench" / "results" / "main_job_cpu.jsonl").read_text())
    with pytest.raises(LookupError, match="new_benchmark_cpu.jsonl is not in tables.RESULT_FILES"):
        stale_tables(copy)
